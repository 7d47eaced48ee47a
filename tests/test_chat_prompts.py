"""Prompt ids are exactly HF's apply_chat_template(messages, add_generation_prompt=True,
tokenize=True) for real chat templates, made locally in the style of the published Qwen and
Llama 3 templates, over a byte-level BPE tokenizer trained here; with and without a system
prompt, with template arguments (enable_thinking), an instruction, and a length limit."""

import pytest

from megatron_rlvr.config import FileData
from megatron_rlvr.data import DataError, PromptRecord, PromptRenderer

# Qwen2.5/Qwen3 style: ChatML turns; the system turn only when given; Qwen3's switch that
# closes an empty think block when thinking is off.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
# Llama 3.1 style: <|begin_of_text|>, a header per turn, content trimmed, <|eot_id|>; a system
# header with the knowledge-cutoff lines always, the user's system message after them.
LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SPECIALS = {
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    "llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "You are a helpful assistant. Put the final answer within \\boxed{}.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
] * 4


def chat_tokenizer(style: str, out_dir):
    """A byte-level BPE tokenizer (the kind Qwen and Llama 3 use), trained on a few lines,
    with the style's special tokens and chat template; saved and loaded back by path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIALS[style], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    if style == "qwen":
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tokenizer.chat_template = QWEN_TEMPLATE
    else:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
        )
        tokenizer.chat_template = LLAMA_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)


@pytest.fixture(scope="module", params=["qwen", "llama"])
def tokenizer(request, tmp_path_factory):
    return request.param, chat_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


QUESTION = "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?"
SYSTEM = "You are a helpful assistant."
INSTRUCTION = "Put the final answer within \\boxed{}."


def fmt(**kw) -> FileData:
    return FileData(path="unused.jsonl", **kw)


def hf_ids(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"]


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
def test_prompt_ids_equal_hf_apply_chat_template(tokenizer, system):
    style, tok = tokenizer
    records = [
        PromptRecord("s", QUESTION, "72"),  # a string prompt is one user message
        PromptRecord("m", [{"role": "user", "content": QUESTION}], "72"),
    ]
    encoded = PromptRenderer(tok, fmt(system_prompt=system, instruction=INSTRUCTION)).encode(records)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{QUESTION} {INSTRUCTION}"}
    ]
    expected = hf_ids(tok, messages)
    assert encoded.encode(records[0]) == expected and encoded.encode(records[1]) == expected
    text = tok.decode(expected)
    if style == "qwen":
        assert text == (f"<|im_start|>system\n{system}<|im_end|>\n" if system else "") + (
            f"<|im_start|>user\n{QUESTION} {INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
        )
    else:
        assert text == (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
            f"December 2023\nToday Date: 26 Jul 2024\n\n{system or ''}<|eot_id|><|start_header_id|>user"
            f"<|end_header_id|>\n\n{QUESTION} {INSTRUCTION}<|eot_id|><|start_header_id|>assistant"
            "<|end_header_id|>\n\n"
        )


def test_a_record_s_own_system_message_and_turns_are_kept(tokenizer):
    _, tok = tokenizer
    conversation = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": QUESTION},
    ]
    record = PromptRecord("c", conversation, "72")
    encoded = PromptRenderer(tok, fmt(system_prompt=SYSTEM, instruction=INSTRUCTION)).encode([record])
    expected = conversation[:3] + [{"role": "user", "content": f"{QUESTION} {INSTRUCTION}"}]
    assert encoded.encode(record) == hf_ids(tok, expected)
    assert record.prompt[-1]["content"] == QUESTION  # the record itself is not changed


def test_template_arguments_reach_the_template(tmp_path):
    tok = chat_tokenizer("qwen", tmp_path)
    record = PromptRecord("q", QUESTION, "72")
    thinking_off = PromptRenderer(tok, fmt(chat_template_kwargs={"enable_thinking": False})).encode([record])
    expected = hf_ids(tok, [{"role": "user", "content": QUESTION}], enable_thinking=False)
    assert thinking_off.encode(record) == expected
    assert tok.decode(expected).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert PromptRenderer(tok, fmt()).encode([record]).encode(record) == hf_ids(
        tok, [{"role": "user", "content": QUESTION}]
    )


def test_long_prompts_are_dropped_and_counted(tokenizer, caplog):
    _, tok = tokenizer
    records = [PromptRecord(f"r{i}", "How many? " * (i * 20 + 1), "1") for i in range(5)]
    lengths = [len(hf_ids(tok, [{"role": "user", "content": r.prompt}])) for r in records]
    limit = sorted(lengths)[2]
    with caplog.at_level("WARNING"):
        encoded = PromptRenderer(tok, fmt(max_prompt_tokens=limit)).encode(records)
    assert [r.prompt_id for r in encoded.records] == [r.prompt_id for r, n in zip(records, lengths) if n <= limit]
    assert encoded.too_long == 2 and caplog.text.count("longer than data.max_prompt_tokens") == 1
    with pytest.raises(DataError, match="every prompt is longer than data.max_prompt_tokens = 1"):
        PromptRenderer(tok, fmt(max_prompt_tokens=1)).encode(records)


def test_without_a_template_the_prompt_text_follows_bos(tmp_path):
    tok = chat_tokenizer("llama", tmp_path)
    record = PromptRecord("q", QUESTION, "72")
    plain = PromptRenderer(tok, fmt(apply_chat_template=False, instruction=INSTRUCTION)).encode([record])
    assert plain.encode(record) == [tok.bos_token_id] + tok.encode(
        f"{QUESTION} {INSTRUCTION}", add_special_tokens=False
    )
    tok.chat_template = None
    with pytest.raises(DataError, match="data.apply_chat_template = true: the tokenizer has no chat template"):
        PromptRenderer(tok, fmt(apply_chat_template=True))
    own = tmp_path / "mine.jinja"
    own.write_text(QWEN_TEMPLATE)
    mine = PromptRenderer(tok, fmt(chat_template=str(own))).encode([record])
    assert tok.decode(mine.encode(record)).startswith("<|im_start|>user\n")
