"""Values a solution's code returns, carried out of the sandbox as plain data.

A verdict compares what the code computed with what the test expects, and that comparison
must not run where the code ran: an `int` subclass whose `__eq__` always says True, or code
that rewrites `operator.eq`, would win it. So the sandbox sends back only values of exact
built-in types (`type(v) is int`, not `isinstance`), encoded as tagged JSON, and the judge
rebuilds them here as fresh built-in objects; anything else is "not a value".
"""

from __future__ import annotations

import math
import types
from typing import Any

MAX_DEPTH = 64
_SMALL_INT = 2**53
# one-shot iterators of the built-in kinds (a generator, map(), zip(), iter(list), ...): read out
# where they were made and rebuilt as an iterator over the same items
# (kinds are told apart by identity: a metaclass's __eq__ can make a class "equal" to any other)
_EMPTY: tuple[Any, ...] = ([], (), set(), "", b"", range(0), {}, {}.values(), {}.items())
_ITERATORS = frozenset(
    [id(kind) for kind in (types.GeneratorType, map, filter, zip, enumerate, reversed)]
    + [id(type(iter(empty))) for empty in _EMPTY]
    + [id(type(reversed(empty))) for empty in _EMPTY[:1] + _EMPTY[5:7]]
)


class NotAValue(ValueError):
    """The code returned something that is not plain data (a subclass, a custom object)."""


def encode_value(value: Any, depth: int = 0) -> Any:
    """value → JSON-able tree; raises NotAValue for any type but the exact built-ins."""
    if depth > MAX_DEPTH:
        raise NotAValue(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -_SMALL_INT < value < _SMALL_INT else {"int": hex(value)}  # no decimal digit limit
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [encode_value(item, depth + 1) for item in value]
    if kind is tuple or kind is set or kind is frozenset:
        items = [encode_value(item, depth + 1) for item in value]
        return {kind.__name__: items}
    if kind is dict:
        return {"dict": [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [encode_value(value.real), encode_value(value.imag)]}
    if kind is range:
        return {"range": [value.start, value.stop, value.step]}
    if id(kind) in _ITERATORS:
        return {"iter": [encode_value(item, depth + 1) for item in value]}
    for base in (bool, int, float, str, list, tuple, dict, set, frozenset, bytes, complex):
        if isinstance(value, base):
            raise NotAValue(f"a {kind.__name__} (a {base.__name__} subclass)")
    raise NotAValue(f"a {kind.__name__} object")


def decode_value(tree: Any, depth: int = 0) -> Any:
    """An encoded tree → fresh built-in objects; raises ValueError on anything else."""
    if depth > MAX_DEPTH + 1:
        raise ValueError("nested too deep")
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if type(tree) is list:
        return [decode_value(item, depth + 1) for item in tree]
    if type(tree) is not dict or len(tree) != 1:
        raise ValueError(f"not an encoded value: {type(tree).__name__}")
    ((tag, body),) = tree.items()
    if tag == "int" and type(body) is str:
        return int(body, 16)
    if tag == "float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "bytes" and type(body) is str:
        return bytes.fromhex(body)
    if tag == "complex" and type(body) is list and len(body) == 2:
        return complex(float(decode_value(body[0])), float(decode_value(body[1])))
    if type(body) is not list:
        raise ValueError(f"not an encoded value: tag {tag!r}")
    if tag == "range" and len(body) == 3 and all(type(n) is int for n in body):
        return range(*body)
    if tag == "iter":
        return iter([decode_value(item, depth + 1) for item in body])
    if tag == "tuple":
        return tuple(decode_value(item, depth + 1) for item in body)
    if tag in ("set", "frozenset"):
        items = [decode_value(item, depth + 1) for item in body]
        return set(items) if tag == "set" else frozenset(items)
    if tag == "dict" and all(type(pair) is list and len(pair) == 2 for pair in body):
        return {decode_value(k, depth + 1): decode_value(v, depth + 1) for k, v in body}
    raise ValueError(f"not an encoded value: tag {tag!r}")


class ValueFailed(Exception):
    """Raised where the judge reads a value whose call raised in the sandbox; `outcome` is the
    sandbox's report of it (data: the parent checks its status)."""

    def __init__(self, outcome: Any):
        super().__init__("the call under test failed")
        self.outcome = outcome if isinstance(outcome, dict) else {"status": "crashed"}


class RecordedValues:
    """`_rlvr_value(i)` in a judge program: the i-th value a solution's calls returned, rebuilt
    as fresh built-in objects at each read, or what the call raised, raised at that read (so a
    call the test would not have reached decides nothing)."""

    def __init__(self, values: Any, raised: Any):
        if type(values) is not list or type(raised) is not list:
            raise ValueError("not a report of values")
        self.values = values
        self.raised = {
            pair[0]: pair[1] for pair in raised if type(pair) is list and len(pair) == 2 and type(pair[0]) is int
        }

    def __call__(self, index: int) -> Any:
        if index in self.raised:
            raise ValueFailed(self.raised[index])
        return decode_value(self.values[index])
