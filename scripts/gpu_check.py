"""The GPU path, proved in one command on a fresh one-GPU machine (scripts/gpu_check.sh runs it).

Steps, in order; the first that fails stops the check, named, with a non-zero exit:
  setup        bash scripts/setup.sh --gpu (torch 2.14.1/CUDA 13, SGLang 0.5.23, TE 2.20.2, Megatron-Core)
  inventory    versions of torch, CUDA, NCCL, megatron.core, transformer_engine, sglang; the GPU
  learner-hf   world-1 learner on CUDA against HF logprobs (bf16, TE spec)   pytest -m gpu -k "hf and not replay"
  replay       routing replay R2/R3 on CUDA (tests/test_routing_replay.py)   pytest -m gpu -k replay
  packed       packed sequences (THD, bf16) vs budgeted micro-batches, R2/R3 pytest -m gpu -k packed
  checkpoint   a checkpoint made on CPU loaded on GPU                       pytest -m gpu -k checkpoint
  sglang-gpu   real SGLang on the GPU (tp 1): engine API, weight sync, R3, repeated prompt across a sync
  learner-gpu  every other `gpu` test (the vocab-sharded logprob/entropy closed form, and any new one)
  train        a short `megatron-rlvr train`: learner and SGLang share GPU 0, R3, bf16, gloo weight sync
  colocated    the same run colocated (launch.colocation): SGLang releases its memory while the learner
               trains, weights handed over by CUDA IPC; GPU memory per phase and hand-over seconds
  submit       `submit --dry-run` of the two Qwen3 recipes
It writes REPORT.md and REPORT.json (every step's command, status, time and figures) into --out,
by default a fresh runs/gpu-check/<UTC time> per check; the train step's run folder is fresh too,
so the check runs again as it ran the first time. Every step has a time limit (a step past it is
stopped with everything it started, and fails); a pytest step that ran no test fails.

--only a,b runs just those steps (in the order above); --keep-going runs every step and reports
each failure instead of stopping at the first. GPU_CHECK_PYTHON=<interpreter> runs the steps with
another Python than .venv/bin/python (and the CLI as `<interpreter> -m megatron_rlvr.cli`): for a
GPU machine whose own Python already holds torch, with the rest on PYTHONPATH (the setup step
then has nothing to do: pass --skip-setup).

--dry-run lists the steps and their commands and runs nothing. --smoke runs the same machinery
on a CPU machine (the GPU steps become no-ops, submit runs for real), so CI can prove the
script itself; GPU_CHECK_FAIL_AT=<step> makes that step fail, to prove the first failure stops
the check, GPU_CHECK_HANG_AT=<step> makes it hang and GPU_CHECK_TIMEOUT_S=<s> overrides every
step's limit, to prove a hung step is stopped. Stdlib only: it runs before the venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = os.environ.get("GPU_CHECK_PYTHON") or ".venv/bin/python"
CLI = [PY, "-m", "megatron_rlvr.cli"] if os.environ.get("GPU_CHECK_PYTHON") else [".venv/bin/megatron-rlvr"]
INVENTORY = """
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(), "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
for name in ("megatron.core", "transformer_engine", "sglang", "transformers"):
    try:
        module = __import__(name, fromlist=["_"])
        info[name] = getattr(module, "__version__", "?")
    except Exception as err:
        info[name] = f"MISSING ({type(err).__name__}: {err})"
