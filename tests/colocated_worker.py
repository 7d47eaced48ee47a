"""One learner rank trains three steps on a fixed batch, twice: straight through, and with the
colocated learner's offload and onload around every step (learner/offload.py). Writes what the
two left behind and what the offload moved; on CUDA, the memory each offload freed.
Run by tests/test_colocated_offload.py through tests/distributed.py."""

from __future__ import annotations

import json
import os
import sys

import torch
from learner_worker import BASE, fixed_batch, hf_logprobs, with_rl_fields

from megatron_rlvr.config import load_config
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.offload import LearnerOffload
from megatron_rlvr.learner.parallel import destroy_parallel, init_parallel


def train(cfg, hf_dir: str, offload: bool) -> dict:
    learner = Learner(cfg, hf_dir)
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    batch = with_rl_fields(batch, hf_logprobs(hf_dir, batch.input_ids))
    mover = LearnerOffload(learner)
    moved, freed, norms = [], [], []
    for _ in range(3):
        if offload:
            before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            moved.append(mover.offload())
            freed.append(before - (torch.cuda.memory_allocated() if torch.cuda.is_available() else 0))
            mover.onload()
        norms.append(learner.train_step(batch)["grad_norm"])
    weights = [p.detach().float().cpu() for chunk in learner.chunks for p in chunk.parameters()]
    learner.close()
    return {"moved": moved, "freed": freed, "grad_norms": norms, "weights": weights}


def _gap(a: dict, b: dict) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a["weights"], b["weights"]))


def main() -> None:
    _, hf_dir, *rest = sys.argv[1:]
    cfg = load_config(None, [*BASE, *rest])
    init_parallel(cfg.parallel, seed=cfg.trainer.seed)
    straight = train(cfg, hf_dir, offload=False)
    around = train(cfg, hf_dir, offload=True)
    # CUDA's kernels may round differently run to run: the straight run again is the noise floor
    again = train(cfg, hf_dir, offload=False) if cfg.parallel.device == "cuda" else straight
    result = {
        "weight_gap": _gap(straight, around),
        "noise_gap": _gap(straight, again),
        "grad_norms": [straight["grad_norms"], around["grad_norms"]],
        "moved": around["moved"],
        "freed": around["freed"],
    }
    with open(os.environ["RESULT"], "w") as f:
        json.dump(result, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
