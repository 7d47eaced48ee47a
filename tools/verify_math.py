#!/usr/bin/env python
"""Checks a response against a gold answer with the math verifier and prints the verdict.

    python tools/verify_math.py RESPONSE GOLD            # prints "1.0 numeric_equal"
    python tools/verify_math.py --response-file out.txt GOLD --explain
    echo 'The answer is \\boxed{7/4}' | python tools/verify_math.py - '1\\frac{3}{4}'
    python tools/verify_math.py --jsonl responses.jsonl [--response-key response] [--gold-key gold]

One pair: exit status 0 when the response is right, 1 when it is wrong; `--explain` also shows
the answer found in the response and both sides as parsed. A JSONL file (a response and a
gold answer on each line): prints the accuracy and the count of each verdict reason; bad lines
are skipped and reported with their line numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rlvr.rewards.math.latex import clean
from megatron_rlvr.rewards.math.parse import parse_answer
from megatron_rlvr.rewards.math.text import AnswerError, extract_answers, gold_answer
from megatron_rlvr.rewards.math.verifier import MathVerifier


def _read(value: str | None, path: str | None) -> str:
    if path is not None:
        return Path(path).read_text()
    return sys.stdin.read() if value == "-" else value


def _explain(label: str, answers: list[str]) -> None:
    for answer in answers:
        try:
            cleaned = clean(answer)
            print(f"{label}: {answer!r} → {cleaned!r} → {parse_answer(cleaned)}")
        except AnswerError as err:
            print(f"{label}: {answer!r} → {err.reason}")


def check_one(args) -> int:
    response = _read(args.response, args.response_file)
    gold = _read(args.gold, args.gold_file)
    with MathVerifier(timeout_s=args.timeout_s, num_workers=1) as verifier:
        reward, reason = verifier.verify(response, gold)
    print(f"{reward} {reason}")
    if args.explain:
        try:
            _explain("answer", extract_answers(response))
        except AnswerError as err:
            print(f"answer: {err.reason}")
        _explain("gold", [gold_answer(gold)])
    return 0 if reward == 1.0 else 1


def check_file(args) -> int:
    responses, golds, bad = [], [], []
    with open(args.jsonl) as f:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("response", nargs="?", help="the model's response ('-': read stdin)")
    parser.add_argument("gold", nargs="?", help="the gold answer")
    parser.add_argument("--response-file", help="read the response from this file")
    parser.add_argument("--gold-file", help="read the gold answer from this file")
    parser.add_argument("--explain", action="store_true", help="show the extracted and parsed answers")
    parser.add_argument("--jsonl", help="score every line of a JSONL file instead")
    parser.add_argument("--response-key", default="response")
    parser.add_argument("--gold-key", default="gold")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    if args.jsonl:
        return check_file(args)
    if args.response_file is not None and args.gold is None:  # --response-file F GOLD
        args.response, args.gold = None, args.response
    if (args.response is None) == (args.response_file is None) or (args.gold is None) == (args.gold_file is None):
        parser.error("give a response (RESPONSE, '-' or --response-file) and a gold answer (GOLD or --gold-file)")
    return check_one(args)


if __name__ == "__main__":
    sys.exit(main())
