"""The runs of a comparison: every combination of algorithm, off-policy degree, --vary variant,
replay mode and seed, each a complete training config of its own in <out>/runs/<name>/config.yaml.

What must not differ between runs does not: every run starts from the same initial weights
(the config's HF checkpoint, or the tiny model, which every run makes under <run>/model from
the same model.init_seed, bit for bit), and a seed fixes the data order and rollout sampling
(trainer.seed). Every run captures the
engine's routing, so that learner/engine routing agreement is measured in every mode, not
only under R3. A run is finished when its DONE marker, written after the run completed, exists
and its metrics.jsonl has every step, or the marker says why train ended it early (nothing left
to learn: every prompt always or never solved); a comparison run again skips finished runs. Runs of
another config, step count or set of --vary values in the same --out are refused."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import itertools
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_rlvr.compare.analysis import Combo, RunResult, read_metrics
from megatron_rlvr.compare.variants import Vary, grid
from megatron_rlvr.config import Config, ConfigError, apply_overrides, load_config, to_yaml
from megatron_rlvr.errors import UserError

DONE = "DONE"
COMPARISON = "comparison.yaml"  # the base config, step count and --vary the runs in --out belong to


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

    def _done(self) -> dict | None:
        path = self.dir / DONE
        return json.loads(path.read_text()) if path.exists() else None

    def finished(self) -> bool:
        """Every step logged, or a run that ended early with its reason (ended_early)."""
        done = self._done()
        return done is not None and (self.steps_logged() == self.steps or bool(done.get("ended_early")))

    def ended_early(self) -> str | None:
        """Why a finished run logged fewer steps than asked (train's own words), else None."""
        done = self._done()
        return done.get("ended_early") if done else None

    def mark_done(self, seconds: float | None = None, ended_early: str | None = None) -> None:
        record = {"steps": self.steps, "seconds": seconds, "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        if ended_early:
            record.update(ended_early=ended_early, steps_logged=self.steps_logged())
        (self.dir / DONE).write_text(json.dumps(record) + "\n")

    def result(self) -> RunResult:
        return RunResult(self.combo, self.seed, read_metrics(self.dir / "metrics.jsonl"))


def run_name(combo: Combo, seed: int) -> str:
    varied = f"{combo.variant.folder_name}-" if combo.variant.settings else ""
    return f"{combo.algo}-k{combo.off_policy}-{varied}{combo.mode}-s{seed}"


def _comparison_record(base: Config, steps: int, varied: list[Vary]) -> dict[str, str]:
    """What comparison.yaml holds, by what a mismatch is called: the config, then comment lines."""
    return {
        "config": to_yaml(base),
        "step count": f"# compare-replay steps: {steps}\n",
        "--vary": "".join(f"# compare-replay --vary {axis}\n" for axis in varied),
    }


def _refuse_another_comparison(out: Path, record: dict[str, str]) -> None:
    path = out / COMPARISON
    if not path.exists() or path.read_text() == "".join(record.values()):
        return
    lines = path.read_text().splitlines(keepends=True)
    theirs = {
        "config": "".join(line for line in lines if not line.startswith("# compare-replay ")),
        "step count": "".join(line for line in lines if line.startswith("# compare-replay steps: ")),
        "--vary": "".join(line for line in lines if line.startswith("# compare-replay --vary ")),
    }
    differing = " and ".join(what for what in record if theirs[what] != record[what]) or "config"
    raise CompareError(
        f"--out {out} holds runs of another {differing} (see {path}); use another --out, or delete it to start over"
    )


def plan_runs(
    config: str,
    overrides: list[str],
    base: Config,
    *,
    modes: list[str],
    algos: list[str],
    off_policy: list[int],
    varied: list[Vary],
    steps: int,
    seeds: int,
    out: Path,
) -> list[RunPlan]:
    """Validates every run's config (`base`: CONFIG with overrides, loaded; each --vary
    variant applied over them) and writes it; returns the runs in the order they run: for each
    algorithm, off-policy degree, variant and seed, every mode (so that an interrupted
    comparison leaves whole sets of modes behind). Nothing is recorded in --out until every
    run's config is valid, so the corrected command is not refused as another comparison."""
    keys = [axis.key for axis in varied]
    twice = next((key for key in keys if keys.count(key) > 1), None)
    if twice is not None:
        raise CompareError(f"--vary {twice} is given twice; put all its values in one --vary")
    record = _comparison_record(base, steps, varied)
    _refuse_another_comparison(out, record)
    raw = apply_overrides(yaml.safe_load(Path(config).read_text()) or {}, list(overrides))
    plans = []
    for algo, degree, variant, seed, mode in itertools.product(algos, off_policy, grid(varied), range(seeds), modes):
        combo = Combo(algo, degree, mode, variant)
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
        plan.dir.mkdir(parents=True, exist_ok=True)
        try:
            run_raw = apply_overrides(copy.deepcopy(raw), variant.overrides())
            for dotted, value in settings.items():
                section, key = dotted.split(".")
                run_raw.setdefault(section, {})[key] = value
            plan.config.write_text(yaml.safe_dump(run_raw, sort_keys=False))
            load_config(plan.config)
        except ConfigError as err:
            raise ConfigError([f"run {plan.name}: {line}" for line in err.problems]) from err
        plans.append(plan)
    (out / COMPARISON).write_text("".join(record.values()))
    return plans


@contextlib.contextmanager
def run_lock(out: Path) -> Iterator[None]:
    """One compare-replay at a time in `out` (two would run, submit or mark the same runs):
    an exclusive lock on <out>/.lock, held while the command works, released however it ends."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise CompareError(
                f"--out {out} is in use by another compare-replay ({holder}); wait for it to end or give another --out"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}\n")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
