"""torchvision.transforms stand-in (see torchvision/__init__.py): a real InterpolationMode
enum; every other name (Compose, Normalize, Resize, ...) is a placeholder."""

from .._standin import InterpolationMode, module_getattr  # noqa: F401

__getattr__ = module_getattr(__name__)

from . import functional, v2  # noqa: E402,F401
