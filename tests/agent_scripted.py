"""A scripted tiny model for episode tests: a real Qwen3-MoE checkpoint (the CPU engine serves
it, its routers route) whose weights make it a bigram machine. Attention and expert outputs
are zero, so the last hidden state is the current token's one-hot embedding, and the output
layer maps each token to the one `SCRIPT` names: after the generation prompt the model writes
`<tool_call>` + a calculator call + `</tool_call>` + `<|im_end|>`, every turn, whatever the
sampling temperature (the chosen logit leads by ~110). With enable_thinking the generation
prompt ends in `<think>` and the model first writes a thought and `</think>`.

The tokenizer is character-level (printable ASCII and newline) plus Qwen3's special tokens and
two whole-string tokens the script uses; its chat template is Qwen3-like (tools in a system
block, a `tool` role rendered as `<tool_response>` inside a user turn) and strips `<think>`
from every assistant turn but the last, as reasoning templates do, so the drift case is real.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

CALL = '\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
THOUGHT = "let me compute"
SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>", CALL, THOUGHT]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}{% set c = m.content %}"
    "{% if not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}{% endif %}"
)


def build_tokenizer(out_dir: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(w, normalized=False) for w in WORDS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_scripted_model(out_dir: Path) -> Path:
    """The checkpoint and its tokenizer in out_dir."""
    from transformers import AutoModelForCausalLM

    from megatron_rlvr.config import TinyModel
    from megatron_rlvr.tiny_model import build_tiny_hf_model

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(out_dir)
    vocab = len(tokenizer)
    spec = TinyModel(hidden_size=128, num_attention_heads=4, head_dim=32)
    assert vocab <= spec.hidden_size
    build_tiny_hf_model(spec, out_dir, vocab, tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    ids = tokenizer.convert_tokens_to_ids
    script = {
        ids("\n"): ids("<tool_call>"),
        ids("<tool_call>"): ids(CALL),
        ids(CALL): ids("</tool_call>"),
        ids("</tool_call>"): ids("<|im_end|>"),
        ids("<think>"): ids(THOUGHT),
        ids(THOUGHT): ids("</think>"),
        ids("</think>"): ids("<tool_call>"),
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                param.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab].copy_(torch.eye(vocab))
        head = model.lm_head.weight
        head.zero_()
        for token in range(vocab):
            head[script.get(token, ids("<|im_end|>")), token] = 10.0
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# the same template keeping past turns as they were: what an episode can run with
STRIP = "{% if not loop.last and '</think>' in c %}{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
KEEP_TEMPLATE = CHAT_TEMPLATE.replace(STRIP, "")
assert KEEP_TEMPLATE != CHAT_TEMPLATE
