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


def ended_early(log: Path) -> str | None:
    """train's own reason for a run that finished (exit 0) short of its steps: the line it
    prints then ("megatron-rlvr train: no prompt has anything left to teach ..."), else None."""
    text = log.read_text(errors="replace") if log.exists() else ""
    said = [m.group(1) for m in re.finditer(r"^megatron-rlvr train: (.+)$", text, flags=re.M)]
    said = [line for line in said if not line.startswith(("finished, but stopping failed", "stopped by"))]
    return said[-1].strip() if said else None


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
            seconds, early = _train(plan, bar, stop)
            plan.mark_done(seconds, ended_early=early)
            if early:
                bar.write(f"{plan.name}: ended at step {plan.steps_logged()} of {plan.steps}: {early}", file=out)
            else:
                bar.write(f"{plan.name}: finished in {seconds:.0f} s", file=out)
    finally:
        bar.close()


def _train(plan: RunPlan, bar, stop: StopSignals) -> tuple[float, str | None]:
    """Runs train on the plan; its seconds, and why it ended early when it did."""
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
    early = ended_early(plan.dir / "train.log") if child.returncode == 0 and plan.steps_logged() < plan.steps else None
    if child.returncode != 0 or (plan.steps_logged() != plan.steps and early is None):
        raise CompareError(
            f"run {plan.name} failed (exit code {child.returncode}): "
            f"{_error_line(plan.dir / 'train.log')} (log: {plan.dir / 'train.log'})"
        )
    return time.monotonic() - started, early


# ----------------------------------------------------------------------------- Slurm
UNKNOWN_TRIES = 3  # a job scontrol and sacct do not know is asked about this often
UNKNOWN_WAIT_S = 2.0  # this far apart, before it is left alone (never submitted twice)


def _job_state(slurm, job_id: str, out) -> str:
    """The job's state; UNKNOWN (neither scontrol nor sacct answered) is asked again a few
    times before it is believed."""
    for attempt in range(UNKNOWN_TRIES):
        state, _, _ = slurm.job_state(job_id)
        if state != "UNKNOWN":
            return state
        if attempt + 1 < UNKNOWN_TRIES:
            time.sleep(UNKNOWN_WAIT_S)
    return state


def _collect(plan: RunPlan, job_id: str, state: str, slurm, out) -> str:
    """What a known job means for its run: "done", "waiting" or "again" (submit it anew)."""
    if state == "UNKNOWN":
        print(
            f"{plan.name}: job {job_id}: neither scontrol nor sacct knows it after {UNKNOWN_TRIES} tries; "
            f"not submitted again (remove {plan.dir / 'slurm_job'} to submit this run anew)",
            file=out,
        )
        return "waiting"
    if state not in slurm.FINAL_STATES:
        print(f"{plan.name}: job {job_id} {state}", file=out)
        return "waiting"
    if state == "COMPLETED" and plan.steps_logged() == plan.steps:
        plan.mark_done()
        print(f"{plan.name}: job {job_id} completed", file=out)
        return "done"
    early = ended_early(plan.dir / "slurm" / job_id / "driver.log") if state == "COMPLETED" else None
    if early:
        plan.mark_done(ended_early=early)
        print(f"{plan.name}: job {job_id} completed at step {plan.steps_logged()} of {plan.steps}: {early}", file=out)
        return "done"
    print(
        f"{plan.name}: job {job_id} ended {state} with {plan.steps_logged()} of {plan.steps} "
        "steps logged; submitting again",
        file=out,
    )
    return "again"


def submit(plans: list[RunPlan], args, out=None) -> list[RunPlan]:
    """One Slurm job per unfinished run that has no live job, with the job options of `submit`
    (args: the command's parsed options). A run whose job completed with every step logged,
    or ended early saying why, is marked finished; a job whose state is unknown is never
    submitted again. Returns the runs still queued, running or unknown."""
    from megatron_rlvr.config import load_config
    from megatron_rlvr.launch import slurm
    from megatron_rlvr.plan import command as memory_plan

    out = out or sys.stdout
    waiting = []
    memory: list[str] | None = None
    for plan in plans:
        if plan.finished():
            continue
        job_file = plan.dir / "slurm_job"
        if job_file.exists():
            job_id = job_file.read_text().strip()
            fate = _collect(plan, job_id, _job_state(slurm, job_id, out), slurm, out)
            if fate == "waiting":
                waiting.append(plan)
            if fate != "again":
                continue
        try:
            cfg = load_config(plan.config)
            resources = slurm.plan(cfg, args.nodes, args.gpus_per_node)
            if memory is None:  # every run has the same layout: one memory check
                memory = memory_plan.submit_check(cfg, args)
            slurm.check_inputs_present(cfg)
            spec = slurm.job_spec(args, cfg, plan.config, [], plan.dir / "slurm", f"rlvr-{plan.name}")
            spec.memory_lines = memory
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
