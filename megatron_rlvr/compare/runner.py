"""Runs the planned runs: one after another on this machine, or as one Slurm job each.

Locally, each run is `megatron-rlvr train <run>/config.yaml` in a child process of its own
(Megatron's parallel state and the router-replay registry are process-global; a crash stays
in its run), with its output in <run>/train.log and one progress bar over every step of the
comparison here. Ctrl-C or SIGTERM stops the current run cleanly (the child shuts its engines
down as train does, and saves its checkpoint) and leaves finished runs in place for the next
invocation; a second signal is passed on too, and the child then ends at once."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_rlvr.compare.plan import CompareError, RunPlan
from megatron_rlvr.stopping import StopRequested, StopSignals


def _error_line(log: Path) -> str:
    """The line of a failed run's log that says why: its first error (later ones tend to be
    fallout), else its last line."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line.removeprefix("[rank0]:").strip() for line in re.split(r"[\r\n]+", text) if line.strip()]
    errors = [line for line in lines if re.match(r"^(megatron-rlvr \w+: |[\w.]*(Error|Exception)\b)", line)]
    return (errors[:1] or lines[-1:] or ["no output"])[0]


def run_local(plans: list[RunPlan], stop: StopSignals, out=None) -> None:
    """Runs every unfinished plan, in order; raises CompareError when one fails and
    StopRequested when asked to stop."""
    from tqdm import tqdm

    out = out or sys.stderr
    todo = [p for p in plans if not p.finished()]
    steps = plans[0].steps if plans else 0
    done = len(plans) - len(todo)
    print(
        f"compare-replay: {len(plans)} runs of {steps} steps; {done} finished earlier, {len(todo)} to run",
        file=out,
        flush=True,
    )
    bar = tqdm(
        total=len(plans) * steps, initial=done * steps, unit="step", desc="compare", file=out, dynamic_ncols=True
    )
    try:
        for number, plan in enumerate(todo, start=done + 1):
            bar.set_description(f"[{number}/{len(plans)}] {plan.name}")
            seconds = _train(plan, bar, stop)
            plan.mark_done(seconds)
            bar.write(f"{plan.name}: finished in {seconds:.0f} s", file=out)
    finally:
        bar.close()


def _train(plan: RunPlan, bar, stop: StopSignals) -> float:
    started = time.monotonic()
    counted = 0
    with open(plan.dir / "train.log", "w") as log:
        # a session of its own: a terminal's Ctrl-C reaches this process only, which passes
        # each stop request on, once
        # resume: an unfinished run continues from the checkpoint it left (or starts afresh)
        child = subprocess.Popen(
            [sys.executable, "-m", "megatron_rlvr.cli", "train", str(plan.config), "trainer.resume=true"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        passed_on = 0
        while child.poll() is None:
            for _ in range(stop.count - passed_on):  # train ends after the step it is in (exit 130)
                child.send_signal(signal.SIGTERM)
            passed_on = stop.count
            stop.sleep(0.5)
            logged = plan.steps_logged()
            if logged != counted:
                bar.update(logged - counted)
                counted = logged
    bar.update(plan.steps_logged() - counted)
    if child.returncode == 130 or stop.requested:
        raise StopRequested(stop.signal_name or "SIGTERM", f"during run {plan.name}")
    if child.returncode != 0 or plan.steps_logged() != plan.steps:
        raise CompareError(
            f"run {plan.name} failed (exit code {child.returncode}): "
            f"{_error_line(plan.dir / 'train.log')} (log: {plan.dir / 'train.log'})"
        )
    return time.monotonic() - started


# ----------------------------------------------------------------------------- Slurm
def submit(plans: list[RunPlan], options: dict, out=None) -> list[RunPlan]:
    """One Slurm job per unfinished run that has no live job (a run whose job completed with
    every step logged is marked finished). Returns the runs still queued or running."""
    try:
        from megatron_rlvr.launch import slurm
    except ImportError:
        raise CompareError(
            "--submit is not available: this install has no Slurm submission (megatron_rlvr.launch.slurm)"
        ) from None
    from megatron_rlvr.config import load_config

    out = out or sys.stdout
    waiting = []
    for plan in plans:
        if plan.finished():
            continue
        job_file = plan.dir / "slurm_job"
        if job_file.exists():
            job_id = job_file.read_text().strip()
            state, _, _ = slurm.job_state(job_id)
            if state == "COMPLETED" and plan.steps_logged() == plan.steps:
                plan.mark_done()
                print(f"{plan.name}: job {job_id} completed", file=out)
                continue
            if state not in slurm.FINAL_STATES and state != "UNKNOWN":
                print(f"{plan.name}: job {job_id} {state}", file=out)
                waiting.append(plan)
                continue
            print(
                f"{plan.name}: job {job_id} ended {state} with {plan.steps_logged()} of {plan.steps} "
                "steps logged; submitting again",
                file=out,
            )
        try:
            cfg = load_config(plan.config)
            resources = slurm.plan(cfg, options["nodes"], options["gpus_per_node"])
            slurm.check_inputs_present(cfg)
            spec = slurm.JobSpec(
                config=plan.config,
                overrides=[],
                nodes=options["nodes"],
                gpus_per_node=options["gpus_per_node"],
                log_root=plan.dir / "slurm",
                job_name=f"rlvr-{plan.name}",
                partition=options.get("partition"),
                time=options.get("time"),
                account=options.get("account"),
            )
            script = slurm.render(spec, resources)
            spec.log_root.mkdir(parents=True, exist_ok=True)
            job_id = slurm.sbatch(script)
        except slurm.SubmitError as err:
            raise CompareError(f"run {plan.name}: {err}") from err
        job_file.write_text(job_id + "\n")
        (plan.dir / "job.sbatch").write_text(script)
        print(f"{plan.name}: submitted job {job_id} (timeline: {spec.log_root}/slurm-{job_id}.out)", file=out)
        waiting.append(plan)
    return waiting
