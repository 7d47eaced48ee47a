"""Helpers for tests that run real engine servers on loopback: the CPU engine, and real
SGLang 0.5.23 on CPU from .venv-sglang (scripts/setup_sglang_cpu.sh), both started by the
project's launcher."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_rlvr.config import CpuEngine, SglangEngine
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout.launcher import engine_process

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def start_engine(model_dir, log_dir, *, routed: bool = True, dtype: str = "float32", api_key: str | None = None):
    proc = engine_process(
        str(model_dir),
        CpuEngine(dtype=dtype),
        host="127.0.0.1",
        port=free_port(),
        routed_experts=routed,
        log_dir=log_dir,
        api_key=api_key,
    )
    return proc.start(ready_timeout_s=120)


def sglang_python() -> str:
    if not SGLANG_PYTHON.exists():
        pytest.fail(
            "real-SGLang tests need .venv-sglang: run `bash scripts/setup_sglang_cpu.sh` "
            "(the README's test command does)"
        )
    return str(SGLANG_PYTHON)


def sglang_engine(**fields) -> SglangEngine:
    return SglangEngine(device="cpu", python=sglang_python(), dtype="float32", **fields)


def sglang_process(model_dir, log_dir, *, routed: bool = True, api_key: str | None = None, **fields):
    return engine_process(
        str(model_dir),
        sglang_engine(**fields),
        host="127.0.0.1",
        port=free_port(),
        routed_experts=routed,
        log_dir=log_dir,
        name="engine 0 (sglang)",
        api_key=api_key,
    )


def start_sglang(model_dir, log_dir, *, routed: bool = True, api_key: str | None = None, **fields):
    """A real SGLang server on CPU through rollout.launcher, as a run starts one (~25 s)."""
    return sglang_process(model_dir, log_dir, routed=routed, api_key=api_key, **fields).start(ready_timeout_s=300)


def start_sglang_cuda(model_dir, log_dir, *, routed: bool = True):
    """SGLang on the GPU from the GPU venv (scripts/gpu_check.sh), float32 so that HF on CPU is
    the reference; a third of the GPU's memory, Triton attention (FlashInfer has no fp32)."""
    engine = SglangEngine(
        device="cuda", dtype="float32", mem_fraction_static=0.3, extra_args=["--attention-backend", "triton"]
    )
    return engine_process(
        str(model_dir),
        engine,
        host="127.0.0.1",
        port=free_port(),
        routed_experts=routed,
        log_dir=log_dir,
        name="engine 0 (sglang cuda)",
    ).start(ready_timeout_s=600)


def hf_teacher_forced(model_dir, prompt: list[int], output: list[int], temperature: float):
    """Logprobs of `output` given `prompt` and the router top-k of every fed position, from
    HF transformers' own forward: what the engine must reproduce."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logits = out.logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    logp = torch.log_softmax(scaled, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
    k = model.config.num_experts_per_tok
    probs = [torch.softmax(lg.float(), -1) for lg in out.router_logits]
    routing = torch.stack([pr.topk(k, -1).indices for pr in probs], dim=1)  # [positions, layers, k]
    return logp, routing[:-1]


def unread_requests(port: int) -> int:
    """Connections to a loopback server on `port` holding bytes it has not read yet (the
    kernel's receive queues, /proc/net/tcp): requests in flight it has not taken."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        if local_port == port and fields[3] == "01" and int(fields[4].split(":")[1], 16) > 0:  # ESTABLISHED
            count += 1
    return count


def kill_with_requests_in_flight(server: psutil.Process, port: int, timeout_s: float = 240.0) -> None:
    """SIGKILLs an engine server while rollout requests to it are in flight, whatever the
    engine. It is frozen (SIGSTOP) in windows of a second until two requests at once sit
    unread in its sockets: the rollout sends several groups at once, a weight sync one call at
    a time (those are let through at once, and so is a broadcast: a window ends)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.send_signal(signal.SIGSTOP)
        window = time.monotonic() + 1.0
        while time.monotonic() < window:
            if unread_requests(port) >= 2:
                time.sleep(0.05)  # let the rest of the batch's requests arrive
                server.send_signal(signal.SIGKILL)
                return
            time.sleep(0.01)
        server.send_signal(signal.SIGCONT)
        time.sleep(0.3)
    pytest.fail(f"no two requests at once reached the engine on port {port} within {timeout_s:.0f} s")
