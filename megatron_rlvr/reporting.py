"""Where a run's metrics go: one JSON object per step in <output_dir>/metrics.jsonl, the same
scalars to TensorBoard, a progress bar (step, reward, tokens/s, ETA) on stderr, and a PNG of
the reward and loss curves when the run ends."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CURVES = (("reward/mean", "mean reward"), ("train/policy_loss", "policy loss"))


class RunReport:
    def __init__(self, output_dir: str | Path, total_steps: int, *, first_step: int = 1,
                 tensorboard: bool = True):
        """first_step > 1 continues a resumed run: lines of later steps (logged after the
        checkpoint it resumes from) are dropped, so every step appears once. TensorBoard's
        events are written anew from the lines kept: metrics.jsonl is the record, and event
        files appended to across a resume would hold the replayed steps twice."""
        from tqdm import tqdm

        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        kept = [line for line in _lines(self.metrics_path) if json.loads(line)["step"] < first_step]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            events = self.dir / "tensorboard"
            for old in events.glob("events.out.tfevents.*") if events.exists() else []:
                old.unlink()
            self.tb = SummaryWriter(str(events))
            for line in kept:
                self._to_tensorboard(json.loads(line))
        self.bar = tqdm(total=total_steps, initial=first_step - 1, unit="step", file=sys.stderr,
                        dynamic_ncols=True, desc="train", mininterval=0)

    def _to_tensorboard(self, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and key != "step":
                self.tb.add_scalar(key, value, metrics["step"])

    def log(self, metrics: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            self._to_tensorboard(metrics)
        tokens_per_s = metrics.get("rollout/tokens", 0) / max(metrics["time/step_s"], 1e-9)
        reward = metrics.get("reward/mean")  # absent on a step that sampled nothing
        self.bar.set_postfix(reward="-" if reward is None else f"{reward:.3f}", tok_s=f"{tokens_per_s:.0f}",
                             loss=f"{metrics.get('train/policy_loss', 0.0):+.4f}", refresh=False)
        self.bar.update(1)

    def close(self) -> Path | None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
        return plot_curves(self.metrics_path, self.dir / "curves.png")


def plot_curves(metrics_path: Path, out: Path) -> Path | None:
    """Reward and loss against step, from metrics.jsonl; None when there is nothing to plot."""
    rows = [json.loads(line) for line in _lines(metrics_path)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(5 * len(CURVES), 3.5))
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes, CURVES):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
