"""Step time of the tiny MoE through our Megatron-Core learner against a plain HF transformers
training step of the same model on the same batch (world size 1, CPU). Steps alternate
between the two so machine noise hits both alike; medians are reported.

    .venv/bin/python benchmarks/learner_step.py [--steps 20] [--batch 16] [--length 48]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
from _common import step_benchmark_args

from megatron_rlvr.algo.losses import policy_loss
from megatron_rlvr.config import TinyModel, load_config
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.parallel import Rendezvous, free_port, init_parallel
from megatron_rlvr.tiny_model import build_tiny_hf_model


class HFStep:
    """The same GRPO update written directly against transformers: forward, log-softmax
    gather, policy_loss, backward, clip, AdamW."""

    def __init__(self, hf_dir: str, lr: float, clip: float):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.clip = clip

    def __call__(self, batch: TrainBatch, algo) -> float:
        self.optimizer.zero_grad()
        logits = self.model(batch.input_ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        logp = torch.nn.functional.pad(logp, (1, 0))
        loss, _ = policy_loss(
            logp,
            batch.old_logprobs,
            batch.advantages,
            batch.response_mask,
            kind=algo.kind,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return float(loss)


def main() -> None:
    args = step_benchmark_args(__doc__)
    cfg = load_config(
        None,
        [
            f"trainer.micro_batch_size={args.batch}",
            "trainer.distributed_optimizer=false",
            "algo.rollout_correction.rollout_is=null",
        ],
    )
    hf_dir = build_tiny_hf_model(TinyModel(), tempfile.mkdtemp(), vocab_size=128)
    init_parallel(cfg.parallel, Rendezvous(rank=0, world_size=1, master_port=free_port()))
    ours = Learner(cfg, hf_dir)
    theirs = HFStep(str(hf_dir), cfg.trainer.lr, cfg.trainer.grad_clip)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (args.batch, args.length), generator=gen)
    mask = torch.zeros(args.batch, args.length)
    mask[:, args.length // 4 :] = 1
    batch = TrainBatch(ids, mask, advantages=torch.randn(args.batch, generator=gen))
    batch.old_logprobs = ours.compute_logprobs(batch)

    timings: dict[str, list[float]] = {"megatron-rlvr": [], "hf-transformers": []}
    for step in range(args.steps + 3):
        for name, run in (
            ("megatron-rlvr", lambda: ours.train_step(batch)),
            ("hf-transformers", lambda: theirs(batch, cfg.algo)),
        ):
            start = time.perf_counter()
            run()
            if step >= 3:  # the first steps compile and allocate
                timings[name].append(time.perf_counter() - start)
    print(
        f"tiny Qwen3-MoE (2 layers, hidden 64, 4 experts top-2), batch {args.batch}×{args.length}, "
        f"{args.steps} steps, world 1, 1 thread, median step time"
    )
    print(f"{'trainer':<18} {'step ms':>9}")
    medians = {name: statistics.median(t) for name, t in timings.items()}
    for name, value in medians.items():
        print(f"{name:<18} {value * 1000:>9.1f}")
    print(f"ratio: {medians['megatron-rlvr'] / medians['hf-transformers']:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
