"""What a run's output folder holds, and how its checkpoints are laid out so that a crash
(SIGKILL mid-save, an OOM kill) cannot take them away:

    checkpoint/
      latest             "step_000004": the newest complete checkpoint (replaced atomically)
      step_000002/       trainer.keep_checkpoints complete ones are kept
        learner/         the learner's Megatron dist checkpoint (every rank writes its part)
        run_state.json   the rollout side: sampler, buffer, counters, the next batch
        complete.json    written last: the step and every file's size
      step_000004/

Each save writes a new folder; only when its complete.json is there does `latest` move to
it, and only then are older folders removed. Resume takes `latest`, or, when that is
missing or names a folder that is not complete, the newest complete one. `train` and `sft`
save and resume through `save` and `resume` here (an SFT run's run_state.json holds its step
only), and refuse to start a new run over an old one (nothing of it changes) unless the user
asks to resume it."""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rlvr.config import ConfigError, ResolvedConfig
from megatron_rlvr.errors import UserError
from megatron_rlvr.samples import EpisodeStats, Group, Sample

log = logging.getLogger(__name__)
METRICS = "metrics.jsonl"
CHECKPOINT = "checkpoint"  # under output_dir: the step folders and `latest`
LATEST = "latest"
LEARNER = "learner"  # in a step folder: the learner's dist checkpoint
RUN_STATE = "run_state.json"  # in a step folder: the rollout side of a resume
MANIFEST = "complete.json"  # in a step folder, written last: the folder is complete
STEP_FOLDER = re.compile(r"step_(\d+)")
# Test hook: "PHASE@STEP" makes the process that reaches that phase of the save of that step
# kill itself with SIGKILL (tests/test_checkpoints.py: a crash at every moment of a save).
KILL_AT = "MEGATRON_RLVR_KILL_AT"
SAVE_PHASES = ("begin", "learner", "run_state", "seal", "latest", "prune")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read or resumed, said in one line."""


# ----------------------------------------------------------------------------- what a run folder holds
@dataclass(frozen=True)
class RunDir:
    path: Path
    last_logged_step: int  # 0: no metrics
    checkpoint_step: int | None  # None: no complete checkpoint

    @property
    def holds_a_run(self) -> bool:
        return self.last_logged_step > 0 or self.checkpoint_step is not None or (self.path / CHECKPOINT).exists()

    def describe(self) -> str:
        parts = []
        if self.last_logged_step:
            parts.append(f"metrics up to step {self.last_logged_step}")
        if self.checkpoint_step is not None:
            parts.append(f"a checkpoint of step {self.checkpoint_step}")
        elif (self.path / CHECKPOINT).exists():
            parts.append("an incomplete checkpoint")
        return " and ".join(parts)


def inspect(output_dir: str | Path) -> RunDir:
    path = Path(output_dir)
    last = 0
    metrics = path / METRICS
    if metrics.exists():
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                last = max(last, int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash: the steps before it still count
    found = resumable(path / CHECKPOINT)
    return RunDir(path, last, found[1] if found else None)


def check_output_dir(cfg: ResolvedConfig) -> RunDir:
    """Refuses (ConfigError, one line) to start a new run in a folder that holds one; with
    trainer.resume the folder is the run to continue. Returns what the folder holds."""
    found = inspect(cfg.trainer.output_dir)
    if found.holds_a_run and not cfg.trainer.resume:
        raise ConfigError(
            [
                f"trainer.output_dir = {cfg.trainer.output_dir!r} holds a run ({found.describe()}): continue it "
                "with trainer.resume=true, or give this run another trainer.output_dir (nothing was changed)"
            ]
        )
    return found


def finished_message(cfg: ResolvedConfig, found: RunDir) -> str | None:
    """When resuming a run whose checkpoint already holds every step asked for: what to say."""
    if cfg.trainer.resume and found.checkpoint_step is not None and found.checkpoint_step >= cfg.trainer.steps:
        return (
            f"the run in {cfg.trainer.output_dir} already finished: its checkpoint is of step "
            f"{found.checkpoint_step} and trainer.steps = {cfg.trainer.steps} (raise trainer.steps to train further)"
        )
    return None


# ----------------------------------------------------------------------------- saving
def step_folder(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def begin_save(root: Path, step: int) -> Path:
    """An empty folder for the checkpoint of `step`. One left by an earlier attempt at this
    step (a crash, or a run resumed from before it) is removed first: `latest` never names it."""
    folder = step_folder(root, step)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    kill_point("begin", step)
    return folder


def write_atomically(path: Path, data: bytes) -> None:
    """The file holds either its old content or `data`, whatever happens mid-write."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """A rename or a new file is durable once its folder is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(folder: Path, step: int) -> None:
    """Marks a fully written folder complete: every file synced, then the manifest (each
    file's size) written last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(path, "rb") as file:
            os.fsync(file.fileno())
        files[str(path.relative_to(folder))] = path.stat().st_size
    for path in sorted({p.parent for p in folder.rglob("*")}):
        _fsync_dir(path)
    kill_point("seal", step)
    write_atomically(folder / MANIFEST, json.dumps({"step": step, "files": files}, indent=1).encode())


def point_latest(root: Path, folder: Path, step: int) -> None:
    kill_point("latest", step)
    write_atomically(root / LATEST, f"{folder.name}\n".encode())


def prune(root: Path, keep: int, step: int) -> list[str]:
    """After the checkpoint of `step` is complete and `latest`: removes every other step
    folder but the keep − 1 newest complete ones before it (incomplete ones, and those of
    later steps, left by a crash before a resume from an earlier step). Returns their names."""
    kill_point("prune", step)
    kept = [f for s, f in _step_folders(root) if s < step and check(f) is None][: keep - 1]
    removed = []
    for s, folder in _step_folders(root):
        if s != step and folder not in kept:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def save(root: Path, step: int, state: dict, save_learner: Callable[[Path], None], keep: int) -> None:
    """The checkpoint of `step`, in the order that leaves the previous one whole if a crash
    comes at any moment: a folder of its own, the learner's part (save_learner, collective over
    the learner ranks), the run state beside it, the manifest, `latest`, and only then the
    removal of older folders (all but `keep` complete ones)."""
    folder = begin_save(root, step)
    save_learner(folder / LEARNER)
    kill_point("run_state", step)
    write_atomically(folder / RUN_STATE, dump_run_state(state))
    seal(folder, step)
    point_latest(root, folder, step)
    removed = prune(root, keep, step)
    log.info("saved %s%s", folder, f" (removed {', '.join(removed)})" if removed else "")


def kill_point(phase: str, step: int) -> None:
    """The test hook (KILL_AT): SIGKILL this process at `phase` of the save of `step`."""
    if os.environ.get(KILL_AT) == f"{phase}@{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def kill_amid_writes(folder: Path, step: int) -> None:
    """The test hook's "learner" phase: SIGKILL this learner rank as the first file of its part
    under `folder` is opened for writing, by it or by a writer process Megatron forks (which
    then kills the rank and itself): the tensors are half written, the metadata not at all."""
    if os.environ.get(KILL_AT) != f"learner@{step}":
        return
    rank, prefix = os.getpid(), str(folder) + os.sep

    def hook(event: str, args: tuple) -> None:
        writing = event == "open" and isinstance(args[1], str) and bool(set(args[1]) & set("wax"))
        if writing and str(args[0]).startswith(prefix):
            os.kill(rank, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)  # cannot be removed: the process dies in it


# ----------------------------------------------------------------------------- reading
def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step folder under root, newest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := STEP_FOLDER.fullmatch(p.name))]
    return sorted(found, reverse=True)


def check(folder: Path) -> str | None:
    """Why `folder` is not a complete checkpoint, or None when it is."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files, step = manifest["files"], int(manifest["step"])
    except FileNotFoundError:
        return f"{folder.name} is incomplete (no {MANIFEST}: the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{folder.name}/{MANIFEST} cannot be read ({type(err).__name__})"
    if (m := STEP_FOLDER.fullmatch(folder.name)) and int(m.group(1)) != step:
        return f"{folder.name}/{MANIFEST} is of step {step}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{folder.name}/{name} is missing or not the size its manifest says ({size} bytes)"
    if not (folder / LEARNER / "metadata.json").is_file() or not (folder / RUN_STATE).is_file():
        return f"{folder.name} lacks {LEARNER}/ or {RUN_STATE}"
    return None


