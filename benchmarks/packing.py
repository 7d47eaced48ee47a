"""The learner's step (old-logprob pass + update) on long-tailed batches of the long-answer task:
padded micro-batches (trainer.micro_batch_size rows, each as wide as the batch's longest sample)
against token-budget micro-batches (trainer.max_tokens_per_microbatch = micro_batch_size × the
batch's longest sample: no budgeted micro-batch is larger than the padded ones, and with equal
lengths the two cut the batch alike). The long-answer demo's model (configs/long-answers-sft-cpu.yaml:
a 4-layer Qwen3-MoE, hidden 128, its character tokenizer), world size 1, CPU, one thread;
contenders alternate step by step on one learner, so machine noise hits both alike; medians are
reported; tokens are real (prompt + response).

Each batch is the task's own (megatron_rlvr/data/long_answers.py): prompts rendered by the chat
template, and as responses the correct worked solutions + <eos>, one token per character. The
tail is the task's: the number of subtraction steps is drawn from P(k) ∝ k^-1.2 on 1..max_steps
(divisors 2..9), and max_steps grows from 1 (one step each: no tail) through 24 (the task's
default) to 40. A batch is --batch rows at evenly spaced quantiles of 4096 of the task's problems
(its length distribution without sampling noise), in shuffled row order.

    nice -n 5 .venv/bin/python benchmarks/packing.py --steps 9 --batch 32   # docs/batching.md: 4-5 minutes on 2 cores
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import step_benchmark_args

from megatron_rlvr.config import LongAnswerSource, load_config
from megatron_rlvr.data.arithmetic import build_arithmetic_tokenizer
from megatron_rlvr.data.long_answers import worked_examples
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.parallel import Rendezvous, free_port, init_parallel
from megatron_rlvr.tiny_model import build_tiny_hf_model

REPO = Path(__file__).resolve().parents[1]
MICRO_BATCH = 4
PROBLEMS = 4096  # problems drawn per tail; a batch takes rows at their length quantiles
MAX_STEPS = (1, 2, 4, 8, 16, 24, 40)  # the task's longest chain, in subtraction steps


def task_batch(rows: int, max_steps: int, tokenizer) -> TrainBatch:
    """`rows` of the task's (prompt, correct solution) pairs at evenly spaced quantiles of the
    solution length, as token ids, in shuffled row order."""
    spec = LongAnswerSource(num_prompts=PROBLEMS, max_steps=max_steps, split="all")
    pairs = sorted(
        (
            (
                tokenizer.apply_chat_template(
                    conversation[:-1], add_generation_prompt=True, tokenize=True, return_dict=False
                ),
                tokenizer(conversation[-1]["content"], add_special_tokens=False)["input_ids"]
                + [tokenizer.eos_token_id],
            )
            for conversation in worked_examples(spec, step_error_rate=0.0, seed=0)
        ),
        key=lambda pair: len(pair[1]),
    )
    gen = torch.Generator().manual_seed(0)
    picked = [pairs[int((i + 0.5) / rows * len(pairs))] for i in torch.randperm(rows, generator=gen).tolist()]
    width = max(len(p) + len(r) for p, r in picked)
    ids = torch.full((rows, width), tokenizer.pad_token_id)
    mask = torch.zeros(rows, width)
    for row, (prompt, response) in enumerate(picked):
        ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        mask[row, len(prompt) : len(prompt) + len(response)] = 1
    return TrainBatch(ids, mask, advantages=torch.randn(rows, generator=gen))


def main() -> None:
    args = step_benchmark_args(__doc__, length=False)
    spec = load_config(REPO / "configs" / "long-answers-sft-cpu.yaml").model
    cfg = load_config(
        None,
        [
            f"trainer.micro_batch_size={MICRO_BATCH}",
            "trainer.distributed_optimizer=false",
            "algo.rollout_correction.rollout_is=null",
        ],
    )
    hf_dir = tempfile.mkdtemp()
    tokenizer = build_arithmetic_tokenizer(hf_dir, spec.tokenizer_chars)
    build_tiny_hf_model(spec, hf_dir, vocab_size=len(tokenizer), tokenizer=tokenizer)
    init_parallel(cfg.parallel, Rendezvous(rank=0, world_size=1, master_port=free_port()))
    learner = Learner(cfg, hf_dir)

    def step(batch: TrainBatch, max_tokens: int | None) -> float:
        learner.cfg.trainer.max_tokens_per_microbatch = max_tokens
        start = time.perf_counter()
        batch.old_logprobs = learner.compute_logprobs(batch)
        learner.train_step(batch)
        return time.perf_counter() - start

    print(
        f"long-answer demo model (Qwen3-MoE, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_experts} experts top-{spec.num_experts_per_tok}), {args.batch} of the task's prompts + correct "
        f"solutions per batch, {args.steps} steps, world 1, 1 thread; padded: {MICRO_BATCH} rows per micro-batch; "
        f"budgeted: {MICRO_BATCH} × the longest tokens per micro-batch"
    )
    print(
        f"{'max_steps':>9} {'median':>6} {'p95':>4} {'p95/median':>10} {'longest':>7} {'padding':>7} "
        f"{'padded tok/s':>12} {'budget tok/s':>12} {'ratio':>6}"
    )
    ratio = 0.0
    for max_steps in MAX_STEPS:
        batch = task_batch(args.batch, max_steps, tokenizer)
        responses = batch.response_mask.sum(-1)
        tokens = float((batch.input_ids != tokenizer.pad_token_id).sum())
        timings: dict[str, list[float]] = {"padded": [], "budget": []}
        for i in range(args.steps + 1):
            contenders = [("padded", None), ("budget", MICRO_BATCH * batch.input_ids.shape[1])]
            for name, max_tokens in contenders[:: 1 if i % 2 else -1]:  # each goes first every other step
                seconds = step(batch, max_tokens)
                if i:  # the first step of a shape compiles and allocates
                    timings[name].append(seconds)
        rate = {name: tokens / statistics.median(t) for name, t in timings.items()}
        ratio = rate["budget"] / rate["padded"]
        median, p95 = float(responses.median()), float(responses.quantile(0.95))
        padding = 1 - tokens / batch.input_ids.numel()
        print(
            f"{max_steps:>9} {median:>6.0f} {p95:>4.0f} {p95 / median:>10.1f} {batch.input_ids.shape[1]:>7} "
            f"{padding:>7.0%} {rate['padded']:>12.0f} {rate['budget']:>12.0f} {ratio:>6.2f}"
        )
    print(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
