"""Where metrics go: metrics.jsonl, TensorBoard and Weights & Biases (offline, read back
from its own run file) hold the same numbers, eval included from step 0; curves.png gains an
eval panel; a missing wandb package is one clear line."""

import glob
import json
import struct
from pathlib import Path

import pytest
from PIL import Image

from megatron_rlvr.config import WandbConfig
from megatron_rlvr.reporting import RunReport, WandbMissing, wandb_module


def read_wandb_history(run_dir) -> list[dict]:
    """History rows of an offline W&B run, from its .wandb file: a LevelDB-style log (7-byte
    file header, 32 KiB blocks, records of crc/length/type chunks) of wandb's Record protos."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length, kind) == (0, 0):
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def log_a_run(out, first_step=1, steps=3, **kw) -> RunReport:
    report = RunReport(out, steps, first_step=first_step, once={"data/prompts": 512}, **kw)
    if first_step == 1:
        report.log_eval(0, {"eval/held/pass@1": 0.25, "eval/held/pass@4": 0.5})
    for step in range(first_step, steps + 1):
        metrics = {"step": step, "reward/mean": 0.1 * step, "time/step_s": 1.0, "train/policy_loss": -0.01 * step}
        if step % 2 == 0:
            metrics.update({"eval/held/pass@1": 0.3 * step, "eval/held/pass@4": 0.4 * step})
        report.log(metrics)
    report.close()
    return report


def test_metrics_reach_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")  # and no network is needed
    log_a_run(tmp_path, wandb=WandbConfig(project="rlvr-test", mode="offline"), config={"trainer": {"steps": 3}})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[0] == {"step": 0, "eval/held/pass@1": 0.25, "eval/held/pass@4": 0.5, "data/prompts": 512}
    assert "data/prompts" not in lines[1]  # logged once
    history = read_wandb_history(tmp_path)
    assert [row["_step"] for row in history] == [0, 1, 2, 3]
    for row, line in zip(history, lines):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == pytest.approx(
            {k: v for k, v in line.items() if k != "step"}
        )
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/held/pass@1")] == [(0, 0.25), (2, pytest.approx(0.6))]
    assert Image.open(tmp_path / "curves.png").size == (1500, 350)  # reward, loss and the eval panel


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    spec = WandbConfig(project="rlvr-test", mode="offline")
    log_a_run(tmp_path, steps=2, wandb=spec)
    first_id = (tmp_path / "wandb_run_id").read_text()
    log_a_run(tmp_path, first_step=3, steps=4, wandb=spec)
    assert (tmp_path / "wandb_run_id").read_text() == first_id
    runs = [Path(p).name for p in glob.glob(f"{tmp_path}/wandb/offline-run-*")]
    assert runs and all(first_id in name for name in runs), runs


def test_without_eval_the_curves_have_two_panels(tmp_path):
    report = RunReport(tmp_path, 2, tensorboard=False)
    for step in (1, 2):
        report.log({"step": step, "reward/mean": 0.5, "time/step_s": 1.0})
    report.close()
    assert Image.open(tmp_path / "curves.png").size == (1000, 350)


def test_a_missing_wandb_is_one_clear_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(WandbMissing, match=r"logging.wandb is set but the wandb package is not installed: pip install"):
        wandb_module(check_only=True)
