"""The ONE place that adapts Megatron-Core to a CPU-only torch (gloo instead of NCCL).

Megatron-Core assumes CUDA in a handful of places (measured on 0.16.1; see
shared/notes/megatron-on-cpu.md). Each adaptation below says what it fixes and when it can
go. `apply()` is called explicitly, once, by the learner when `parallel.device == "cpu"`;
it refuses any other megatron-core version, since these adaptations target exact code.
`apply_local_spec_on_cuda()` applies only the local spec's fixes (3-7), for a CUDA run without
transformer-engine that MEGATRON_RLVR_CUDA_LOCAL_SPEC=1 opts into (a check, not a run mode).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_rlvr.errors import UserError

TESTED_MEGATRON_CORE = "0.16.1"
log = logging.getLogger(__name__)

_state: dict[str, Any] = {"applied": False}  # the mode must outlive apply(); one per process


class CpuCompatError(UserError, RuntimeError):
    pass


# ---------------------------------------------------------------------------- 1. RNG tracker
class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker keeps named CUDA generator states (for dropout in
    tensor-parallel regions); this keeps the same named states on the CPU generator.
    Remove when Megatron-Core's tracker supports a CPU device."""

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


def _install_rng_tracker() -> None:
    """Also the "device" RNG state that activation recompute saves and restores around each
    recomputed layer: on CPU the CPU generator already is (and is restored separately)."""
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: None


# ---------------------------------------------------------------------------- 2. cuda → cpu
def _to_cpu_device(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, int) and not isinstance(value, bool):
        return "cpu"  # a bare device index means a CUDA device
    return value


_SPECIAL = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to, torch.device})


class CudaToCpuMode(TorchFunctionMode):
    """Redirects every CUDA placement (device="cuda"/index kwargs, .cuda(), .to("cuda"),
    torch.device("cuda")) to the CPU, and makes `grad.type()` report the CUDA type that clip_grads.py asserts on.
    Patching the ~175 call sites one by one is impractical; this costs ~1 µs per op.
    Remove when Megatron-Core takes a device argument throughout."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not kwargs and func not in _SPECIAL:  # the hot path: most ops place nothing
            return func(*args)
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device:  # `with torch.device(torch.cuda.current_device()):` (YaRN rotary)
            return torch.device(_to_cpu_device(args[0])) if args else func(**kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def _patch_autograd_backward() -> None:
    """Function modes are thread-local state that the autograd engine does not carry into
    the backward of Python-defined Functions, where Megatron allocates with
    device=torch.cuda.current_device() (e.g. the MoE all-to-all). Run those under the mode too."""
    from torch.autograd import function as autograd_function

    original = autograd_function.BackwardCFunction.apply

    def apply_on_cpu(self, *args):
        with CudaToCpuMode():
            return original(self, *args)

    autograd_function.BackwardCFunction.apply = apply_on_cpu


class _NoOpStream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass

    def wait_event(self, *args) -> None:
        pass

    def record_event(self, *args):
        return _NoOpStream()

    def synchronize(self) -> None:
        pass

    def record(self, *args) -> None:
        pass

    def query(self) -> bool:
        return True


def _patch_cuda_runtime() -> None:
    """Streams, events and device queries as no-ops: on CPU every op is synchronous. And no
    CUDA at all, as on a machine without GPUs: on one with GPUs, torch.compile (Megatron's fused
    router functions) asks whether CUDA is available, then for the properties of device 0 of the
    zero devices reported here (IndexError, seen on the first GPU run), and would otherwise
    touch the real GPU (its RNG state) from a CPU run."""
    torch.cuda.is_available = lambda: False
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 0
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = _NoOpStream
    torch.cuda.Event = _NoOpStream
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()
    torch.cuda.default_stream = lambda *a, **k: _NoOpStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None
    torch.Tensor.record_stream = lambda self, stream: None


# ---------------------------------------------------------------------------- 3-5. MoE, norm
def _patch_moe_utils() -> None:
    """moe_utils references transformer-engine's fused kernels by name; without TE they are
    undefined and every MoE forward raises NameError. Define them as None (the unfused
    paths check for None). And its maybe_move_tensor_to_cpu only converts CUDA tensors, so on
    CPU the all-to-all split sizes stay tensors and EP>1 fails: convert always."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)

    def move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor):
            tensor = tensor.detach().to("cpu")
            return tensor.numpy() if as_numpy else tensor
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = move_to_host
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host


