"""Process-group setup for the learner: one entry point for torchrun-style environments and
for Ray actors (which pass rank, world size and the rendezvous address explicitly)."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlvr.config import ResolvedParallel
from megatron_rlvr.errors import UserError


def device() -> torch.device:
    """This rank's device, as `parallel.device` chose it in init_parallel: its CUDA device
    under NCCL, else the CPU (also on a machine that has GPUs: a CPU run never touches them)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MissingTransformerEngine(UserError, RuntimeError):
    pass


CUDA_LOCAL_SPEC = "MEGATRON_RLVR_CUDA_LOCAL_SPEC"


def require_transformer_engine() -> None:
    """parallel.device = cuda builds Megatron's transformer-engine layer spec; the local spec
    on CUDA needs the adaptations learner/cpu_compat.py makes for the local spec (plain norms
    under sequence parallelism, the fused MoE kernels' names), so CUDA without TE is refused,
    unless MEGATRON_RLVR_CUDA_LOCAL_SPEC=1 asks for the local spec with those adaptations:
    for checking the CUDA path on a GPU machine without TE (scripts/gpu_check.py), not for runs."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError as err:
        if os.environ.get(CUDA_LOCAL_SPEC) == "1":
            from megatron_rlvr.learner import cpu_compat

            cpu_compat.apply_local_spec_on_cuda()
            return
        raise MissingTransformerEngine(
            f"parallel.device = cuda needs transformer-engine ({err}): install the GPU environment "
            "(bash scripts/setup.sh --gpu, the [gpu] extra) or set parallel.device = cpu"
        ) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on host, for a local rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Rendezvous:
        """torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)."""
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", 29500)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )


def init_parallel(
    parallel: ResolvedParallel, rendezvous: Rendezvous | None = None, seed: int = 0, timeout_s: float = 600.0
) -> None:
    """Initialises torch.distributed (gloo on CPU, NCCL on CUDA) and Megatron's model-parallel
    groups for the resolved layout. CPU runs get the CPU adaptations first."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rv = rendezvous or Rendezvous.from_env()
    expected = parallel.tp * parallel.pp * parallel.dp
    if rv.world_size != expected:
        raise ValueError(
            f"world size {rv.world_size} != parallel.tp · pp · dp = {parallel.tp}·{parallel.pp}·"
            f"{parallel.dp} = {expected}"
        )
    if parallel.device == "cpu":
        from megatron_rlvr.learner import cpu_compat

        cpu_compat.apply()
        backend = "gloo"
    else:
        require_transformer_engine()
        torch.cuda.set_device(rv.local_rank)
        backend = "nccl"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{rv.master_addr}:{rv.master_port}",
            rank=rv.rank,
            world_size=rv.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tears down Megatron's groups and the default group (tests run many layouts)."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
