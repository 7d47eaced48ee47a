"""Math verifier throughput and accuracy, ours against math-verify (the field's reference),
on the same labelled cases, measured side by side in one run (rounds alternate, medians
reported, so machine noise hits both alike).

    .venv/bin/python benchmarks/verifier.py [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from megatron_rlvr.rewards.math import MathVerifier

CASES_FILE = Path(__file__).resolve().parents[1] / "tests" / "data" / "math_cases.jsonl"


def run_ours(verifier: MathVerifier, cases: list[dict]) -> list[float]:
    verdicts = verifier.verify_batch([c["response"] for c in cases], [c["gold"] for c in cases])
    return [reward for reward, _ in verdicts]


def run_math_verify(cases: list[dict]) -> list[float]:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs every timeout
    rewards = []
    for case in cases:
        try:
            gold = parse(case["gold"] if "\\boxed" in case["gold"] else f"${case['gold']}$")
            rewards.append(1.0 if verify(gold, parse(case["response"])) else 0.0)
        except Exception:
            rewards.append(0.0)
    return rewards


def accuracy(rewards: list[float], cases: list[dict]) -> float:
    return sum(r == c["label"] for r, c in zip(rewards, cases)) / len(cases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    cases = [json.loads(line) for line in CASES_FILE.open()]
    clean = [c for c in cases if c["tag"] != "adversarial"]
    print(f"{len(cases)} labelled cases ({len(cases) - len(clean)} adversarial), {args.rounds} "
          "rounds, median time per round; labels are this project's own")
    print(f"{'case set':<16} {'verifier':<12} {'pairs/s':>9} {'accuracy':>9}")
    with MathVerifier(timeout_s=5.0, num_workers=args.workers) as verifier:
        run_ours(verifier, cases[:4])  # start the sandbox workers outside the clock
        for label, subset in (("non-adversarial", clean), ("all", cases)):
            timings: dict[str, list[float]] = {"ours": [], "math-verify": []}
            results: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for name, fn in (("ours", lambda: run_ours(verifier, subset)),
                                 ("math-verify", lambda: run_math_verify(subset))):
                    start = time.perf_counter()
                    results[name] = fn()
                    timings[name].append(time.perf_counter() - start)
            throughput = {name: len(subset) / statistics.median(t) for name, t in timings.items()}
            for name in ("ours", "math-verify"):
                print(f"{label:<16} {name:<12} {throughput[name]:>9.1f} "
                      f"{accuracy(results[name], subset):>9.3f}")
    print(f"ratio: {throughput['ours'] / throughput['math-verify']:.2f}")


if __name__ == "__main__":
    main()
