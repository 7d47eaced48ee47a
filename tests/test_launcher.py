"""Engine server commands and environments, the engine config checks, and the errors for what
cannot start. Fast: no real engine starts here (tests/test_sglang_cpu.py starts real ones)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from megatron_rlvr.config import ConfigError, CpuEngine, SglangEngine, load_config
from megatron_rlvr.config.resolve import sglang_install
from megatron_rlvr.errors import UserError
from megatron_rlvr.launch.placement import InProcess, RayActors, engine_gpus
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout import launcher
from megatron_rlvr.rollout.launcher import EngineStartError, ServerProcess, cpu_binding, engine_process, failure_reason

TINY = "configs/tiny-moe-cpu.yaml"
SGLANG_CPU = "configs/tiny-moe-sglang-cpu.yaml"


def test_cpu_engine_command(tmp_path):
    proc = engine_process(
        "/models/x", CpuEngine(dtype="bfloat16"), host="127.0.0.1", port=30100, routed_experts=True, log_dir=tmp_path
    )
    assert proc.command[1:] == [
        "-m",
        "megatron_rlvr.rollout.server",
        "--model-path",
        "/models/x",
        "--host",
        "127.0.0.1",
        "--port",
        "30100",
        "--dtype",
        "bfloat16",
        "--threads",
        "1",
        "--enable-return-routed-experts",
    ]
    assert proc.url == "http://127.0.0.1:30100" and proc.log_path == tmp_path / "engine-30100.log"


def test_sglang_command_carries_the_layout(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda name: object())
    engine = SglangEngine(tp=4, ep=4, mem_fraction_static=0.6, extra_args=["--chunked-prefill-size", "4096"])
    proc = engine_process(
        "/m", engine, host="127.0.0.1", port=30000, routed_experts=True, log_dir=tmp_path, gpus=[4, 5, 6, 7]
    )
    cmd = proc.command
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for flag, value in (
        ("--tp-size", "4"),
        ("--ep-size", "4"),
        ("--mem-fraction-static", "0.6"),
        ("--dtype", "bfloat16"),
        ("--weight-version", "0"),
    ):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-return-routed-experts" in cmd and "--skip-tokenizer-init" in cmd
    assert cmd[-2:] == ["--chunked-prefill-size", "4096"]  # last, so they override ours
    assert "--device" not in cmd and proc.env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    no_r3 = engine_process("/m", engine, host="127.0.0.1", port=30000, routed_experts=False, log_dir=tmp_path)
    assert "--enable-return-routed-experts" not in no_r3.command and no_r3.env == {}
    assert "--disable-overlap-schedule" not in cmd  # the overlap scheduler stays, but in flight:
    in_flight = engine_process(
        "/m", engine, host="127.0.0.1", port=30000, routed_experts=True, log_dir=tmp_path, in_flight=True
    )
    assert "--disable-overlap-schedule" in in_flight.command  # its queued forward would mis-tag a token's version


def test_sglang_on_cpu_gets_the_cpu_flags_environment_and_its_own_interpreter(monkeypatch, tmp_path):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    engine = SglangEngine(
        device="cpu", python="/opt/sglang/bin/python", tp=2, dtype="float32", extra_args=["--max-total-tokens", "4096"]
    )
    proc = engine_process("/m", engine, host="127.0.0.1", port=1, routed_experts=False, log_dir=tmp_path)
    cmd = proc.command
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    for flag, value in (
        ("--device", "cpu"),
        ("--attention-backend", "torch_native"),
        ("--sampling-backend", "pytorch"),
        ("--tp-size", "2"),
    ):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--sleep-on-idle" in cmd and "--disable-cuda-graph" in cmd
    assert cmd[-2:] == ["--max-total-tokens", "4096"]  # the user's value wins over the launcher's 65536
    assert proc.env == {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|3")  # a user's binding is kept
    assert (
        "SGLANG_CPU_OMP_THREADS_BIND"
        not in engine_process("/m", engine, host="127.0.0.1", port=1, routed_experts=False, log_dir=tmp_path).env
    )


@pytest.mark.parametrize(
    "cores, ranks, expected",
    [
        ([0, 1], 1, "0-1"),
        ([0, 1], 2, "0|1"),
        (list(range(16)), 2, "0-7|8-15"),
        ([3], 2, "3|3"),
        ([0, 1, 2], 2, "0|1"),
    ],
)
def test_cpu_binding_gives_each_rank_its_cores(cores, ranks, expected):
    assert cpu_binding(cores, ranks) == expected


def test_missing_sglang_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineStartError, match=r"needs SGLang: bash scripts/setup.sh --gpu .*rollout.engine.python"):
        engine_process("/m", SglangEngine(), host="127.0.0.1", port=1, routed_experts=False, log_dir=tmp_path)


def test_engines_get_contiguous_shares_of_launch_engine_cpus_and_threads_to_match(tmp_path):
    cores = [
        "launch.ray_address=127.0.0.1:6379",
        "launch.engine_cpus=[4,5,6,7]",
    ]  # another node's cores: not checked here
    cfg = load_config(TINY, [*cores, "rollout.num_engines=2"])
    assert [RayActors(cfg).engine_cpus(i) for i in range(2)] == [[4, 5], [6, 7]]
    assert InProcess(load_config(TINY)).engine_cpus(0) is None
    cpu = engine_process(
        "/m", CpuEngine(), host="127.0.0.1", port=1, routed_experts=False, log_dir=tmp_path, cpus=[4, 5]
    )
    assert cpu.command[cpu.command.index("--threads") + 1] == "2" and cpu.cpus == [4, 5]
    sglang = SglangEngine(device="cpu", python="/opt/sglang/bin/python", tp=2)
    proc = engine_process("/m", sglang, host="127.0.0.1", port=1, routed_experts=False, log_dir=tmp_path, cpus=[6, 7])
    assert proc.env["SGLANG_CPU_OMP_THREADS_BIND"] == "6|7" and proc.cpus == [6, 7]


def test_local_engines_get_the_gpus_after_the_learners():
    assert [engine_gpus(None, i, 2) for i in range(3)] == [[1, 2], [3, 4], [5, 6]]
    assert [engine_gpus([0, 0, 1, 1], i, 2) for i in range(2)] == [[0, 0], [1, 1]]
    assert engine_gpus([0], 0, 1) == [0]  # one GPU shared with the learner, asked for explicitly


# --------------------------------------------------------------------------- config checks
def _problems(overrides, path=TINY):
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return err.value.problems


SGLANG = ["rollout.engine.type=sglang", "rollout.engine.device=cpu"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (SGLANG + ["weight_sync.checksum=true"], "weight_sync.checksum = true: SGLang has no per-bucket checksum"),
        (SGLANG + ["weight_sync.pause_mode=in_place"], "weight_sync.pause_mode = in_place: SGLang cannot flush"),
        (
            SGLANG + ["rollout.engine.extra_args=[--hicache-storage-backend=file]"],
            "rollout.engine.extra_args: --hicache-storage-backend keeps KV across the cache flush",
        ),
        (SGLANG + ["weight_sync.backend=nccl"], "weight_sync.backend = nccl: NCCL needs parallel.device = cuda"),
        (SGLANG + ["rollout.engine.tp=2", "rollout.engine.ep=4"], "rollout.engine.ep = 4: must divide"),
        (SGLANG + ["rollout.engine.gpus=[0]"], "rollout.engine.gpus: only for launch.mode = local"),
        (
            [
                "rollout.engine.type=sglang",
                "parallel.device=cuda",
                "launch.mode=local",
                "rollout.num_engines=2",
                "rollout.engine.gpus=[1]",
            ],
            "rollout.engine.gpus = [1]: needs rollout.num_engines × rollout.engine.tp = 2",
        ),
        (["parallel.device=cuda", "weight_sync.backend=nccl"], "weight_sync.backend = nccl: the engines run on CPU"),
        (
            SGLANG + [f"rollout.engine.python={sys.executable}"],
            "has no SGLang (build one with bash scripts/setup_sglang_cpu.sh",
        ),
        (["launch.engine_cpus=[4096]"], "launch.engine_cpus = [4096]: core 4096 is not one this process may run on"),
        (["launch.learner_cpus=[0, 0]"], "launch.learner_cpus = [0, 0]: core 0 is listed twice"),
        (
            ["launch.engine_cpus=[0]", "rollout.num_engines=2"],
            "launch.engine_cpus = [0]: fewer cores than rollout.num_engines (2)",
        ),
        (
            SGLANG + ["rollout.engine.python=/nonexistent/python"],
            "rollout.engine.python = '/nonexistent/python': cannot run it",
        ),
    ],
)
def test_what_an_engine_cannot_honour_is_one_line_naming_the_field(overrides, expected):
    problems = _problems(overrides)
    assert any(expected in line for line in problems), problems
    assert all("\n" not in line for line in problems)


def test_the_python_check_reads_metadata_and_imports_nothing(tmp_path, monkeypatch):
    """Checking rollout.engine.python reads package metadata: importing SGLang would take
    seconds to minutes. A stand-in sglang that records being imported is found, not imported."""
    site = tmp_path / "site"
    imported = tmp_path / "imported"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text(f"open({str(imported)!r}, 'w').close()\n")
    (site / "sglang-9.9.9.dist-info").mkdir()
    (site / "sglang-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.9\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    assert sglang_install(sys.executable)["sglang"] == "9.9.9"
    assert not imported.exists()


def test_resolve_fills_what_depends_on_the_engine():
    cpu = load_config(TINY)
    assert (cpu.weight_sync.checksum, cpu.weight_sync.backend, cpu.weight_sync.parity_tolerance) == (True, "gloo", 1e-3)
    bf16 = load_config(TINY, ["rollout.engine.dtype=bfloat16"])
    assert bf16.weight_sync.parity_tolerance == 0.5  # bf16 vs fp32: ~0.02 per token, ~0.3 where routing flips
    gpu = load_config(TINY, ["rollout.engine.type=sglang", "rollout.engine.dtype=bfloat16", "parallel.device=cuda"])
    assert (gpu.weight_sync.checksum, gpu.weight_sync.backend, gpu.weight_sync.parity_tolerance) == (False, "nccl", 0.5)
    shared = ["rollout.engine.type=sglang", "parallel.device=cuda", "launch.mode=local", "rollout.engine.gpus=[0]"]
    assert load_config(TINY, shared).weight_sync.backend == "gloo"  # NCCL: one rank per GPU
    assert load_config(TINY, shared[:-1] + ["rollout.engine.gpus=[1]"]).weight_sync.backend == "nccl"
    with pytest.raises(
        ConfigError, match=r"weight_sync.backend = nccl: rollout.engine.gpus = \[0\] shares the learner"
    ):
        load_config(TINY, [*shared, "weight_sync.backend=nccl"])
    off = load_config(TINY, ["weight_sync.parity_tolerance=null"])
    assert off.weight_sync.parity_tolerance is None
    in_place = load_config(
        TINY, SGLANG + ["weight_sync.pause_mode=in_place", "rollout.engine.extra_args=[--disable-radix-cache]"]
    )
    assert in_place.weight_sync.pause_mode == "in_place"


# --------------------------------------------------------------------------- failures at start
def test_a_server_that_dies_at_start_is_one_line_naming_engine_reason_and_log(tmp_path):
    script = (
        "import sys; print('loading'); print('launch_server.py: error: unrecognized arguments: --bogus'); sys.exit(2)"
    )
    proc = ServerProcess([sys.executable, "-c", script], "127.0.0.1", 1, tmp_path / "x.log", name="engine 3 (sglang)")
    with pytest.raises(EngineStartError) as err:
        proc.start(ready_timeout_s=30)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("engine 3 (sglang) (http://127.0.0.1:1) exited with 2 before it was ready")
    assert "unrecognized arguments: --bogus" in message and str(tmp_path / "x.log") in message


def test_failure_reason_picks_the_error_line(tmp_path):
    log = tmp_path / "l.log"
    log.write_text(
        "INFO start\nTraceback (most recent call last):\n  File x\nOSError: [Errno 98] Address already in use\n"
        "[2026] Received sigquit from a child process.\n"
    )
    assert failure_reason(log) == "OSError: [Errno 98] Address already in use"


GROUP_SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
""")


