"""Everything a training run needs, started in dependency order and always torn down: the
model (made locally on first run for the tiny default), engine servers, the learner ranks,
the buffer, the verifier pool, and the rollout manager with active sampling on an event
loop of its own thread, so that generation can go on while the learner trains.

launch.mode picks where components live (launch/placement.py): ray (default) makes learner
ranks, engine hosts, the buffer and the verifiers Ray actors on a local Ray or an existing
cluster; local keeps one learner rank and everything else in this process, engines as child
processes, no Ray."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rlvr import run_dir
from megatron_rlvr.algo.ema_state import EmaBaselines
from megatron_rlvr.config import HFModel, ResolvedConfig, TinyModel
from megatron_rlvr.data import build_arithmetic_tokenizer
from megatron_rlvr.errors import original
from megatron_rlvr.stopping import StopRequested, StopSignals

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rlvr.evaluation import Evaluator
    from megatron_rlvr.launch.engines import EngineFleet
    from megatron_rlvr.launch.learners import LearnerGroup
    from megatron_rlvr.launch.placement import AsyncProxy, Placement
    from megatron_rlvr.launch.verifiers import VerifierPool
    from megatron_rlvr.rollout.client import EngineClient
    from megatron_rlvr.rollout.manager import RolloutManager
    from megatron_rlvr.rollout.sampler import ActiveSampler

log = logging.getLogger(__name__)
# an engine dying during a sync (before or after buckets went out) is survived this many times in a row
SYNC_ATTEMPTS = 3


def prepare_model(cfg: ResolvedConfig) -> tuple[Path, Any]:
    """(HF model dir, tokenizer). The tiny default is created once under output_dir/model:
    a character tokenizer for the task and a random Qwen3-MoE sized to it."""
    from transformers import AutoTokenizer

    if isinstance(cfg.model, HFModel):
        return Path(cfg.model.path), AutoTokenizer.from_pretrained(cfg.model.path)
    model_dir = Path(cfg.trainer.output_dir) / "model"
    if not (model_dir / "config.json").exists():
        from megatron_rlvr.tiny_model import build_tiny_hf_model

        tokenizer = build_arithmetic_tokenizer(model_dir, cfg.model.tokenizer_chars)
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


def _made_by_start() -> Any:
    """None: a component _start() has not made yet. Run's component fields are typed as what
    _start() puts there, since everything but _teardown runs after it; _teardown checks for None."""
    return None


@dataclass
class Run:
    cfg: ResolvedConfig
    model_dir: Path
    tokenizer: PreTrainedTokenizerBase
    stop: StopSignals
    rollout: LoopThread = field(default_factory=LoopThread)
    # the components _start() makes, in this order (None until then: _teardown stops those made)
    engines: EngineFleet = field(default_factory=_made_by_start)
    learners: LearnerGroup = field(default_factory=_made_by_start)
    clients: list[EngineClient] = field(default_factory=list)
    manager: RolloutManager = field(default_factory=_made_by_start)
    buffer: AsyncProxy = field(default_factory=_made_by_start)  # the buffer.Buffer, where placement put it
    verifiers: VerifierPool = field(default_factory=_made_by_start)
    sampler: ActiveSampler = field(default_factory=_made_by_start)
    evaluator: Evaluator | None = None  # when eval.sets are given
    data_stats: dict = field(default_factory=dict)  # data/* counts, logged once
    ema_baselines: EmaBaselines = field(default_factory=EmaBaselines)  # algo.advantage's per-prompt EMA
    version: int = 0
    finished_step: int = 0  # the last step whose metrics were logged
    trained_step: int = 0  # the last step the learner trained (ahead of finished_step mid-step)
    trained_groups: int = 0  # groups the learner has trained on, over the whole run
    saved_step: int = 0  # the step of the checkpoint on disk (0: none)
    _rollout_snapshot: dict | None = None  # the rollout side as it was when finished_step ended
    pending: concurrent.futures.Future | None = None  # the next batch, being generated (or ready)
    teardown_failures: list[str] = field(default_factory=list)  # components that did not stop cleanly
    parity_failure: Exception | None = None  # a failed post-sync probe, raised once the step is saved

    @functools.cached_property
    def routing_shape(self) -> tuple[int, int] | None:
        if not self.cfg.rollout.return_routed_experts:
            return None
        from megatron_rlvr.learner.model import read_hf_config

        hf = read_hf_config(self.model_dir)
        return hf.num_hidden_layers, hf.num_experts_per_tok

    def next_batch(self) -> list:
        """The groups of the batch requested last (a stop request ends the wait). If every
        engine died and came back with initial weights, they get the current ones (as a new
        policy version) and the batch is asked for again, for the policy that trains next."""
        from megatron_rlvr.rollout.manager import EnginesNeedWeights

        while True:
            assert self.pending is not None, "request_batch() comes first"
            try:
                groups = self.stop.result(self.pending, "the next batch of rollouts")
                self.pending = None
                return groups
            except EnginesNeedWeights:
                log.warning("every engine restarted: pushing the current weights as version %d", self.version + 1)
                self.version += 1
                self.sync_weights()
                self.request_batch(self.version)

    def request_batch(self, policy_version: int) -> None:
        """Starts generating the next batch of useful groups on the rollout thread. Synchronous
        runs drain what is in flight, so no group straddles a weight update."""
        overlap = self.cfg.buffer.async_rollout or self.cfg.rollout.updates == "in_flight"
        fill = self.sampler.fill(self.cfg.buffer.batch_groups, policy_version, drain=not overlap)
        self.pending = self.rollout.submit(fill)

    def sleep_engines(self) -> None:
        """launch.colocation: the engines release their memory for the learner (else nothing)."""
        if self.cfg.launch.colocation.enabled:
            self.learners.sleep_engines()

    def evaluate(self, step: int) -> dict:
        """Eval metrics when evaluation is due after `step` (0: before training), else {}."""
        if self.evaluator is None or not self.evaluator.due(step):
            return {}
        return self.stop.result(self.rollout.submit(self.evaluator.evaluate()), f"the evaluation after step {step}")

    def sync_weights(self, *, defer_parity: bool = False) -> dict:
        """Pushes the learner's weights to every live engine as the current version; engines
        restarted since the last sync get them too and take work again. A failed parity probe
        raises at once, or (defer_parity: a step just trained) is kept for raise_parity_failure
        after the step's metrics and checkpoint."""
        from megatron_rlvr.weight_sync.probe import ParityError  # torch: imported where used
        from megatron_rlvr.weight_sync.syncer import EnginesLost

        for attempt in range(1, SYNC_ATTEMPTS + 1):
            if self.cfg.launch.colocation.enabled:  # the engines may be asleep: no health, no retry
                try:
                    metrics = self.learners.sync_weights(
                        self.version, self.rollout.run(self.manager.waiting_for_weights())
                    )
                except Exception as err:
                    if not isinstance(lost := original(err), ParityError):
                        raise
                    self.parity_failure, metrics = lost, lost.metrics
                break
            # a first stop request lets the trained step finish (sync, metrics, checkpoint state)
            self.stop.result(
                self.rollout.submit(self.manager.restart_unanswering()), "engines to answer /health", urgent_only=True
            )
            try:
                restarted = self.rollout.run(self.manager.waiting_for_weights())
                self.rollout.run(self.manager.pause_clocks())  # the engines stand paused: idle
                paused_at, metrics = time.monotonic(), {}
                try:
                    metrics = self.learners.sync_weights(self.version, restarted)
                finally:
                    # they resumed when the sync proper ended; the parity probe after it generates
                    resumed = paused_at + metrics.get("weight_sync/seconds", math.inf)
                    self.rollout.run(self.manager.resume_clocks(resumed))
                break
            except Exception as err:  # an engine that died during the sync: restart it, sync again
                lost = original(err)
                if isinstance(lost, ParityError):  # the engines hold the version: the sync is done
                    self.parity_failure, metrics = lost, lost.metrics
                    break
                if not isinstance(lost, EnginesLost) or attempt == SYNC_ATTEMPTS:
                    raise
                self.rollout.run(self.manager.restart_engines(lost.restart))  # the dead, and survivors stuck
                log.warning(
                    "%s; syncing version %d again (attempt %d of %d)",
                    original(err),
                    self.version,
                    attempt + 1,
                    SYNC_ATTEMPTS,
                )
        self.stop.result(
            self.rollout.submit(self.manager.readmit(self.version)), "restarted engines to rejoin", urgent_only=True
        )
        if not defer_parity:
            self.raise_parity_failure()
        return metrics

    def raise_parity_failure(self) -> None:
        """Raises a failed parity probe, saying where the last finished step's checkpoint is
        (saved now if it is not on disk) and how to go on."""
        if self.parity_failure is not None:
            failure, self.parity_failure = self.parity_failure, None
            raise type(failure)(f"{failure}; {self.save_last()}")

    def finish_step(self, step: int, *, save: bool) -> None:
        """Records the rollout side as it is at the end of `step` (what a checkpoint of this
        step holds, even if written later, after a stop request) and saves if asked."""

        async def rollout_state() -> dict:
            # sampler and buffer at one point, so no group being scored is in neither; an
            # overlapped run's next batch, once drawn from the buffer, is part of the state: a
            # resumed run trains on it rather than counting a second one as used. The pending
            # fill was submitted to this loop before this coroutine, so it has begun (and
            # cleared the previous fill's draw) by now.
            sampler, buffer, drawn = await self.sampler.snapshot()
            pending, next_batch = self.pending, None
            if pending is not None:
                ready = pending.done() and pending.exception() is None
                next_batch = pending.result() if ready else drawn
            return {
                "step": step,
                "version": self.version,
                "sampler": sampler,
                "ema_baselines": self.ema_baselines.to_dict(),
                "buffer": buffer,
                "manager": dict(self.manager.stats),
                "trained_groups": self.trained_groups,
                "next_batch": next_batch,
            }

        self._rollout_snapshot = self.rollout.run(rollout_state())
        self.finished_step = step
        if save:
            self.save()

    def save(self) -> None:
        """A checkpoint of the last finished step, the rollout side's state beside the
        learner's, in a step folder of its own (run_dir.save)."""
        step, state = self.finished_step, self._rollout_snapshot
        assert state is not None and state["step"] == step, "finish_step() records the state a save writes"
        run_dir.save(self.checkpoints, step, state, self.learners.save, self.cfg.trainer.keep_checkpoints)
        self.saved_step = step

    @property
    def checkpoints(self) -> Path:
        return Path(self.cfg.trainer.output_dir) / run_dir.CHECKPOINT

    def save_last(self) -> str:
        """Saves the last finished step unless it is on disk already; says where it stands."""
        where = self.checkpoints
        if self.trained_step > self.finished_step:
            # the learner trained a step that never finished (its sync, its metrics line): its
            # weights are ahead of the rollout side's state, so what is on disk stays
            kept = f"checkpoint of step {self.saved_step} in {where}" if self.saved_step else "no checkpoint"
            return f"step {self.trained_step} did not finish: {kept} (continue with trainer.resume=true)"
        if self.finished_step == 0:
            return "no step had finished: nothing to save"
        if self.saved_step < self.finished_step:
            self.save()
        return f"checkpoint of step {self.saved_step} in {where} (continue with trainer.resume=true)"

    def resume(self) -> int:
        """Restores the last checkpoint, if there is one, and pushes its weights to the
        engines; returns the step it was taken after (0: none)."""
        found = run_dir.resume(self.checkpoints, self.learners.load, "train")
        if found is None:
            return 0
        path, state = found
        step = state["step"]

        async def restore() -> int:
            cut_off = self.sampler.load_state(state["sampler"])
            self.ema_baselines = EmaBaselines.from_dict(state.get("ema_baselines", {"values": {}}))
            await self.buffer.load_state(state["buffer"])
            self.manager.stats.update(state["manager"])
            return cut_off

        cut_off = self.rollout.run(restore())
        if cut_off:
            log.info(
                "%d groups were still generating when step %d's checkpoint was taken: their prompts are "
                "generated again first (partial responses are not saved)",
                cut_off,
                step,
            )
        if state.get("next_batch") is not None:
            self.pending = concurrent.futures.Future()
            self.pending.set_result(state["next_batch"])
        self.version = state["version"]
        self.trained_groups = state.get("trained_groups", 0)
        self.finished_step = self.saved_step = self.trained_step = step
        self._rollout_snapshot = state
        self.sync_weights()
        log.info("resumed from %s at step %d (policy version %d)", path, step, self.version)
        return step


