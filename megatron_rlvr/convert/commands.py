"""`megatron-rlvr convert hf-to-mcore | mcore-to-hf`: checks what can be checked before any
process starts, runs the ranks (convert.launch), then verifies against HF transformers here,
once the ranks have exited, so the model is never in memory twice. A failed conversion
leaves no output directory behind."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_rlvr.convert.checks import DTYPES, ConvertError, compare_configs, target_dtype
from megatron_rlvr.run_dir import learner_checkpoint
from megatron_rlvr.stopping import StopRequested, StopSignals

CONVERT_JSON = "convert.json"  # beside a converted checkpoint: source, dtype, layout, figures
PROBE_SHAPE = (2, 16)  # tokens the logits are compared on (16 splits over any tp up to 16)
# Largest |logit difference| accepted, relative to the largest |logit|: fp32 kernels differ by
# rounding only; bf16 ones by bf16 rounding of every intermediate.
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def _read_config(config_dir: Path, label: str):
    from megatron_rlvr.learner.model import UnsupportedArchitecture, read_hf_config

    if not (config_dir / "config.json").is_file():
        raise ConvertError(f"{label} {config_dir}: no config.json there")
    try:
        return read_hf_config(config_dir)
    except UnsupportedArchitecture as err:
        raise ConvertError(str(err)) from err


@contextlib.contextmanager
def _output(out: Path):
    """Creates the (new or empty) output directory and yields a scratch directory for the
    ranks. On failure the output goes; the scratch stays when the error points into it."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="megatron-rlvr-convert-"))
    try:
        yield workdir
    except BaseException as err:
        shutil.rmtree(out, ignore_errors=True)
        if str(workdir) not in str(err):
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    shutil.rmtree(workdir, ignore_errors=True)


def _layout(tp: int, pp: int, ep: int, etp: int | None) -> dict:
    return {"tp": tp, "pp": pp, "ep": ep, "etp": etp}


def _device(device: str | None) -> str:
    import torch

    if device:
        return device
    import importlib.util

    # CUDA needs transformer-engine (learner/parallel.py refuses it otherwise)
    gpu_ready = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    return "cuda" if gpu_ready else "cpu"


def _probe_tokens(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(PROBE_SHAPE[1])] for _ in range(PROBE_SHAPE[0])]