def resumable(root: Path) -> tuple[Path, int, str | None] | None:
    """(folder, step, why `latest` was not taken: None when it was) of the checkpoint a
    resume takes: the one `latest` names, else the newest complete one. None: there is none.
    An old single-folder checkpoint (before step folders) is refused in one line."""
    if (root / "metadata.json").exists() or (root / "run_state.pkl").exists():
        raise CheckpointError(
            f"{root} is a checkpoint of an older version (one folder, its run state pickled), which this "
            "version does not resume: start afresh in another trainer.output_dir (its learner part still "
            f"converts: megatron-rlvr convert mcore-to-hf --ckpt {root})"
        )
    why = None
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        name, why = "", f"{root / LATEST} is missing"
    except (OSError, UnicodeDecodeError) as err:
        name, why = "", f"{root / LATEST} cannot be read ({type(err).__name__})"
    if name:
        match = STEP_FOLDER.fullmatch(name)
        problem = check(root / name) if match else "that is not a step folder's name"
        if match and problem is None:
            return root / name, int(match.group(1)), None
        why = f"{root / LATEST} names {name!r}, but {problem}"
    elif why is None:
        why = f"{root / LATEST} is empty"
    for step, folder in _step_folders(root):
        if check(folder) is None:
            return folder, step, why
    return None