@contextlib.contextmanager
def open_run(cfg: ResolvedConfig, stop: StopSignals):
    """Starts every component (a stop request during start-up ends it at the next wait);
    stops every one of them on exit, error or stop request."""
    from megatron_rlvr.launch.placement import placement_for

    placement = placement_for(cfg)
    stop.check("before start-up")
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(cfg)
    with contextlib.ExitStack() as cluster:
        run = None
        try:
            temp_dir = cluster.enter_context(_run_temp_dir())
            cluster.enter_context(placement.session(str(Path(temp_dir) / "ray")))
            stop.check("while Ray started")
            run = Run(cfg, model_dir, tokenizer, stop)
            _start(run, placement)
            yield run
        finally:
            if run is not None:
                _teardown(run)
            cluster.close()  # Ray last: actors first, then its daemons


@contextlib.contextmanager
def _run_temp_dir():
    """A temporary folder the run and every process it starts use (TMPDIR: Python's
    multiprocessing folders, Ray's session), removed at the end, so nothing is left in /tmp.
    After a failure Ray's logs in it are kept, and the log says where."""
    path = tempfile.mkdtemp(prefix="rlvr-")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = path, None
    failed = False
    try:
        yield path
    except StopRequested:
        raise
    except BaseException:
        failed = True
        raise
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
        tempfile.tempdir = None
        if failed and (Path(path) / "ray").exists():
            log.error("Ray's logs of this run are kept in %s", Path(path) / "ray")
        else:
            shutil.rmtree(path, ignore_errors=True)


