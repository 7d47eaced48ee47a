"""Math verifier accuracy and speed, ours against math-verify (the field's reference), on the
same labelled pairs, side by side in one run.

    .venv/bin/python benchmarks/verifier.py [--cases FILE.jsonl ...] [--workers 2] [--rounds 3] [--ours-only]

Cases default to tests/data/math_cases*.jsonl (this project's own labels); pass a held-out
set with --cases (lines with response, gold, label and optionally tag). Each verifier checks
every pair one at a time (time per pair: mean, median, p99, max); ours also scores the whole set as
one batch, as a training run does, with --workers sandbox processes (--rounds times, median
kept). `ratio:` is our batch throughput over math-verify's (one pair at a time, as it is used).
--ours-only leaves math-verify out: with PYTHONPATH set to another checkout (and run from
there), this same script times that checkout's verifier, for a before/after ratio in one run.
False positives are wrong answers scored right (every label-0 pair is a look-alike probe of
some kind); false negatives are right answers scored wrong.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from megatron_rlvr.rewards.math.verifier import MathVerifier

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"


def load(paths: list[Path]) -> list[dict]:
    cases = []
    for path in paths:
        for number, line in enumerate(path.open(), 1):
            case = json.loads(line)
            if not {"response", "gold", "label"} <= case.keys():
                sys.exit(f"{path}:{number}: a case needs response, gold and label")
            cases.append(case)
    return cases


def math_verify_scorer():
    """math-verify's documented use: parse the gold (as LaTeX) and the response, then verify."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs every timeout

    def score(response: str, gold: str) -> float:
        try:
            parsed_gold = parse(gold if "\\boxed" in gold else f"${gold}$")
            return 1.0 if verify(parsed_gold, parse(response)) else 0.0
        except Exception:
            return 0.0

    return score


def one_at_a_time(score, cases: list[dict]) -> tuple[list[float], list[float]]:
    rewards, seconds = [], []
    for case in cases:
        start = time.perf_counter()
        rewards.append(score(case["response"], case["gold"]))
        seconds.append(time.perf_counter() - start)
    return rewards, seconds


def summary(name: str, cases: list[dict], rewards: list[float], seconds: list[float], pairs_per_s: float) -> str:
    n = len(cases)
    right = sum(r == c["label"] for r, c in zip(rewards, cases))
    false_pos = sum(r == 1.0 and c["label"] == 0 for r, c in zip(rewards, cases))
    false_neg = sum(r == 0.0 and c["label"] == 1 for r, c in zip(rewards, cases))
    ms = sorted(s * 1000 for s in seconds)
    p99 = ms[min(n - 1, int(0.99 * n))]
    return (
        f"{name:<12} {right / n:>8.1%} {false_pos:>9} {false_neg:>9} {statistics.mean(ms):>8.2f} {statistics.median(ms):>10.2f} "
        f"{p99:>9.1f} {ms[-1]:>9.0f} {pairs_per_s:>9.1f}"
    )


def by_tag(cases: list[dict], results: dict[str, list[float]]) -> None:
    groups = defaultdict(list)
    for i, case in enumerate(cases):
        groups[case.get("tag", "-")].append(i)
    names = list(results)
    print(f"\n{'family':<18} {'pairs':>5} " + " ".join(f"{n:>12}" for n in names))
    for tag, indices in sorted(groups.items()):
        accs = [sum(results[n][i] == cases[i]["label"] for i in indices) / len(indices) for n in names]
        print(f"{tag:<18} {len(indices):>5} " + " ".join(f"{a:>12.1%}" for a in accs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, nargs="+", default=sorted(DATA.glob("math_cases*.jsonl")))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--ours-only", action="store_true", help="leave math-verify out")
    args = parser.parse_args()
    cases = load(args.cases)
    try:
        reference = None if args.ours_only else math_verify_scorer()
    except ImportError:
        reference = None
        print(
            "math-verify is not installed (bash scripts/setup.sh installs it with the dev extra): showing ours only",
            file=sys.stderr,
        )
    print(
        f"{len(cases)} labelled pairs ({sum(c['label'] for c in cases)} right answers) from "
        f"{', '.join(p.name for p in args.cases)}; {args.workers} sandbox workers"
    )
    with MathVerifier(timeout_s=args.timeout_s, num_workers=args.workers) as verifier:
        verifier.verify_batch(["\\boxed{x^2}"] * 4, ["x*x"] * 4)  # start the workers outside the clock
        batch_seconds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            batch = [r for r, _ in verifier.verify_batch([c["response"] for c in cases], [c["gold"] for c in cases])]
            batch_seconds.append(time.perf_counter() - start)
        ours, ours_seconds = one_at_a_time(lambda r, g: verifier.verify(r, g)[0], cases)
    if ours != batch:
        print("note: batch and one-at-a-time verdicts differ (a timeout near the limit)", file=sys.stderr)
    ours_rate = len(cases) / statistics.median(batch_seconds)
    header = (
        f"{'verifier':<12} {'accuracy':>8} {'false pos':>9} {'false neg':>9} {'mean ms':>8} {'median ms':>10} "
        f"{'p99 ms':>9} {'max ms':>9} {'pairs/s':>9}"
    )
    rows = [summary("ours", cases, ours, ours_seconds, ours_rate)]
    results = {"ours": ours}
    if reference is not None:
        theirs, theirs_seconds = one_at_a_time(reference, cases)
        theirs_rate = len(cases) / sum(theirs_seconds)
        rows.append(summary("math-verify", cases, theirs, theirs_seconds, theirs_rate))
        results["math-verify"] = theirs
    print(header)
    print("\n".join(rows))
    by_tag(cases, results)
    if reference is not None:
        print(f"ratio: {ours_rate / theirs_rate:.2f}")


if __name__ == "__main__":
    main()
