"""Everything a training run needs, started in dependency order and always torn down: the
model (made locally on first run for the tiny default), engine servers, the learner, the
rollout manager and weight syncer on one event loop, the buffer and the verifier.

Local mode: one learner rank in this process and the engines as child processes. Learner
layouts with more ranks run under Ray (the orchestration capability)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlvr.config import Config, HFModel, TinyModel
from megatron_rlvr.data import build_arithmetic_tokenizer, load_data

log = logging.getLogger(__name__)


class RunError(RuntimeError):
    """A run this mode cannot start, said in one line."""


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
        build_tiny_hf_model(spec, model_dir, vocab_size=spec.vocab_size or len(tokenizer))
    return model_dir, AutoTokenizer.from_pretrained(model_dir)


@dataclass
class Run:
    cfg: Config
    model_dir: Path
    tokenizer: object
    loop: asyncio.AbstractEventLoop
    learner: object = None
    engines: list = field(default_factory=list)
    clients: list = field(default_factory=list)
    manager: object = None
    syncer: object = None
    buffer: object = None
    sampler: object = None
    verifier: object = None
    version: int = 0

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        if not self.cfg.rollout.return_routed_experts:
            return None
        hf = self.learner.bridge.hf_config
        return hf.num_hidden_layers, hf.num_experts_per_tok


def _start_engines(cfg: Config, model_dir: Path) -> list:
    from megatron_rlvr.learner.parallel import free_port
    from megatron_rlvr.rollout.launcher import engine_process

    log_dir = Path(cfg.trainer.output_dir) / "logs"
    engines = [engine_process(str(model_dir), cfg.rollout.engine, host=cfg.rollout.host, port=free_port(),
                              routed_experts=bool(cfg.rollout.return_routed_experts), log_dir=log_dir)
               for _ in range(cfg.rollout.num_engines)]
    errors: list[Exception] = []

    def start(engine) -> None:
        try:
            engine.start()
        except Exception as err:  # reported below, after every start attempt finished
            errors.append(err)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for engine in engines:
            engine.stop()
        raise errors[0]
    return engines


@contextlib.contextmanager
def local_run(cfg: Config):
    """Starts every component; stops every one of them on exit, error or Ctrl-C."""
    from megatron_rlvr.buffer.buffer import Buffer
    from megatron_rlvr.learner.learner import Learner
    from megatron_rlvr.learner.parallel import Rendezvous, destroy_parallel, free_port, init_parallel
    from megatron_rlvr.rewards.math import MathVerifier
    from megatron_rlvr.rollout import protocol as p
    from megatron_rlvr.rollout.client import EngineClient
    from megatron_rlvr.rollout.manager import RolloutManager, RoutingShape
    from megatron_rlvr.rollout.sampler import ActiveSampler
    from megatron_rlvr.weight_sync.syncer import WeightSyncer

    if cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp != 1:
        raise RunError("local runs train with one learner rank; multi-rank layouts run under Ray")
    Path(cfg.trainer.output_dir).mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(cfg)
    run = Run(cfg, model_dir, tokenizer, asyncio.new_event_loop())
    try:
        run.engines = _start_engines(cfg, model_dir)
        init_parallel(cfg.parallel, Rendezvous(0, 1, master_port=free_port()), seed=cfg.trainer.seed)
        run.learner = Learner(cfg, model_dir)
        run.clients = [EngineClient(e.url, timeout_s=cfg.rollout.request_timeout_s) for e in run.engines]
        eos = tokenizer.eos_token_id
        sampling = p.SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                    top_p=cfg.rollout.top_p, n=cfg.rollout.n_samples_per_prompt,
                                    stop_token_ids=[eos] if eos is not None else None)
        shape = run.routing_shape
        hf = run.learner.bridge.hf_config
        run.manager = RolloutManager(run.clients, sampling,
                                     routing=RoutingShape(*shape, hf.num_experts) if shape else None)
        run.syncer = WeightSyncer(run.clients, cfg.weight_sync, master_address="127.0.0.1",
                                  checksums=cfg.weight_sync.checksum and cfg.rollout.engine.type == "cpu")
        run.loop.run_until_complete(run.syncer.connect())
        run.version = run.syncer.version
        run.buffer = Buffer(zero_std_eps=cfg.buffer.zero_std_eps, max_staleness=cfg.buffer.max_staleness)
        run.verifier = MathVerifier(timeout_s=cfg.verifier.timeout_s, num_workers=cfg.verifier.num_workers)
        data = load_data(cfg.data)
        for number, reason in data.skipped:
            log.warning("data line %d skipped: %s", number, reason)
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        run.sampler = ActiveSampler(
            run.manager, run.buffer, data.records, verifier=run.verifier, seed=cfg.trainer.seed,
            encode=lambda text: bos + tokenizer.encode(text, add_special_tokens=False),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        yield run
    finally:
        _teardown(run, destroy_parallel)


def _teardown(run: Run, destroy_parallel) -> None:
    if run.manager is not None:
        with contextlib.suppress(Exception):
            run.loop.run_until_complete(run.manager.abort_all())
    for client in run.clients:
        with contextlib.suppress(Exception):
            run.loop.run_until_complete(client.close())
    for engine in run.engines:
        engine.stop()
    if run.verifier is not None:
        run.verifier.close()
    if run.learner is not None:
        destroy_parallel()
    run.loop.close()
