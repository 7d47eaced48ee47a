"""Colocated placement on a Ray cluster: each engine lands beside the learner ranks whose GPUs
it shares, and its server is shown exactly those GPUs. Two 8-GPU nodes simulated on this
machine (the GPUs are Ray's resource counts only: no device is touched)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rlvr.config import load_config
from megatron_rlvr.launch.placement import RayActors, Role

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_gpu_nodes():
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 9, "num_gpus": 8, "object_store_memory": 80 * 2**20}
    )
    cluster.add_node(num_cpus=9, num_gpus=8, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_the_30b_recipe_colocated_puts_each_engine_on_the_gpus_of_its_learner_ranks(
    two_gpu_nodes, tmp_path, monkeypatch
):
    """16 learner ranks (tp 2 · pp 2 · dp 4) and 4 engines of tp 4 on the same 16 GPUs: engine i
    sits on the node of ranks 4i..4i+3 and its server sees their GPUs, no other."""

    class Where:  # defined here so that Ray ships it by value to workers that cannot import tests/
        def where(self) -> tuple[str, list[int]]:
            import ray

            return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]

    monkeypatch.setenv("RLVR_PLACEMENT_TIMEOUT_S", "60")  # a group that cannot be placed fails, not hangs
    cfg = load_config(
        REPO / "configs" / "qwen3-30b-a3b-grpo-r3.yaml",
        [
            f"launch.ray_address={two_gpu_nodes.address}",
            f"trainer.output_dir={tmp_path}",
            "rollout.num_engines=4",
            "rollout.engine.tp=4",
            "launch.colocation.enabled=true",
            "buffer.async_rollout=false",  # refused with colocation: rollout and training take turns
        ],
    )
    p = cfg.parallel
    world = p.tp * p.pp * p.dp
    assert world == 16
    placement = RayActors(cfg)
    with placement.session(str(tmp_path / "ray")):
        shown = [placement.engine_gpus(i) for i in range(cfg.rollout.num_engines)]
        engines = [placement.place(Role.ENGINE, Where, index=i) for i in range(cfg.rollout.num_engines)]
        engine_at = [h.call("where") for h in engines]
        ranks = [placement.place(Role.LEARNER_RANK, Where, index=r) for r in range(world)]
        rank_at = [h.call("where") for h in ranks]  # every rank placed beside the engines: room for both

    for i, (node, ids) in enumerate(engine_at):
        mine = rank_at[4 * i : 4 * i + 4]
        assert {n for n, _ in mine} == {node}, (i, node, mine)
        assert shown[i] == [g for _, gpus in mine for g in gpus], (i, shown[i], mine)
        assert ids == shown[i][:1]  # the host itself holds a share of the first
    every_gpu = sorted((n, g) for n, gpus in rank_at for g in gpus)
    assert len(set(every_gpu)) == 16  # one rank a GPU, as separate placement gives
