"""The GPU environment as CI can check it without a GPU: its pins resolve together (pip's
resolver over package metadata; a conflict fails), and scripts/gpu_check.sh's own machinery
(steps in order, the report, the first failure named)."""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def _pins(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=1500, cwd=REPO)
    if done.returncode == 3:
        pytest.skip(f"the package index cannot be reached: {done.stderr.strip()}")
    return done


def test_the_gpu_pins_resolve_together():
    done = _pins("bash", "scripts/setup.sh", "--gpu", "--check")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu pins: consistent" in done.stdout
    for pin in (
        "torch==2.14.1",
        "transformers==5.19.0",
        "sglang==0.5.23",
        "transformer-engine-torch==2.20.2",
        "transformer-engine-cu13==2.20.2",
        "megatron-core==0.16.1",
    ):
        assert pin in done.stdout, done.stdout
    assert "not pinned" not in done.stdout  # the closure in constraints-gpu.txt is complete


def test_a_pin_that_disagrees_with_sglangs_fails_the_check(tmp_path):
    """The project's CPU transformers pin under the GPU pins: SGLang 0.5.23 needs 5.19.0."""
    text = (REPO / "constraints-gpu.txt").read_text().replace("transformers==5.19.0", "transformers==5.23.0")
    (tmp_path / "bad.txt").write_text(text)
    done = _pins(sys.executable, "scripts/gpu_pins.py", "check", "--constraints", str(tmp_path / "bad.txt"))
    assert done.returncode == 1
    assert "CONFLICT" in done.stderr and "transformers" in done.stderr, done.stderr[-3000:]


STEPS = [
    "setup",
    "inventory",
    "learner-hf",
    "replay",
    "packed",
    "checkpoint",
    "sglang-gpu",
    "learner-gpu",
    "train",
    "colocated",
    "submit",
]


def test_gpu_check_lists_its_steps_in_order():
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    listed = [line.split(":")[0].split(". ", 1)[1] for line in done.stdout.splitlines() if line[:1].isdigit()]
    assert listed == STEPS
    assert "tests/test_engine_api.py -k sglang_cuda" in done.stdout
    assert "rollout.engine.gpus=[0]" in done.stdout and "algo.routing_replay=r3" in done.stdout
    # every check writes a fresh folder (a train run refuses one an earlier run wrote)
    assert re.search(r"trainer.output_dir=\S*/runs/gpu-check/\d{8}-\d{6}/train-run-\d{8}-\d{6}\b", done.stdout)


