"""The RL loop. Each step: a batch of useful groups → old logprobs (R2 records, R3 replays
the engines' routing) → group advantages → N mini-batch updates → weight sync (+ parity
probe) → metrics → checkpoint."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from megatron_rlvr.batching import groups_to_batch
from megatron_rlvr.config import Config
from megatron_rlvr.learner.checkpoint import save_checkpoint
from megatron_rlvr.reporting import RunReport
from megatron_rlvr.run import Run, local_run
from megatron_rlvr.weight_sync.learner_sync import sync_weights


def train(cfg: Config) -> list[dict]:
    history: list[dict] = []
    with local_run(cfg) as run:
        report = RunReport(cfg.trainer.output_dir, cfg.trainer.steps, tensorboard=cfg.logging.tensorboard)
        for step in range(1, cfg.trainer.steps + 1):
            started = time.perf_counter()
            groups = run.loop.run_until_complete(run.sampler.fill(cfg.buffer.batch_groups, run.version))
            batch = groups_to_batch(groups, normalize_std=cfg.algo.normalize_std,
                                    pad_id=run.tokenizer.pad_token_id or 0, routing=run.routing_shape)
            batch.old_logprobs = run.learner.compute_logprobs(batch)
            learner_metrics = run.learner.train_step(batch)
            run.version += 1
            sync_metrics = sync_weights(run.learner, run.version, syncer=run.syncer, loop=run.loop)
            metrics = step_metrics(step, run, learner_metrics, sync_metrics, time.perf_counter() - started)
            report.log(metrics)
            history.append(metrics)
            if cfg.trainer.save_interval and step % cfg.trainer.save_interval == 0:
                save_checkpoint(run.learner, Path(cfg.trainer.output_dir) / "checkpoint")
        save_checkpoint(run.learner, Path(cfg.trainer.output_dir) / "checkpoint")
        report.close()
    return history


def step_metrics(step: int, run: Run, learner: dict, sync: dict, seconds: float) -> dict:
    rewards, tokens = run.sampler.take_rewards()
    buffer = run.buffer.stats()
    return {
        "step": step,
        "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward/samples": len(rewards),
        "rollout/tokens": tokens,
        "buffer/kept_groups": buffer["kept"],
        "buffer/dropped_zero_std": buffer["dropped_zero_std"],
        **{f"buffer/{k}": v for k, v in buffer.items() if k not in ("kept", "dropped_zero_std")},
        "rollout/moved_groups": run.manager.stats["moved"],
        "time/step_s": seconds,
        "policy_version": run.version,
        **{f"train/{k}": v for k, v in learner.items()},
        **sync,
    }