def test_a_server_that_hangs_is_stopped_with_its_children_after_the_timeout(tmp_path):
    proc = ServerProcess([sys.executable, "-c", GROUP_SCRIPT], "127.0.0.1", 9, tmp_path / "h.log", name="engine 0")
    with pytest.raises(EngineStartError, match=r"engine 0 .* not healthy after 2 s \(rollout.start_timeout_s\)"):
        proc.start(ready_timeout_s=2)
    child = int((tmp_path / "h.log").read_text().split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert proc.watchdog.poll() is not None


HEALTHY_PARENT = textwrap.dedent("""
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def test_an_engine_runs_on_its_launch_engine_cpus_and_so_does_what_it_starts(tmp_path):
    core = max(os.sched_getaffinity(0))
    cfg = load_config(TINY, [f"launch.engine_cpus=[{core}]", "launch.mode=local"])
    port = free_port()
    server = engine_process(
        "/m",
        cfg.rollout.engine,
        host="127.0.0.1",
        port=port,
        routed_experts=False,
        log_dir=tmp_path,
        cpus=InProcess(cfg).engine_cpus(0),
    )
    server.command = [sys.executable, "-c", HEALTHY_PARENT, str(port)]  # the launcher's start, a light server
    try:
        server.start(ready_timeout_s=60)
        child = int(server.log_path.read_text().split()[0])
        for pid in (server.proc.pid, child):
            status = open(f"/proc/{pid}/status").read()
            assert f"Cpus_allowed_list:\t{core}\n" in status and os.sched_getaffinity(pid) == {core}
        assert b"OMP_NUM_THREADS=1\0" in open(f"/proc/{server.proc.pid}/environ", "rb").read()
    finally:
        server.stop()


LEARNER = textwrap.dedent("""
    import os, sys
    from megatron_rlvr.config import load_config
    from megatron_rlvr.launch.learners import LearnerRank
    before = os.sched_getaffinity(0)
    rank = LearnerRank(load_config(sys.argv[1], sys.argv[2:]), "/m", 0, 1)
    import torch
    print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    rank.close()
    print(os.sched_getaffinity(0) == before)
""")


def test_a_learner_runs_on_its_launch_learner_cpus_until_it_closes():
    core = max(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", LEARNER, TINY, f"launch.learner_cpus=[{core}]", "launch.mode=local"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.splitlines() == [f"[{core}] 1", "True"], done.stderr[-2000:]


CLOSING = textwrap.dedent("""
    import os, sys, weakref
    from megatron_rlvr.config import load_config
    from megatron_rlvr.learner.parallel import free_port
    from megatron_rlvr.sft.rank import SftRank

    def gloo_threads():
        count = 0
        for task in os.listdir("/proc/self/task"):
            try:
                count += open(f"/proc/self/task/{task}/comm").read().startswith(("gloo", "pt_gloo"))
            except OSError:  # a thread that ended meanwhile
                pass
        return count

    cfg = load_config(sys.argv[1], sys.argv[3:])
    print(gloo_threads())
    for _ in range(2):
        rank = SftRank(cfg, sys.argv[2], 0, 1)
        rank.setup(("127.0.0.1", free_port("127.0.0.1")))
        model = weakref.ref(rank.learner.chunks[0])
        opened = gloo_threads()
        rank.close()
        print(opened, model() is None, gloo_threads())
""")


def test_a_closed_learner_lets_its_model_and_its_gloo_threads_go(tiny_hf_dir):
    """Local mode, compare-replay and the benchmarks run many learners in one process: each
    one's model and process groups must go when it closes, or their gloo threads pile up on the
    learner's core (Megatron's DDP hooks hold the model through C++, out of the collector's reach)."""
    done = subprocess.run(
        [sys.executable, "-c", CLOSING, TINY, str(tiny_hf_dir), "launch.mode=local"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stderr[-2000:]
    runs = [line.split() for line in lines[1:]]
    assert all(freed == "True" for _, freed, _ in runs), lines
    # each run opens its groups' threads (a dozen and more); closed, they go, but for a few that
    # torch starts once per process: the count after a close never grows from run to run
    left = {int(after) for _, _, after in runs}
    assert len(left) == 1 and all(int(opened) > 2 * max(left) for opened, _, _ in runs), lines


def test_cores_a_node_has_not_got_are_one_line_and_leave_nothing_running(tmp_path):
    script = "import time; time.sleep(600)"
    server = ServerProcess(
        [sys.executable, "-c", script], "127.0.0.1", 9, tmp_path / "p.log", name="engine 1", cpus=[4096]
    )
    with pytest.raises(UserError, match=r"^engine 1 \(http://127.0.0.1:9\) cannot be pinned to cores \[4096\]: "):
        server.start(ready_timeout_s=5)
    assert server.proc.poll() is not None and server.watchdog is None


OWNER = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from megatron_rlvr.rollout.launcher import ServerProcess
    server = ServerProcess([sys.executable, "-c", sys.argv[1]], "127.0.0.1", 9, Path(sys.argv[2]))
    threading.Thread(target=server.start, kwargs={"ready_timeout_s": 600}, daemon=True).start()
    time.sleep(600)
""")


def test_a_dead_owner_never_leaves_its_server_running(tmp_path):
    """The owner dies (SIGKILL: no teardown runs) while its server is starting: the watchdog
    takes the server's whole process group down."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, GROUP_SCRIPT, str(tmp_path / "o.log")])
    deadline = time.monotonic() + 60
    log = tmp_path / "o.log"  # the server prints its child's pid once both run
    while time.monotonic() < deadline and not (log.exists() and log.read_text().strip()):
        time.sleep(0.1)

    def tree_and_servers() -> tuple[list[psutil.Process], list[psutil.Process]]:
        tree = psutil.Process(owner.pid).children(recursive=True)
        return tree, [p for p in tree if "watchdog" not in " ".join(p.cmdline())]

    # a process just forked shows its parent's command line until it execs: wait for the watchdog's
    tree, servers = tree_and_servers()
    while time.monotonic() < deadline and (len(servers) != 2 or len(tree) != 3):
        time.sleep(0.1)
        tree, servers = tree_and_servers()
    assert len(servers) == 2 and any("watchdog" in " ".join(p.cmdline()) for p in tree)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    gone, alive = psutil.wait_procs(tree, timeout=30)  # the watchdog exits once the group is gone
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]


def test_a_taken_port_is_refused_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = ServerProcess(
            [sys.executable, "-c", "raise SystemExit(0)"], "127.0.0.1", port, tmp_path / "p.log", name="engine 1 (cpu)"
        )
        with pytest.raises(
            EngineStartError,
            match=rf"^engine 1 \(cpu\) \(http://127.0.0.1:{port}\) cannot start: "
            rf"port {port} is in use; log: .*p.log$",
        ):
            proc.start()
    assert proc.proc is None  # nothing was started


def test_a_fatal_log_line_fails_the_start_although_the_process_lives(tmp_path):
    script = (
        "import time; print('ERROR:    [Errno 98] error while attempting to bind on address: address already "
        "in use', flush=True); time.sleep(600)"
    )
    proc = ServerProcess(
        [sys.executable, "-c", script], "127.0.0.1", 9, tmp_path / "f.log", name="engine 0", check_port=False
    )
    # the fatal line, not the 120 s bound (whose message is "not healthy after 120 s")
    with pytest.raises(EngineStartError, match="failed to start: .*address already in use; log: "):
        proc.start(ready_timeout_s=120)
    assert not proc.alive


def test_pinning_a_process_whose_threads_come_and_go_pins_the_living_ones():
    """Threads that end between the listing of /proc/PID/task and their pinning (a benchmark
    runs several runs in one process, each leaving short-lived threads) are not an error."""
    cores = sorted(os.sched_getaffinity(0))
    done = threading.Event()

    def churn():
        while not done.is_set():
            batch = [threading.Thread(target=time.sleep, args=(0.0005,)) for _ in range(16)]
            for t in batch:
                t.start()
            for t in batch:
                t.join()

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        for _ in range(300):
            launcher.pin_process(os.getpid(), cores, "this test")
    finally:
        done.set()
        churner.join()
    assert sorted(os.sched_getaffinity(0)) == cores
