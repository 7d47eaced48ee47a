"""The CPU engine's colocation endpoints, with SGLang 0.5.23's names and fields
(srt/entrypoints/http_server.py, srt/managers/io_struct.py):

- `POST /release_memory_occupation {tags}` and `POST /resume_memory_occupation {tags}`, tags
  `kv_cache`, `weights` (and `cuda_graph`, which the CPU engine has none of); None or empty
  means all (on resume: all that are released). Release is refused unless the engine is idle,
  as SGLang asserts. Released weights really leave the process: every parameter and persistent
  buffer drops its storage and the freed pages go back to the OS (malloc_trim). On resume they
  come back as zeros, unless the engine runs with `--enable-weights-cpu-backup`, which keeps
  them aside (in host memory, as SGLang's backup is) and puts them back. The CPU engine's KV
  cache lives only while requests run (per batch, not a static pool as SGLang's), so an idle
  engine holds none; releasing it returns what the allocator kept of it to the OS. While
  anything is released, `generate` is refused; while the weights are, weight updates are too.
- `POST /update_weights_from_tensor {serialized_named_tensors, load_format, flush_cache,
  abort_all_requests, weight_version}`: one payload per engine TP rank (this engine has one),
  each `MultiprocessingSerializer.serialize(obj, output_str=True)`: base64 of a ForkingPickler
  pickle. On GPU the tensors in it are CUDA IPC handles; on CPU they are shared-memory
  storages, which an unrelated process can open only by file name (torch's `file_system`
  sharing strategy; the default `file_descriptor` one passes a descriptor that only the
  sender's own children may fetch). `load_format` `flattened_bucket` carries
  `{"flattened_tensor": uint8, "metadata": [FlattenedTensorMetadata-like]}`, None a list of
  (name, tensor). The pickle is read by an allow-list unpickler (SGLang's SafeUnpickler does
  the same), inside a begin/end weight-update session as every 0.5.23 update.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import io
import pickle
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from fastapi import FastAPI, Request
from torch.multiprocessing import reductions

from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.cpu_engine import CpuEngine, EngineError, expert_weight_table

if TYPE_CHECKING:
    from megatron_rlvr.rollout.server import WeightUpdates

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")


class MemoryOccupation:
    """What the engine has released, and the weights' shapes (or their backup) to resume."""

    def __init__(self, engine: CpuEngine, *, weights_cpu_backup: bool = False):
        self.engine = engine
        self.weights_cpu_backup = weights_cpu_backup
        self._stash: list[tuple[torch.Tensor, torch.Tensor | tuple[torch.Size, torch.dtype]]] = []

    def release(self, tags: list[str] | None) -> list[str]:
        chosen = set(tags or ALL_TAGS)
        again = chosen & self.engine.released
        if again:
            raise EngineError(f"already released: {', '.join(sorted(again))}")
        self.engine.mark_released(chosen)  # refused unless idle; generate refused from here on
        if "weights" in chosen:
            with self.engine.model_lock:
                self._drop_weights()
        _return_freed_memory()
        return sorted(chosen)

    def resume(self, tags: list[str] | None) -> list[str]:
        chosen = set(tags) if tags else set(self.engine.released)
        missing = chosen - self.engine.released
        if missing:
            raise EngineError(f"not released, so nothing to resume: {', '.join(sorted(missing))}")
        if "weights" in chosen:
            with self.engine.model_lock:
                self._restore_weights()
        self.engine.mark_resumed(chosen)
        return sorted(chosen)

    def _drop_weights(self) -> None:
        """Every parameter and persistent buffer gives up its storage (tied ones once); the
        engine's name table, whose expert views hold the storages too, goes with them."""
        seen: set[int] = set()
        for tensor in self.engine.model.state_dict(keep_vars=True).values():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            kept = tensor.data if self.weights_cpu_backup else (tensor.shape, tensor.dtype)
            self._stash.append((tensor, kept))
            tensor.data = torch.empty(0, dtype=tensor.dtype)
        self.engine.weights = {}

    def _restore_weights(self) -> None:
        for tensor, kept in self._stash:
            tensor.data = kept if isinstance(kept, torch.Tensor) else torch.zeros(kept[0], dtype=kept[1])
        self._stash = []
        self.engine.weights = expert_weight_table(self.engine.model, self.engine.family)


def _return_freed_memory() -> None:
    """Hands the pages free()d into malloc's arenas back to the OS (glibc; elsewhere a no-op):
    tensors above the mmap threshold are unmapped at once, smaller ones would stay in RSS."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


# ---------------------------------------------------------------------- tensor payloads
@dataclass
class FlattenedTensorMetadata:
    """SGLang's srt/weight_sync/tensor_bucket.FlattenedTensorMetadata, field for field: a
    payload pickled with SGLang's own class unpickles into this one."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
