"""Scores a labelled held-out JSONL set with our math verifier and with math-verify, side by side.

    .venv/bin/python benchmarks/heldout_math.py [--cases tests/data/math_heldout_blind_r6.jsonl]
                                                [--misses runs/heldout_misses.jsonl]

Each line holds id, gold, response, label (true: the response's final answer equals the gold)
and category; categories named `lookalike:*` are wrong answers that differ from the gold only
subtly. A false positive is a wrong answer scored right (the costly error in RL: it pays for
a wrong answer), a false negative a right answer scored wrong. Prints accuracy, false
positives and false negatives overall, on the negatives, on the look-alikes and per category,
then every miss; --misses also writes the misses as JSONL.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from math_verify import parse, verify

from megatron_rlvr.rewards.math.verifier import MathVerifier

DEFAULT_CASES = Path(__file__).resolve().parents[1] / "tests" / "data" / "math_heldout_blind_r6.jsonl"
FIELDS = {"id", "gold", "response", "label", "category"}


def load(path: Path) -> list[dict]:
    cases = []
    for number, line in enumerate(path.open(encoding="utf-8"), 1):
        case = json.loads(line)
        if not FIELDS <= case.keys():
            sys.exit(f"{path}:{number}: a case needs {', '.join(sorted(FIELDS))}")
        cases.append(case)
    return cases


def ours(cases: list[dict]) -> list[tuple[bool, str]]:
    with MathVerifier() as verifier:
        verdicts = verifier.verify_batch([c["response"] for c in cases], [c["gold"] for c in cases])
    return [(reward == 1.0, reason) for reward, reason in verdicts]


def math_verify_one(gold: str, response: str) -> tuple[bool, str]:
    """math-verify wants the gold as LaTeX it can find: in dollars unless already boxed or delimited."""
    gold_text = gold if ("$" in gold or "\\boxed" in gold) else f"${gold}$"
    try:
        parsed_gold, parsed_response = parse(gold_text), parse(response)
        return bool(verify(parsed_gold, parsed_response)), f"{parsed_response[-1:]}"
    except Exception as error:  # math-verify raises on odd input; count it as a 0.0, like ours
        return False, f"error: {type(error).__name__}"


def theirs(cases: list[dict]) -> list[tuple[bool, str]]:
    return [math_verify_one(c["gold"], c["response"]) for c in cases]


def tally(cases: list[dict], scored: list[tuple[bool, str]], keep: Callable[[dict], bool]) -> str:
    pairs = [(c["label"], said) for c, (said, _) in zip(cases, scored, strict=True) if keep(c)]
    if not pairs:
        return "n=0"
    right = sum(label == said for label, said in pairs)
    false_pos = sum(said and not label for label, said in pairs)
    false_neg = sum(label and not said for label, said in pairs)
    return f"n={len(pairs):3d} acc={right / len(pairs):6.1%} FP={false_pos:3d} FN={false_neg:3d}"


def in_category(category: str) -> Callable[[dict], bool]:
    return lambda case: case["category"] == category


def report(cases: list[dict], results: dict[str, list[tuple[bool, str]]]) -> list[dict]:
    slices: dict[str, Callable[[dict], bool]] = {
        "all": lambda c: True,
        "positives": lambda c: c["label"],
        "negatives": lambda c: not c["label"],
        "look-alikes": lambda c: c["category"].startswith("lookalike:"),
    }
    for category in sorted({c["category"] for c in cases}):
        slices[f"  {category}"] = in_category(category)
    width = max(len(name) for name in slices)
    print(f"{'slice':{width}}  " + "  ".join(f"{name:34}" for name in results))
    for name, keep in slices.items():
        print(f"{name:{width}}  " + "  ".join(f"{tally(cases, scored, keep):34}" for scored in results.values()))
    misses = []
    for index, case in enumerate(cases):
        wrong = {name: scored[index][1] for name, scored in results.items() if scored[index][0] != case["label"]}
        if wrong:
            misses.append(
                {
                    "id": case["id"],
                    "label": case["label"],
                    "category": case["category"],
                    "gold": case["gold"],
                    "response_tail": case["response"][-160:],
                    "missed_by": wrong,
                }
            )
    print(f"\nmisses ({len(misses)}): id, label, category, gold, missed by (reason or parsed answer)")
    for miss in misses:
        print(f"  {miss['id']} {miss['label']!s:5} {miss['category']:32} {miss['gold'][:40]!r:44} {miss['missed_by']}")
    return misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=DEFAULT_CASES, help="labelled JSONL set")
    parser.add_argument("--misses", type=Path, help="also write every miss here as JSONL")
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs every unparsable answer
    cases = load(args.cases)
    results = {"ours": ours(cases), "math-verify": theirs(cases)}
    misses = report(cases, results)
    if args.misses:
        args.misses.parent.mkdir(parents=True, exist_ok=True)
        with args.misses.open("w", encoding="utf-8") as out:
            out.writelines(json.dumps(miss, ensure_ascii=False) + "\n" for miss in misses)


if __name__ == "__main__":
    main()
