"""SFT on tool conversations: the ids are the chat template's render of the whole conversation
with its tools, and the loss mask is 1 exactly on what the assistant generates (its content,
its tool calls, its end token), 0 on system, user and tool turns, the tool schemas, the
generation prompts and the boundary after each end token. A template that re-renders history
(a Qwen3-like one stripping past reasoning) is refused naming the record; `megatron-rlvr sft` on
such conversations learns (held-out loss falls)."""

import json
import string
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rlvr.config import PromptFormat
from megatron_rlvr.config.sft import SftConfig
from megatron_rlvr.data.records import DataError
from megatron_rlvr.sft.data import Conversation, ConversationRenderer, load_conversations

REPO = Path(__file__).resolve().parents[1]

# Qwen3-like: tools in the system turn, tool calls as <tool_call>{json}</tool_call> after the
# content, consecutive tool turns grouped in one user turn of <tool_response>s, and the
# reasoning (<think>…</think>) of assistant turns before the last user query stripped.
TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}"
    "{%- if '</think>' in content and loop.index0 < ns.last_query %}"
    "{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in m.tool_calls or [] %}"
    '{{- \'<tool_call>{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- (call.function.arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>' + m.content + '</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
SPECIALS += ["<tool_response>", "</tool_response>"]
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "evaluate",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """One token per printable character, and the template's markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIALS + chars)}, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[3:],
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("qwen-like")
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def call(expr: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "calc", "arguments": {"expr": expr}}}],
    }


THREE_TURNS = [
    {"role": "user", "content": "12+7*3?"},
    {**call("7*3"), "content": "<think>mul</think>"},
    {"role": "tool", "content": "21"},
    {"role": "assistant", "content": "", "tool_calls": call("12+21")["tool_calls"] + call("0+0")["tool_calls"]},
    {"role": "tool", "content": "33"},
    {"role": "tool", "content": "0"},
    {"role": "assistant", "content": "#### 33"},
]


def trained_text(tok, example) -> list[str]:
    """The runs of consecutive trained tokens, as text."""
    runs, current = [], ""
    for token, m in zip(example.ids, example.mask):
        if m:
            current += tok.decode([token])
        elif current:
            runs.append(current)
            current = ""
    return runs + ([current] if current else [])


def test_a_three_turn_tool_conversation_trains_exactly_the_assistants_tokens(tokenizer):
    example = ConversationRenderer(tokenizer, PromptFormat()).example(Conversation(THREE_TURNS, [CALC], "t.jsonl:1"))
    full = tokenizer.apply_chat_template(THREE_TURNS, tools=[CALC], tokenize=True, return_dict=False)
    assert example.ids == list(full)  # the one render of the whole conversation
    assert trained_text(tokenizer, example) == [
        '<think>mul</think><tool_call>{"name": "calc", "arguments": {"expr": "7*3"}}</tool_call><|im_end|>',
        '<tool_call>{"name": "calc", "arguments": {"expr": "12+21"}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"expr": "0+0"}}</tool_call><|im_end|>',
        "#### 33<|im_end|>",
    ]
    # untrained: the tools' schemas, the user and tool turns, each generation prompt, the
    # newline the template writes after each end token
    text = tokenizer.decode(example.ids)
    assert text.startswith('<|im_start|>system\n# Tools\n<tools>\n{"type": "function"')
    assert "<|im_start|>user\n<tool_response>33</tool_response>\n<tool_response>0</tool_response><|im_end|>" in text
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    after_end = [example.mask[k + 1] for k, t in enumerate(example.ids[:-1]) if t == im_end]
    assert after_end == [0] * len(after_end)


def test_the_cold_start_trains_the_tokens_and_mask_an_rl_episode_of_the_same_conversation_has(tokenizer):
    """An episode (agent/render.py) sends the prompt, then each model turn's tokens as sampled (up
    to its end token) and the bridge the template adds (the boundary after the end token, the tool
    turn, the generation prompt). SFT on the same conversation must give those ids and that mask,
    or the cold start learns a turn layout RL then never shows (a dropped separator, a trained
    boundary)."""
    from megatron_rlvr.agent.render import TurnRenderer

    def text_of(message: dict) -> str:  # what the model writes for a turn (the template renders calls so)
        calls = [c["function"] for c in message.get("tool_calls", [])]
        return message["content"] + "".join(
            f'<tool_call>{{"name": "{c["name"]}", "arguments": {json.dumps(c["arguments"])}}}</tool_call>'
            for c in calls
        )

    renderer = TurnRenderer(tokenizer, tools=[CALC])
    ids = renderer.prompt(THREE_TURNS[:1])
    mask = [0] * len(ids)
    history = THREE_TURNS[:1]
    turns = [(1, [2]), (3, [4, 5]), (6, [])]  # each assistant message and the tool turns after it
    for index, tool_turns in turns:
        written = text_of(THREE_TURNS[index])
        model_ids = tokenizer(written, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = ids + model_ids, mask + [1] * len(model_ids)
        if tool_turns:
            bridge = renderer.bridge(history, written, [THREE_TURNS[k] for k in tool_turns], model_ids)
            assert bridge.broken is None
            ids, mask = ids + bridge.ids, mask + [0] * len(bridge.ids)
            history = [*history, {"role": "assistant", "content": written}, *(THREE_TURNS[k] for k in tool_turns)]
    example = ConversationRenderer(tokenizer, PromptFormat()).example(Conversation(THREE_TURNS, [CALC]))
    assert example.ids[: len(ids)] == ids and example.mask[: len(ids)] == mask
    # the render goes on with the boundary after the last end token, which the episode never needs
    assert tokenizer.decode(example.ids[len(ids) :]) == "\n" and example.mask[len(ids) :] == [0]


def test_a_conversation_ending_on_a_tool_turn_trains_up_to_its_last_assistant_turn(tokenizer):
    renderer = ConversationRenderer(tokenizer, PromptFormat())
    cut = renderer.example(Conversation(THREE_TURNS[:5], [CALC]))
    whole = renderer.example(Conversation(THREE_TURNS[:4], [CALC]))
    assert cut == whole


def test_a_template_that_re_renders_history_is_refused_naming_the_record(tokenizer):
    """Two user queries: the first answer's reasoning is stripped once the second arrives, so
    that answer has no tokens of its own in the whole render."""
    conversation = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<think>add</think>#### 2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "#### 4"},
    ]
    renderer = ConversationRenderer(tokenizer, PromptFormat())
    with pytest.raises(
        DataError, match=r"^t\.jsonl:4: the chat template renders the conversation before assistant turn 2 differently"
    ):
        renderer.example(Conversation(conversation, None, "t.jsonl:4"))
    conversation[1]["content"] = "#### 2"  # no reasoning: nothing to strip
    assert sum(renderer.example(Conversation(conversation, None, "t.jsonl:4")).mask) == 2 * (
        len("#### 2") + 1
    )  # each answer and its end token


def test_tool_records_load_with_tools_per_row_or_from_the_config(tmp_path):
    rows = [
        {"messages": THREE_TURNS, "tools": json.dumps([CALC])},  # as Parquet files often hold them: JSON text
        {
            "messages": [
                {"role": "user", "content": "x"},
                {**call("1+1"), "content": None, "reasoning_content": "add", "extra": 1},
                {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "calc"},
                {"role": "assistant", "content": "#### 2"},
            ]
        },
    ]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    other = {**CALC, "function": {**CALC["function"], "name": "other"}}
    sft = SftConfig.model_validate({"data": {"type": "file", "path": str(path), "tools": [other]}})
    first, second = load_conversations(sft, 0)
    assert first.tools == [CALC] and second.tools == [other]
    assert second.messages[1:3] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "1+1"}}}],
            "reasoning_content": "add",
        },
        {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "calc"},
    ]
    bad = [
        (
            {"messages": [{"role": "assistant", "content": "", **call("1")}], "tools": [{"name": "calc"}]},
            "tools must be",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
            "JSON object",
        ),
        ({"messages": [{"role": "tool", "content": None}, {"role": "assistant", "content": "a"}]}, "content must be"),
    ]
    for row, why in bad:
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(DataError, match=rf"^{path}:1: .*{why}"):
            load_conversations(SftConfig.model_validate({"data": {"type": "file", "path": str(path)}}), 0)


def test_tool_conversations_need_a_chat_template(tokenizer):
    renderer = ConversationRenderer(tokenizer, PromptFormat(apply_chat_template=False))
    with pytest.raises(DataError, match=r"^t:1: tool calls and tool turns need a chat template"):
        renderer.example(Conversation(THREE_TURNS, [CALC], "t:1"))


# ----------------------------------------------------------------------------- a short run
def traces(count: int) -> list[dict]:
    """Worked tool traces: a sum, a calculator call, its result, the answer."""
    rows = []
    for i in range(count):
        a, b = 10 + (7 * i) % 80, 3 + (5 * i) % 60
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{a}+{b}"},
                    call(f"{a}+{b}"),
                    {"role": "tool", "content": str(a + b)},
                    {"role": "assistant", "content": f"#### {a + b}"},
                ]
            }
        )
    return rows


@pytest.mark.slow
def test_sft_on_tool_conversations_learns(tmp_path):
    """`megatron-rlvr sft` on tool traces (the tiny model's character tokenizer, the template's
    end marker its <eos>): the held-out loss on the assistant's tokens falls well below its start
    (4.93 → 0.94 in 12 steps here; slow: about a minute alone, nearly three on a loaded machine)."""
    data = tmp_path / "traces.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in traces(72)))
    config = {
        "model": {
            "type": "tiny",
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "tokenizer_chars": "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c"))),
        },
        "parallel": {"device": "cpu"},
        "data": {"type": "arithmetic", "chat_template": TEMPLATE.replace("<|im_end|>", "' + eos_token + '")},
        "sft": {
            "data": {"type": "file", "path": str(data), "tools": [CALC]},
            "heldout_examples": 8,
            "batch_tokens": 4096,
            "micro_batch_tokens": 4096,
            "max_tokens": 512,
            "eval_interval": 0,
            "pass_at_1": False,
        },
        "trainer": {
            "output_dir": str(tmp_path / "run"),
            "steps": 12,
            "lr": 5.0e-3,
            "warmup_steps": 2,
            "distributed_optimizer": False,
        },
        "launch": {"mode": "local"},
    }
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_rlvr.cli", "sft", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start, end = metrics[0]["heldout/sft_loss"], metrics[-1]["heldout/sft_loss"]
    assert metrics[-1]["step"] == 12 and metrics[0]["data/sft_examples"] == 64
    assert end < 0.5 * start, (start, end)