_DTYPES |= {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): reductions.rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
} | {("torch", name): dtype for name, dtype in _DTYPES.items()}


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            hint = (
                " (a file-descriptor tensor: send CPU tensors with torch's file_system sharing strategy)"
                if name == "rebuild_storage_fd" or module == "multiprocessing.resource_sharer"
                else ""
            )
            raise EngineError(f"serialized_named_tensors: {module}.{name} is not allowed in a payload{hint}")
        return found


def deserialize_named_tensors(payload: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One rank's payload → (name, tensor) pairs, views into the shared memory it names."""
    try:
        obj = _PayloadUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    except EngineError:
        raise
    except (binascii.Error, pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError) as err:
        raise EngineError(f"serialized_named_tensors: not a tensor payload ({type(err).__name__}: {err})") from err
    if load_format == "flattened_bucket":
        return _from_flattened_bucket(obj)
    if not isinstance(obj, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor) for x in obj
    ):
        raise EngineError("serialized_named_tensors: load_format None carries a list of (name, tensor)")
    return obj


def _from_flattened_bucket(obj: Any) -> list[tuple[str, torch.Tensor]]:
    flat = obj.get("flattened_tensor") if isinstance(obj, dict) else None
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise EngineError("flattened_bucket: flattened_tensor must be a 1-D uint8 tensor")
    if not isinstance(metadata, list) or not metadata:
        raise EngineError("flattened_bucket: metadata must be a non-empty list")
    named = []
    for meta in metadata:
        try:
            name, shape, dtype = str(meta.name), torch.Size(meta.shape), meta.dtype
            start, end = int(meta.start_idx), int(meta.end_idx)
        except (AttributeError, TypeError, ValueError) as err:
            raise EngineError(f"flattened_bucket: malformed metadata entry ({err})") from err
        if not isinstance(dtype, torch.dtype):
            raise EngineError(f"flattened_bucket: {name}: dtype {dtype!r} is not a torch dtype")
        size = shape.numel() * dtype.itemsize
        if not (0 <= start and end == start + size <= flat.numel()) or start % dtype.itemsize:
            raise EngineError(
                f"flattened_bucket: {name}: bytes [{start}, {end}) do not hold {tuple(shape)} {dtype} "
                f"aligned inside a {flat.numel()}-byte bucket"
            )
        named.append((name, flat[start:end].view(dtype).view(shape)))
    return named


# ---------------------------------------------------------------------- endpoints
def register_memory_api(
    app: FastAPI, updates: WeightUpdates, memory: MemoryOccupation, parse_body: Callable[..., Awaitable[Any]]
) -> None:
    """The endpoints on the server's app; parse_body is the server's (request, model) → model."""

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request):
        req = await parse_body(request, p.ReleaseMemoryOccupationReqInput)
        released = await asyncio.to_thread(memory.release, req.tags)
        return {"success": True, "message": f"released {', '.join(released)}"}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request):
        req = await parse_body(request, p.ResumeMemoryOccupationReqInput)
        resumed = await asyncio.to_thread(memory.resume, req.tags)
        return {"success": True, "message": f"resumed {', '.join(resumed)}"}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        req = await parse_body(request, p.UpdateWeightsFromTensorReqInput)
        if updates.session is None:
            raise EngineError("updates must be inside /begin_weight_update … /end_weight_update")
        try:
            count = await asyncio.to_thread(_load_tensors, req, updates)
        except EngineError as err:
            updates.session["failed"] = str(err)
            raise
        updates.session["version"] = req.weight_version or updates.session["version"]
        return {"success": True, "message": f"updated {count} tensors"}


def _load_tensors(req: p.UpdateWeightsFromTensorReqInput, updates: WeightUpdates) -> int:
    engine = updates.engine
    if "weights" in engine.released:
        raise EngineError("weights are released: resume them (/resume_memory_occupation) before updating")
    if len(req.serialized_named_tensors) != 1:
        raise EngineError(
            f"serialized_named_tensors has {len(req.serialized_named_tensors)} entries: one per TP rank, "
            "and this engine has 1"
        )
    if req.load_format not in (None, "direct", "flattened_bucket"):
        raise EngineError(f"load_format {req.load_format!r}: the CPU engine loads None, direct or flattened_bucket")
    if req.abort_all_requests:
        engine.abort(abort_all=True)
    named = deserialize_named_tensors(req.serialized_named_tensors[0], req.load_format)
    updates.check_version(req.weight_version)
    updates.apply([n for n, _ in named], [t for _, t in named])
    if req.flush_cache and engine.busy:
        raise EngineError("weights loaded, but the cache flush failed: requests are running")
    return len(named)
