"""What a colocated learner sets aside while the engines generate on its devices: the
optimizer's states (Adam's moments, and the fp32 master copies of a bf16 model) and the
gradient buffers. The model's own weights stay: the probe and the next hand-over read them.

On CUDA the optimizer's tensors move to CPU memory and the gradient buffers' storage is freed
(Megatron-Core's own offload_grad_buffers: every view stays valid, the storage comes back
zeroed); on CPU there is nothing to free, and the bytes are counted alone, so the step's
metrics say what a GPU run would move."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class LearnerOffload:
    def __init__(self, learner):
        self.learner = learner
        self.offloaded = False
        self.on_cuda = learner.cfg.parallel.device == "cuda"

    def _optimizer_tensors(self) -> Iterator[tuple[dict | None, object, torch.Tensor]]:
        """(state dict, key, tensor) for every optimizer state tensor, and (None, None, tensor)
        for every master copy (a parameter the optimizer steps that is not the model's own: a
        fp32 model's optimizer steps the model's parameters, which stay). A master copy moves
        by its .data, keeping its identity, which the optimizer's state is keyed by."""
        model_params = {id(p) for chunk in self.learner.chunks for p in chunk.parameters()}
        optimizer = self.learner.optimizer
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            torch_optimizer = inner.optimizer
            for state in torch_optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        yield state, key, value
            for group in torch_optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in model_params:
                        yield None, None, param

    def _grad_buffers(self) -> list:
        return [b for chunk in self.learner.chunks for b in chunk.buffers + chunk.expert_parallel_buffers]

    def offload(self) -> dict[str, float]:
        """Sets aside the optimizer's tensors and the gradient buffers; returns the bytes of each."""
        if self.offloaded:
            return {}
        optimizer_bytes = grad_bytes = 0
        for container, key, tensor in self._optimizer_tensors():
            optimizer_bytes += tensor.numel() * tensor.element_size()
            if self.on_cuda and tensor.is_cuda:
                _move(container, key, tensor, torch.device("cpu"))
        for buffer in self._grad_buffers():
            if buffer.grad_data is not None:
                grad_bytes += buffer.grad_data.numel() * buffer.grad_data.element_size()
        if self.on_cuda:
            torch.cuda.synchronize()
            for chunk in self.learner.chunks:
                chunk.offload_grad_buffers(synchronize=False, empty_cache=False)
            torch.cuda.empty_cache()
        self.offloaded = True
        return {"colocate/offload_optimizer_bytes": optimizer_bytes, "colocate/offload_grad_bytes": grad_bytes}

    def onload(self) -> None:
        """Brings back what offload() set aside (gradients zeroed, as a step starts them)."""
        if not self.offloaded:
            return
        if self.on_cuda:
            device = torch.device("cuda", torch.cuda.current_device())
            for container, key, tensor in list(self._optimizer_tensors()):
                if not tensor.is_cuda:
                    _move(container, key, tensor, device)
            for chunk in self.learner.chunks:
                chunk.restore_grad_buffers(synchronize=True)
        self.offloaded = False


def _move(state: dict | None, key: object, tensor: torch.Tensor, device: torch.device) -> None:
    if state is None:  # a master copy: the same object, its storage elsewhere
        tensor.data = tensor.data.to(device)
    else:
        state[key] = tensor.to(device)


def memory_snapshot(device: str) -> dict[str, float]:
    """This process's memory now, in MiB: on CUDA what torch allocated and reserved and what
    the whole device has in use (every process on it: the engines' share shows there); on CPU
    the resident set."""
    if device == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {
            "allocated_mb": torch.cuda.memory_allocated() / 2**20,
            "reserved_mb": torch.cuda.memory_reserved() / 2**20,
            "device_used_mb": (total - free) / 2**20,
        }
    with open("/proc/self/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {"learner_rss_mb": rss_kb / 1024}
