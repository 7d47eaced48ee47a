"""What the config lets a sync do: R3 with a pause that re-routes sequences is refused
wherever a sync can land on sequences being generated, and how long a sync waits for
restarting engines follows how long an engine may take to start."""

from pathlib import Path

import pytest

from megatron_rlvr.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-moe-cpu.yaml"
SGLANG = ["rollout.engine.type=sglang", "rollout.engine.device=cpu"]


def _problems(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    return err.value.problems


def test_r3_with_retract_is_refused_when_an_async_batch_is_generating_during_the_sync():
    """buffer.async_rollout generates the next batch while a step trains and syncs: a retract
    re-prefills those sequences under the new weights (the rule once looked at in_flight only)."""
    problems = _problems([*SGLANG, "buffer.async_rollout=true", "algo.routing_replay=r3"])
    assert problems == [
        "weight_sync.pause_mode = retract: with buffer.async_rollout = true and algo.routing_replay = r3 the "
        "pause must be in_place (or abort, which ends them); a retracted sequence is routed again under the new "
        "weights, so the routing replayed for its earlier tokens would not be the one that produced them"
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        ["weight_sync.pause_mode=in_place", "rollout.engine.extra_args=[--disable-radix-cache]"],
        ["weight_sync.pause_mode=abort"],
    ],
    ids=["in_place", "abort"],
)
def test_r3_async_loads_with_a_pause_that_keeps_or_ends_sequences(overrides):
    cfg = load_config(TINY, [*SGLANG, "buffer.async_rollout=true", "algo.routing_replay=r3", *overrides])
    assert cfg.rollout.return_routed_experts is True


def test_r3_with_retract_stays_allowed_where_engines_drain_before_every_sync():
    assert load_config(TINY, [*SGLANG, "algo.routing_replay=r3"]).weight_sync.pause_mode == "retract"
    assert load_config(TINY, [*SGLANG, "buffer.async_rollout=true"]).weight_sync.pause_mode == "retract"


def test_the_sync_waits_for_restarting_engines_as_long_as_an_engine_may_take_to_start():
    assert load_config(TINY, ["rollout.start_timeout_s=1800"]).weight_sync.engine_wait_s == 1860
    assert load_config(TINY, ["weight_sync.engine_wait_s=90"]).weight_sync.engine_wait_s == 90
    assert _problems(["weight_sync.engine_wait_s=0"])[0].startswith("weight_sync.engine_wait_s")
