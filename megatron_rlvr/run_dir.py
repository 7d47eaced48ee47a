"""What a run's output folder holds, read without starting anything: the steps its
metrics.jsonl logged and the step of its checkpoint. `train` refuses to start a new run over
an old one (nothing of it changes) unless the user asks to resume it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_rlvr.config import ConfigError, ResolvedConfig

METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint"
RUN_STATE = "run_state.pkl"  # beside the learner's checkpoint: the rollout side of a resume
RUN_STEP = "run_state.json"  # {"step": N}: the checkpoint's step, readable without unpickling


@dataclass(frozen=True)
class RunDir:
    path: Path
    last_logged_step: int  # 0: no metrics
    checkpoint_step: int | None  # None: no complete checkpoint

    @property
    def holds_a_run(self) -> bool:
        return self.last_logged_step > 0 or self.checkpoint_step is not None or (self.path / CHECKPOINT).exists()

    def describe(self) -> str:
        parts = []
        if self.last_logged_step:
            parts.append(f"metrics up to step {self.last_logged_step}")
        if self.checkpoint_step is not None:
            parts.append(f"a checkpoint of step {self.checkpoint_step}")
        elif (self.path / CHECKPOINT).exists():
            parts.append("an incomplete checkpoint")
        return " and ".join(parts)


def inspect(output_dir: str | Path) -> RunDir:
    path = Path(output_dir)
    last = 0
    metrics = path / METRICS
    if metrics.exists():
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash: the steps before it still count
    step = None
    step_file = path / CHECKPOINT / RUN_STEP
    if step_file.exists():
        try:
            step = int(json.loads(step_file.read_text())["step"])
        except (ValueError, KeyError, TypeError):
            step = None
    return RunDir(path, last, step)


def check_output_dir(cfg: ResolvedConfig) -> RunDir:
    """Refuses (ConfigError, one line) to start a new run in a folder that holds one; with
    trainer.resume the folder is the run to continue. Returns what the folder holds."""
    found = inspect(cfg.trainer.output_dir)
    if found.holds_a_run and not cfg.trainer.resume:
        raise ConfigError(
            [
                f"trainer.output_dir = {cfg.trainer.output_dir!r} holds a run ({found.describe()}): continue it "
                "with trainer.resume=true, or give this run another trainer.output_dir (nothing was changed)"
            ]
        )
    return found


def finished_message(cfg: ResolvedConfig, found: RunDir) -> str | None:
    """When resuming a run whose checkpoint already holds every step asked for: what to say."""
    if cfg.trainer.resume and found.checkpoint_step is not None and found.checkpoint_step >= cfg.trainer.steps:
        return (
            f"the run in {cfg.trainer.output_dir} already finished: its checkpoint is of step "
            f"{found.checkpoint_step} and trainer.steps = {cfg.trainer.steps} (raise trainer.steps to train further)"
        )
    return None
