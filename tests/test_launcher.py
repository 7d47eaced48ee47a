"""Engine server commands, and the errors for what cannot start."""

import sys

import pytest

from megatron_rlvr.config import CpuEngine, SglangEngine
from megatron_rlvr.rollout import launcher
from megatron_rlvr.rollout.launcher import EngineStartError, ServerProcess, engine_process


def test_cpu_engine_command(tmp_path):
    proc = engine_process("/models/x", CpuEngine(dtype="bfloat16"), host="127.0.0.1", port=30100,
                          routed_experts=True, log_dir=tmp_path)
    assert proc.command[1:] == ["-m", "megatron_rlvr.rollout.server", "--model-path", "/models/x", "--host",
                                "127.0.0.1", "--port", "30100", "--dtype", "bfloat16",
                                "--enable-return-routed-experts"]
    assert proc.url == "http://127.0.0.1:30100" and proc.log_path == tmp_path / "engine-30100.log"


def test_sglang_command_carries_the_layout(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda name: object())
    engine = SglangEngine(tp=4, ep=4, mem_fraction_static=0.6, extra_args=["--chunked-prefill-size", "4096"])
    cmd = engine_process("/m", engine, host="127.0.0.1", port=30000, routed_experts=True, log_dir=tmp_path).command
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    for flag, value in (("--tp-size", "4"), ("--ep-size", "4"), ("--mem-fraction-static", "0.6"), ("--dtype", "bfloat16")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--enable-return-routed-experts" in cmd and cmd[-2:] == ["--chunked-prefill-size", "4096"]
    no_r3 = engine_process("/m", engine, host="127.0.0.1", port=30000, routed_experts=False, log_dir=tmp_path)
    assert "--enable-return-routed-experts" not in no_r3.command


def test_missing_sglang_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineStartError, match=r"needs SGLang: pip install .*\[gpu\]"):
        engine_process("/m", SglangEngine(), host="127.0.0.1", port=1, routed_experts=False, log_dir=tmp_path)


def test_a_server_that_dies_at_start_reports_its_log(tmp_path):
    proc = ServerProcess([sys.executable, "-c", "import sys; print('boom: no model'); sys.exit(3)"],
                         "127.0.0.1", 1, tmp_path / "x.log")
    with pytest.raises(EngineStartError, match=r"exited with 3(.|\n)*boom: no model"):
        proc.start(ready_timeout_s=30)
