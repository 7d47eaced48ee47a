"""One rank of a conversion (started by convert.launch, one process per rank of the layout).

    python -m megatron_rlvr.convert.worker JOB_JSON      (RANK, WORLD_SIZE, MASTER_* set)

Each rank holds only its shard of the model: it reads its own tensors from the HF files,
and every full tensor of the export passes through one at a time. Rank 0 writes the HF files
and shows the progress bars. Known problems end the rank with {"error": one line} in its
result file and exit code 2; the parent reports the line. Imports stay inside functions:
Megatron's checkpoint writer re-imports this module in a helper process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PORT_TAKEN = 3  # exit code: the rendezvous port was taken meanwhile; the parent retries


def _progress(total: int, desc: str):
    from tqdm import tqdm

    rank0 = int(os.environ.get("RANK", 0)) == 0
    return tqdm(total=total, desc=desc, unit="layer", disable=None if rank0 else True, file=sys.stderr, leave=False)


def _by_layer(pairs, num_layers: int, desc: str):
    """Passes (HF name, tensor) pairs through, advancing a per-layer progress bar."""
    import re

    layer = re.compile(r"\.layers\.(\d+)\.")
    with _progress(num_layers, desc) as bar:
        for name, tensor in pairs:
            match = layer.search(name)
            if match and int(match.group(1)) + 1 > bar.n:
                bar.update(int(match.group(1)) + 1 - bar.n)
            yield name, tensor


def _build(hf_config, device: str, dtype):
    from megatron_rlvr.convert.checks import ConvertError
    from megatron_rlvr.learner.model import build_model_chunks, make_bridge

    try:  # Megatron-Core validates the config (and the layout against it) with ValueErrors
        bridge = make_bridge(hf_config, device=device, dtype=dtype, routing_replay=False)
        return bridge, build_model_chunks(bridge)
    except ValueError as err:
        raise ConvertError(f"Megatron-Core cannot build this model: {err}") from None


def _parts(model) -> tuple:
    """The model as views of its parts: the modules before the layers, each layer, the ones
    after. Each view holds its modules under the names the whole model gives them, so that
    load_hf_weights can take one layer at a time. Every parameter must be in one view."""
    import torch

    def view(top: dict, decoder: dict):
        root, root.decoder = torch.nn.Module(), torch.nn.Module()
        for name, module in top.items():
            root.add_module(name, module)
        for name, module in decoder.items():
            root.decoder.add_module(name, module)
        return root

    head = view({n: m for n, m in model.named_children() if n not in ("decoder", "output_layer")}, {})
    layers = [
        view({}, {"layers": torch.nn.ModuleList([torch.nn.Module()] * i + [layer])})
        for i, layer in enumerate(model.decoder.layers)
    ]
    output = {"output_layer": model.output_layer} if getattr(model, "output_layer", None) else {}
    tail = view(output, {n: m for n, m in model.decoder.named_children() if n != "layers"})
    covered = [id(p) for v in (head, *layers, tail) for p in v.parameters()]
    if sorted(covered) != sorted(id(p) for p in model.parameters()):
        raise RuntimeError("the model has parameters outside its embedding, layers and head")
    return head, layers, tail


def _load_hf(modules, bridge, hf_dir: str) -> None:
    from megatron_rlvr.learner.model import load_hf_weights

    for model in modules:
        head, layers, tail = _parts(model)
        load_hf_weights([head], bridge, hf_dir)
        with _progress(len(layers), f"loading {Path(hf_dir).name}") as bar:
            for layer in layers:
                load_hf_weights([layer], bridge, hf_dir)
                bar.update(1)
        load_hf_weights([tail], bridge, hf_dir)


def _logits(modules, tokens: list, workdir: str) -> None:
    """Full-vocabulary logits of the tokens through the pipeline, gathered over TP, saved by
    one rank of the last stage for the parent to compare with HF transformers."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_rlvr.learner.batch import MicroBatch, TrainBatch
    from megatron_rlvr.learner.forward import run_schedule

    ids = torch.tensor(tokens)
    for model in modules:
        model.eval()

    def collect(mb, output, non_loss_data=True):
        return gather_from_tensor_model_parallel_region(output).float().cpu()

    with torch.no_grad():
        outputs = run_schedule(
            modules,
            [MicroBatch(TrainBatch(ids, torch.zeros(ids.shape)), torch.arange(len(ids)))],
            collect,
            forward_only=True,
            collect=True,
        )
    if mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        torch.save(outputs[0], Path(workdir) / "logits.pt")