def test_gpu_check_runs_again_into_the_same_folder_and_stops_a_hung_step_with_its_children(tmp_path):
    def check(**env) -> subprocess.CompletedProcess:
        command = ["bash", "scripts/gpu_check.sh", "--smoke", "--out", str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, **env})

    assert check().returncode == 0
    hung = check(GPU_CHECK_HANG_AT="inventory", GPU_CHECK_TIMEOUT_S="2")
    assert hung.returncode == 1 and "FAILED at step inventory" in hung.stderr and "timed out after 2 s" in hung.stderr
    assert "timed out after 2 s: stopped with every process it started" in (tmp_path / "REPORT.md").read_text()
    child = int((tmp_path / "hung.pid").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE  # killed too


def test_a_pytest_step_that_runs_no_test_fails(tmp_path):
    gpu_check = runpy.run_path(str(REPO / "scripts" / "gpu_check.py"), run_name="gpu_check")
    step = gpu_check["pytest_step"](
        "empty", "selects nothing", "tests/test_gpu_setup.py", "-k", "no_such_test_anywhere"
    )
    assert not gpu_check["run_step"](step, tmp_path, smoke=False)
    assert step.status == "FAILED (exit 5)" and "nothing was checked" in step.tail


def test_gpu_check_smoke_writes_the_report_and_stops_at_the_first_failure(tmp_path):
    ok = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--smoke", "--out", str(tmp_path / "ok")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert ok.returncode == 0, ok.stderr[-3000:]
    report = json.loads((tmp_path / "ok" / "REPORT.json").read_text())
    assert report["verdict"] == "PASSED" and [s["name"] for s in report["steps"]] == STEPS[1:]
    assert report["steps"][-1]["status"] == "passed"  # submit --dry-run of both recipes ran for real
    env = {**os.environ, "GPU_CHECK_FAIL_AT": "sglang-gpu"}
    failed = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--smoke", "--out", str(tmp_path / "bad")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert failed.returncode == 1 and "FAILED at step sglang-gpu" in failed.stderr
    report = json.loads((tmp_path / "bad" / "REPORT.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert report["verdict"] == "FAILED at step sglang-gpu" and status["sglang-gpu"] == "FAILED (exit 7)"
    assert status["train"] == status["colocated"] == status["submit"] == "not run"
    assert "injected failure" in (tmp_path / "bad" / "REPORT.md").read_text()


def _dry_run(only: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--only", only],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )


def test_gpu_check_runs_chosen_steps_past_a_failure_with_another_python(tmp_path):
    # --only picks steps, --keep-going reports every failure, GPU_CHECK_PYTHON replaces .venv
    # (a GPU machine's own Python, with the rest on PYTHONPATH: docs/gpu-check-report.md)
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable}
    listed = _dry_run("submit,learner-hf", env)
    assert listed.returncode == 0, listed.stderr
    assert [line.split(":")[0] for line in listed.stdout.splitlines() if line[:1].isdigit()] == [
        "1. learner-hf",
        "2. submit",
    ]
    assert (
        f"{sys.executable} -m pytest -m gpu" in listed.stdout
        and f"{sys.executable} -m megatron_rlvr.cli submit" in listed.stdout
    )
    bad = _dry_run("nope", dict(os.environ))
    assert bad.returncode == 2 and "no such step ['nope']" in bad.stderr
    done = subprocess.run(
        [
            "bash",
            "scripts/gpu_check.sh",
            "--smoke",
            "--keep-going",
            "--only",
            "inventory,submit",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**env, "GPU_CHECK_FAIL_AT": "inventory"},
    )
    assert done.returncode == 1 and "FAILED at step inventory" in done.stderr
    report = json.loads((tmp_path / "REPORT.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"inventory": "FAILED (exit 7)", "submit": "passed"}  # submit ran, with sys.executable


def test_gpu_check_reads_the_train_steps_figures_from_its_run_folder(tmp_path):
    gpu_check = runpy.run_path(str(REPO / "scripts" / "gpu_check.py"), run_name="gpu_check")
    (tmp_path / "train-run-20260101-000000").mkdir()
    (tmp_path / "train-run-20260101-000000" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    step = next(s for s in gpu_check["plan"](tmp_path, "20260101-000000") if s.name == "train")
    assert gpu_check["figures"](step, tmp_path, "")["steps"][0]["reward/mean"] == 0.5


def test_cuda_without_transformer_engine_runs_the_local_spec_only_where_asked():
    # MEGATRON_RLVR_CUDA_LOCAL_SPEC=1 (gpu_check on a GPU machine without TE): the local spec's
    # fixes, none of the CPU's device redirection. In a process of its own: the fixes are global.
    pytest.importorskip("megatron.core")
    code = """
import os, torch
from megatron_rlvr.learner import cpu_compat, parallel
try:
    import transformer_engine
    print("te")
except ImportError:
    available, count = torch.cuda.is_available, torch.cuda.device_count
    os.environ[parallel.CUDA_LOCAL_SPEC] = "1"
    parallel.require_transformer_engine()
    from megatron.core.transformer.moe import moe_utils
    assert moe_utils.fused_permute is None and cpu_compat._state["local_spec"]
    assert not cpu_compat._state["applied"] and "mode" not in cpu_compat._state
    assert torch.cuda.is_available is available and torch.cuda.device_count is count
    print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.strip() == "te":
        pytest.skip("transformer-engine is installed here")
    assert done.stdout.strip() == "ok"


def test_cuda_without_transformer_engine_is_refused_before_any_group_is_made():
    pytest.importorskip("megatron.core")
    try:
        import transformer_engine  # noqa: F401

        pytest.skip("transformer-engine is installed here")
    except ImportError:
        pass
    import torch.distributed as dist

    from megatron_rlvr.config import load_config
    from megatron_rlvr.errors import UserError
    from megatron_rlvr.learner.parallel import Rendezvous, init_parallel

    parallel = load_config(None, ["parallel.device=cuda"]).parallel
    with pytest.raises(UserError, match=r"parallel.device = cuda needs transformer-engine.*setup.sh --gpu"):
        init_parallel(parallel, Rendezvous(rank=0, world_size=1))
    assert not dist.is_initialized()
