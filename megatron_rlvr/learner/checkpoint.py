"""Learner checkpoints with Megatron's dist_checkpointing: model, optimizer, LR schedule, step
and RNG. Tensors are saved by their global (unsharded) coordinates, so a checkpoint saved in
one layout (say TP=2) loads into another (say EP=2), and on either layer spec (CPU or GPU).
RNG states (CPU, CUDA, Megatron's tracker) are per rank and only restored into the same
layout on the same device type."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlvr.errors import UserError
from megatron_rlvr.learner import ModelChunk
from megatron_rlvr.run_dir import CheckpointError, kill_amid_writes

log = logging.getLogger(__name__)
# Layout-independent optimizer state: per-parameter tensors, keys without the chained-optimizer
# prefix (dense and expert optimizers chain differently in different layouts).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _layout() -> list[int]:
    """The parallel layout (pp, tp, ep, etp, dp): per-rank state only fits the same one."""
    from megatron.core import parallel_state as mpu

    return [
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_expert_model_parallel_world_size(),
        mpu.get_expert_tensor_parallel_world_size(),
        mpu.get_data_parallel_world_size(),
    ]


def _state(
    learner, *, loading: bool, with_optimizer: bool, with_rng: bool, path: str | Path | None = None
) -> tuple[dict, dict]:
    """The sharded state to save or load, and (loading: the checkpoint's path given) the model
    entries the checkpoint lacks that keep their current value (see fit_to_checkpoint)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = model_state(learner.modules[0])
    kept = fit_to_checkpoint(learner.modules[0], model_sd, path) if path is not None else {}
    state = {"model": model_sd}
    if with_optimizer and loading:
        _allocate_optimizer_state(learner.optimizer)
    if with_optimizer:
        state["optimizer"] = learner.optimizer.sharded_state_dict(
            model_sd, is_loading=loading, metadata=OPTIMIZER_METADATA
        )
    if with_rng:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        rng = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
        if _device() == "cuda":  # the default CUDA generator, beside the tracker's named ones
            rng["cuda"] = torch.cuda.get_rng_state()
        state["rng"] = ShardedObject("rng_state", rng, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)
    return state, kept


def _device() -> str:
    """Where this learner computes. RNG states are per device type: the CPU tracker's are
    Mersenne-Twister states, CUDA's Philox ones, so they only go back on the same type."""
    from megatron_rlvr.learner.parallel import device

    return device().type


def _allocate_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no state until its first step, and the distributed optimizer
    cannot describe (or receive) state it does not have: allocate it with Megatron's own
    zero-gradient dummy step, which the load then overwrites."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def save_checkpoint(learner, path: str | Path) -> None:
    """Collective: every learner rank calls it with the same path."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state, _ = _state(learner, loading=False, with_optimizer=True, with_rng=True)
    state["scheduler"] = learner.scheduler.state_dict()
    state["step"] = learner.step
    state["layout"] = _layout()
    state["device"] = _device()
    state["optimizer_parts"] = _optimizer_parts(learner.optimizer)
    kill_amid_writes(path, learner.step)  # the crash test's hook; nothing unless asked for
    dist_checkpointing.save(state, str(path))


def _optimizer_parts(optimizer) -> int:
    """How many optimizers Megatron chains (dense, experts): it depends on the layout."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


@contextlib.contextmanager
def _reading(path: str | Path):
    """A checkpoint whose files cannot be read (cut short, mixed, not a checkpoint) is a
    CheckpointError in one line, not the reader's traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        said = str(err).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}{': ' + said[0][:200] if said else ''})"
        ) from err


def load_checkpoint(learner, path: str | Path, *, with_optimizer: bool = True) -> int:
    """Restores a checkpoint saved in any layout; returns its step. RNG states come back only
    when the layout is the same (they are per rank)."""
    with _reading(path):
        return _load_checkpoint(learner, path, with_optimizer=with_optimizer)


def _load_checkpoint(learner, path: str | Path, *, with_optimizer: bool) -> int:
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(path))
    same_layout = list(common.get("layout", [])) == _layout()
    same_rng = same_layout and common.get("device", "cpu") == _device()  # older ones: CPU-made
    if with_optimizer and common.get("optimizer_parts") != _optimizer_parts(learner.optimizer):
        # Megatron stores chained optimizers' common state by position, so a layout that
        # chains differently (e.g. TP=2 → EP=2 adds an expert optimizer) cannot take it back.
        log.warning(
            "checkpoint %s: optimizer is chained differently in this layout; "
            "loading weights, LR schedule and step, and starting Adam moments afresh",
            path,
        )
        with_optimizer = False
        learner.scheduler.load_state_dict(common["scheduler"])
    state, kept = _state(learner, loading=True, with_optimizer=with_optimizer, with_rng=same_rng, path=path)
    loaded = dist_checkpointing.load(state, str(path))
    learner.modules[0].load_state_dict({**loaded["model"], **kept})
    if with_optimizer:
        learner.optimizer.load_state_dict(loaded["optimizer"])
        learner.scheduler.load_state_dict(common["scheduler"])
    else:
        learner.optimizer.reload_model_params()
    if same_rng:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.set_rng_state(loaded["rng"]["torch"])
        get_cuda_rng_tracker().set_states(loaded["rng"]["tracker"])
        if "cuda" in loaded["rng"]:
            torch.cuda.set_rng_state(loaded["rng"]["cuda"])
    else:
        log.info(
            "checkpoint made in layout %s on %s, this run is %s on %s: RNG states not restored",
            common.get("layout"),
            common.get("device", "cpu"),
            _layout(),
            _device(),
        )
    learner.step = int(common["step"])
    return learner.step


# ----------------------------------------------------------------------------- spec-independent keys
# (local spec's key fragment, transformer-engine spec's) for the norms TE fuses into the
# linear layer that follows them (TELayerNormColumnParallelLinear's layer_norm_weight)
_DENSE_NORM = ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
_MLA_NORMS = (
    ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),
    ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"),
)


def model_state(module: ModelChunk) -> dict:
    """The model's sharded state dict under the transformer-engine spec's checkpoint keys,
    whichever spec built it, so that a checkpoint (or conversion) made on CPU (local spec)
    loads on GPU (TE spec) and back. Megatron-Core 0.16.1's TE spec fuses a dense layer's
    pre-MLP norm into `mlp.linear_fc1` but keeps an MoE layer's apart as `pre_mlp_layernorm`;
    its MLA spec fuses the q and kv norms (qk_layernorm) into `linear_q_up_proj` and
    `linear_kv_up_proj`. The local spec keys the pre-MLP norm of every layer as
    `mlp.linear_fc1.layer_norm_` (standard attention) or `pre_mlp_layernorm.` (MLA) and keeps
    the MLA norms apart. The input norm (fused into linear_qkv, or apart under MLA) and the
    experts already agree."""
    state = module.sharded_state_dict()
    for name, value in state.items():
        layer, found, _ = name.partition(_DENSE_NORM[0])
        if found:
            te = _DENSE_NORM[0] if f"{layer}mlp.router.weight" in state else _DENSE_NORM[1]
            value.key = value.key.replace(_DENSE_NORM[1], _DENSE_NORM[0]).replace(_DENSE_NORM[0], te)
        for local, te in _MLA_NORMS:  # q_layernorm is standard attention's qk norm too
            layer, found, _ = name.partition(local)
            if found and f"{layer}{te.replace('layer_norm_', 'weight')}" in state:
                value.key = value.key.replace(local, te)
    return state


def _local_key(key: str) -> str | None:
    """The key a checkpoint written before keys were made spec-independent (local spec's
    keys) may hold a TE-keyed norm under, None for a tensor whose key never differed."""
    for local, te in (*_MLA_NORMS, _DENSE_NORM):
        if te in key:
            return key.replace(te, local)
    if _DENSE_NORM[0] in key:  # an MoE layer's norm, which the standard local spec remapped
        return key.replace(_DENSE_NORM[0], _DENSE_NORM[1])
    return None


def fit_to_checkpoint(module: ModelChunk, state: dict, path: str | Path) -> dict:
    """Fits a model state (from model_state) to what the checkpoint at `path` holds, in place:
    a norm the checkpoint keeps under the local spec's key (checkpoints written before keys
    were made spec-independent) is read from there; `_extra_state` objects it lacks
    (transformer-engine's FP8 metadata, absent from a local-spec checkpoint) are not requested.
    Returns those entries with their current value, for load_state_dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    held = {value.key for value in load_sharded_metadata(str(path)).values()}
    current, kept = None, {}
    for name, value in list(state.items()):
        if not isinstance(value, (ShardedTensor, ShardedObject)) or value.key in held:
            continue
        legacy = _local_key(value.key)
        if isinstance(value, ShardedTensor) and legacy in held:
            value.key = legacy
        elif isinstance(value, ShardedObject) and name.endswith("._extra_state"):
            current = current if current is not None else module.state_dict()
            kept[name] = current[name]
            del state[name]
    return kept


# ----------------------------------------------------------------------------- model only
class ModelCheckpointMismatch(UserError, ValueError):
    """A checkpoint that does not hold this model's tensors, said in one line."""


def save_model(modules: list[ModelChunk], path: str | Path) -> None:
    """Model weights only (what `convert hf-to-mcore` writes), under the keys of a learner
    checkpoint's model, so that load_model reads either kind. Collective."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": model_state(modules[0])}, str(path))


def load_model(modules: list[ModelChunk], path: str | Path) -> None:
    """Loads the model weights of a model-only or learner checkpoint saved in any layout.
    Megatron would load a checkpoint with a tensor too many (an untied lm_head under a tied
    config) without a word, so the tensor set and shapes are checked first. Collective."""
    from megatron.core import dist_checkpointing

    with _reading(path):
        state = model_state(modules[0])
        kept = fit_to_checkpoint(modules[0], state, path)
        check_model_tensors(state, dist_checkpointing.load_tensors_metadata(str(path)), path)
        loaded = dist_checkpointing.load({"model": state}, str(path))
        modules[0].load_state_dict({**loaded["model"], **kept})


def _global_shapes(state: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint key → global shape of every tensor a model's sharded state dict holds."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    shapes = {}
    for value in state.values():
        built = nested_values(value.build()) if isinstance(value, ShardedTensorFactory) else [value]
        shapes.update({t.key: tuple(t.global_shape) for t in built if isinstance(t, ShardedTensor)})
    return shapes


def check_model_tensors(state: dict, metadata: dict, path: str | Path) -> None:
    """Raises ModelCheckpointMismatch naming the first model tensor the checkpoint lacks,
    holds in another shape, or holds beyond the model (optimizer state aside). Collective:
    what the model lacks is judged on the tensors of all ranks (stages hold different ones)."""
    ours = _global_shapes(state)
    theirs = {key: tuple(t.global_shape) for key, t in metadata.items() if not key.startswith("optimizer.")}
    for key, shape in ours.items():
        if key not in theirs:
            raise ModelCheckpointMismatch(f"checkpoint {path} lacks tensor {key} {list(shape)}")
        if theirs[key] != shape:
            raise ModelCheckpointMismatch(
                f"tensor {key} is {list(theirs[key])} in checkpoint {path} but {list(shape)} "
                "in this model (a different config: layers, heads, experts, vocab, sizes)"
            )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(ours))
    extra = sorted(set(theirs).difference(*everyone))
    if extra:
        raise ModelCheckpointMismatch(
            f"checkpoint {path} holds tensor {extra[0]} {list(theirs[extra[0]])} that this model "
            "lacks (a different config, e.g. tie_word_embeddings)"
        )
