"""Learner and engines colocated (launch.colocation): what the config refuses, the engines'
sleep and wake bounded against engines that never answer, and the colocated run end to end
with the CPU engine, step by step equal to the separate-device run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from engine_fixtures import start_engine

from megatron_rlvr.config import Config, ConfigError, load_config, resolve
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.weight_sync.colocated import ColocatedSyncer, ColocationError

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "configs" / "tiny-moe-cpu.yaml"


# --------------------------------------------------------------------------- config
def problems(*overrides: str) -> list[str]:
    try:
        load_config(CPU_CONFIG, ["launch.colocation.enabled=true", *overrides])
    except ConfigError as err:
        return err.problems
    return []


def test_colocation_is_off_by_default_and_a_plain_colocated_cpu_config_loads():
    assert Config().launch.colocation.enabled is False
    assert problems() == []


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("buffer.async_rollout=true", "buffer.async_rollout = true: launch.colocation.enabled = true"),
        ("rollout.updates=in_flight", "rollout.updates = in_flight: launch.colocation.enabled = true"),
    ],
)
def test_overlap_modes_are_refused_in_one_line_each(override, named):
    found = [p for p in problems(override) if "launch.colocation" in p]
    assert len(found) == 1 and found[0].startswith(named), found
    assert "\n" not in found[0]


def test_colocated_sglang_engines_must_cover_the_learners_gpus_exactly():
    cfg = Config.model_validate(
        {
            "parallel": {"device": "cuda", "tp": 2, "dp": 2},
            "rollout": {"engine": {"type": "sglang", "tp": 2}, "num_engines": 1},
            "launch": {"colocation": {"enabled": True}},
            "weight_sync": {"pause_mode": "retract"},
        }
    )
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert any(
        p.startswith("rollout.num_engines = 1: launch.colocation.enabled = true") and "tp·pp·dp = 4" in p
        for p in err.value.problems
    ), err.value.problems
    cfg.rollout.num_engines = 2
    resolve(cfg)  # 2 engines × tp 2 = the learner's 4 GPUs


def test_submit_counts_the_learners_gpus_alone_and_refuses_an_engine_that_would_span_nodes():
    from megatron_rlvr.launch import slurm

    recipe = REPO / "configs" / "qwen3-30b-a3b-grpo-r3.yaml"
    colocated = ["launch.colocation.enabled=true", "buffer.async_rollout=false"]
    plan = slurm.plan(load_config(recipe, colocated), nodes=2, gpus_per_node=8)  # separate, it needs 4 nodes
    assert (plan.learner_gpus, plan.engine_gpus) == (16, 0)
    assert plan.lines()[-1] == "total    16 of 16 GPUs (learner and engines on the same GPUs)"
    with pytest.raises(slurm.SubmitError, match="would span nodes"):
        slurm.plan(load_config(recipe, colocated), nodes=4, gpus_per_node=6)  # 4 GPUs an engine, 6 a node
    with pytest.raises(slurm.SubmitError, match="cannot hold the run"):
        slurm.plan(load_config(recipe, ["buffer.async_rollout=false"]), nodes=2, gpus_per_node=8)


# --------------------------------------------------------------------------- faults
class SilentServer:
    """A real HTTP endpoint on loopback that accepts every connection and never answers:
    an engine stuck in a release or a resume."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def colocated_cfg(**colocation):
    return load_config(
        CPU_CONFIG, ["launch.colocation.enabled=true", *(f"launch.colocation.{k}={v}" for k, v in colocation.items())]
    )


def test_an_engine_that_never_releases_ends_the_sleep_naming_it_and_what_it_waited_for():
    server = SilentServer()
    client = EngineClient(server.url, timeout_s=60)
    syncer = ColocatedSyncer([client], colocated_cfg(release_timeout_s=1.5))

    async def sleep():
        try:
            await syncer.sleep()
        finally:
            await client.close()

    try:
        with pytest.raises(ColocationError) as err:
            asyncio.run(asyncio.wait_for(sleep(), 30))  # the bound, not this guard, ends it
    finally:
        server.close()
    assert str(err.value) == (
        f"engine {server.url} did not release its kv_cache within 1.5 s (launch.colocation.release_timeout_s)"
    )
    assert syncer.released == {}  # nothing counted as released