print(json.dumps(info))
"""
TRAIN = [
    "configs/tiny-moe-sglang-cpu.yaml",
    "parallel.device=cuda",
    "rollout.engine.device=cuda",
    "rollout.engine.python=null",
    "rollout.engine.gpus=[0]",
    "rollout.engine.mem_fraction_static=0.3",
    "rollout.engine.dtype=bfloat16",
    "trainer.dtype=bfloat16",
    "launch.mode=local",
    "weight_sync.backend=gloo",  # one GPU cannot hold two NCCL ranks ("Duplicate GPU detected")
    "algo.routing_replay=r3",
    "trainer.steps=5",
]
# colocated: the engine on the learner's GPU by placement (rollout.engine.gpus left out), its weights
# and KV cache released for every learner phase, the weights handed over by update_weights_from_tensor
COLOCATED = [
    *(arg for arg in TRAIN if not arg.startswith(("rollout.engine.gpus=", "weight_sync.backend=", "trainer.steps="))),
    "launch.colocation.enabled=true",
    "trainer.steps=3",
]
SGLANG_GPU_TESTS = "tests/test_engine_api.py"


@dataclass
class Step:
    name: str
    what: str
    command: list[str]
    kind: str = "command"  # command | pytest | train | inventory
    gpu: bool = True  # a no-op in --smoke
    timeout_s: int = 1800  # past it the step is stopped, with every process it started, and fails
    status: str = "not run"
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    tail: str = ""


def pytest_step(name: str, what: str, *selection: str) -> Step:
    return Step(
        name, what, [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *selection], kind="pytest"
    )


def plan(out: Path, stamp: str) -> list[Step]:
    train_dir = out / f"train-run-{stamp}"  # a run refuses a folder an earlier run wrote
    return [
        Step("setup", "bash scripts/setup.sh --gpu", ["bash", "scripts/setup.sh", "--gpu"], timeout_s=5400),
        Step("inventory", "versions and the GPU", [PY, "-c", INVENTORY], kind="inventory", timeout_s=300),
        pytest_step(
            "learner-hf",
            "world-1 learner on CUDA vs HF logprobs (bf16, TE spec)",
            "-k",
            "hf and not replay",  # R3 against HF's logprobs runs in step "replay"
            "--ignore",
            SGLANG_GPU_TESTS,
        ),
        pytest_step("replay", "routing replay R2/R3 on CUDA", "-k", "replay", "--ignore", SGLANG_GPU_TESTS),
        pytest_step(
            "packed",
            "packed sequences (THD, TE, bf16) vs budgeted micro-batches: logprobs, loss, grads, R2/R3",
            "-k",
            "packed",
            "--ignore",
            SGLANG_GPU_TESTS,
        ),
        pytest_step(
            "checkpoint", "a checkpoint made on CPU loaded on GPU", "-k", "checkpoint", "--ignore", SGLANG_GPU_TESTS
        ),
        pytest_step(
            "sglang-gpu",
            "SGLang on the GPU (tp 1): API, weight sync, R3, repeated prompt across a sync",
            SGLANG_GPU_TESTS,
            "-k",
            "sglang_cuda",
        ),
        pytest_step(
            "learner-gpu",
            "every other gpu test (vocab-sharded logprobs and entropy on CUDA, and any new one)",
            "-k",
            "not (hf or replay or checkpoint or packed)",
            "--ignore",
            SGLANG_GPU_TESTS,
        ),
        Step(
            "train",
            "megatron-rlvr train: learner + SGLang on GPU 0, R3, bf16, 5 steps",
            [*CLI, "train", *TRAIN, f"trainer.output_dir={train_dir}"],
            kind="train",
        ),
        Step(
            "colocated",
            "megatron-rlvr train colocated: SGLang asleep while the learner trains, CUDA IPC hand-over, 3 steps",
            [*CLI, "train", *COLOCATED, f"trainer.output_dir={out / f'colocated-run-{stamp}'}"],
            kind="train",
            timeout_s=900,
        ),
        Step(
            "submit",
            "submit --dry-run of both Qwen3 recipes",
            [
                "bash",
                "-c",
                " && ".join(
                    f"{shlex.join(CLI)} submit configs/{name}.yaml --nodes {nodes} --gpus-per-node 8 --dry-run >/dev/null"
                    for name, nodes in (("qwen3-30b-a3b-grpo-r3", 4), ("qwen3-235b-a22b-gspo", 16))
                ),
            ],
            gpu=False,
            timeout_s=300,
        ),
    ]


def figures(step: Step, out: Path, stdout: str) -> dict:
    """The numbers a reader of the report needs from each kind of step."""
    if step.kind == "inventory":
        return json.loads(stdout.strip().splitlines()[-1])
    if step.kind == "pytest":
        xml = out / f"{step.name}.xml"
        if not xml.exists():
            return {}
        tests = {}
        for case in ElementTree.parse(xml).getroot().iter("testcase"):
            outcome = (
                "failed"
                if case.find("failure") is not None or case.find("error") is not None
                else "skipped"
                if case.find("skipped") is not None
                else "passed"
            )
            tests[f"{case.get('classname')}::{case.get('name')}"] = {
                "outcome": outcome,
                "seconds": float(case.get("time", 0)),
                **{prop.get("name"): prop.get("value") for prop in case.iter("property")},  # e.g. the plan's ratio
            }
        return {
            "tests": tests,
            "passed": sum(t["outcome"] == "passed" for t in tests.values()),
            "failed": sum(t["outcome"] == "failed" for t in tests.values()),
            "skipped": sum(t["outcome"] == "skipped" for t in tests.values()),
        }
    if step.kind == "train":
        runs = sorted(out.glob(f"{step.name}-run-*/metrics.jsonl"))  # the step's run folder is <name>-run-<stamp>
        path = runs[-1] if runs else out / f"{step.name}-run" / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        keys = (
            "step",
            "reward/mean",
            "policy_version",
            "weight_sync/engine_version",
            "weight_sync/parity_max_gap",
            "weight_sync/parity_tolerance",
            "weight_sync/seconds",
            "train/routing_agreement_engine",
            "train/routing_agreement_engine_used",
            "time/step_s",
            "rollout/engine_kind",
        )
        colocate = lambda row: {k: v for k, v in row.items() if k.startswith("colocate/")}  # noqa: E731
        return {"steps": [{**{k: row.get(k) for k in keys}, **colocate(row)} for row in rows]}
    return {}


def bounded(command: list[str], timeout_s: float) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a command run in a session of its own; the code is None
    when it ran past timeout_s. Whatever of that session is left at the end (a server a test
    left behind, or the whole step when it ran past its limit) is killed."""
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    code: int | None = None
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        stdout = stderr = ""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if code is None:
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process that left the session still holds the pipes
            pass
    return code, stdout, stderr


