"""Learner checkpoints with Megatron's dist_checkpointing: model, optimizer, LR schedule, step
and RNG. Tensors are saved by their global (unsharded) coordinates, so a checkpoint saved in
one layout (say TP=2) loads into another (say EP=2). RNG states are per rank and only
restored into the same layout."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlvr.errors import UserError
from megatron_rlvr.learner import ModelChunk

log = logging.getLogger(__name__)
# Layout-independent optimizer state: per-parameter tensors, keys without the chained-optimizer
# prefix (dense and expert optimizers chain differently in different layouts).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _layout() -> list[int]:
    """The parallel layout (pp, tp, ep, etp, dp): per-rank state only fits the same one."""
    from megatron.core import parallel_state as mpu

    return [mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size(),
            mpu.get_expert_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size(),
            mpu.get_data_parallel_world_size()]


def _state(learner, *, loading: bool, with_optimizer: bool, with_rng: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = learner.modules[0].sharded_state_dict()
    state = {"model": model_sd}
    if with_optimizer and loading:
        _allocate_optimizer_state(learner.optimizer)
    if with_optimizer:
        state["optimizer"] = learner.optimizer.sharded_state_dict(
            model_sd, is_loading=loading, metadata=OPTIMIZER_METADATA)
    if with_rng:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        rng = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
        state["rng"] = ShardedObject("rng_state", rng, (dist.get_world_size(),),
                                     (dist.get_rank(),), replica_id=0)
    return state


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
    state = _state(learner, loading=False, with_optimizer=True, with_rng=True)
    state["scheduler"] = learner.scheduler.state_dict()
    state["step"] = learner.step
    state["layout"] = _layout()
    state["optimizer_parts"] = _optimizer_parts(learner.optimizer)
    dist_checkpointing.save(state, str(path))


def _optimizer_parts(optimizer) -> int:
    """How many optimizers Megatron chains (dense, experts): it depends on the layout."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def load_checkpoint(learner, path: str | Path, *, with_optimizer: bool = True) -> int:
    """Restores a checkpoint saved in any layout; returns its step. RNG states come back only
    when the layout is the same (they are per rank)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(path))
    same_layout = list(common.get("layout", [])) == _layout()
    if with_optimizer and common.get("optimizer_parts") != _optimizer_parts(learner.optimizer):
        # Megatron stores chained optimizers' common state by position, so a layout that
        # chains differently (e.g. TP=2 → EP=2 adds an expert optimizer) cannot take it back.
        log.warning("checkpoint %s: optimizer is chained differently in this layout; "
                    "loading weights, LR schedule and step, and starting Adam moments afresh", path)
        with_optimizer = False
        learner.scheduler.load_state_dict(common["scheduler"])
    state = _state(learner, loading=True, with_optimizer=with_optimizer, with_rng=same_layout)
    loaded = dist_checkpointing.load(state, str(path))
    learner.modules[0].load_state_dict(loaded["model"])
    if with_optimizer:
        learner.optimizer.load_state_dict(loaded["optimizer"])
        learner.scheduler.load_state_dict(common["scheduler"])
    else:
        learner.optimizer.reload_model_params()
    if same_layout:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.set_rng_state(loaded["rng"]["torch"])
        get_cuda_rng_tracker().set_states(loaded["rng"]["tracker"])
    else:
        log.info("checkpoint layout %s differs from this one: RNG states not restored",
                 common.get("layout"))
    learner.step = int(common["step"])
    return learner.step


# ----------------------------------------------------------------------------- model only
class ModelCheckpointMismatch(UserError, ValueError):
    """A checkpoint that does not hold this model's tensors, said in one line."""


def save_model(modules: list[ModelChunk], path: str | Path) -> None:
    """Model weights only (what `convert hf-to-mcore` writes), under the keys of a learner
    checkpoint's model, so that load_model reads either kind. Collective."""
    from megatron.core import dist_checkpointing

    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": modules[0].sharded_state_dict()}, str(path))


def load_model(modules: list[ModelChunk], path: str | Path) -> None:
    """Loads the model weights of a model-only or learner checkpoint saved in any layout.
    Megatron would load a checkpoint with a tensor too many (an untied lm_head under a tied
    config) without a word, so the tensor set and shapes are checked first. Collective."""
    from megatron.core import dist_checkpointing

    state = modules[0].sharded_state_dict()
    check_model_tensors(state, dist_checkpointing.load_tensors_metadata(str(path)), path)
    loaded = dist_checkpointing.load({"model": state}, str(path))
    modules[0].load_state_dict(loaded["model"])


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
    theirs = {key: tuple(t.global_shape) for key, t in metadata.items()
              if not key.startswith("optimizer.")}
    for key, shape in ours.items():
        if key not in theirs:
            raise ModelCheckpointMismatch(f"checkpoint {path} lacks tensor {key} {list(shape)}")
        if theirs[key] != shape:
            raise ModelCheckpointMismatch(
                f"tensor {key} is {list(theirs[key])} in checkpoint {path} but {list(shape)} "
                "in this model (a different config: layers, heads, experts, vocab, sizes)")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(ours))
    extra = sorted(set(theirs).difference(*everyone))
    if extra:
        raise ModelCheckpointMismatch(
            f"checkpoint {path} holds tensor {extra[0]} {list(theirs[extra[0]])} that this model "
            "lacks (a different config, e.g. tie_word_embeddings)")
