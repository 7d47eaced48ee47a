"""How far an HF export of a long-answer model gets on held-out odd_count problems, by list
length: greedy and sampled (temperature 1) accuracy of the whole working per number of digits,
and, for the wrong greedy answers, the part of the first wrong step (its label, the digit read
from the prompt, the count) or the end. It tells a model that samples badly (greedy right,
sampled wrong: RL can sharpen it) from one that has not learned the rule for that length.

    python tools/long_answer_lengths.py runs/long-answers-sft/hf [num_prompts=192] [samples=4] [seed=7]
"""

import collections
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_rlvr.config import LongAnswerSource
from megatron_rlvr.data.long_answers import long_answer_prompts
from megatron_rlvr.rewards.long_answers import first_mismatch, solution

LONGEST_ROW = 8  # lists of this many digits or more share the table's last row


def first_wrong_part(response: str, gold: str) -> str:
    """Where a wrong response first leaves the correct working: 'label', 'digit' or 'count'
    of a step ("c3=2"), or 'the end' ('#### n', stopping early or going on)."""
    got, want = response.split(" "), gold.split(" ")
    i = first_mismatch(got, want)
    if i >= len(want) - 2 or i >= len(got):
        return "the end"
    step, gold_step = got[i], want[i]
    if step[:1] != gold_step[:1]:
        return "label"
    return "digit" if step[1:2] != gold_step[1:2] else "count"


def by_length(golds: list[str], greedy: list[str], sampled: list[list[str]]) -> dict[int, dict]:
    """Per number of steps (capped at LONGEST_ROW): problems, greedy and sampled accuracy, and
    the first wrong part of each wrong greedy answer."""
    rows: dict[int, dict] = {}
    for gold, first, samples in zip(golds, greedy, sampled):
        row = rows.setdefault(
            min(gold.count("="), LONGEST_ROW),
            {"problems": 0, "greedy": 0, "sampled": 0.0, "wrong": collections.Counter()},
        )
        row["problems"] += 1
        row["greedy"] += first == gold
        row["sampled"] += sum(s == gold for s in samples) / len(samples)
        if first != gold:
            row["wrong"][first_wrong_part(first, gold)] += 1
    return dict(sorted(rows.items()))


def generate(model, tokenizer, prompts: list[list[dict]], samples: int) -> tuple[list[str], list[list[str]]]:
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    common = {"max_new_tokens": 256, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    with torch.no_grad():
        first = model.generate(**batch, do_sample=False, **common)
        more = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, num_return_sequences=samples, **common)
    width = batch.input_ids.shape[1]
    decode = lambda rows: [tokenizer.decode(r[width:], skip_special_tokens=True).strip() for r in rows]  # noqa: E731
    sampled = decode(more)
    return decode(first), [sampled[i * samples : (i + 1) * samples] for i in range(len(prompts))]


def main(path: str, num_prompts: int = 192, samples: int = 4, seed: int = 7) -> None:
    spec = LongAnswerSource(
        problem="odd_count", max_steps=32, tail_exponent=1.0, split="heldout", num_prompts=num_prompts, seed=seed
    )
    prompts = [r.prompt for r in long_answer_prompts(spec).records]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    greedy: list[str] = []
    sampled: list[list[str]] = []
    for start in range(0, len(prompts), 32):
        first, more = generate(model, tokenizer, prompts[start : start + 32], samples)
        greedy += first
        sampled += more
    golds = [solution(p) for p in prompts]
    print(
        f"{path}: {num_prompts} held-out odd_count problems (max_steps 32, tail 1.0, seed {seed}), {samples} samples each"
    )
    print("digits  problems  greedy  sampled  first wrong part of the wrong greedy answers")
    rows = by_length(golds, greedy, sampled)
    for steps, row in rows.items():
        wrong = ", ".join(f"{part} {n}" for part, n in row["wrong"].most_common())
        label = f"{steps}+" if steps == LONGEST_ROW else str(steps)
        print(f"{label:>6}  {_rates(row)}  {wrong}")
    print(
        f"   all  {_rates({key: sum(row[key] for row in rows.values()) for key in ('problems', 'greedy', 'sampled')})}"
    )


def _rates(row: dict) -> str:
    return f"{row['problems']:>8}  {row['greedy'] / row['problems']:>6.3f}  {row['sampled'] / row['problems']:>7.3f}"


def parse(argv: list[str]) -> tuple[str, dict[str, int]]:
    """The export's path and the key=value settings, or SystemExit with one line naming what is wrong."""
    if not argv or "=" in argv[0]:
        raise SystemExit("usage: long_answer_lengths.py HF_DIR [num_prompts=N] [samples=N] [seed=N]")
    settings = {}
    for arg in argv[1:]:
        key, _, value = arg.partition("=")
        if key not in ("num_prompts", "samples", "seed") or not value.isdigit() or (key != "seed" and int(value) < 1):
            raise SystemExit(f"{arg!r}: expected num_prompts=N, samples=N (N >= 1) or seed=N")
        settings[key] = int(value)
    return argv[0], settings


if __name__ == "__main__":
    path, settings = parse(sys.argv[1:])
    main(path, **settings)
