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
        checkpoint it resumes from) are dropped, so every step appears once."""
        from tqdm import tqdm

        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        kept = [line for line in _lines(self.metrics_path) if json.loads(line)["step"] < first_step]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))
        self.last: dict | None = json.loads(kept[-1]) if kept else None  # the latest step logged
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=first_step)
        self.bar = tqdm(total=total_steps, initial=first_step - 1, unit="step", file=sys.stderr,
                        dynamic_ncols=True, desc="train", mininterval=0)

    def log(self, metrics: dict) -> None:
        self.last = metrics
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, metrics["step"])
        tokens_per_s = metrics.get("rollout/tokens", 0) / max(metrics["time/step_s"], 1e-9)
        self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", tok_s=f"{tokens_per_s:.0f}",
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
