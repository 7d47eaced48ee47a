"""HF checkpoint directories: sharded safetensors written one file's worth at a time, the
config and tokenizer files carried along, and a tensor-by-tensor bitwise comparison."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_rlvr.convert.checks import ConvertError

INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")


class ShardedSafetensors:
    """Writes (name, tensor) pairs into safetensors files of at most max_bytes each, then the
    index JSON that from_pretrained reads. Holds one file's tensors in memory at a time; files
    carry a temporary name until the index is written, so an interrupted write is no checkpoint."""

    def __init__(self, out_dir: str | Path, max_bytes: int):
        self.out, self.max_bytes = Path(out_dir), max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.total_bytes = 0
        self.written: list[list[str]] = []  # names per file

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in names for names in self.written):
            raise ConvertError(f"tensor {name} was exported twice")
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()  # no shared storage
        self.pending_bytes += size
        self.total_bytes += size

    def _partial(self, index: int) -> Path:
        return self.out / f"model-{index + 1:05d}.partial"

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self._partial(len(self.written))), metadata={"format": "pt"})
        self.written.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> int:
        """Names the files model-0000i-of-0000n and writes the index; returns the file count."""
        if self.pending:
            self._flush()
        weight_map = {}
        for index, names in enumerate(self.written):
            final = f"model-{index + 1:05d}-of-{len(self.written):05d}.safetensors"
            os.replace(self._partial(index), self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        manifest = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX).write_text(json.dumps(manifest, indent=2) + "\n")
        return len(self.written)


def copy_side_files(src: str | Path, dst: str | Path, dtype: str | None = None) -> None:
    """Copies an HF directory's config, tokenizer and generation files (no weights, no index);
    with dtype, config.json then declares the dtype the weights are written in."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(Path(src).iterdir()):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)
    if dtype is not None:
        config = json.loads((dst / "config.json").read_text())
        config["dtype"] = dtype
        if "torch_dtype" in config:
            config["torch_dtype"] = dtype
        (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def compare_bitwise(
    produced: Iterable[tuple[str, torch.Tensor]], reference, dtype: torch.dtype, *, tied: bool, label: str
) -> dict:
    """Compares a stream of (name, tensor) with a reference (names() and get(name)) tensor by
    tensor, the reference cast to dtype (the conversion's own, asked-for cast). A tensor either
    side lacks is refused by name (a tied lm_head may be absent). Returns the figures: tensors
    compared, bitwise equal, and the first unequal tensor with its largest difference."""
    names = reference.names() - ({"lm_head.weight"} if tied else set())
    seen, equal, first = set(), 0, None
    for name, tensor in produced:
        if name not in names:
            raise ConvertError(f"tensor {name} is not in {label}")
        seen.add(name)
        expected = reference.get(name).to(dtype)
        if tensor.shape == expected.shape and torch.equal(tensor.cpu(), expected):
            equal += 1
        elif first is None:
            diff = (
                (tensor.cpu().float() - expected.float()).abs().max().item()
                if tensor.shape == expected.shape
                else "in shape"
            )
            first = f"{name} (max abs diff {diff})"
    if names - seen:
        raise ConvertError(f"unexpected tensor {sorted(names - seen)[0]} in {label}: the model has no place for it")
    return {"tensors": len(seen), "bitwise_equal": equal, "first_unequal": first}