def _compare_logits(workdir: Path, hf_dir: Path, tokens: list, dtype: str, *, strict_keys: bool) -> dict:
    """Runs the tokens through HF transformers from hf_dir and compares with the logits the
    ranks computed, both in dtype. strict_keys: the directory is our output, so every tensor
    transformers expects must be there and none other."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from megatron_rlvr.families import read_hf_config

    hf_logging.disable_progress_bar()  # ours are per layer; its per-tensor bar adds nothing
    # the config as the learner reads it (kimi_k2 as deepseek_v3)
    model, info = AutoModelForCausalLM.from_pretrained(
        hf_dir, config=read_hf_config(hf_dir), dtype=getattr(torch, dtype), output_loading_info=True
    )
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if strict_keys and info.get(kind):
            raise ConvertError(
                f"transformers loads {hf_dir} with {kind.replace('_', ' ')}: {sorted(map(str, info[kind]))[0]}"
            )
    with torch.no_grad():
        reference = model(torch.tensor(tokens)).logits.float()
    ours = torch.load(workdir / "logits.pt")
    diff = (ours - reference).abs().max().item()
    tolerance = LOGIT_TOLERANCE[dtype] * max(1.0, reference.abs().max().item())
    if not diff <= tolerance:  # NaN fails too
        raise ConvertError(
            f"verify: logits differ from HF transformers by up to {diff:.3g} (tolerance {tolerance:.3g})"
        )
    return {"max_logit_diff": diff, "logit_tolerance": tolerance, "probe_tokens": PROBE_SHAPE}


def _require_bitwise(figures: dict) -> None:
    if figures["bitwise_equal"] != figures["tensors"]:
        raise ConvertError(
            f"verify: {figures['tensors'] - figures['bitwise_equal']} of "
            f"{figures['tensors']} tensors changed, first {figures['first_unequal']}"
        )


def hf_to_mcore(
    hf: str | Path,
    out: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    dtype: str | None = None,
    verify: bool = True,
    device: str | None = None,
    stop: StopSignals | None = None,
) -> dict:
    """HF checkpoint → Megatron dist checkpoint (loadable in any layout), with the HF config
    and tokenizer files under out/hf. Returns the verify figures."""
    from megatron_rlvr.convert.hf_files import copy_side_files
    from megatron_rlvr.convert.launch import resolve_layout, run_ranks

    hf, out = Path(hf).resolve(), Path(out).resolve()
    hf_config = _read_config(hf, "--hf")
    target = target_dtype(hf, dtype)
    parallel = resolve_layout(hf, _layout(tp, pp, ep, etp), _device(device))
    tokens = _probe_tokens(hf_config.vocab_size)
    with _output(out) as workdir:
        job = {
            "command": "hf-to-mcore",
            "hf": str(hf),
            "out": str(out),
            "dtype": target,
            "verify": verify,
            "tokens": tokens,
        }
        figures = run_ranks(job, parallel, workdir, stop=stop)[0]
        if verify:
            _require_bitwise(figures)
            figures["compared_as"] = target  # the source cast to the checkpoint's dtype
            figures.update(_compare_logits(workdir, hf, tokens, target, strict_keys=False))
        copy_side_files(hf, out / "hf")
        layout = parallel.model_dump(include={"tp", "pp", "ep", "etp", "dp"})
        record = {"source": str(hf), "dtype": target, "layout": layout, "verify": figures}
        (out / CONVERT_JSON).write_text(json.dumps(record, indent=2) + "\n")
    return figures


def mcore_to_hf(
    ckpt: str | Path,
    out: str | Path,
    *,
    hf_config: str | Path | None = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    dtype: str | None = None,
    verify: bool = True,
    device: str | None = None,
    max_shard_mb: float = 5000.0,
    stop: StopSignals | None = None,
) -> dict:
    """Megatron checkpoint (a converted one, or a learner checkpoint with --hf-config: a run's
    checkpoint folder, which means its latest complete step, or a step folder) → HF
    safetensors shards with their index, config and tokenizer files, in dtype (--dtype
    spelling; default: the checkpoint's, the dtype holding most of its elements). Returns the
    verify figures; a checkpoint converted from HF whose source is still there is also compared
    with it tensor by tensor: the source cast to the checkpoint's dtype, then to the output's."""
    from megatron_rlvr.convert.hf_files import copy_side_files
    from megatron_rlvr.convert.launch import resolve_layout, run_ranks

    ckpt, out = learner_checkpoint(Path(ckpt).resolve(), "--ckpt"), Path(out).resolve()
    stored = ckpt / "hf"
    if hf_config is not None:
        config_dir = Path(hf_config).resolve()
        config = _read_config(config_dir, "--hf-config")
        if stored.is_dir():
            compare_configs(
                config, _read_config(stored, "checkpoint"), f"--hf-config {config_dir}", f"checkpoint {ckpt}"
            )
    elif stored.is_dir():
        config_dir, config = stored, _read_config(stored, "checkpoint")
    else:
        raise ConvertError(
            f"--ckpt {ckpt} carries no HF config (not written by convert hf-to-mcore): pass --hf-config DIR"
        )
    parallel = resolve_layout(config_dir, _layout(tp, pp, ep, etp), _device(device))
    tokens = _probe_tokens(config.vocab_size)
    with _output(out) as workdir:
        job = {
            "command": "mcore-to-hf",
            "ckpt": str(ckpt),
            "hf_config": str(config_dir),
            "out": str(out),
            "verify": verify,
            "tokens": tokens,
            "dtype": DTYPES[dtype] if dtype else None,
            "max_shard_bytes": int(max_shard_mb * 2**20),
        }
        figures = run_ranks(job, parallel, workdir, stop=stop)[0]
        copy_side_files(config_dir, out, dtype=figures["dtype"])
        if verify:
            figures.update(_compare_logits(workdir, out, tokens, figures["dtype"], strict_keys=True))
            figures.update(
                _round_trip(ckpt, out, figures["checkpoint_dtype"], figures["dtype"], config.tie_word_embeddings)
            )
    return figures


class _CastReader:
    """An HF reader whose tensors come cast to dtype: what a checkpoint in that dtype holds
    of them."""

    def __init__(self, reader, dtype):
        self.reader, self.dtype = reader, dtype

    def names(self) -> set[str]:
        return self.reader.names()

    def get(self, name: str):
        return self.reader.get(name).to(self.dtype)


def _round_trip(ckpt: Path, out: Path, stored: str, written: str, tied: bool) -> dict:
    """For a checkpoint written by hf-to-mcore: every tensor of the output against its source
    cast to the checkpoint's dtype (stored), then to the output's (written)."""
    import torch

    from megatron_rlvr.convert.hf_files import compare_bitwise
    from megatron_rlvr.learner.model import HFReader

    record = ckpt / CONVERT_JSON
    source = Path(json.loads(record.read_text())["source"]) if record.is_file() else None
    if source is None or not any(source.glob("*.safetensors")):
        return {"round_trip": "no HF source recorded or found: tensors not compared"}
    produced = HFReader(out)
    figures = compare_bitwise(
        ((n, produced.get(n)) for n in sorted(produced.names())),
        _CastReader(HFReader(source), getattr(torch, stored)),
        getattr(torch, written),
        tied=tied,
        label=str(source),
    )
    _require_bitwise(figures)
    compared_as = stored if stored == written else f"{stored}, then {written}"
    return {**figures, "round_trip": str(source), "compared_as": compared_as}


# ----------------------------------------------------------------------------- command line
def add_parser(sub) -> None:
    """The `convert` subcommand and its two directions."""
    convert = sub.add_parser("convert", help="HF <-> Megatron checkpoints through mbridge, any layout, verified")
    directions = convert.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_mcore = directions.add_parser("hf-to-mcore", help="HF checkpoint -> Megatron dist checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF checkpoint directory")
    to_mcore.add_argument("--out", required=True, help="new directory for the Megatron checkpoint")
    to_mcore.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="weights dtype; default: config.json's, refused if that would round a tensor",
    )
    to_hf = directions.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors")
    to_hf.add_argument(
        "--ckpt",
        required=True,
        help="Megatron checkpoint: a converted one, or a run's "
        "checkpoint/ folder (its latest complete step) or one of its step_NNNNNN/ folders",
    )
    to_hf.add_argument("--out", required=True, help="new directory for the HF checkpoint")
    to_hf.add_argument("--hf-config", help="HF config and tokenizer directory; default: the checkpoint's own")
    to_hf.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="weights dtype; default: the checkpoint's (the dtype holding most of its elements)",
    )
    to_hf.add_argument("--max-shard-mb", type=float, default=5000.0, help="largest safetensors file")
    for parser in (to_mcore, to_hf):
        for flag, meaning in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert")):
            parser.add_argument(f"--{flag}", type=int, default=1, help=f"{meaning}-parallel ranks")
        parser.add_argument("--etp", type=int, help="expert tensor-parallel ranks; default: --tp")
        parser.add_argument(
            "--device", choices=["cpu", "cuda"], help="default: cuda when available with transformer-engine"
        )
        parser.add_argument(
            "--verify",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="compare logits with HF transformers and tensors bitwise (default: on)",
        )


def describe(figures: dict) -> list[str]:
    """The verify figures as lines for people."""
    lines = []
    if "tensors" in figures:
        compared_as = f" in {figures['compared_as']}" if "compared_as" in figures else ""
        lines.append(
            f"verify: {figures['bitwise_equal']}/{figures['tensors']} tensors bitwise equal "
            f"to the source{compared_as} ({figures.get('round_trip', 'after reloading the saved checkpoint')})"
        )
    elif "round_trip" in figures:
        lines.append(f"verify: {figures['round_trip']}")
    if "max_logit_diff" in figures:
        tokens = "x".join(map(str, figures["probe_tokens"]))
        lines.append(
            f"verify: max |logit diff| vs HF transformers {figures['max_logit_diff']:.3g} "
            f"over {tokens} tokens (tolerance {figures['logit_tolerance']:.3g})"
        )
    return lines


def main(args: argparse.Namespace, stop: StopSignals | None = None) -> int:
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, verify=args.verify, device=args.device, stop=stop)
    try:
        if args.direction == "hf-to-mcore":
            figures = hf_to_mcore(args.hf, args.out, dtype=args.dtype, **layout)
        else:
            figures = mcore_to_hf(
                args.ckpt,
                args.out,
                hf_config=args.hf_config,
                dtype=args.dtype,
                max_shard_mb=args.max_shard_mb,
                **layout,
            )
    except StopRequested as err:
        print(f"megatron-rlvr convert: {err}; every rank was stopped and no output was left", file=sys.stderr)
        return 130
    print(f"{args.direction}: wrote {args.out}")
    for line in describe(figures):
        print(line)
    return 0