def _start(run: Run, placement: Placement) -> None:
    from megatron_rlvr.buffer.buffer import Buffer
    from megatron_rlvr.evaluation import build_evaluator
    from megatron_rlvr.launch.engines import EngineFleet
    from megatron_rlvr.launch.learners import LearnerGroup
    from megatron_rlvr.launch.placement import Role
    from megatron_rlvr.launch.verifiers import VerifierPool
    from megatron_rlvr.learner.model import read_hf_config
    from megatron_rlvr.rollout import protocol as p
    from megatron_rlvr.rollout.client import EngineClient
    from megatron_rlvr.rollout.manager import RolloutManager, RoutingShape
    from megatron_rlvr.rollout.prompt_history import PromptHistory
    from megatron_rlvr.rollout.sampler import ActiveSampler, GroupSizes

    cfg, tokenizer = run.cfg, run.tokenizer
    loaded, renderer, train = _prompts(run)  # bad data stops the run before any engine starts
    agent = _agent(run, renderer)  # so do tools that cannot load and a template episodes cannot use
    # this run's engines answer only requests that carry it; hex: SGLang reads its --config file as argv,
    # where a urlsafe key starting with "-" (1 run in 64) was taken for a flag
    api_key = secrets.token_hex(32)
    run.engines = EngineFleet(cfg, run.model_dir, placement, api_key)
    urls = run.engines.start(run.stop)
    run.learners, run.version = LearnerGroup.start(cfg, run.model_dir, urls, placement, run.stop, api_key)
    run.clients = [EngineClient(url, api_key=api_key, timeout_s=cfg.rollout.request_timeout_s) for url in urls]
    eos = tokenizer.eos_token_id
    sampling = p.SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        n=cfg.rollout.n_samples_per_prompt,
        stop_token_ids=[eos] if eos is not None else None,
    )
    shape = run.routing_shape
    num_experts = read_hf_config(run.model_dir).num_experts

    async def restart(engine: int) -> str | None:
        return await asyncio.to_thread(run.engines.restart, engine)

    run.manager = RolloutManager(
        run.clients,
        sampling,
        restart=restart,
        routing=RoutingShape(*shape, num_experts) if shape else None,
        agent=agent,
    )
    run.buffer = placement.place(
        Role.SERVICE, Buffer, zero_std_eps=cfg.buffer.zero_std_eps, max_staleness=cfg.buffer.max_staleness
    ).proxy()
    run.verifiers = VerifierPool(cfg, placement, api_key)  # a judge the run serves takes the run's key
    skip = cfg.buffer.skip_prompts
    history = PromptHistory(
        enabled=skip.enabled,
        explore_solved=skip.explore_solved,
        explore_unsolved=skip.explore_unsolved,
        max_skip_probability=skip.max_probability,
        seed=cfg.trainer.seed,
    )
    sizes = GroupSizes.of(cfg.rollout, cfg.trainer.steps)
    # the fewest useful groups a short batch may have: one real sample per mini-batch and rank
    min_groups = math.ceil(cfg.algo.num_minibatches * cfg.parallel.dp / sizes.smallest)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    run.sampler = ActiveSampler(
        run.manager,
        run.buffer,
        train.records,
        score=run.verifiers,
        seed=cfg.trainer.seed,
        seeded=bool(cfg.rollout.seeded_sampling),
        history=history,
        max_groups=cfg.buffer.max_generated_groups_per_step,
        min_groups=min_groups,
        encode=train.encode,
        decode=decode,
        in_flight=cfg.rollout.updates == "in_flight",
        group_sizes=sizes,
        messages=renderer.messages if agent is not None else None,
    )
    run.evaluator = build_evaluator(cfg, renderer, run.manager, run.verifiers, decode, sampling.stop_token_ids, loaded)