def _patch_torch_norm() -> None:
    """WrappedTorchNorm asserts `not sequence_parallel`, so MoE + TP (which requires SP)
    cannot train without TE/apex. Under SP the norm is applied to each rank's sequence shard
    independently, which is exactly a plain norm; only its weight gradient must be summed over
    TP, which finalize_model_grads does for params marked `sequence_parallel`."""
    import dataclasses

    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, *args, **kwargs)
        plain = dataclasses.replace(config, sequence_parallel=False)
        norm = original_new(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


# ---------------------------------------------------------------------------- 7. MLA, local spec
def _patch_mla_local_attention() -> None:
    """Multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight) builds its core attention with
    separate key and value head sizes (k_channels = nope + rope dims, v_channels = v_head_dim);
    the local DotProductAttention takes neither and sizes its output by kv_channels. Accept them
    and size the output by the value heads; the math is already per-head-size agnostic (MLA
    passes its own softmax scale). Without transformer-engine, the MLA module still sees
    HAVE_TE true (megatron's TE extension imports against a stand-in) and calls isinstance with
    a non-type TELinear: tell it there is no TE. Remove when the local DotProductAttention takes
    k/v channels and the TE check looks at the real package."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    multi_latent_attention.HAVE_TE = False
    original_init = DotProductAttention.__init__

    def init(self, *args, k_channels=None, v_channels=None, **kwargs):
        original_init(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    DotProductAttention.__init__ = init


# ---------------------------------------------------------------------------- 6. optimizer load
def _patch_distributed_optimizer_load() -> None:
    """Without TE/apex the distributed optimizer falls back to torch Adam, whose state holds a
    per-parameter `step` tensor. Two load bugs follow: (a) load_state_dict gives every
    parameter the SAME step tensor, which torch Adam then increments once per parameter, so
    bias correction drifts after a resume: give each its own copy; (b) the fully-reshardable
    load skips `step` in what it reads but copies every state key, raising KeyError('step'):
    keep the live (just restored) step. Remove when upstream handles torch Adam's step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


# ---------------------------------------------------------------------------- 7. expert bias
def _patch_expert_bias_add() -> None:
    """Experts with biases (gpt-oss) on the local spec: MLP.forward adds the fc2 bias, times
    the routing prob, with `output +=` onto linear_fc2's output. Without expert or tensor
    parallelism that output is the TP all-reduce Function's input returned as is, a view
    autograd forbids modifying in place, so the backward fails. Hand MLP a copy there. Remove
    when Megatron-Core adds the expert bias out of place (0.16.1 does not)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    original_forward = RowParallelLinear.forward

    def forward(self, input_):
        output, bias = original_forward(self, input_)
        if self.is_expert and bias is not None and not self.explicit_expert_comm and torch.is_grad_enabled():
            output = output.clone()
        return output, bias

    RowParallelLinear.forward = forward


# ---------------------------------------------------------------------------- entry point
def check_version() -> None:
    import megatron.core

    version = megatron.core.__version__
    if version != TESTED_MEGATRON_CORE:
        raise CpuCompatError(
            f"megatron-core {version} is not the version the CPU adaptations were written for "
            f"({TESTED_MEGATRON_CORE}); install megatron-core=={TESTED_MEGATRON_CORE} or run on CUDA"
        )


def _apply_local_spec_fixes() -> None:
    """The adaptations the local (non-transformer-engine) spec needs on any device: 3-7 above.
    1, 2 and the CUDA runtime no-ops are for the CPU alone."""
    if _state.get("local_spec"):
        return
    _patch_moe_utils()
    _patch_torch_norm()
    _patch_distributed_optimizer_load()
    _patch_mla_local_attention()
    _patch_expert_bias_add()
    _state["local_spec"] = True


def apply_local_spec_on_cuda() -> None:
    """CUDA without transformer-engine, where MEGATRON_RLVR_CUDA_LOCAL_SPEC=1 asks for it (the
    learner refuses it otherwise): the local spec's fixes, no device redirection. For checking
    the CUDA path (NCCL, CUDA RNG states, checkpoints across devices) on a machine that has no
    TE; what runs is not the TE spec that GPU runs use. Idempotent."""
    check_version()
    _apply_local_spec_fixes()
    log.warning("megatron-core %s on CUDA with the local spec (no transformer-engine)", TESTED_MEGATRON_CORE)


def apply() -> None:
    """Adapts Megatron-Core to CPU, once per process. Idempotent. Also on a machine with
    GPUs: parallel.device = cpu means this process computes on the CPU only."""
    if _state["applied"]:
        return
    check_version()
    _install_rng_tracker()
    _patch_cuda_runtime()
    _apply_local_spec_fixes()
    _patch_autograd_backward()
    mode = CudaToCpuMode()
    mode.__enter__()  # stays active for the life of the process, by design
    _state.update(applied=True, mode=mode)
    log.info("megatron-core %s adapted to CPU", TESTED_MEGATRON_CORE)