def run_step(step: Step, out: Path, smoke: bool) -> bool:
    injected = os.environ.get("GPU_CHECK_FAIL_AT") == step.name
    hang = os.environ.get("GPU_CHECK_HANG_AT") == step.name
    real = not injected and not hang and not (smoke and step.gpu)
    if injected:
        command = ["bash", "-c", f"echo 'injected failure (GPU_CHECK_FAIL_AT={step.name})' >&2; exit 7"]
    elif hang:  # with a child that would outlive a kill of the step's own process
        command = ["bash", "-c", f"sleep 3600 & echo $! > {shlex.quote(str(out / 'hung.pid'))}; wait"]
    elif not real:
        command = ["true"]
    else:
        command = step.command + ([f"--junitxml={out / (step.name + '.xml')}"] if step.kind == "pytest" else [])
    limit = float(os.environ.get("GPU_CHECK_TIMEOUT_S", step.timeout_s))
    started = time.monotonic()
    code, stdout, stderr = bounded(command, limit)
    step.seconds = round(time.monotonic() - started, 1)
    output = stdout + stderr
    if code is None:
        output += f"\ntimed out after {limit:.0f} s: stopped with every process it started"
    elif code == 5 and step.kind == "pytest":
        output += "\nno test matched this step's selection: nothing was checked"
    step.tail = output[-3000:]
    (out / f"{step.name}.log").write_text(output)
    if real:  # a failed step's figures too (which tests failed, how far training got)
        try:
            step.figures = figures(step, out, stdout)
        except (ValueError, OSError, IndexError) as err:
            step.figures = {"unreadable": f"{type(err).__name__}: {err}"}
    ok = code == 0
    step.status = (
        "passed" if ok else f"FAILED (timed out after {limit:.0f} s)" if code is None else f"FAILED (exit {code})"
    )
    if not real and ok:
        step.status = "skipped (smoke: needs a GPU)"
    return ok


def write_report(steps: list[Step], out: Path, mode: str, failures: list[Step]) -> None:
    verdict = (
        "PASSED"
        if not failures
        else f"FAILED at step {failures[0].name}"
        if len(failures) == 1
        else f"FAILED at steps {', '.join(f.name for f in failures)}"
    )
    data = {
        "verdict": verdict,
        "mode": mode,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "steps": [asdict(s) for s in steps],
    }
    (out / "REPORT.json").write_text(json.dumps(data, indent=1))
    lines = [
        f"# GPU check: {verdict}",
        "",
        f"mode: {mode}; {data['time']}; logs and junit XML beside this file",
        "",
        "| step | what | status | s |",
        "|---|---|---|---|",
    ]
    lines += [f"| {s.name} | {s.what} | {s.status} | {s.seconds} |" for s in steps]
    for s in steps:
        if s.figures:
            lines += ["", f"## {s.name}", "", "```", json.dumps(s.figures, indent=1)[:6000], "```"]
    for failed in failures:
        lines += ["", f"## {failed.name} failed: `{shlex.join(failed.command)}`", "", "```", failed.tail, "```"]
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description="Prove the GPU path on a one-GPU machine (see the module doc).")
    parser.add_argument("--out", type=Path, help="report folder (default: a fresh runs/gpu-check/<UTC time>)")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and their commands; run nothing")
    parser.add_argument("--smoke", action="store_true", help="CPU machine: GPU steps are no-ops (tests the script)")
    parser.add_argument("--skip-setup", action="store_true", help="the GPU venv is already there")
    parser.add_argument("--only", help="comma-separated steps to run (in the check's order); the rest are left out")
    parser.add_argument("--keep-going", action="store_true", help="run every step; report each failure")
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = (args.out or REPO / "runs" / "gpu-check" / stamp).resolve()
    steps = plan(out, stamp)
    if args.skip_setup or args.smoke:
        steps = [s for s in steps if s.name != "setup"]
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {s.name for s in steps})
        if unknown:
            parser.error(f"--only: no such step {unknown}; the steps: {', '.join(s.name for s in steps)}")
        steps = [s for s in steps if s.name in wanted]
    if args.dry_run:
        for number, step in enumerate(steps, 1):
            print(f"{number}. {step.name}: {step.what}\n   {shlex.join(step.command)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    mode = "smoke (CPU)" if args.smoke else "gpu"
    failures: list[Step] = []
    for step in steps:
        print(f"[gpu-check] {step.name}: {step.what} ...", flush=True)
        ok = run_step(step, out, args.smoke)
        print(f"[gpu-check] {step.name}: {step.status} in {step.seconds} s", flush=True)
        if not ok:
            failures.append(step)
        write_report(steps, out, mode, failures)  # after each step: a check stopped from outside keeps it
        if failures and not args.keep_going:
            break
    if failures:
        named = ", ".join(f"{f.name} ({f.status})" for f in failures)
        print(f"[gpu-check] FAILED at step {named}; report: {out / 'REPORT.md'}", file=sys.stderr)
        return 1
    print(f"[gpu-check] PASSED; report: {out / 'REPORT.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
