"""The RL loop. Each step: a batch of useful groups → old logprobs (R2 records, R3 replays
the engines' routing) → group advantages → N mini-batch updates → weight sync (+ parity
probe) → metrics → checkpoint."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from megatron_rlvr.batching import groups_to_batch
from megatron_rlvr.config import Config
from megatron_rlvr.learner.checkpoint import save_checkpoint
from megatron_rlvr.run import Run, local_run
from megatron_rlvr.weight_sync.learner_sync import sync_weights


def train(cfg: Config) -> list[dict]:
    history: list[dict] = []
    with local_run(cfg) as run:
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
            run.log_metrics(metrics)
            history.append(metrics)
            report(metrics, cfg.trainer.steps)
            if cfg.trainer.save_interval and step % cfg.trainer.save_interval == 0:
                save_checkpoint(run.learner, Path(cfg.trainer.output_dir) / "checkpoint")
        save_checkpoint(run.learner, Path(cfg.trainer.output_dir) / "checkpoint")
    return history


def step_metrics(step: int, run: Run, learner: dict, sync: dict, seconds: float) -> dict:
    rewards = run.sampler.take_rewards()
    buffer = run.buffer.stats()
    return {
        "step": step,
        "reward/mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward/samples": len(rewards),
        "buffer/kept_groups": buffer["kept"],
        "buffer/dropped_zero_std": buffer["dropped_zero_std"],
        **{f"buffer/{k}": v for k, v in buffer.items() if k not in ("kept", "dropped_zero_std")},
        "rollout/moved_groups": run.manager.stats["moved"],
        "time/step_s": seconds,
        "policy_version": run.version,
        **{f"train/{k}": v for k, v in learner.items()},
        **sync,
    }


def report(metrics: dict, steps: int) -> None:
    print(f"step {metrics['step']}/{steps}  reward {metrics['reward/mean']:.3f}  "
          f"loss {metrics['train/policy_loss']:+.4f}  kept {metrics['buffer/kept_groups']}  "
          f"{metrics['time/step_s']:.1f}s", file=sys.stderr, flush=True)
