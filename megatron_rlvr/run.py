"""Everything a training run needs, started in dependency order and always torn down: the
model (made locally on first run for the tiny default), engine servers, the learner ranks,
the buffer, the verifier pool, and the rollout manager with active sampling on an event
loop of its own thread, so that generation can go on while the learner trains.

launch.mode = ray (default): learner ranks, engines, the buffer and the verifiers are Ray
actors on a local Ray or an existing cluster. launch.mode = local: one learner rank in this
process, engines as child processes, no Ray."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import pickle
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr.config import Config, HFModel, TinyModel
from megatron_rlvr.data import build_arithmetic_tokenizer, load_data

log = logging.getLogger(__name__)
RUN_STATE = "run_state.pkl"  # beside the learner's checkpoint: rollout side of a resume


class RunError(RuntimeError):
    """A run that cannot start or resume, said in one line."""


def prepare_model(cfg: Config) -> tuple[Path, object]:
    """(HF model dir, tokenizer). The tiny default is created once under output_dir/model:
    a character tokenizer for the task and a random Qwen3-MoE sized to it."""
    from transformers import AutoTokenizer

    if isinstance(cfg.model, HFModel):
        return Path(cfg.model.path), AutoTokenizer.from_pretrained(cfg.model.path)
    model_dir = Path(cfg.trainer.output_dir) / "model"
    if not (model_dir / "config.json").exists():
        from megatron_rlvr.tiny_model import build_tiny_hf_model

        tokenizer = build_arithmetic_tokenizer(model_dir)
        spec: TinyModel = cfg.model
        build_tiny_hf_model(spec, model_dir, vocab_size=spec.vocab_size or len(tokenizer), tokenizer=tokenizer)
    return model_dir, AutoTokenizer.from_pretrained(model_dir)


class LoopThread:
    """An event loop running in its own thread; the training thread hands it coroutines."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout", daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro):
        return self.submit(coro).result()

    def cancel_all(self, timeout_s: float = 30.0) -> None:
        """Cancels every task on the loop (a batch being filled, groups in flight, restarts)."""
        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.submit(cancel()).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@dataclass
class Run:
    cfg: Config
    model_dir: Path
    tokenizer: object
    rollout: LoopThread = field(default_factory=LoopThread)
    engines: object = None
    learners: object = None
    clients: list = field(default_factory=list)
    manager: object = None
    buffer: object = None
    verifiers: object = None
    sampler: object = None
    version: int = 0

    @functools.cached_property
    def routing_shape(self) -> tuple[int, int] | None:
        if not self.cfg.rollout.return_routed_experts:
            return None
        from megatron_rlvr.learner.model import read_hf_config

        hf = read_hf_config(self.model_dir)
        return hf.num_hidden_layers, hf.num_experts_per_tok

    def next_batch(self, pending: concurrent.futures.Future) -> list:
        """The groups `pending` delivers. If every engine died and came back with initial
        weights, they get the current ones (as a new policy version) and the batch is asked
        for again, for the policy that trains next."""
        from megatron_rlvr.rollout.sampler import EnginesNeedWeights

        while True:
            try:
                return pending.result()
            except EnginesNeedWeights:
                log.warning("every engine restarted: pushing the current weights as version %d", self.version + 1)
                self.version += 1
                self.sync_weights()
                pending = self.request_batch(self.version)

    def request_batch(self, policy_version: int) -> concurrent.futures.Future:
        """The next batch of useful groups, generated on the rollout thread. Synchronous runs
        drain what is in flight, so no group straddles a weight update."""
        fill = self.sampler.fill(self.cfg.buffer.batch_groups, policy_version,
                                 drain=not self.cfg.buffer.async_rollout)
        return self.rollout.submit(fill)

    def sync_weights(self) -> dict:
        """Pushes the learner's weights to every live engine as the current version; engines
        restarted since the last sync get them too and take work again."""
        metrics = self.learners.sync_weights(self.version)
        self.rollout.run(self.manager.readmit(self.version))
        return metrics

    def save(self, step: int) -> None:
        path = Path(self.cfg.trainer.output_dir) / "checkpoint"
        self.learners.save(path)

        async def rollout_state() -> dict:
            return {"step": step, "version": self.version, "sampler": self.sampler.state(),
                    "buffer": await self.buffer.state(), "manager": dict(self.manager.stats)}

        partial = path / (RUN_STATE + ".partial")  # a crash mid-write leaves the last state whole
        partial.write_bytes(pickle.dumps(self.rollout.run(rollout_state())))
        partial.replace(path / RUN_STATE)

    def resume(self) -> int:
        """Restores the last checkpoint, if there is one, and pushes its weights to the
        engines; returns the step it was taken after (0: none)."""
        path = Path(self.cfg.trainer.output_dir) / "checkpoint"
        if not (path / RUN_STATE).exists():
            log.info("no checkpoint in %s: starting afresh", path)
            return 0
        state = pickle.loads((path / RUN_STATE).read_bytes())
        step = self.learners.load(path)
        if step != state["step"]:
            raise RunError(f"checkpoint {path} is incomplete: learner at step {step}, rollout state "
                           f"at step {state['step']} (delete it or set trainer.resume=false)")

        async def restore() -> None:
            self.sampler.load_state(state["sampler"])
            await self.buffer.load_state(state["buffer"])
            self.manager.stats.update(state["manager"])

        self.rollout.run(restore())
        self.version = state["version"]
        self.sync_weights()
        log.info("resumed from %s at step %d (policy version %d)", path, step, self.version)
        return step


