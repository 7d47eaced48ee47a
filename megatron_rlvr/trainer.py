"""The RL loop. Each step: a batch of useful groups → old logprobs (R2 records, R3 replays
the engines' routing) → group advantages → N mini-batch updates → weight sync (+ parity
probe) → metrics → checkpoint.

Synchronous runs generate the next batch after the weight sync. With buffer.async_rollout
the next batch is generated while this one trains, by a policy at most one version older
(the buffer drops anything staler than buffer.max_staleness)."""

from __future__ import annotations

import statistics
import time

from megatron_rlvr.batching import groups_to_batch
from megatron_rlvr.config import Config
from megatron_rlvr.reporting import RunReport
from megatron_rlvr.run import Run, open_run


def train(cfg: Config) -> list[dict]:
    history: list[dict] = []
    steps, overlap = cfg.trainer.steps, cfg.buffer.async_rollout
    with open_run(cfg) as run:
        first = (run.resume() if cfg.trainer.resume else 0) + 1
        report = RunReport(cfg.trainer.output_dir, steps, first_step=first, tensorboard=cfg.logging.tensorboard)
        pending = run.request_batch(run.version) if first <= steps else None
        for step in range(first, steps + 1):
            started = time.perf_counter()
            groups = run.next_batch(pending)
            if overlap and step < steps:
                pending = run.request_batch(run.version + 1)
            batch = groups_to_batch(groups, normalize_std=cfg.algo.normalize_std,
                                    pad_id=run.tokenizer.pad_token_id or 0, routing=run.routing_shape)
            batch.old_logprobs = run.learners.compute_logprobs(batch)
            learner_metrics = run.learners.train_step(batch)
            run.version += 1
            sync_metrics = run.sync_weights()
            metrics = step_metrics(step, run, learner_metrics, sync_metrics, time.perf_counter() - started,
                                   report.last)
            report.log(metrics)
            history.append(metrics)
            if step == steps or (cfg.trainer.save_interval and step % cfg.trainer.save_interval == 0):
                run.save(step)
            if not overlap and step < steps:  # after the metrics and the checkpoint it belongs to
                pending = run.request_batch(run.version)
        report.close()
    return history


def step_metrics(step: int, run: Run, learner: dict, sync: dict, seconds: float, previous: dict | None) -> dict:
    """previous: the last step's metrics. A step trained from the buffer's surplus alone scores
    no new sample: its reward/mean is carried over (and reward/samples says 0)."""
    async def rollout_side() -> tuple:
        return run.sampler.take_rewards(), await run.buffer.stats(), dict(run.manager.stats)

    (rewards, tokens), buffer, engines = run.rollout.run(rollout_side())
    return {
        "step": step,
        "reward/mean": statistics.fmean(rewards) if rewards else (previous or {}).get("reward/mean", 0.0),
        "reward/samples": len(rewards),
        "rollout/tokens": tokens,
        "buffer/kept_groups": buffer["kept"],
        "buffer/dropped_zero_std": buffer["dropped_zero_std"],
        **{f"buffer/{k}": v for k, v in buffer.items() if k not in ("kept", "dropped_zero_std")},
        "rollout/moved_groups": engines.get("moved", 0),
        "rollout/engines_serving": run.manager.serving,
        **{f"verifier/{reason}": n for reason, n in sorted(run.verifiers.take_reasons().items())},
        "time/step_s": seconds,
        "policy_version": run.version,
        **{f"train/{k}": v for k, v in learner.items()},
        **sync,
    }
