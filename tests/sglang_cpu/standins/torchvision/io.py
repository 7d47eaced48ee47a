"""torchvision.io stand-in (see torchvision/__init__.py): every name is a placeholder."""

from ._standin import module_getattr

__getattr__ = module_getattr(__name__)
