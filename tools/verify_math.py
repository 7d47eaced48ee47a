#!/usr/bin/env python
"""Scores a JSONL file of model responses with the math verifier.

    python tools/verify_math.py responses.jsonl [--response-key response] [--gold-key gold]

Each line needs a response and a gold answer; prints accuracy and the count of each
verdict reason. Bad lines are skipped and reported with their line numbers.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_rlvr.rewards.math import MathVerifier


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--response-key", default="response")
    parser.add_argument("--gold-key", default="gold")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    responses, golds, bad = [], [], []
    with open(args.path) as f:
        for number, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                responses.append(str(row[args.response_key]))
                golds.append(str(row[args.gold_key]))
            except (json.JSONDecodeError, KeyError, TypeError):
                bad.append(number)
    if bad:
        print(f"skipped {len(bad)} bad lines: {bad[:20]}", file=sys.stderr)
    with MathVerifier(timeout_s=args.timeout_s) as verifier:
        verdicts = verifier.verify_batch(responses, golds)
        print(f"{sum(r for r, _ in verdicts):.0f}/{len(verdicts)} correct")
        for reason, count in verifier.stats.most_common():
            print(f"  {reason}: {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
