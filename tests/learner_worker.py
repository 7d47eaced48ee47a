"""One learner rank for the multi-process tests (launched by tests/distributed.py).

    learner_worker.py SCENARIO HF_DIR [CKPT_DIR] [dotted.config=overrides ...]

Scenarios: parity (logprobs vs HF, one train step, export), ckpt-save, ckpt-load, descent.
Writes this rank's JSON result to $RESULT.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from megatron_rlvr.config import load_config
from megatron_rlvr.learner.batch import TrainBatch
from megatron_rlvr.learner.checkpoint import load_checkpoint, save_checkpoint
from megatron_rlvr.learner.learner import Learner
from megatron_rlvr.learner.parallel import destroy_parallel, init_parallel

BASE = ["trainer.micro_batch_size=2", "rollout.max_new_tokens=8", "algo.num_minibatches=2"]


def fixed_batch(vocab: int, batch_size: int = 16, length: int = 12) -> TrainBatch:
    """The same batch on every rank and in every layout: prompts of 4 tokens, responses of
    varying length, right padding."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, length), generator=gen)
    mask = torch.zeros(batch_size, length)
    for b in range(batch_size):
        mask[b, 4 : 6 + b % 6] = 1
    return TrainBatch(ids, mask)


def hf_logprobs(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)
    return torch.nn.functional.pad(logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))


def with_rl_fields(batch: TrainBatch, logprobs: torch.Tensor) -> TrainBatch:
    gen = torch.Generator().manual_seed(1)
    batch.old_logprobs = logprobs + 0.02 * torch.randn(logprobs.shape, generator=gen)
    batch.rollout_logprobs = logprobs + 0.05 * torch.randn(logprobs.shape, generator=gen)
    batch.advantages = torch.randn(batch.size, generator=gen)
    return batch


def parity(learner: Learner, hf_dir: str) -> dict:
    from safetensors.torch import load_file

    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    logprobs = learner.compute_logprobs(batch)
    reference = hf_logprobs(hf_dir, batch.input_ids)
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = {name: tensor.clone() for name, tensor in learner.export_hf()}
    metrics = learner.train_step(with_rl_fields(batch, logprobs))
    after = learner.compute_logprobs(batch)
    moved = {name: tensor for name, tensor in learner.export_hf()}
    return {
        "logprob_max_diff_vs_hf": float((logprobs - reference)[:, 1:].abs().max()),
        "metrics": metrics,
        "logprobs_after_step": after.tolist(),
        "exported_names_match": sorted(exported) == sorted(original),
        "export_bitwise_equal": all(torch.equal(exported[n], original[n]) for n in original if n in exported),
        "export_changed_after_training": any(not torch.equal(moved[n], original[n]) for n in original),
    }


def descent(learner: Learner) -> dict:
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    batch.old_logprobs = learner.compute_logprobs(batch)
    batch.advantages = torch.linspace(-1.0, 1.0, batch.size)
    return {"losses": [learner.train_step(batch)["policy_loss"] for _ in range(6)]}


def main() -> None:
    scenario, hf_dir, *rest = sys.argv[1:]
    ckpt = rest.pop(0) if scenario.startswith("ckpt") else None
    cfg = load_config(None, [*BASE, *rest])
    init_parallel(cfg.parallel, seed=cfg.trainer.seed)
    learner = Learner(cfg, hf_dir)
    batch = fixed_batch(learner.bridge.hf_config.vocab_size)
    if scenario == "parity":
        result = parity(learner, hf_dir)
    elif scenario == "descent":
        result = descent(learner)
    elif scenario == "ckpt-save":
        batch = with_rl_fields(batch, hf_logprobs(hf_dir, batch.input_ids))
        learner.train_step(batch)
        save_checkpoint(learner, ckpt)
        result = {"logprobs": learner.compute_logprobs(batch).tolist()}
        learner.train_step(batch)  # the uninterrupted run's next step, for resume checks
        result["logprobs_next"] = learner.compute_logprobs(batch).tolist()
    elif scenario == "ckpt-load":
        step = load_checkpoint(learner, ckpt)
        result = {"step": step, "logprobs": learner.compute_logprobs(batch).tolist()}
        learner.train_step(with_rl_fields(batch, hf_logprobs(hf_dir, batch.input_ids)))
        result["logprobs_next"] = learner.compute_logprobs(batch).tolist()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    with open(os.environ["RESULT"], "w") as f:
        json.dump(result, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
