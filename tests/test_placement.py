"""Where components live is decided in one module: every component is started through a
Placement and called through Handles the same way wherever it runs."""

from __future__ import annotations

import asyncio
import re
import typing
from pathlib import Path

import pytest

from megatron_rlvr.config import Config, LaunchConfig
from megatron_rlvr.launch.placement import (
    PLACEMENTS,
    InProcess,
    LocalHandle,
    RayActors,
    Role,
    call_all,
    close_all,
    placement_for,
)

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rlvr"


class Component:
    def __init__(self, name: str, *, fail_close: bool = False):
        self.name, self.fail_close, self.closed = name, fail_close, False

    def hello(self, who: str) -> str:
        return f"{self.name} greets {who}"

    async def later(self, value: int) -> int:
        await asyncio.sleep(0)
        return value * 2

    def broken(self) -> None:
        raise ValueError(f"{self.name} is broken")

    def close(self) -> None:
        self.closed = True
        if self.fail_close:
            raise RuntimeError(f"{self.name} could not close")


def test_every_launch_mode_the_config_accepts_has_a_placement():
    modes = set(typing.get_args(LaunchConfig.model_fields["mode"].annotation))
    assert modes == set(PLACEMENTS)
    assert isinstance(placement_for(Config.model_validate({"launch": {"mode": "local"}})), InProcess)
    assert isinstance(placement_for(Config.model_validate({"launch": {"mode": "ray"}})), RayActors)


def test_in_process_components_answer_calls_in_order_and_raise_their_own_errors():
    placement = InProcess(Config())
    handles = [placement.place(Role.SERVICE, Component, f"c{i}", index=i) for i in range(3)]
    assert call_all(handles, "hello", "you") == ["c0 greets you", "c1 greets you", "c2 greets you"]
    with pytest.raises(ValueError, match="c0 is broken"):
        call_all(handles, "broken")
    assert asyncio.run(handles[1].proxy().later(21)) == 42  # async methods stay awaitable
    assert asyncio.run(handles[2].call_async("hello", "me")) == "c2 greets me"  # sync ones run off the loop


def test_closing_tries_every_component_and_reports_the_first_failure():
    handles = [
        LocalHandle(Component("a")),
        LocalHandle(Component("b", fail_close=True)),
        LocalHandle(Component("c", fail_close=True)),
        LocalHandle(Component("d")),
    ]
    with pytest.raises(RuntimeError, match="b could not close"):
        close_all(handles, grace_s=0.0)
    assert all(h.obj.closed for h in handles)


def test_no_component_asks_where_it_lives():
    """Ray actors are made, and launch.mode read, only by the placement module (the config
    package defines and checks the field): adding a placement kind does not touch the components."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "placement.py" or path.parent == PACKAGE / "config":
            continue
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        code = re.sub(r'"""(.|\n)*?"""', "", code)  # docstrings may say where things run
        assert "ray.remote" not in code, path
        assert not re.search(r"launch\.mode(?!=)", code), path  # read; setting it (`launch.mode=local`) is not asking
        assert not re.search(r"\bremote\s*[:=]", code), path


@pytest.fixture(scope="module")
def four_gpu_nodes():
    """A Ray cluster of four nodes with 8 GPUs each, on this machine: the GPUs are Ray's
    resource counts only (no device is touched), which is all that placement decides by."""
    import os

    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's default (hybrid) policy keeps a task on a node until it is half used, then spreads;
    # the threshold at 0 makes it spread at once, as it does on a large cluster's busy nodes:
    # where the learner lands must not depend on it
    spread = os.environ.get("RAY_scheduler_spread_threshold")
    os.environ["RAY_scheduler_spread_threshold"] = "0.0"
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 9, "num_gpus": 8, "object_store_memory": 80 * 2**20},
    )
    for _ in range(3):
        cluster.add_node(num_cpus=9, num_gpus=8, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()
        if spread is None:
            del os.environ["RAY_scheduler_spread_threshold"]
        else:
            os.environ["RAY_scheduler_spread_threshold"] = spread


@pytest.mark.parametrize("engines", [(4, 4), (8, 2)], ids=["4 engines of tp 4", "8 engines of tp 2"])
def test_the_30b_recipe_keeps_each_learner_node_whole_and_engines_off_it(
    engines, four_gpu_nodes, tmp_path, monkeypatch
):
    """The 30B recipe on 4 × 8 GPUs: 16 learner ranks (tp 2 · pp 2 · dp 4, ep 8) and 16 GPUs of
    engines. Engines are placed first, as a run starts them; the learner's ranks still fill two
    whole nodes, 8 consecutive ranks a node (so tp and ep groups never cross the network), and
    the engines the other two. (Ray's default policy put 3 engines of tp 2 on one node and
    left the learner GPUs on every node.)"""
    from megatron_rlvr.config import load_config

    class Where:  # defined here so that Ray ships it by value to workers that cannot import tests/
        """Says where Ray put it: its node and the GPU ids Ray gave it."""

        def where(self) -> tuple[str, list[int]]:
            import ray

            return ray.get_runtime_context().get_node_id(), [int(g) for g in ray.get_gpu_ids()]

    monkeypatch.setenv("RLVR_PLACEMENT_TIMEOUT_S", "60")  # a group that cannot be placed fails, not hangs
    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "qwen3-30b-a3b-grpo-r3.yaml",
        [
            f"launch.ray_address={four_gpu_nodes.address}",
            f"trainer.output_dir={tmp_path}",
            f"rollout.num_engines={engines[0]}",
            f"rollout.engine.tp={engines[1]}",
        ],
    )
    p = cfg.parallel
    world = p.tp * p.pp * p.dp
    placement = RayActors(cfg)
    with placement.session(str(tmp_path / "ray")):
        # engines first, up and running (a run waits for their servers) before any learner rank
        engines = [placement.place(Role.ENGINE, Where, index=i) for i in range(cfg.rollout.num_engines)]
        engine_at = [h.call("where") for h in engines]
        ranks = [placement.place(Role.LEARNER_RANK, Where, index=r) for r in range(world)]
        rank_at = [h.call("where") for h in ranks]

    rank_nodes = [node for node, _ in rank_at]
    assert len(set(rank_nodes)) == 2, rank_nodes
    for first in range(0, world, 8):  # 8 consecutive ranks a node: tp·ep = 16 spans exactly two
        assert len(set(rank_nodes[first : first + 8])) == 1, rank_nodes
    for node in set(rank_nodes):
        gpus = [g for n, ids in rank_at if n == node for g in ids]
        assert sorted(gpus) == list(range(8)), gpus  # one GPU a rank, none shared
    engine_nodes = {node for node, _ in engine_at}
    assert len(engine_nodes) == 2 and not engine_nodes & set(rank_nodes), (engine_nodes, rank_nodes)
    assert all(len(ids) == cfg.rollout.engine.tp for _, ids in engine_at)
