#!/usr/bin/env python
"""Writes a small RLVR data set in verl's layout: arithmetic word problems ("tom has 3 apples
and gets 2 more. how many apples?") as chat messages, split into train.parquet and a held-out
test.parquet with no problem in common. configs/arithmetic-words-verl.yaml trains the tiny
model on it with evaluation on the held-out split.

    python tools/make_arithmetic_words.py [--out runs/data/arithmetic-words] [--test 200] [--seed 0]

Columns, as verl's data_preprocess scripts write them: data_source, prompt (a list of
{role, content}), ability, reward_model {style, ground_truth}, extra_info {split, index,
question, answer}. Everything is lower case, to fit the tiny model's character tokenizer.
"""

from __future__ import annotations

import argparse
import itertools
import random
from pathlib import Path

NAMES = ["tom", "ann", "bob", "eva", "max", "ida"]
THINGS = ["apples", "pens", "cards", "coins", "books"]
# (template, answer): one problem per operation; the operands are small so answers stay short
PROBLEMS = [
    ("{name} has {a} {things} and gets {b} more. how many {things}?", lambda a, b: a + b),
    ("{name} had {a} {things} and lost {b}. how many {things} are left?", lambda a, b: a - b),
    ("{name} has {a} bags with {b} {things} each. how many {things}?", lambda a, b: a * b),
]
MAX_OPERAND = 3


def problems() -> list[dict]:
    out = []
    for (template, solve), name, things, a, b in itertools.product(
        PROBLEMS, NAMES, THINGS, range(MAX_OPERAND + 1), range(MAX_OPERAND + 1)
    ):
        answer = solve(a, b)
        if answer >= 0:  # nobody loses more than they have
            out.append({"question": template.format(name=name, things=things, a=a, b=b), "answer": str(answer)})
    return out


def verl_rows(items: list[dict], split: str) -> list[dict]:
    return [
        {
            "data_source": "arithmetic_words",
            "prompt": [{"role": "user", "content": item["question"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": item["answer"]},
            "extra_info": {"split": split, "index": index, "question": item["question"], "answer": item["answer"]},
        }
        for index, item in enumerate(items)
    ]


def write(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            (
                "extra_info",
                pa.struct(
                    [("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("split", pa.string())]
                ),
            ),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/data/arithmetic-words", help="folder for train/test.parquet")
    parser.add_argument("--test", type=int, default=200, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    items = problems()
    random.Random(args.seed).shuffle(items)
    test, train = items[: args.test], items[args.test :]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "train.parquet", verl_rows(train, "train"))
    write(out / "test.parquet", verl_rows(test, "test"))
    print(f"wrote {len(train)} training and {len(test)} held-out problems to {out}/train.parquet, test.parquet")


if __name__ == "__main__":
    main()