@contextlib.contextmanager
def open_run(cfg: Config):
    """Starts every component; stops every one of them on exit, error or Ctrl-C."""
    from megatron_rlvr.launch.cluster import ray_session

    remote = cfg.launch.mode == "ray"
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(cfg)
    with contextlib.ExitStack() as cluster:
        run = None
        try:
            if remote:
                cluster.enter_context(ray_session(cfg))
            run = Run(cfg, model_dir, tokenizer)
            _start(run, remote)
            yield run
        finally:
            with _signals_held():
                if run is not None:
                    _teardown(run)
                cluster.close()  # Ray last: actors first, then its daemons


@contextlib.contextmanager
def _signals_held():
    """A second Ctrl-C (or SIGTERM) during teardown would cut it short and orphan what is
    left: both wait until it is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)


def _start(run: Run, remote: bool) -> None:
    from megatron_rlvr.buffer.buffer import Buffer
    from megatron_rlvr.launch.cluster import AsyncActor
    from megatron_rlvr.launch.engines import EngineFleet
    from megatron_rlvr.launch.learners import LearnerGroup
    from megatron_rlvr.launch.verifiers import VerifierPool
    from megatron_rlvr.learner.model import read_hf_config
    from megatron_rlvr.rollout import protocol as p
    from megatron_rlvr.rollout.client import EngineClient
    from megatron_rlvr.rollout.manager import RolloutManager, RoutingShape
    from megatron_rlvr.rollout.sampler import ActiveSampler

    cfg, tokenizer = run.cfg, run.tokenizer
    run.engines = EngineFleet(cfg, run.model_dir, remote=remote)
    urls = run.engines.start()
    run.learners, run.version = LearnerGroup.start(cfg, run.model_dir, urls, remote=remote)
    run.clients = [EngineClient(url, timeout_s=cfg.rollout.request_timeout_s) for url in urls]
    eos = tokenizer.eos_token_id
    sampling = p.SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p, n=cfg.rollout.n_samples_per_prompt,
                                stop_token_ids=[eos] if eos is not None else None)
    shape = run.routing_shape
    num_experts = read_hf_config(run.model_dir).num_experts
    async def restart(engine: int) -> bool:
        return await asyncio.to_thread(run.engines.restart, engine)

    run.manager = RolloutManager(run.clients, sampling, restart=restart,
                                 routing=RoutingShape(*shape, num_experts) if shape else None)
    buffer_args = {"zero_std_eps": cfg.buffer.zero_std_eps, "max_staleness": cfg.buffer.max_staleness}
    if remote:
        import ray

        run.buffer = AsyncActor(ray.remote(Buffer).options(num_cpus=0.01).remote(**buffer_args))
    else:
        run.buffer = Buffer(**buffer_args)
    run.verifiers = VerifierPool(cfg, remote=remote)
    data = load_data(cfg.data)
    for number, reason in data.skipped:
        log.warning("data line %d skipped: %s", number, reason)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    run.sampler = ActiveSampler(
        run.manager, run.buffer, data.records, score=run.verifiers, seed=cfg.trainer.seed,
        seeded=bool(cfg.rollout.seeded_sampling),
        encode=lambda text: bos + tokenizer.encode(text, add_special_tokens=False),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def _teardown(run: Run) -> None:
    """Every step is attempted, whatever failed before it."""
    with contextlib.suppress(Exception):
        run.rollout.cancel_all()  # nothing may submit or send once the clients close
    if run.manager is not None:
        with contextlib.suppress(Exception):
            run.rollout.submit(run.manager.abort_all()).result(timeout=30)
    for client in run.clients:
        with contextlib.suppress(Exception):
            run.rollout.submit(client.close()).result(timeout=10)
    run.rollout.close()
    if run.learners is not None:
        with contextlib.suppress(Exception):
            run.learners.close()
    if run.verifiers is not None:
        with contextlib.suppress(Exception):
            run.verifiers.close()
    if run.engines is not None:
        run.engines.stop()
