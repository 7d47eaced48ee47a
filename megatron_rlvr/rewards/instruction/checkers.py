"""The checks themselves: IFEval's 25 and IFBench's 58 checker classes of if-verifiable 0.1.2,
run by its own `evaluate_instructions` (strict: the response as it is; loose: also with the first
or last line dropped, or '*' removed, as IFEval's paper defines). Only the checkers are used:
the library's `get_eval_data` (which downloads data sets) is never called, though its package
imports `datasets` for it.

`score` is what the sandbox calls, once per response (worker.py): this module is imported by
the verifier's supervisor before it confines itself, and makes the NLTK data first
(nltk_data.py) and seeds langdetect, whose verdicts otherwise vary from call to call."""

from __future__ import annotations

import functools
from typing import Any

from megatron_rlvr.rewards.instruction.nltk_data import use_local_nltk_data
from megatron_rlvr.rewards.reasoning import strip_reasoning

GRADINGS = ("binary", "fraction")


@functools.cache
def registry() -> dict[str, Any]:
    """instruction id → checker class: IFEval's ids (keywords:existence, ...) and IFBench's
    (count:word_count_range, ...), which do not overlap."""
    use_local_nltk_data()  # before the IFBench module's import-time check for its data
    from langdetect import DetectorFactory

    DetectorFactory.seed = 0  # langdetect's documented way to make detection deterministic
    from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT as IFBENCH
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT as IFEVAL

    shared = set(IFEVAL) & set(IFBENCH)
    if shared:
        raise RuntimeError(f"if-verifiable's IFEval and IFBench share instruction ids {sorted(shared)}")
    return {**IFEVAL, **IFBENCH}


def followed(response: str, ids: list[str], kwargs: list[dict], prompt: str, loose: bool) -> list[bool]:
    """Whether the response follows each instruction, by the library's own evaluation."""
    from if_verifiable.common import evaluate_instructions

    results, _ = evaluate_instructions(response, ids, kwargs, prompt, registry())
    if len(results) != len(ids):  # the library skips ids it does not know; load refuses them
        raise RuntimeError(f"the library checked {len(results)} of {len(ids)} instructions")
    return [r.loose_pass if loose else r.strict_pass for r in results]


def score(response: str, record: dict) -> float:
    """The reward of one response: record holds ground_truth (instruction_id_list, kwargs),
    prompt, grading (binary: 1 when every instruction is followed; fraction: the share
    followed) and loose. A checker that raises is the sandbox's runtime_error, never a 0."""
    truth = record["ground_truth"]
    ok = followed(
        strip_reasoning(response), truth["instruction_id_list"], truth["kwargs"], record["prompt"], record["loose"]
    )
    if record["grading"] == "binary":
        return float(all(ok))
    return sum(ok) / len(ok)


def _load_models() -> None:
    """Reads langdetect's language profiles and Punkt's English model now, in this process, so
    that the forked children that score responses have them (each would take seconds to)."""
    import langdetect
    from if_verifiable.ifeval.instructions_util import count_sentences

    registry()
    langdetect.detect("This sentence is written in English.")
    count_sentences("One sentence. Another one.")


# at import: the sandbox's supervisor imports this module before it confines itself (a confined
# child can write no NLTK data directory), and forks one child per response
_load_models()
