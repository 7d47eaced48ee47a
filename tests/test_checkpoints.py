"""Checkpoints a crash cannot take away: each save writes a step folder of its own, marks it
complete last, then moves `latest`; resume takes `latest` or, when that is missing or bad, the
newest complete folder. A run of `train` or `sft` SIGKILLed at each moment of a save
(run_dir.KILL_AT) resumes from the new step or the previous one, never from a mix."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from megatron_rlvr import run_dir
from megatron_rlvr.run_dir import CheckpointError, learner_checkpoint, resumable
from megatron_rlvr.samples import Group, Sample

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- folders, no run
def fake_checkpoint(root: Path, step: int, *, sealed: bool = True) -> Path:
    """A step folder with the files a save writes (contents aside), sealed or not."""
    folder = run_dir.begin_save(root, step)
    (folder / run_dir.LEARNER).mkdir()
    (folder / run_dir.LEARNER / "metadata.json").write_text("{}")
    (folder / run_dir.LEARNER / "__0_0.distcp").write_bytes(os.urandom(100))
    (folder / run_dir.RUN_STATE).write_bytes(run_dir.dump_run_state({"step": step}))
    if sealed:
        run_dir.seal(folder, step)
    return folder


def test_resume_takes_latest_and_falls_back_to_the_newest_complete_folder_saying_why(tmp_path):
    root = tmp_path / "checkpoint"
    assert resumable(root) is None  # nothing saved yet
    for step in (2, 4):
        run_dir.point_latest(root, fake_checkpoint(root, step), step)
    fake_checkpoint(root, 6, sealed=False)  # killed mid-save: never named by latest
    assert resumable(root) == (root / "step_000004", 4, None)

    (root / "latest").write_text("step_000006\n")  # names an incomplete folder
    folder, step, why = resumable(root)
    assert (folder.name, step) == ("step_000004", 4) and "names 'step_000006', but step_000006 is incomplete" in why
    (root / "latest").write_bytes(b"\xff\xfe garbage")
    assert resumable(root)[1] == 4 and "cannot be read" in resumable(root)[2]
    (root / "latest").unlink()
    assert resumable(root)[1] == 4 and "latest is missing" in resumable(root)[2]

    with open(root / "step_000004" / run_dir.LEARNER / "__0_0.distcp", "r+b") as file:
        file.truncate(10)  # a file cut short after the folder was sealed
    folder, step, why = resumable(root)
    assert step == 2 and why.endswith("latest is missing")
    assert "learner/__0_0.distcp is missing or not the size" in run_dir.check(root / "step_000004")


def test_only_keep_checkpoints_complete_folders_stay_after_a_save(tmp_path):
    root = tmp_path / "checkpoint"
    for step in (1, 2, 3):
        fake_checkpoint(root, step)
    fake_checkpoint(root, 4, sealed=False)
    fake_checkpoint(root, 9)  # a later step, saved before a resume from an earlier one
    fake_checkpoint(root, 5)
    assert run_dir.prune(root, 2, 5) == ["step_000009", "step_000004", "step_000002", "step_000001"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000003", "step_000005"]
    assert run_dir.prune(root, 1, 5) == ["step_000003"]


def test_paths_users_give_mean_the_learner_part_of_a_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoint"
    run_dir.point_latest(root, fake_checkpoint(root, 2), 2)
    fake_checkpoint(root, 3, sealed=False)
    learner = root / "step_000002" / "learner"
    assert learner_checkpoint(root, "--ckpt") == learner  # a run's checkpoint folder: latest
    assert learner_checkpoint(run, "--ckpt") == learner  # the run's output folder
    assert learner_checkpoint(root / "step_000002", "--ckpt") == learner
    assert learner_checkpoint(learner, "--ckpt") == learner  # a dist checkpoint itself
    with pytest.raises(CheckpointError, match=r"^--ckpt .*step_000003: step_000003 is incomplete"):
        learner_checkpoint(root / "step_000003", "--ckpt")
    with pytest.raises(CheckpointError, match=r"^model.mcore_checkpoint .*: no Megatron checkpoint there"):
        learner_checkpoint(tmp_path / "nothing", "model.mcore_checkpoint")


def test_resume_loads_the_run_state_then_the_learner_and_refuses_another_commands_checkpoint(tmp_path):
    root = tmp_path / "checkpoint"
    folder = fake_checkpoint(root, 2)  # train's run state: no "command"
    run_dir.point_latest(root, folder, 2)
    loaded = []

    def load_learner(path: Path) -> int:
        loaded.append(path)
        return 2

    assert run_dir.resume(root, load_learner, "train") == (folder, {"step": 2})
    assert loaded == [folder / run_dir.LEARNER]
    with pytest.raises(CheckpointError, match=r"of `megatron-rlvr train`, which `megatron-rlvr sft` does not resume"):
        run_dir.resume(root, load_learner, "sft")
    assert len(loaded) == 1  # refused before the learner loads
    with pytest.raises(CheckpointError, match=r"inconsistent: learner at step 5, run state at step 2"):
        run_dir.resume(root, lambda path: 5, "train")
    assert run_dir.resume(tmp_path / "none", load_learner, "sft") is None


def test_an_old_single_folder_checkpoint_is_refused_in_one_line(tmp_path):
    root = tmp_path / "run" / "checkpoint"
    root.mkdir(parents=True)
    (root / "metadata.json").write_text("{}")
    (root / "run_state.pkl").write_bytes(b"\x80\x04.")
    with pytest.raises(CheckpointError) as refused:
        run_dir.inspect(tmp_path / "run")
    assert "older version" in str(refused.value) and "\n" not in str(refused.value)
    assert learner_checkpoint(root, "--ckpt") == root  # its learner part is a dist checkpoint still


def test_the_run_state_round_trips_through_json_and_reads_no_objects(tmp_path):
    rng = random.Random(7)
    sample = Sample(
        "p1", "g1", 0, [1, 2], [3], [-0.25], "stop", "3", [{"version": 3, "start": 0, "end": 1}],
        routed_experts=np.arange(12, dtype=np.int32).reshape(2, 3, 2), reward=1.0,
    )  # fmt: skip
    state = {
        "step": 3,
        "sampler": {"rng": rng.getstate(), "history": {"outcomes": {"p1": (2, "solved")}}},
        "buffer": {"ready": [Group("p1", "g1", [sample], answer="6")], "counts": {"kept": 1}},
        "next_batch": None,
        "scalar": np.float32(0.1),
    }
    path = tmp_path / "run_state.json"
    path.write_bytes(run_dir.dump_run_state(state))
    back = run_dir.load_run_state(path)
    random.Random().setstate(back["sampler"]["rng"])  # a tuple again, as setstate needs
    assert back["sampler"] == state["sampler"] and back["scalar"] == state["scalar"]
    got = back["buffer"]["ready"][0].samples[0]
    assert np.array_equal(got.routed_experts, sample.routed_experts) and got.routed_experts.dtype == np.int32
    assert {**got.__dict__, "routed_experts": None} == {**sample.__dict__, "routed_experts": None}
    with pytest.raises(TypeError, match="a object is not saved"):
        run_dir.dump_run_state({"step": 1, "thing": object()})
    path.write_text('{"step": 1, "x": {"__group__": {"os": "system"}}}')  # builds only Group/Sample
    with pytest.raises(CheckpointError, match=r"run_state.json cannot be read \(TypeError"):
        run_dir.load_run_state(path)
    path.write_text('{"step": 1, "sampler": {"rng"')  # cut short
    with pytest.raises(CheckpointError, match="cannot be read"):
        run_dir.load_run_state(path)


def test_a_learner_checkpoint_that_cannot_be_read_is_one_line(tmp_path):
    """A common.pt cut short (what a kill mid-save left in the old layout: `EOFError` from
    torch.load in every trial) is refused in one line naming the folder, before any state of
    the learner changes."""
    import torch

    from megatron_rlvr.learner.checkpoint import load_checkpoint

    folder = tmp_path / "learner"
    folder.mkdir()
    (folder / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
        '"common_backend": "torch", "common_backend_version": 1}'
    )
    torch.save({"step": 3, "layout": [1, 1, 1, 1, 1]}, folder / "common.pt")
    whole = (folder / "common.pt").read_bytes()
    (folder / "common.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(None, folder)
    assert str(refused.value).startswith(f"checkpoint {folder} cannot be read (") and "\n" not in str(refused.value)


# ----------------------------------------------------------------------------- runs killed mid-save
COMMANDS = {
    "train": [
        "train",
        str(REPO / "configs" / "tiny-moe-cpu.yaml"),
        "buffer.batch_groups=4",
        "rollout.n_samples_per_prompt=4",
    ],
    # the demo's cold start made small: 2 layers, 200 conversations, ~350 tokens a step; a
    # constant LR (a cosine's depends on trainer.steps, which the runs below raise as they go)
    "sft": [
        "sft",
        str(REPO / "configs" / "long-answers-sft-cpu.yaml"),
        "model.num_layers=2",
        "sft.data.num_prompts=200",
        "sft.heldout_examples=0",
        "sft.batch_tokens=512",
        "sft.pass_at_1=false",
        "trainer.warmup_steps=0",
        "trainer.lr_decay_style=constant",
    ],
}


def launch(command: str, out: Path, *overrides: str, kill_at: str | None = None) -> str:
    """A short local run of `command` (saved every step, two kept); KILL_AT given, it is
    SIGKILLed there. Returns its log. A run killed so leaves no process behind: its engine's
    watchdog stops the engine; Megatron's checkpoint writer leaves a multiprocessing manager
    (and its resource tracker) that outlive their parent, so the run's process group is killed here."""
    name, config, *preset = COMMANDS[command]
    command_line = [
        sys.executable,
        "-m",
        "megatron_rlvr.cli",
        name,
        config,
        f"trainer.output_dir={out}",
        "launch.mode=local",
        "trainer.save_interval=1",
        "trainer.keep_checkpoints=2",
        *preset,
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k != run_dir.KILL_AT}
    env.update({run_dir.KILL_AT: kill_at} if kill_at else {})
    log_path = out.parent / f"{out.name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command_line, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
        code = proc.wait(600)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert code == (-signal.SIGKILL if kill_at else 0), (kill_at, code, text[-3000:])
    deadline = time.monotonic() + 60  # the watchdog: a second to notice, ten of grace
    while (left := _running_for(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
    return text


def _running_for(out: Path) -> list[str]:
    """Processes whose command line names the run's folder (its engine servers)."""
    found = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
    return [cmd[:100] for cmd in found if str(out) in cmd]


def on_disk(out: Path) -> tuple[str, dict[str, bool]]:
    """(what `latest` names, step folder → complete?)."""
    root = out / "checkpoint"
    folders = {p.name: run_dir.check(p) is None for p in root.glob("step_*")}
    return (root / "latest").read_text().strip(), folders


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# (phase, the step a resume continues from after a SIGKILL there while saving step 3)
PHASES = [
    ("begin", 2),  # the step folder made, nothing in it
    ("learner", 2),  # in the learner's part: tensor files being written, its metadata not
    ("run_state", 2),  # the learner's part written, run_state.json (train's rollout side, sft's step) not
    ("seal", 2),  # everything written and synced, the manifest not
    ("latest", 2),  # complete, `latest` still naming step 2
    ("prune", 3),  # `latest` moved, step 1 (beyond keep_checkpoints) not yet removed
]


def kill_then_check(command: str, out: Path, phase: str, step: int, resumes_at: int) -> None:
    """Saving `step` is killed at `phase` (in a resumed run when the folder holds one); the
    folders are as that moment leaves them, and `latest` names the step a resume takes."""
    fresh = not out.exists()
    resume = [] if fresh else ["trainer.resume=true"]
    launch(command, out, f"trainer.steps={step}", *resume, kill_at=f"{phase}@{step}")
    latest, folders = on_disk(out)
    assert latest == f"step_{resumes_at:06d}", phase
    assert folders.get(f"step_{step:06d}", False) == (phase in ("latest", "prune")), (phase, folders)
    if phase == "learner":  # killed amid Megatron's writes: tensors partly there, metadata not
        written = {p.name for p in (out / "checkpoint" / f"step_{step:06d}" / "learner").iterdir()}
        assert not written & {"metadata.json", ".metadata"}, written
    if phase == "prune":
        assert folders[f"step_{step - 2:06d}"]  # not removed yet: the kill came first
    assert steps_logged(out)[-1] == step  # the step's metrics were logged before its save


@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_killed_mid_save_resumes_from_a_whole_checkpoint(command, tmp_path):
    """Killed amid the learner's writes while saving step 2; `latest` then pointed at that
    half-written folder by hand: the resume says why it does not take it, continues from
    step 1, and the run ends with the keep_checkpoints newest folders on disk."""
    out = tmp_path / "run"
    kill_then_check(command, out, "learner", 2, 1)
    (out / "checkpoint" / "latest").write_text("step_000002\n")
    done = launch(command, out, "trainer.steps=2", "trainer.resume=true")
    assert "latest names 'step_000002', but step_000002 is incomplete (no complete.json" in done
    assert "resuming from the newest complete checkpoint" in done and "step_000001 at step 1" in done
    assert steps_logged(out) == [1, 2]
    assert on_disk(out) == ("step_000002", {"step_000001": True, "step_000002": True})


@pytest.mark.slow
@pytest.mark.timeout(1800)  # eight runs of a minute or two each on a loaded 2-core machine
@pytest.mark.parametrize("command", COMMANDS)
def test_a_run_killed_at_every_moment_of_a_save_resumes_as_if_never_killed(command, tmp_path):
    """Each phase in turn, one resumed run each; the run then logs what an uninterrupted one
    logs (a synchronous CPU run is deterministic), so no resume mixed two checkpoints."""
    out = tmp_path / "run"
    for phase, resumes_at in PHASES:
        kill_then_check(command, out, phase, 3, resumes_at)
    done = launch(command, out, "trainer.steps=4", "trainer.resume=true")
    assert "resumed from" in done and "step_000003 at step 3" in done  # the prune kill's latest
    assert "resuming from the newest complete" not in done
    assert on_disk(out) == ("step_000004", {"step_000003": True, "step_000004": True})
    launch(command, tmp_path / "whole", "trainer.steps=4")
    noisy = ("time/", "loop/", "weight_sync/seconds", "weight_sync/parity_max_gap", "train/mismatch_")
    whole = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    resumed = (out / "metrics.jsonl").read_text().splitlines()
    assert len(whole) == len(resumed) == 4
    for a, b in zip(map(json.loads, whole), map(json.loads, resumed)):
        assert set(a) == set(b)
        for key in (k for k in a if not k.startswith(noisy)):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
