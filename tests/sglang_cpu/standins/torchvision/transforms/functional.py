"""torchvision.transforms.functional stand-in (see torchvision/__init__.py)."""

from .._standin import InterpolationMode, module_getattr  # noqa: F401

__getattr__ = module_getattr(__name__)
