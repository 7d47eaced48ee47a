"""Start-up patch for the CPU SGLang test server (plays the role of a sitecustomize).

Imported at interpreter start in every Python process of .venv-sglang (the API
server and the scheduler/detokenizer subprocesses SGLang spawns) by the `import` line of the
`sglang_cpu_standins.pth` file that scripts/setup_sglang_cpu.sh writes into that venv's
site-packages. Nothing here touches the project venv.

Replaces: the host-buffer allocator SGLang 0.5.23 uses for `--enable-return-routed-experts`.
Why: sglang.srt.state_capturer.base.BaseHostCache allocates the routed-experts host buffer
with `ALLOC_MEMORY_FUNCS[device](..., pin_memory=True)`; for device "cpu" that resolves to
`alloc_with_host_register` (sglang/srt/mem_cache/pool_host/common.py), which pins the buffer
with `torch.cuda.cudart().cudaHostRegister(...)` and fails on a CPU-only torch. On CPU the
"host" buffer is ordinary memory anyway, so `ALLOC_MEMORY_FUNCS["cpu"]` is set to a plain
allocation (same signature, pin_memory ignored). The patch is applied right after that module
is first imported (a meta-path hook), without editing any installed file; it is a no-op for
every other module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.common"


def _alloc_plain_cpu(dims, dtype, device, pin_memory, allocator=None, registration_granularity_bytes=None):
    """alloc_with_host_register without the cudaHostRegister: plain (pageable) memory."""
    del pin_memory, registration_granularity_bytes
    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    import torch

    return torch.empty(dims, dtype=dtype, device=device)


def _patch(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain_cpu


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
