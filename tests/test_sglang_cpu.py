"""Real SGLang 0.5.23 on CPU, started by the project's launcher, in the loop a GPU run uses:
its receiver's bucket layout, start failures, a dead owner, a tp-2 engine in the weight-update
group, a short training run with R3, and a server SIGKILLed mid-run. Needs .venv-sglang
(`bash scripts/setup_sglang_cpu.sh`, part of the README's test command). Each SGLang server
takes ~2 GB and ~25 s to start; at most two run at once."""

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from engine_fixtures import (
    REPO,
    hf_teacher_forced,
    kill_with_requests_in_flight,
    sglang_process,
    sglang_python,
    start_sglang,
)

from megatron_rlvr.config import WeightSyncConfig
from megatron_rlvr.rollout.client import EngineClient
from megatron_rlvr.rollout.launcher import EngineStartError
from megatron_rlvr.weight_sync.buckets import buckets
from megatron_rlvr.weight_sync.syncer import WeightSyncer
from megatron_rlvr.weight_sync.transport import engine_rank_count

pytestmark = pytest.mark.sglang

RECEIVE = textwrap.dedent("""
    import sys, torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    spec = torch.load(sys.argv[1])
    received = FlattenedTensorBucket.empty(spec["names"], spec["dtypes"], spec["shapes"], "cpu")
    flat = received.get_flattened_tensor()
    posted = {"dtype": str(flat.dtype), "numel": flat.numel()}
    flat.copy_(spec["buffer"])  # what the broadcast delivers
    torch.save({"posted": posted, "tensors": dict(received.reconstruct_tensors())}, sys.argv[2])
""")


