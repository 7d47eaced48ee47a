"""The runs of a comparison: every combination of algorithm, off-policy degree, replay mode and
seed, each a complete training config of its own in <out>/runs/<name>/config.yaml.

What must not differ between runs does not: every run starts from the same initial weights
(the config's HF checkpoint, or the tiny model, which every run makes under <run>/model from
the same model.init_seed, bit for bit), and a seed fixes the data order and rollout sampling
(trainer.seed). Every run captures the
engine's routing, so that learner/engine routing agreement is measured in every mode, not
only under R3. A run is finished when its metrics.jsonl has every step and its DONE marker,
written after the run completed, exists; a comparison run again skips finished runs."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_rlvr.compare.analysis import Combo, RunResult, read_metrics
from megatron_rlvr.config import Config, ConfigError, apply_overrides, load_config, to_yaml
from megatron_rlvr.errors import UserError

DONE = "DONE"
COMPARISON = "comparison.yaml"  # the base config and step count the runs in --out belong to


class CompareError(UserError, RuntimeError):
    """A comparison that cannot go on, said in one line."""


@dataclass(frozen=True)
class RunPlan:
    combo: Combo
    seed: int
    dir: Path
    steps: int

    @property
    def name(self) -> str:
        return self.dir.name

    @property
    def config(self) -> Path:
        return self.dir / "config.yaml"

    def steps_logged(self) -> int:
        return len({row["step"] for row in read_metrics(self.dir / "metrics.jsonl")} & set(range(1, self.steps + 1)))

    def finished(self) -> bool:
        return (self.dir / DONE).exists() and self.steps_logged() == self.steps

    def mark_done(self, seconds: float | None = None) -> None:
        (self.dir / DONE).write_text(
            json.dumps({"steps": self.steps, "seconds": seconds, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")})
            + "\n"
        )

    def result(self) -> RunResult:
        return RunResult(self.combo, self.seed, read_metrics(self.dir / "metrics.jsonl"))


def run_name(combo: Combo, seed: int) -> str:
    return f"{combo.algo}-k{combo.off_policy}-{combo.mode}-s{seed}"


def _check_same_comparison(out: Path, base: Config, steps: int) -> None:
    record = to_yaml(base) + f"# compare-replay steps: {steps}\n"
    path = out / COMPARISON
    if path.exists() and path.read_text() != record:
        raise CompareError(
            f"--out {out} holds runs of another config or step count (see {path}); use "
            "another --out, or delete it to start over"
        )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(record)


def plan_runs(
    config: str,
    overrides: list[str],
    base: Config,
    *,
    modes: list[str],
    algos: list[str],
    off_policy: list[int],
    steps: int,
    seeds: int,
    out: Path,
) -> list[RunPlan]:
    """Validates every run's config (`base`: CONFIG with overrides, loaded) and writes it;
    returns the runs in the order they run:
    for each algorithm, off-policy degree and seed, every mode (so that an interrupted
    comparison leaves whole sets of modes behind)."""
    _check_same_comparison(out, base, steps)
    raw = apply_overrides(yaml.safe_load(Path(config).read_text()) or {}, list(overrides))
    plans = []
    for algo in algos:
        for degree in off_policy:
            for seed in range(seeds):
                for mode in modes:
                    combo = Combo(algo, degree, mode)
                    plan = RunPlan(combo, seed, out / "runs" / run_name(combo, seed), steps)
                    settings = {
                        "algo.kind": algo,
                        "algo.routing_replay": mode,
                        "algo.num_minibatches": degree,
                        "trainer.seed": seed,
                        "trainer.steps": steps,
                        "trainer.resume": False,
                        "trainer.output_dir": str(plan.dir),
                        "rollout.return_routed_experts": True,
                    }
                    run_raw = copy.deepcopy(raw)
                    for dotted, value in settings.items():
                        section, key = dotted.split(".")
                        run_raw.setdefault(section, {})[key] = value
                    plan.dir.mkdir(parents=True, exist_ok=True)
                    plan.config.write_text(yaml.safe_dump(run_raw, sort_keys=False))
                    try:
                        load_config(plan.config)
                    except ConfigError as err:
                        raise ConfigError([f"run {plan.name}: {line}" for line in err.problems]) from err
                    plans.append(plan)
    return plans
