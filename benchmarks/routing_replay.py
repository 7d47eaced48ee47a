"""Learner step time with routing replay off, R2 and R3, on the same batch and weights (world
size 1, CPU). A step is what the RL loop runs on the learner: the old-logprob pass (R2 records
there, R3 replays the engine's routing) and the train step (both replay, and measure agreement).
Modes alternate step by step; medians are reported.

    .venv/bin/python benchmarks/routing_replay.py [--steps 20] [--batch 16] [--length 48]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
from _common import step_benchmark_args

from megatron_rlvr.config import TinyModel, load_config
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.parallel import Rendezvous, free_port, init_parallel
from megatron_rlvr.tiny_model import build_tiny_hf_model

MODES = ("none", "r2", "r3")


def engine_routing(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    """Routing as an engine would report it: HF transformers' top-k, [B, T, layers, k]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(ids, output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return torch.stack([lg.view(*ids.shape, -1).topk(k, -1).indices for lg in logits], 2).to(torch.uint8)


def main() -> None:
    args = step_benchmark_args(__doc__)
    hf_dir = build_tiny_hf_model(TinyModel(), tempfile.mkdtemp(), vocab_size=128)
    base = [f"trainer.micro_batch_size={args.batch // 2}", "trainer.distributed_optimizer=false"]
    init_parallel(load_config(None, base).parallel, Rendezvous(0, 1, master_port=free_port()))
    learners = {mode: Learner(load_config(None, [*base, f"algo.routing_replay={mode}"]), hf_dir) for mode in MODES}

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (args.batch, args.length), generator=gen)
    mask = torch.zeros(args.batch, args.length)
    mask[:, args.length // 4 : -1] = 1
    batch = TrainBatch(
        ids, mask, advantages=torch.randn(args.batch, generator=gen), routed_experts=engine_routing(str(hf_dir), ids)
    )

    def rl_step(learner: Learner) -> None:
        batch.old_logprobs = learner.compute_logprobs(batch)
        learner.train_step(batch)

    timings: dict[str, list[float]] = {mode: [] for mode in MODES}
    for step in range(args.steps + 3):
        for mode in MODES:
            start = time.perf_counter()
            rl_step(learners[mode])
            if step >= 3:
                timings[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(t) for mode, t in timings.items()}
    print(
        f"tiny Qwen3-MoE (2 MoE layers, 4 experts top-2), batch {args.batch}×{args.length}, "
        f"2 micro-batches, {args.steps} steps, world 1; old-logprob pass + train step"
    )
    print(f"{'replay':<8} {'step ms':>9} {'vs none':>8}")
    for mode in MODES:
        print(f"{mode:<8} {medians[mode] * 1000:>9.1f} {medians[mode] / medians['none']:>8.3f}")
    print(f"ratio: {max(medians['r2'], medians['r3']) / medians['none']:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