def hf_to_mcore(job: dict) -> dict:
    """Loads the HF checkpoint into this rank's shard and saves it as a Megatron dist
    checkpoint. Verify: reload the saved checkpoint into NaN-filled weights, export it and
    compare every tensor with the source bitwise, then compute logits."""
    import torch

    from megatron_rlvr.convert.hf_files import compare_bitwise
    from megatron_rlvr.learner.checkpoint import load_model, save_model
    from megatron_rlvr.learner.model import HFReader, export_hf_weights, read_hf_config

    hf_config = read_hf_config(job["hf"])
    dtype = getattr(torch, job["dtype"])
    bridge, modules = _build(hf_config, job["parallel"]["device"], dtype)
    _load_hf(modules, bridge, job["hf"])
    save_model(modules, job["out"])
    if not job["verify"]:
        return {}
    with torch.no_grad():
        for p in (p for m in modules for p in m.parameters()):
            p.fill_(float("nan"))  # a tensor the reload missed cannot pass the comparison
    load_model(modules, job["out"])
    export = _by_layer(export_hf_weights(modules, bridge), hf_config.num_hidden_layers, "verifying")
    figures = {}
    if int(os.environ["RANK"]) == 0:
        figures = compare_bitwise(
            export, HFReader(job["hf"]), dtype, tied=hf_config.tie_word_embeddings, label=job["hf"]
        )
    else:
        for _ in export:  # collective: every rank takes part in every gather
            pass
    _logits(modules, job["tokens"], job["workdir"])
    return figures


def checkpoint_dtype(ckpt: str):
    """The dtype of a Megatron checkpoint's model weights: the one holding most of their
    elements (a bf16 model keeps its norms in fp32; optimizer state does not count)."""
    import math
    from collections import Counter

    from megatron.core import dist_checkpointing

    metadata = dist_checkpointing.load_tensors_metadata(ckpt)
    elements: Counter[Any] = Counter()  # by torch dtype
    for key, tensor in metadata.items():
        if not key.startswith("optimizer."):
            elements[tensor.dtype] += math.prod(tensor.global_shape)
    return elements.most_common(1)[0][0]


def mcore_to_hf(job: dict) -> dict:
    """Loads the Megatron checkpoint (any layout it was saved in) into a model of the dtype
    asked for (default: the checkpoint's; loading casts) and streams the model out as HF
    safetensors files in that dtype, rank 0 writing; verify computes logits in it, as HF
    transformers will."""
    import torch

    from megatron_rlvr.convert.hf_files import ShardedSafetensors
    from megatron_rlvr.learner.checkpoint import load_model
    from megatron_rlvr.learner.model import export_hf_weights, read_hf_config

    hf_config = read_hf_config(job["hf_config"])
    stored = checkpoint_dtype(job["ckpt"])
    written = getattr(torch, job["dtype"]) if job.get("dtype") else stored
    bridge, modules = _build(hf_config, job["parallel"]["device"], written)
    load_model(modules, job["ckpt"])
    export = _by_layer(export_hf_weights(modules, bridge), hf_config.num_hidden_layers, "writing")
    result: dict[str, Any] = {
        "dtype": str(written).removeprefix("torch."),
        "checkpoint_dtype": str(stored).removeprefix("torch."),
    }
    if int(os.environ["RANK"]) == 0:
        writer = ShardedSafetensors(job["out"], job["max_shard_bytes"])
        for name, tensor in export:
            writer.add(name, tensor.to(written))  # a bf16 model keeps its norms in fp32
        result["files"] = writer.close()
    else:
        for _ in export:
            pass
    if job["verify"]:
        _logits(modules, job["tokens"], job["workdir"])
    return result


def main() -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")  # Megatron and mbridge warn about absent optional kernels
    logging.getLogger("megatron").setLevel(logging.ERROR)
    job = json.loads(Path(sys.argv[1]).read_text())
    result_path = Path(job["workdir"]) / f"rank{os.environ['RANK']}.json"

    from megatron_rlvr.config import ResolvedParallel
    from megatron_rlvr.convert.checks import ConvertError
    from megatron_rlvr.learner.checkpoint import ModelCheckpointMismatch
    from megatron_rlvr.learner.model import CheckpointMismatch
    from megatron_rlvr.learner.parallel import destroy_parallel, init_parallel

    try:
        init_parallel(ResolvedParallel(**job["parallel"]))
    except RuntimeError as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            return PORT_TAKEN
        raise
    command = {"hf-to-mcore": hf_to_mcore, "mcore-to-hf": mcore_to_hf}[job["command"]]
    try:
        result = command(job)
    except (ConvertError, CheckpointMismatch, ModelCheckpointMismatch) as err:
        result_path.write_text(json.dumps({"error": str(err)}))
        return 2
    result_path.write_text(json.dumps(result))
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