def test_an_engine_that_never_resumes_ends_the_wake_before_any_weight_is_handed_over():
    server = SilentServer()
    client = EngineClient(server.url, timeout_s=60)
    syncer = ColocatedSyncer([client], colocated_cfg(resume_timeout_s=1.5))
    syncer.released = {0: ["kv_cache", "weights"]}  # as after a sleep
    syncer.version = 0
    handed = []

    def named():
        handed.append(True)
        yield from ()

    async def wake():
        try:
            await syncer.sync(named(), 1)
        finally:
            await client.close()

    try:
        with pytest.raises(ColocationError) as err:
            asyncio.run(asyncio.wait_for(wake(), 30))
    finally:
        server.close()
    assert str(err.value) == (
        f"engine {server.url} did not resume its weights within 1.5 s (launch.colocation.resume_timeout_s)"
    )
    assert not handed


# --------------------------------------------------------------------------- runs
def train(out: Path, *overrides: str, timeout: float = 600) -> tuple[list[dict], subprocess.CompletedProcess]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rlvr.cli",
            "train",
            str(CPU_CONFIG),
            f"trainer.output_dir={out}",
            "trainer.steps=3",
            "trainer.save_interval=0",
            "buffer.batch_groups=4",
            "rollout.n_samples_per_prompt=4",
            "launch.mode=local",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [], done


def test_a_colocated_run_learns_step_for_step_as_the_separate_run(tmp_path):
    """CPU engine, seeded sampling: the same weights give the same samples, so a hand-over that
    delivers every weight exactly (and a learner whose offload loses nothing) gives the same
    rewards per step as the broadcast run, to the last bit; the parity probe passes after every
    hand-over."""
    separate, done = train(tmp_path / "separate")
    assert done.returncode == 0, done.stderr[-3000:]
    colocated, done = train(tmp_path / "colocated", "launch.colocation.enabled=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in colocated] == [1, 2, 3]
    for a, b in zip(separate, colocated):
        assert b.get("reward/mean") == a.get("reward/mean") and b["reward/samples"] == a["reward/samples"]
        assert b["train/policy_loss"] == pytest.approx(a["train/policy_loss"], abs=1e-6)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-6)
        assert b["weight_sync/parity_max_gap"] <= 1e-5 and b["weight_sync/engine_version"] == b["step"]
        assert b["colocate/handover_bytes"] == a["weight_sync/bytes"] > 0  # every weight, once
        for key in ("colocate/sleep_s", "colocate/wake_s", "colocate/handover_s"):
            assert b[key] > 0
        for phase in ("before_sleep", "after_sleep", "after_onload", "after_train", "after_handover"):
            assert b[f"colocate/mem/{phase}/learner_rss_mb"] > 0
        assert b["colocate/offload_grad_bytes"] > 0
        assert not any(k.startswith("colocate/") for k in a)
    assert colocated[-1]["colocate/offload_optimizer_bytes"] > 0  # Adam's moments exist after a step


def test_a_frozen_engine_process_ends_the_sleep_naming_it(tiny_hf_dir, tmp_path):
    """A real CPU engine process stopped with SIGSTOP (alive, its port open, never answering):
    the release is given up at its bound, with the engine named."""
    server = start_engine(tiny_hf_dir, tmp_path)
    client = EngineClient(server.url, timeout_s=60)
    syncer = ColocatedSyncer([client], colocated_cfg(release_timeout_s=2))

    async def sleep():
        try:
            await syncer.sleep()
        finally:
            await client.close()

    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ColocationError, match=r"^engine .* did not release its kv_cache within 2 s"):
            asyncio.run(asyncio.wait_for(sleep(), 30))
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()
