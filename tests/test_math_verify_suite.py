"""The math verifier on labelled sets nobody here tuned it on: math-verify 0.9.0's own suite
(tests/data/math_verify_suite.jsonl, vendored with its licence) and the blind held-out sets
(tests/data/math_heldout_blind_r*.jsonl, written without reading the verifier). Each must score
at least 95% with no false positive; the per-module table is printed (pytest -s shows it)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from megatron_rlvr.rewards.math.verifier import MathVerifier

DATA = Path(__file__).parent / "data"
SETS = {
    "math_verify_suite.jsonl": "module",
    "math_heldout_blind_r6.jsonl": "category",
    "math_heldout_blind_r7.jsonl": "category",
}


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(timeout_s=5.0, num_workers=2) as v:
        yield v


@pytest.mark.parametrize("name", list(SETS))
def test_a_set_written_elsewhere_scores_95_percent_with_no_false_positive(verifier, name):
    cases = [json.loads(line) for line in (DATA / name).open()]
    verdicts = verifier.verify_batch([c["response"] for c in cases], [c["gold"] for c in cases])
    table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    misses, false_positives = [], []
    for case, (reward, reason) in zip(cases, verdicts):
        label = float(bool(case["label"]))
        row = table[case[SETS[name]].split(":")[0]]
        row[0] += 1
        row[1] += reward == label
        row[2] += reward == 1.0 and label == 0.0
        if reward != label:
            (false_positives if reward == 1.0 else misses).append((reason, case["gold"][:60], case["response"][-80:]))
    print(f"\n{name}: {'group':<28} {'pairs':>5} {'right':>6} {'false pos':>9}")
    for group, (n, right, fp) in sorted(table.items()):
        print(f"{'':>{len(name) + 2}}{group:<28} {n:>5} {right / n:>6.1%} {fp:>9}")
    right = sum(row[1] for row in table.values())
    print(f"{'':>{len(name) + 2}}{'total':<28} {len(cases):>5} {right / len(cases):>6.1%} {len(false_positives):>9}")
    assert not false_positives, false_positives
    assert right >= 0.95 * len(cases), misses
