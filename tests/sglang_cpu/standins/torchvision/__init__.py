"""Import-only stand-in for `torchvision`, for the CPU SGLang test server only.

Replaces: the real torchvision package. Why: SGLang 0.5.23 imports torchvision at module
level from its multimodal code (e.g. sglang.srt.configs -> nano_nemotron_vl -> internvl_utils
does `import torchvision.transforms as T`), which `sglang.launch_server` loads even for a
text-only model; the only torchvision on PyPI is built against CUDA and would drag in the
CUDA torch stack, while this box runs the CPU build of torch 2.13.0.

What it provides: the submodules SGLang imports (transforms, transforms.functional,
transforms.v2, transforms.v2.functional, io) and a real `InterpolationMode` enum; any other
name is a placeholder that raises NotImplementedError when called (see _standin.py). It is
put on sys.path only inside .venv-sglang (by scripts/setup_sglang_cpu.sh, through
a .pth file); nothing in the project venv sees it.
"""

from ._standin import module_getattr

__version__ = "0.0.0+sglang.cpu.standin"
__getattr__ = module_getattr(__name__)

from . import io, transforms  # noqa: E402,F401  (as the real package does)