def test_sglangs_receiver_posts_our_buckets_dtype_and_count_and_rebuilds_the_tensors(tmp_path):
    """SGLang's own FlattenedTensorBucket.empty (what its receiver allocates and broadcasts
    into) against our packed buckets, mixed dtypes and odd sizes included."""
    gen = torch.Generator().manual_seed(0)
    named = [
        ("a.weight", torch.randn(7, 3, generator=gen)),
        ("b.bias", torch.randn(5, generator=gen)),
        ("c.weight", torch.randn(4, 9, generator=gen).bfloat16()),
        ("d", torch.randn(3, generator=gen).bfloat16()),
        ("e", torch.randn(2, 2, generator=gen).half()),
    ]
    for index, bucket in enumerate(buckets(named, max_bytes=1 << 20)):
        spec = {
            "names": bucket.names,
            "dtypes": [bucket.dtype_name] * len(bucket.names),
            "shapes": bucket.shapes,
            "buffer": bucket.buffer,
        }
        torch.save(spec, tmp_path / f"spec{index}.pt")
        done = subprocess.run(
            [sglang_python(), "-c", RECEIVE, str(tmp_path / f"spec{index}.pt"), str(tmp_path / f"out{index}.pt")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = torch.load(tmp_path / f"out{index}.pt")
        assert (
            out["posted"]
            == {"dtype": str(bucket.buffer.dtype), "numel": bucket.buffer.numel()}
            == {"dtype": "torch.uint8", "numel": bucket.nbytes}
        )
        for name in bucket.names:
            assert torch.equal(out["tensors"][name], dict(named)[name])


def _no_process_left(tree: list[psutil.Process], timeout_s: float = 30.0) -> None:
    gone, alive = psutil.wait_procs(tree, timeout=timeout_s)
    assert not alive, [" ".join(p.cmdline())[:100] for p in alive]


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_a_bad_flag_in_extra_args_is_one_line_and_leaves_nothing_running(tiny_hf_dir, tmp_path):
    before = _descendants()
    with pytest.raises(EngineStartError) as err:
        start_sglang(tiny_hf_dir, tmp_path, extra_args=["--no-such-flag", "3"])
    message = str(err.value)
    assert "\n" not in message and message.startswith("engine 0 (sglang)")
    assert "unrecognized arguments: --no-such-flag" in message and str(tmp_path) in message
    _no_process_left([psutil.Process(p) for p in _descendants() - before if psutil.pid_exists(p)])


def test_a_port_in_use_is_one_line_and_leaves_nothing_running(tiny_hf_dir, tmp_path):
    before = _descendants()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = sglang_process(tiny_hf_dir, tmp_path)
        server.port = taken.getsockname()[1]
        server.command[server.command.index("--port") + 1] = str(server.port)
        with pytest.raises(EngineStartError, match=f"port {server.port} is in use"):
            server.start()  # refused before anything starts
        server.check_port = False  # as if the port were taken after the check: SGLang's own failure
        with pytest.raises(EngineStartError) as err:
            server.start(ready_timeout_s=240)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"engine 0 (sglang) (http://127.0.0.1:{server.port})")
    assert "address already in use" in message and str(server.log_path) in message, message
    _no_process_left([psutil.Process(p) for p in _descendants() - before if psutil.pid_exists(p)])


OWNER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from engine_fixtures import start_engine, start_sglang
    start = start_sglang if sys.argv[1] == "sglang" else start_engine
    server = start(sys.argv[2], sys.argv[2] + "-logs")
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("kind", ["cpu", "sglang"])
def test_a_server_never_outlives_its_sigkilled_owner(kind, tiny_hf_dir, tmp_path):
    """The owner (a run's process, or an engine actor) dies without any teardown: the
    watchdog beside its server stops the server's whole process group."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, kind, str(tiny_hf_dir), str(REPO / "tests")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert owner.stdout.readline().strip() == "ready"
    tree = psutil.Process(owner.pid).children(recursive=True)
    server = "sglang.launch_server" if kind == "sglang" else "rollout.server"
    assert any(server in " ".join(p.cmdline()) for p in tree)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    _no_process_left(tree, timeout_s=60)


def test_a_tp2_engine_joins_the_update_group_with_both_ranks_and_serves_the_new_weights(tiny_hf_dir, tmp_path):
    """SGLang 0.5.23 runs tp 2 on CPU (a core set per rank); the group is then world 3 with the
    engine's ranks at offsets 1 and 2, and after a sync both ranks' shards are the new weights.
    The server has the run's API key: requests without it (a weight update too) get 401; the
    key is on no process's command line and not in the server's log."""
    from safetensors.torch import load_file
    from test_engine_api import updated_model_dir

    key = secrets.token_urlsafe(32)  # as every run's engines have one: SGLang's --api-key, off its argv
    server = start_sglang(tiny_hf_dir, tmp_path, tp=2, api_key=key)
    auth = {"Authorization": f"Bearer {key}"}
    try:
        prompt = [5, 17, 3, 44, 9]
        body = {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
        }
        assert httpx.post(f"{server.url}/generate", json=body, timeout=120).status_code == 401
        update = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]], "group_name": "g"}
        assert httpx.post(f"{server.url}/update_weights_from_distributed", json=update, timeout=60).status_code == 401
        assert all(key not in " ".join(proc.cmdline()) for proc in psutil.Process(server.proc.pid).children(True))
        assert key not in " ".join(psutil.Process(server.proc.pid).cmdline())
        row = httpx.post(f"{server.url}/generate", json=body, headers=auth, timeout=120).json()
        logp, _ = hf_teacher_forced(tiny_hf_dir, prompt, row["output_ids"], 1.0)
        got = torch.tensor([lp for lp, _, _ in row["meta_info"]["output_token_logprobs"]])
        assert (got - logp).abs().max() <= 1e-4  # tp 2 computes what HF computes

        original = load_file(str(tiny_hf_dir / "model.safetensors"))
        gen = torch.Generator().manual_seed(3)
        new = {n: t + 0.3 * torch.randn(t.shape, generator=gen) for n, t in original.items()}

        async def sync():
            client = EngineClient(server.url, api_key=key)
            syncer = WeightSyncer([client], WeightSyncConfig(bucket_mb=0.05), engine_ranks=[engine_rank_count(2)])
            try:
                await syncer.connect()
                return await syncer.sync(list(new.items()), 1)
            finally:
                await syncer.close()
                await client.close()

        report = asyncio.run(sync())
        assert report.engine_version == 1 and report.buckets > 1
        row = httpx.post(f"{server.url}/generate", json=body, headers=auth, timeout=120).json()
        logp, _ = hf_teacher_forced(updated_model_dir(tiny_hf_dir, tmp_path, new), prompt, row["output_ids"], 1.0)
        got = torch.tensor([lp for lp, _, _ in row["meta_info"]["output_token_logprobs"]])
        assert (got - logp).abs().max() <= 1e-4
        assert key not in server.log_path.read_text() and "<api-key>" in server.log_path.read_text()
        assert not server.key_file.exists()  # the --config file lived while SGLang started
    finally:
        server.stop()


# --------------------------------------------------------------------------- training runs
def train_command(tmp_path, *overrides) -> list[str]:
    return [
        sys.executable,
        "-m",
        "megatron_rlvr.cli",
        "train",
        str(REPO / "configs" / "tiny-moe-sglang-cpu.yaml"),
        f"trainer.output_dir={tmp_path}",
        f"rollout.engine.python={sglang_python()}",
        "buffer.batch_groups=4",
        "rollout.n_samples_per_prompt=4",
        *overrides,
    ]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_short_run_against_sglang_syncs_every_step_and_replays_its_routing(tmp_path):
    before = _descendants()
    done = subprocess.run(
        train_command(tmp_path, "trainer.steps=3", "algo.routing_replay=r3"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = rows(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    used = 0
    for m in metrics:
        used += m["buffer/batch_groups"]  # a step's batch (bounded sampling may shorten one)
        assert m["buffer/used"] == used
        assert m["rollout/engine_kind"] == "sglang"
        assert m["weight_sync/engine_version"] == m["policy_version"] == m["weight_sync/version"] == m["step"]
        assert m["weight_sync/parity_max_gap"] <= 1e-3 == m["weight_sync/parity_tolerance"]
        assert m["train/routing_agreement_engine_used"] == 1.0  # R3 replays exactly what SGLang routed
        assert 0.0 < m["train/routing_agreement_engine"] <= 1.0
    _no_process_left([psutil.Process(p) for p in _descendants() - before if psutil.pid_exists(p)])


@pytest.mark.slow  # ~3 min: two SGLang servers, one restarted; its CPU-engine twin (test_train_e2e) is in the default tier
def test_a_sglang_server_sigkilled_mid_rollout_loses_no_group_and_rejoins_with_current_weights(tmp_path):
    """Two SGLang engines; one is SIGKILLed with a request in flight as a batch is being
    generated. Its groups move to the other, it is restarted, and it takes work again only
    once a sync gave it the current weights; the run goes on to its last step."""
    log = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(
        # longer answers than the recipe's: a batch takes long enough for the kill to land in it
        train_command(
            tmp_path, "trainer.steps=60", "launch.mode=local", "rollout.num_engines=2", "rollout.max_new_tokens=16"
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while len(rows(metrics)) < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)  # a step is logged: the next batch is being generated
        servers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "sglang.launch_server" in " ".join(p.cmdline()) and p.ppid() == proc.pid
        ]
        assert len(servers) == 2, (tmp_path / "stderr.log").read_text()[-3000:]
        kill_with_requests_in_flight(servers[0], int(servers[0].cmdline()[servers[0].cmdline().index("--port") + 1]))
        killed_at = len(rows(metrics))
        while time.monotonic() < deadline and proc.poll() is None:
            if "joined ['http" in (tmp_path / "stderr.log").read_text():
                # the step after the re-join, and one whose metrics see the engine serving again
                # (the join is logged as the sync begins, the readmission comes after it)
                rejoined_at = len(rows(metrics))
                while time.monotonic() < deadline and proc.poll() is None:
                    now = rows(metrics)
                    if len(now) >= rejoined_at + 1 and now[-1]["rollout/engines_serving"] == 2:
                        break
                    time.sleep(0.2)
                break
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 130, (tmp_path / "stderr.log").read_text()[-3000:]
        log.close()
    done = rows(metrics)
    assert [m["step"] for m in done] == list(range(1, len(done) + 1)) and len(done) >= killed_at + 2
    assert done[-1]["rollout/moved_groups"] >= 1  # killed with groups in flight: they went to the other engine
    assert done[-1]["buffer/dropped_failed"] == 0  # none lost
    assert done[-1]["rollout/engines_serving"] == 2  # restarted, given the weights, serving again
    assert all(m["weight_sync/engine_version"] == m["policy_version"] for m in done)
