"""The `sft` section: supervised fine-tuning (`megatron-rlvr sft CONFIG`) on the same learner,
model, layout and trainer settings as an RL run, as the cold start an RL run then begins from.
Only the sft command reads it; `train` ignores it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from megatron_rlvr.config.base import PositiveInt, Section
from megatron_rlvr.config.base import raise_problems as _raise
from megatron_rlvr.config.data import LongAnswerSource


class SftLongAnswers(LongAnswerSource):
    """Worked solutions of the built-in long-answer task, some of them wrong on purpose."""

    step_error_rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="probability that one step of a written solution is off by one (the answer "
        "is then wrong): imitated, it leaves the cold start right only sometimes",
    )


class SftFile(Section):
    """Conversations from JSONL or Parquet files: a `messages` list (verl's multi-turn SFT
    layout, OpenAI's message layout: assistant tool_calls and tool turns included) whose
    assistant turns are trained, or a prompt and a response column; tools per row or for all."""

    type: Literal["file"] = Field("file", description="file: conversations from JSONL or Parquet files")
    path: str | list[str] = Field(description="a .jsonl or .parquet file, or a list of them")
    format: Literal["messages", "prompt_response"] = Field(
        "messages",
        description="messages: a list of {role, content} per row; prompt_response: a prompt (string or "
        "messages) and the assistant's response",
    )
    messages_key: str = Field("messages", description="the messages column (format messages), dotted")
    prompt_key: str = Field("prompt", description="the prompt column (format prompt_response), dotted")
    response_key: str = Field("response", description="the response column (format prompt_response), dotted")
    tools_key: str = Field(
        "tools",
        description="the column of a row's tools (OpenAI function schemas, or their JSON text) that the chat "
        "template is given, dotted; a row without it takes sft.data.tools",
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="tools (OpenAI function schemas: {type: function, function: {name, description, "
        "parameters}}) for every row that has none of its own",
    )

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class SftConfig(Section):
    """Steps, learning rate, precision, layout and output folder come from trainer, parallel
    and model, as for RL; prompts are rendered with data's chat-template settings."""

    data: Annotated[SftLongAnswers | SftFile, Field(discriminator="type")] = Field(
        default_factory=SftLongAnswers, description="the conversations: long_answers (built in) or file"
    )
    heldout_examples: int = Field(
        64, ge=0, description="the last N conversations are held out: their loss is reported, never trained on"
    )
    batch_tokens: PositiveInt = Field(
        8192, description="tokens (prompt and response, before padding) per optimizer step"
    )
    micro_batch_tokens: PositiveInt = Field(
        4096,
        description="most tokens of one micro-batch, padding included (rows grouped first-fit-decreasing)",
    )
    max_tokens: PositiveInt = Field(1024, description="longer conversations are dropped (counted)")
    pack_sequences: bool = Field(
        False,
        description="conversations back to back in rows of max_tokens, each attending only to itself "
        "(a block-diagonal causal mask), micro_batch_tokens // max_tokens rows a micro-batch, instead of "
        "one conversation a row padded to the longest: padding only at row ends, attention quadratic in "
        "max_tokens; the local attention only (CPU, not transformer-engine)",
    )
    eval_interval: int = Field(20, ge=0, description="steps between held-out losses; 0: at the end only")
    export_dir: str | None = Field(
        None,
        description="where the final HF model (weights, config, tokenizer) goes, for an RL run's "
        "model.path; None: trainer.output_dir/hf",
    )
    pass_at_1: bool = Field(
        True,
        description="score the exported model on eval.sets with an engine and the verifiers at the end "
        "(the same evaluation as train's)",
    )

    @model_validator(mode="after")
    def _check(self) -> SftConfig:
        if self.micro_batch_tokens < self.max_tokens:
            _raise(
                [
                    f"sft.micro_batch_tokens = {self.micro_batch_tokens}: must hold the longest "
                    f"conversation, sft.max_tokens = {self.max_tokens}"
                ]
            )
        return self