def resume(root: Path, load_learner: Callable[[Path], int], command: str) -> tuple[Path, dict] | None:
    """Loads the checkpoint a resume takes (see resumable): (its folder, its run state), the
    learner's part loaded by load_learner (collective; returns the learner's step). None, and
    nothing loaded, when there is none. A checkpoint another command wrote (`command`: "train"
    or "sft"; a run state without one is train's) is refused in one line, before anything loads."""
    found = resumable(root)
    if found is None:
        log.info("no complete checkpoint in %s: starting afresh", root)
        return None
    path, _, why = found
    if why is not None:
        log.warning("%s: resuming from the newest complete checkpoint, %s", why, path)
    state = load_run_state(path / RUN_STATE)
    if (made_by := state.get("command", "train")) != command:
        raise CheckpointError(
            f"{path} is a checkpoint of `megatron-rlvr {made_by}`, which `megatron-rlvr {command}` does not "
            "resume: give this run another trainer.output_dir"
        )
    step = load_learner(path / LEARNER)
    if step != state["step"]:
        raise CheckpointError(
            f"checkpoint {path} is inconsistent: learner at step {step}, run state at step {state['step']} "
            "(remove that folder to resume from an older one)"
        )
    return path, state


def learner_checkpoint(path: str | Path, what: str) -> Path:
    """The learner's dist checkpoint that a path given by the user means: a run's checkpoint
    folder (→ `latest`, or the newest complete step), a step folder, a run's output folder,
    or a dist checkpoint itself (a converted one, or an older version's single folder).
    `what` names the option in the error (one line)."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    if (path / LEARNER).is_dir():
        problem = check(path)
        if problem is not None:
            raise CheckpointError(f"{what} {path}: {problem}")
        return path / LEARNER
    root = path / CHECKPOINT if (path / CHECKPOINT).is_dir() else path
    found = resumable(root) if root.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"{what} {path}: no Megatron checkpoint there (neither a dist checkpoint with metadata.json, "
            f"nor a run's {CHECKPOINT}/ folder with a complete step_NNNNNN/ in it)"
        )
    if found[2] is not None:
        log.warning("%s %s: %s; using %s", what, path, found[2], found[0])
    return found[0] / LEARNER


# ----------------------------------------------------------------------------- the run state as JSON
# Tagged values JSON has no type for; reading builds only these, never arbitrary objects.
_TUPLE, _ARRAY, _GROUP, _SAMPLE = "__tuple__", "__ndarray__", "__group__", "__sample__"
_EPISODE = "__episode__"  # an episode's Sample.episode (agent/)


def _encode(value: Any) -> Any:
    if isinstance(value, Group | Sample):
        tag = _GROUP if isinstance(value, Group) else _SAMPLE
        return {tag: {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, EpisodeStats):
        return {_EPISODE: {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, np.ndarray | np.generic):
        array = np.ascontiguousarray(value)
        if array.dtype.hasobject:
            raise TypeError(f"run state: an array of Python objects ({array.dtype}) is not saved")
        data = base64.b64encode(array.tobytes()).decode()
        return {_ARRAY: {"dtype": array.dtype.str, "shape": list(array.shape), "data": data}}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"run state: dict keys must be strings, not {sorted({type(k).__name__ for k in value})}")
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"run state: a {type(value).__name__} is not saved")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == _TUPLE:
            return tuple(_decode(v) for v in inner)
        if tag == _ARRAY:
            array = np.frombuffer(base64.b64decode(inner["data"]), dtype=np.dtype(inner["dtype"]))
            array = array.reshape(inner["shape"]).copy()
            return array[()] if array.ndim == 0 else array
        if tag in (_GROUP, _SAMPLE):
            fields = {k: _decode(v) for k, v in inner.items()}
            return Group(**fields) if tag == _GROUP else Sample(**fields)
        if tag == _EPISODE:
            return EpisodeStats(**{k: _decode(v) for k, v in inner.items()})
    return {k: _decode(v) for k, v in value.items()}


def dump_run_state(state: dict) -> bytes:
    return json.dumps(_encode(state)).encode()


def load_run_state(path: Path) -> dict:
    """The run state saved by dump_run_state; CheckpointError (one line) when unreadable."""
    try:
        state = _decode(json.loads(path.read_text()))
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no step")
        return state
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err})") from None
