"""The algo config → the keyword arguments of the pure functions (one place that reads it)."""

from __future__ import annotations

from typing import Any

from megatron_rlvr.algo.baselines import AdvantageOptions
from megatron_rlvr.algo.corrections import RolloutCorrection, StaleNegativeCaps
from megatron_rlvr.algo.reinforce import RecOptions
from megatron_rlvr.config import AlgoConfig
from megatron_rlvr.config.rejection import parse_rejection
from megatron_rlvr.config.schema import ASYMRE_SHIFT


def rollout_correction_of(algo: AlgoConfig) -> RolloutCorrection:
    rc, sn = algo.rollout_correction, algo.stale_negatives
    return RolloutCorrection(
        is_level=rc.rollout_is,
        is_upper=rc.rollout_is_threshold,
        is_lower=rc.rollout_is_threshold_lower,
        batch_normalize=rc.rollout_is_batch_normalize,
        rejection=parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold),
        stale_negatives=StaleNegativeCaps(sn.positive_cap, sn.negative_cap, sn.negative_floor) if sn.enabled else None,
        bypass=rc.bypass_mode,
        bypass_loss=rc.loss_type,
    )


def loss_options(algo: AlgoConfig) -> dict[str, Any]:
    """policy_loss's keyword arguments besides tensors and the normaliser."""
    if algo.clip_low is None or algo.clip_high is None:
        raise ValueError("algo.clip_low / clip_high are unresolved: load the config with load_config")
    return {
        "kind": algo.kind,
        "clip_low": algo.clip_low,
        "clip_high": algo.clip_high,
        "clip_ratio_c": algo.clip_ratio_c,
        "agg": algo.agg,
        "correction": rollout_correction_of(algo),
        "rec": RecOptions(**algo.rec.model_dump()),
        "opmd_tau": algo.opmd.tau,
    }


def advantage_options(algo: AlgoConfig) -> AdvantageOptions:
    adv = algo.advantage
    shift = adv.baseline_shift if adv.baseline_shift is not None else (ASYMRE_SHIFT if algo.kind == "asymre" else 0.0)
    return AdvantageOptions(
        baseline_type=adv.baseline_type,
        normalize_std=algo.normalize_std,
        shift=shift,
        tau=algo.opmd.tau,
        ema_decay=adv.ema_decay,
        reward_scale=adv.reward_scale,
        reward_clip=adv.reward_clip,
    )
