"""launch.colocation: learner ranks and engines on the same devices (docs/colocation.md), and
the checks that span sections for it. Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from megatron_rlvr.config.base import Section

if TYPE_CHECKING:
    from megatron_rlvr.config.schema import Config


class ColocationConfig(Section):
    """Learner and engines share devices: each step the engines release their KV cache and
    weights while the learner trains, the learner sets aside its optimizer states and
    gradients while the engines generate, and new weights are handed over in memory
    (update_weights_from_tensor) instead of broadcast."""

    enabled: bool = Field(
        False,
        description="true: every engine shares its devices with learner ranks (on CUDA engine i takes the GPUs of "
        "learner ranks i·tp .. (i+1)·tp − 1); false: separate devices, weights broadcast",
    )
    release_timeout_s: float = Field(
        120.0, gt=0, description="how long an engine gets to release its KV cache, then its weights"
    )
    resume_timeout_s: float = Field(
        300.0, gt=0, description="how long an engine gets to take back its weights, then its KV cache"
    )
    handover_timeout_s: float = Field(
        600.0, gt=0, description="how long an engine gets to load one bucket of handed-over weights"
    )
    offload_learner: bool = Field(
        True,
        description="the learner's optimizer states and gradients leave the device while the engines generate "
        "(moved to CPU memory on cuda; on cpu counted only, nothing to free)",
    )


def colocation_problems(cfg: Config) -> list[str]:
    """What colocation cannot run with, one line each. Rollout and training take turns on the
    same devices, so nothing may generate while the learner trains."""
    co = cfg.launch.colocation
    if not co.enabled:
        return []
    problems = []
    if cfg.buffer.async_rollout:
        problems.append(
            "buffer.async_rollout = true: launch.colocation.enabled = true puts the engines to sleep while the "
            "learner trains on their devices, so the next batch cannot be generated meanwhile (set false)"
        )
    if cfg.rollout.updates == "in_flight":
        problems.append(
            "rollout.updates = in_flight: launch.colocation.enabled = true releases the engines' weights and "
            "KV cache for every step, so no sequence can go on across a sync (use between_batches)"
        )
    engine, p = cfg.rollout.engine, cfg.parallel
    world = p.tp * p.pp * (p.dp or 1)
    if engine.type == "sglang" and engine.device == "cuda":
        if p.device != "cuda":
            pass  # refused with the engine's own checks
        elif cfg.rollout.num_engines * engine.tp != world:
            problems.append(
                f"rollout.num_engines = {cfg.rollout.num_engines}: launch.colocation.enabled = true puts each "
                f"engine's {engine.tp} GPUs (rollout.engine.tp) on learner ranks' GPUs, so num_engines · tp must "
                f"equal the learner's tp·pp·dp = {world}"
            )
        if engine.gpus is not None:
            problems.append(
                "rollout.engine.gpus: launch.colocation.enabled = true puts the engines on the learner's GPUs "
                "(leave it null)"
            )
    return problems
