"""The built-in tiny task (sums and products of small integers, "3+4=" → "7") and the
character tokenizer the CPU default run creates for it, with a chat template of its own so
the default run renders its prompts through the same path as a chat model's run. Nothing
comes from a hub."""

from __future__ import annotations

import random
from pathlib import Path

from megatron_rlvr.config import ArithmeticSource
from megatron_rlvr.data.records import LoadedPrompts, PromptRecord

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
# Each message's content in turn, an assistant's followed by <eos>; nothing marks the roles or
# opens the answer, so a task prompt renders as "<bos>3+4=". Role tokens cost the tiny model
# learning speed (0.9 reward at step 100 instead of 81 in a side-by-side run) for nothing the
# task needs; what matters is that the default run takes the chat-template path a real model's does.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def arithmetic_prompts(spec: ArithmeticSource) -> LoadedPrompts:
    """Sums and products of small integers as one user message each: verifiable, and learnable
    by a tiny model in minutes."""
    rng = random.Random(spec.seed)
    records = []
    for i in range(spec.num_prompts):
        a, b = rng.randint(0, spec.max_operand), rng.randint(0, spec.max_operand)
        op = rng.choice("+*")
        answer = str(a + b if op == "+" else a * b)
        records.append(
            PromptRecord(f"arith-{i}", [{"role": "user", "content": f"{a}{op}{b}="}], answer, "math", "arithmetic")
        )
    return LoadedPrompts(records)


def build_arithmetic_tokenizer(out_dir: str | Path, chars: str = "0123456789+*-=. "):
    """A character-level tokenizer (one token per character of `chars`, plus <pad>, <bos>,
    <eos>, <unk>), saved as a transformers fast tokenizer with CHAT_TEMPLATE, so engines and
    the learner load it by path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(chars), key=chars.index))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()  # characters back to the exact string, no separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer
