"""A record's instructions, read at load from either layout people keep them in, and checked
there, so that a record the checkers cannot score stops the run before it starts:

- Google's IFEval (google/IFEval): `instruction_id_list` and `kwargs` (one dict per id), as
  columns of the row or as an object in the ground-truth column;
- IF-RLVR (allenai/IF_multi_constraints_upto5 and the IFBench training sets): the ground truth
  is `[{"instruction_id": [...], "kwargs": [...]}]`, as a list, its JSON, or the Python literal
  open-instruct writes (single quotes, None).

Both become {"instruction_id_list": [...], "kwargs": [...]}, the record's answer. Refused: an
id the library does not have; an argument its checker does not take; a missing argument that
the checker would draw at random (IFEval's checkers invent missing arguments, so two runs would
score against different instructions) or leave None; Tulu 3's `func_name` ground truth (RLVR-IFeval), whose
25 functions are open-instruct's own code with their own verdicts, not the library's."""

from __future__ import annotations

import ast
import json
import random
from typing import Any

UNSUPPORTED = {
    "words:start_verb": "needs NLTK's English part-of-speech tagger data, which no package on the index ships",
}


# builds of a checker compared, each with its own seed, to find arguments it draws at random (a
# random choice between two values is the same in all of them once in 2**(SEEDS-1))
SEEDS = 12


class ConstraintError(ValueError):
    """What is wrong with a record's instructions (the loader adds which record)."""


def read_constraints(answer: Any, row: dict) -> dict[str, list]:
    """The record's instructions from its ground truth (`answer`, None when the row has none)
    or, for Google's layout, from the row's own instruction_id_list and kwargs columns."""
    truth = _literal(answer) if isinstance(answer, str) else row if answer is None else answer
    if isinstance(truth, list) and len(truth) == 1:
        truth = _literal(truth[0]) if isinstance(truth[0], str) else truth[0]  # IF-RLVR wraps its one set in a list
    if not isinstance(truth, dict):
        raise ConstraintError(f"expected instruction ids and kwargs, got a {type(truth).__name__}")
    if "func_name" in truth:
        raise ConstraintError(
            f"func_name {truth['func_name']!r}: Tulu 3's func_name ground truth is not read "
            "(use instruction_id + kwargs, as IFEval and IF-RLVR write them)"
        )
    ids = truth.get("instruction_id_list", truth.get("instruction_id"))
    if ids is None:
        raise ConstraintError("no instruction_id_list (IFEval) or instruction_id (IF-RLVR)")
    kwargs = truth.get("kwargs")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ConstraintError(f"the instruction ids must be a non-empty list of strings, got {ids!r}")
    if (
        not isinstance(kwargs, list)
        or len(kwargs) != len(ids)
        or not all(k is None or isinstance(k, dict) for k in kwargs)
    ):
        raise ConstraintError(f"kwargs must be a list of {len(ids)} objects, one per instruction id, got {kwargs!r}")
    kwargs = [{k: v for k, v in (args or {}).items() if v is not None} for args in kwargs]
    for instruction, args in zip(ids, kwargs):
        _check(instruction, args)
    return {"instruction_id_list": ids, "kwargs": kwargs}


def _literal(text: str) -> Any:
    """JSON, or the Python literal IF-RLVR's files hold (single quotes, None): open-instruct
    writes its ground truths with str() and reads them with ast.literal_eval."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ConstraintError(f"the ground truth is neither JSON nor a Python literal: {text[:60]!r}") from None


def _check(instruction: str, args: dict) -> None:
    from megatron_rlvr.rewards.instruction.checkers import registry  # the library, on first need

    checkers = registry()
    if instruction in UNSUPPORTED:
        raise ConstraintError(f"instruction {instruction!r} is not supported: it {UNSUPPORTED[instruction]}")
    if instruction not in checkers:
        raise ConstraintError(f"unknown instruction id {instruction!r} (not an IFEval or IFBench id)")
    drawn = [_built(checkers[instruction], instruction, args, seed) for seed in range(SEEDS)]
    # missing: drawn at random, or left None (the prompt is given when scoring)
    missing = {k for built in drawn[1:] for k in built if built[k] != drawn[0].get(k)}
    missing |= {k for k, v in drawn[0].items() if v is None and k != "prompt"}
    if missing:
        raise ConstraintError(f"instruction {instruction!r} lacks arguments {sorted(missing)} (given: {sorted(args)})")


def _built(checker_class: Any, instruction: str, args: dict, seed: int) -> dict:
    """The arguments the checker holds once built from `args`, with the library's random draws
    for missing ones seeded (the interpreter's random state is kept)."""
    state = random.getstate()
    random.seed(seed)
    try:
        checker = checker_class(instruction)
        checker.build_description(**args)
        return dict(checker.get_instruction_args() or {})
    except TypeError as err:  # an argument build_description does not take
        raise ConstraintError(f"instruction {instruction!r}: {err}") from None
    except (ValueError, KeyError) as err:
        raise ConstraintError(f"instruction {instruction!r}: bad arguments {args} ({err})") from None
    finally:
        random.setstate(state)
