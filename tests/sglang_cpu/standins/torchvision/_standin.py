"""Shared machinery of the import-only `torchvision` stand-in (see torchvision/__init__.py).

Every name that is not defined explicitly resolves, lazily, to a `_Missing` placeholder: it
can be imported, have attributes looked up, be put in dicts and used as a base class or a
default argument (all things SGLang's multimodal modules do at import time), but calling it
raises NotImplementedError naming what was called. So an image/video code path reached on
this CPU test box fails loudly instead of computing something wrong.
"""

from __future__ import annotations

import enum

_WHY = (
    "is not available: torchvision here is an import-only stand-in "
    "(tests/sglang_cpu/standins/torchvision) because the PyPI torchvision wheel is a CUDA build; "
    "the CPU SGLang test server serves text models only"
)


class _Missing:
    def __init__(self, name: str):
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} {_WHY}")

    def __mro_entries__(self, bases):
        # `class X(torchvision.transforms.Foo): ...` at import time: subclass a class whose
        # instances fail on construction instead.
        name = self._name

        class _MissingBase:
            def __init__(self, *args, **kwargs):
                raise NotImplementedError(f"{name} {_WHY}")

        _MissingBase.__qualname__ = _MissingBase.__name__ = name.rsplit(".", 1)[-1]
        return (_MissingBase,)

    def __repr__(self):
        return f"<torchvision stand-in placeholder {self._name}>"


class InterpolationMode(enum.Enum):
    """Same members and values as torchvision.transforms.InterpolationMode."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def module_getattr(module_name: str):
    """A module-level __getattr__ (PEP 562) that hands out placeholders."""

    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        return _Missing(f"{module_name}.{attr}")

    return __getattr__
