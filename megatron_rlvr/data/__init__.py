"""Prompts for RL: records from JSONL or Parquet files (plain or verl layout) or the built-in
arithmetic task, rendered with the model's chat template into the token ids the engines get.

    load_data(source, verifiers)      → LoadedPrompts (records, bad rows skipped)
    PromptRenderer(tokenizer, fmt)    → .encode(records) → EncodedPrompts (ids per prompt)
    check_inputs(cfg)                 → every data file and row of a run checked, before it starts
"""

from megatron_rlvr.data.arithmetic import CHAT_TEMPLATE, arithmetic_prompts, build_arithmetic_tokenizer
from megatron_rlvr.data.chat import EncodedPrompts, PromptRenderer
from megatron_rlvr.data.check import check_inputs, load_data
from megatron_rlvr.data.records import DataError, LoadedPrompts, PromptRecord

__all__ = [
    "CHAT_TEMPLATE",
    "DataError",
    "EncodedPrompts",
    "LoadedPrompts",
    "PromptRecord",
    "PromptRenderer",
    "arithmetic_prompts",
    "build_arithmetic_tokenizer",
    "check_inputs",
    "load_data",
]
