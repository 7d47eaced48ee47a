"""Writes tests/data/verl_rollout_correction.pt: verl 0.9.1's rollout correction and policy
losses evaluated on random ragged float64 batches, the reference tests/test_rollout_correction.py
holds our algo/ to (values, IS weights, rejection masks and gradients).

verl is not a dependency of this project (its import pulls in ray, transformers, tensordict,
omegaconf, codetiming, orjson, pyvers): run this once, with verl on the path, outside the venv's
own packages:

    pip download verl==0.9.1 --no-deps -d /tmp/verl && unzip -q /tmp/verl/verl-0.9.1-*.whl -d /tmp/verlsite
    pip install --target /tmp/verldeps --no-deps tensordict pyvers omegaconf \\
        antlr4-python3-runtime==4.9.3 cloudpickle codetiming orjson
    PYTHONPATH=/tmp/verlsite:/tmp/verldeps .venv/bin/python tools/make_verl_fixtures.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

CASES = [  # verl's rollout_correction settings, and the loss they feed
    {"rollout_is": "token", "rollout_is_threshold": 2.0, "loss": "vanilla", "agg": "token-mean"},
    {"rollout_is": "sequence", "rollout_is_threshold": 3.0, "loss": "vanilla", "agg": "seq-mean-token-mean"},
    {"rollout_is": "token", "rollout_is_threshold": "0.7_1.6", "loss": "vanilla", "agg": "token-mean"},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.3_2.5", "loss": "vanilla", "agg": "token-mean"},
    {
        "rollout_is": "token",
        "rollout_is_threshold": 1.5,
        "rollout_is_batch_normalize": True,
        "loss": "vanilla",
        "agg": "seq-mean-token-sum-norm",
    },
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": 4.0,
        "rollout_is_batch_normalize": True,
        "loss": "vanilla",
        "agg": "token-mean",
    },
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.7_1.5", "loss": "vanilla", "agg": "token-mean"},
    {"rollout_rs": "token_k2,token_k3", "rollout_rs_threshold": "0.08,0.06", "loss": "vanilla", "agg": "token-mean"},
    {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_sum_k1,seq_mean_k3",
        "rollout_rs_threshold": "2.5,0.05",
        "loss": "vanilla",
        "agg": "seq-mean-token-mean",
    },
    {"rollout_rs": "seq_sum_k2,seq_max_k3", "rollout_rs_threshold": "0.6,0.3", "loss": "vanilla", "agg": "token-mean"},
    {
        "rollout_rs": "seq_mean_k1,seq_sum_k3",
        "rollout_rs_threshold": "0.2_1.1,1.0",
        "loss": "vanilla",
        "agg": "token-mean",
    },
    {
        "rollout_rs": "seq_mean_k2,seq_max_k2",
        "rollout_rs_threshold": "0.05,0.2",
        "loss": "vanilla",
        "agg": "token-mean",
    },
    {"rollout_is": "token", "rollout_is_threshold": 2.0, "loss": "gspo", "agg": "seq-mean-token-mean"},
    {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "token_k3",
        "rollout_rs_threshold": 0.1,
        "bypass_mode": True,
        "loss_type": "ppo_clip",
        "loss": "bypass_mode",
        "agg": "token-mean",
    },
    {
        "rollout_is": "token",
        "rollout_is_threshold": 1.5,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.1,
        "bypass_mode": True,
        "loss_type": "reinforce",
        "loss": "bypass_mode",
        "agg": "token-mean",
    },
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": "0.3_3.0",
        "bypass_mode": True,
        "loss_type": "reinforce",
        "loss": "bypass_mode",
        "agg": "seq-mean-token-mean",
    },
]
CLIP = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
SETTINGS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def ragged_batch(seed: int, rows: int = 6, width: int = 10) -> dict[str, torch.Tensor]:
    """Random logprobs (float64) with ragged response masks, one row empty."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 3 - 0.05
    rollout = old + 0.3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    logprobs = old + 0.25 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[2] = 0
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    advantages = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, width).clone()
    return {
        "logprobs": logprobs,
        "old_logprobs": old,
        "rollout_logprobs": rollout,
        "mask": mask,
        "advantages": advantages,
    }


def verl_case(case: dict, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from verl.workers.config import ActorConfig, PolicyLossConfig

    rc = {key: case[key] for key in SETTINGS if key in case}
    loss_config = {}
    if case["loss"] == "bypass_mode":
        corr = RolloutCorrectionConfig(**rc, bypass_mode=True, loss_type=case["loss_type"])
        loss_config = {"policy_loss": PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=corr)}
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **CLIP, **loss_config)
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    mask, adv = batch["mask"], batch["advantages"]
    out: dict[str, torch.Tensor] = {}
    if case["loss"] == "bypass_mode":
        old = batch["rollout_logprobs"]
        loss, _ = core_algos.compute_policy_loss_bypass_mode(old, logprobs, adv, mask, case["agg"], config=config)
    else:
        weights, keep, _ = compute_rollout_correction_and_rejection_mask(
            batch["old_logprobs"], batch["rollout_logprobs"], mask, **rc
        )
        is_weights = weights.batch["rollout_is_weights"] if weights is not None else None
        if is_weights is not None:
            out["is_weights"] = is_weights
        out["keep"] = keep
        fn = core_algos.get_policy_loss_fn(case["loss"])
        loss, _ = fn(batch["old_logprobs"], logprobs, adv, keep, case["agg"], config, rollout_is_weights=is_weights)
    loss.backward()
    out.update(loss=loss.detach(), grad=logprobs.grad)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/data/verl_rollout_correction.pt"))
    args = parser.parse_args()
    import verl

    records = []
    for index, case in enumerate(CASES):
        batch = ragged_batch(seed=index)
        records.append({"case": case, "inputs": batch, "verl": verl_case(case, batch)})
    torch.save({"verl_version": verl.__version__, "clip": CLIP, "records": records}, args.out)
    print(f"{len(records)} cases from verl {verl.__version__} → {args.out}")


if __name__ == "__main__":
    main()