def _agent(run: Run, renderer):
    """The agent section's tools, parser and renderer (None: single-turn rollouts)."""
    if run.cfg.agent is None:
        return None
    from megatron_rlvr.agent.runner import AgentRunner
    from megatron_rlvr.learner.model import read_hf_config

    return AgentRunner(
        run.cfg.agent,
        run.tokenizer,
        model_type=read_hf_config(run.model_dir).model_type,
        chat_template=renderer.template,
        template_kwargs=run.cfg.data.chat_template_kwargs,
    )


def _prompts(run: Run) -> tuple:
    """Every data file read and checked, and the prompts rendered into token ids (chat
    template, length limit): (loaded per source, renderer, training prompts)."""
    from megatron_rlvr.data import PromptRenderer
    from megatron_rlvr.data.check import data_counts, load_all

    loaded = load_all(run.cfg, report=False)  # the command's input check reported the skipped rows
    renderer = PromptRenderer(run.tokenizer, run.cfg.data)
    train = renderer.encode(loaded["data"].records)
    run.data_stats = data_counts(loaded, train)
    return loaded, renderer, train


def _teardown(run: Run) -> None:
    """Stops every component, in order, each step attempted whatever failed before it (and
    logged with the component it came from). After a second stop request nothing waits
    gracefully: requests are not aborted, and processes are killed rather than asked."""
    urgent = run.stop.urgent
    failures: list[str] = []

    def attempt(what: str, action) -> None:
        try:
            action()
        except Exception as err:  # every later step still runs; the run's exit says it failed
            log.error("teardown: %s failed: %s: %s", what, type(err).__name__, err)
            failures.append(what)

    attempt("cancelling the rollout tasks", lambda: run.rollout.cancel_all(timeout_s=2 if urgent else 30))
    if run.manager is not None and not urgent:
        attempt("aborting requests in flight", lambda: run.rollout.submit(run.manager.abort_all()).result(timeout=30))
    for client in run.clients:
        attempt(
            f"closing the client of {client.base_url}",
            lambda client=client: run.rollout.submit(client.close()).result(timeout=10),
        )
    attempt("stopping the rollout thread", run.rollout.close)
    if run.manager is not None and run.manager.agent is not None:
        attempt("stopping the tool workers", run.manager.agent.pool.close)
    if run.learners is not None:
        attempt("closing the learner ranks", lambda: run.learners.close(graceful=not urgent))
    if run.verifiers is not None:
        attempt("closing the verifier workers", run.verifiers.close)
    if run.engines is not None:
        attempt("stopping the engines", lambda: run.engines.stop(graceful=not urgent))
    run.teardown_failures = failures
