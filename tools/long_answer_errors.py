"""Where a long-answer model goes wrong on the remainder problem: samples each of N held-out and N training problems
(uniform over problems, 4 samples each, temperature 1) with HF transformers and sorts every
wrong answer by its first step that differs from the correct chain: the first step (read
from the prompt), a later step (its left side copied wrong, off by one, other), or the end.

    python tools/long_answer_errors.py runs/long-answers-sft/hf [max_divisor [max_steps [N]]]
"""

import collections
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_rlvr.data.long_answers import is_heldout
from megatron_rlvr.rewards.long_answers import prompt_text, worked_solution


def first_difference(got: list[str], gold: list[str]) -> str:
    i = next((j for j, (a, b) in enumerate(zip(got, gold)) if a != b), min(len(got), len(gold)))
    if i >= len(gold) - 1 or (i < len(got) and got[i] == "####"):
        return "the end"
    if i == 0:
        return "the first step"
    left, _, right = got[i].partition("=")
    gold_left, _, gold_right = gold[i].partition("=")
    if left != gold_left:
        return "a later step: left side"
    if right.isdigit() and abs(int(right) - int(gold_right)) == 1:
        return "a later step: off by one"
    return "a later step: other"


def main(path: str, max_divisor: int = 5, max_steps: int = 24, per_split: int = 48) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    problems = [(k * d + r, d) for d in range(2, max_divisor + 1) for k in range(1, max_steps + 1) for r in range(d)]
    for split in ("heldout", "train"):
        chosen = [p for p in problems if is_heldout(prompt_text(*p)) == (split == "heldout")]
        random.Random(0).shuffle(chosen)
        kinds: collections.Counter[str] = collections.Counter()
        for n, d in chosen[:per_split]:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt_text(n, d)}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
            out = model.generate(ids, do_sample=True, max_new_tokens=256, num_return_sequences=4, pad_token_id=0)
            gold = worked_solution(n, d)
            for row in out:
                answer = tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True).strip()
                kinds["right" if answer == gold else first_difference(answer.split(" "), gold.split(" "))] += 1
        total = sum(kinds.values())
        print(f"{split}: " + ", ".join(f"{kind} {count / total:.3f}" for kind, count in kinds.most_common()))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
