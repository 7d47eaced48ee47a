"""The learner's step (old-logprob pass + update) on long-tailed batches: padded micro-batches
(trainer.micro_batch_size rows, each as wide as the batch's longest sample) against token-budget
micro-batches (trainer.max_tokens_per_microbatch = micro_batch_size × the batch's longest sample:
no budgeted micro-batch is larger than the padded ones, and with equal lengths the two cut the
batch alike). World size 1, CPU, one thread; contenders alternate step by step on one learner,
so machine noise hits both alike; medians are reported; tokens are real (prompt + response).

Response lengths are long-tailed and synthetic: lognormal quantiles around a median of
--length tokens (a tail of width sigma puts the batch's p95 at exp(1.645 sigma) × its median),
cut at 16 × the median, after a 16-token prompt: the shape of a reasoning task's batches.

    nice -n 5 .venv/bin/python benchmarks/packing.py [--steps 3] [--batch 32] [--length 32]
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

PROMPT = 16
MICRO_BATCH = 4
TAILS = (0.0, 0.5, 0.9, 1.2, 1.6)  # lognormal sigma of the response lengths


def long_tailed_batch(rows: int, median: int, sigma: float, vocab: int) -> TrainBatch:
    """Responses at the lognormal's quantiles (no sampling noise), in shuffled row order."""
    normal = torch.distributions.Normal(0.0, 1.0)
    z = normal.icdf((torch.arange(rows) + 0.5) / rows)
    lengths = (median * torch.exp(sigma * z)).round().clamp(1, 16 * median).long()
    gen = torch.Generator().manual_seed(0)
    lengths = lengths[torch.randperm(rows, generator=gen)]
    width = PROMPT + int(lengths.max())
    ids = torch.randint(0, vocab, (rows, width), generator=gen)
    mask = torch.zeros(rows, width)
    for row, n in enumerate(lengths.tolist()):
        mask[row, PROMPT : PROMPT + n] = 1
    return TrainBatch(ids, mask, advantages=torch.randn(rows, generator=gen))


def main() -> None:
    args = step_benchmark_args(__doc__)
    spec = TinyModel(hidden_size=128, moe_intermediate_size=64)
    cfg = load_config(
        None,
        [
            f"trainer.micro_batch_size={MICRO_BATCH}",
            "trainer.distributed_optimizer=false",
            "algo.rollout_correction.rollout_is=null",
        ],
    )
    hf_dir = build_tiny_hf_model(spec, tempfile.mkdtemp(), vocab_size=256)
    init_parallel(cfg.parallel, Rendezvous(rank=0, world_size=1, master_port=free_port()))
    learner = Learner(cfg, hf_dir)

    def step(batch: TrainBatch, max_tokens: int | None) -> float:
        learner.cfg.trainer.max_tokens_per_microbatch = max_tokens
        start = time.perf_counter()
        batch.old_logprobs = learner.compute_logprobs(batch)
        learner.train_step(batch)
        return time.perf_counter() - start

    print(
        f"tiny Qwen3-MoE (2 layers, hidden 128, 4 experts top-2), {args.batch} samples of a {PROMPT}-token "
        f"prompt + a long-tailed response (median {args.length}), {args.steps} steps, world 1, 1 thread; "
        f"padded: {MICRO_BATCH} rows per micro-batch; budgeted: {MICRO_BATCH} × the longest tokens per micro-batch"
    )
    print(
        f"{'sigma':>5} {'p95/median':>10} {'longest':>7} {'padding':>7} {'padded tok/s':>12} "
        f"{'budget tok/s':>12} {'ratio':>6}"
    )
    ratio = 0.0
    for sigma in TAILS:
        batch = long_tailed_batch(args.batch, args.length, sigma, 256)
        responses = batch.response_mask.sum(-1)
        tokens = float(PROMPT * batch.size + responses.sum())
        timings: dict[str, list[float]] = {"padded": [], "budget": []}
        for i in range(args.steps + 1):
            contenders = [("padded", None), ("budget", MICRO_BATCH * batch.input_ids.shape[1])]
            for name, max_tokens in contenders[:: 1 if i % 2 else -1]:  # each goes first every other step
                seconds = step(batch, max_tokens)
                if i:  # the first step of a shape compiles and allocates
                    timings[name].append(seconds)
        rate = {name: tokens / statistics.median(t) for name, t in timings.items()}
        ratio = rate["budget"] / rate["padded"]
        tail = float(responses.quantile(0.95) / responses.median())
        padding = 1 - tokens / batch.input_ids.numel()
        print(
            f"{sigma:>5.2f} {tail:>10.1f} {batch.input_ids.shape[1]:>7} {padding:>7.0%} "
            f"{rate['padded']:>12.0f} {rate['budget']:>12.0f} {ratio:>6.2f}"
        )
    print(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
