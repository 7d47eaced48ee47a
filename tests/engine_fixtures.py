"""Helpers for tests that run real CPU engine servers on loopback."""

from __future__ import annotations

import torch

from megatron_rlvr.config import CpuEngine
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout.launcher import engine_process


def start_engine(model_dir, log_dir, *, routed: bool = True, dtype: str = "float32"):
    proc = engine_process(str(model_dir), CpuEngine(dtype=dtype), host="127.0.0.1", port=free_port(),
                          routed_experts=routed, log_dir=log_dir)
    return proc.start(ready_timeout_s=120)


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
