"""Where a run's metrics go: one JSON object per step in <output_dir>/metrics.jsonl, the same
scalars to TensorBoard and (logging.wandb) Weights & Biases, a progress bar (step, reward,
eval pass@1, tokens/s, ETA) on stderr with a line per evaluation, and a PNG of the reward,
loss and eval curves when the run ends. Evaluation before training is logged as step 0."""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

from megatron_rlvr.errors import UserError

CURVES = (("reward/mean", "mean reward"), ("train/policy_loss", "policy loss"))
WANDB_ID = "wandb_run_id"  # beside metrics.jsonl: a resumed run continues the same W&B run


class WandbMissing(UserError):
    """logging.wandb is set, but the wandb package is not installed."""


def wandb_module(check_only: bool = False):
    """The wandb package, imported on first need (it is an optional dependency)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise WandbMissing(
            "logging.wandb is set but the wandb package is not installed: "
            "pip install -c constraints.txt -e '.[wandb]' (or set logging.wandb=null)"
        )
    if check_only:
        return None
    import wandb

    return wandb


class RunReport:
    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        *,
        first_step: int = 1,
        tensorboard: bool = True,
        wandb=None,
        config: dict | None = None,
        once: dict | None = None,
    ):
        """first_step > 1 continues a resumed run: lines of later steps (logged after the
        checkpoint it resumes from) are dropped, so every step appears once. TensorBoard's
        events are written anew from the lines kept: metrics.jsonl is the record, and event
        files appended to across a resume would hold the replayed steps twice. wandb: a
        WandbConfig; once: metrics added to the first line a fresh run writes (data counts)."""
        from tqdm import tqdm

        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        kept = [line for line in _lines(self.metrics_path) if json.loads(line)["step"] < first_step]
        kept = kept if first_step > 1 else []  # a fresh run: not even an earlier attempt's step-0 eval
        self.metrics_path.write_text("".join(line + "\n" for line in kept))
        self.once = dict(once or {}) if first_step == 1 else {}  # a resumed run logged them already
        self.eval_shown: str = ""
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            events = self.dir / "tensorboard"
            for old in events.glob("events.out.tfevents.*") if events.exists() else []:
                old.unlink()
            self.tb = SummaryWriter(str(events))
            for line in kept:
                self._to_tensorboard(json.loads(line))
        self.wandb = _start_wandb(wandb, self.dir, config or {}) if wandb is not None else None
        self.bar = tqdm(
            total=total_steps,
            initial=first_step - 1,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            desc="train",
            mininterval=0,
        )

    @classmethod
    def for_run(cls, cfg, *, first_step: int, once: dict | None = None) -> RunReport:
        return cls(
            cfg.trainer.output_dir,
            cfg.trainer.steps,
            first_step=first_step,
            tensorboard=cfg.logging.tensorboard,
            wandb=cfg.logging.wandb,
            config=cfg.model_dump(mode="json"),
            once=once,
        )

    def _to_tensorboard(self, metrics: dict) -> None:
        assert self.tb is not None  # called only with TensorBoard on
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and key != "step":
                self.tb.add_scalar(key, value, metrics["step"])

    def _write(self, metrics: dict) -> None:
        metrics.update(self.once)
        self.once = {}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tb is not None:
            self._to_tensorboard(metrics)
        if self.wandb is not None:
            self.wandb.log(
                {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}, step=metrics["step"]
            )
        evals = _eval_summary(metrics)
        if evals:
            self.bar.write(f"eval at step {metrics['step']}: {evals}", file=sys.stderr)
            first = next(k for k in metrics if k.startswith("eval/") and k.endswith("/pass@1"))
            self.eval_shown = f"{metrics[first]:.3f}"

    def log_eval(self, step: int, metrics: dict) -> None:
        """Evaluation outside a training step (step 0, before training); nothing when empty."""
        if metrics:
            self._write({"step": step, **metrics})

    def log(self, metrics: dict) -> None:
        self._write(metrics)
        tokens = metrics.get("rollout/tokens", metrics.get("train/sft_tokens", 0))  # generated, or SFT's trained
        tokens_per_s = tokens / max(metrics["time/step_s"], 1e-9)
        reward = metrics.get("reward/mean")  # absent on a step that sampled nothing
        shown = {"reward": "-" if reward is None else f"{reward:.3f}"}
        if self.eval_shown:
            shown["eval"] = self.eval_shown
        self.bar.set_postfix(
            **shown,
            tok_s=f"{tokens_per_s:.0f}",
            loss=f"{metrics.get('train/policy_loss', metrics.get('train/sft_loss', 0.0)):+.4f}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> Path | None:
        self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        return plot_curves(self.metrics_path, self.dir / "curves.png")


def _start_wandb(spec, out_dir: Path, config: dict):
    wandb = wandb_module()
    id_path = out_dir / WANDB_ID
    run_id = id_path.read_text().strip() if id_path.exists() else secrets.token_hex(4)
    run = wandb.init(
        project=spec.project,
        entity=spec.entity,
        name=spec.name or out_dir.resolve().name,
        group=spec.group,
        tags=spec.tags or None,
        mode=spec.mode,
        dir=str(out_dir),
        config=config,
        id=run_id,
        resume="allow",
        settings=wandb.Settings(console="off", silent=True),
    )
    id_path.write_text(run_id)
    return run


def _eval_summary(metrics: dict) -> str:
    """ "heldout pass@1 0.412 pass@4 0.700 avg@4 0.412 len 3.1 trunc 0.00" per set."""
    sets: dict[str, list[str]] = {}
    for key, value in metrics.items():
        if key.startswith("eval/") and key.count("/") == 2:
            _, name, metric = key.split("/")
            if metric not in ("prompts", "failed"):
                short = {"response_length": "len", "truncated": "trunc"}.get(metric, metric)
                sets.setdefault(name, []).append(f"{short} {value:.3f}")
    return "; ".join(f"{name} {' '.join(parts)}" for name, parts in sets.items())


def plot_curves(metrics_path: Path, out: Path) -> Path | None:
    """Reward and loss against step, from metrics.jsonl, and each eval set's pass@1 (and its
    largest pass@k) when the run evaluated; None when there is nothing to plot."""
    rows = [json.loads(line) for line in _lines(metrics_path)]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eval_keys = sorted({k for r in rows for k in r if k.startswith("eval/") and "/pass@" in k})
    panels = len(CURVES) + bool(eval_keys)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.5))
    train = [r for r in rows if "reward/mean" in r or "train/policy_loss" in r]
    for ax, (key, title) in zip(axes, CURVES):
        ax.plot([r["step"] for r in train], [r.get(key, float("nan")) for r in train])
        ax.set_title(title)
    if eval_keys:
        ax = axes[-1]
        for key in eval_keys:
            points = [(r["step"], r[key]) for r in rows if key in r]
            ax.plot(*zip(*points), marker="o", label=key.removeprefix("eval/"))
        ax.set_title("eval")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
