"""The model section: a tiny random Qwen3-MoE built locally, or an HF checkpoint directory;
and the shape facts of either that layout checks need."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from megatron_rlvr.config.base import ConfigError, PositiveInt, Section
from megatron_rlvr.config.base import raise_problems as _raise

# HF `model_type`s the learner can build: families.py's table (plain Python, so validating a
# config never imports Megatron or torch)
from megatron_rlvr.families import (
    EXPERT_COUNT_KEYS,
    SUPPORTED_MODEL_TYPES,  # noqa: F401
    family_name,
    num_experts,
    unsupported_message,
)


# ----------------------------------------------------------------------------- model
class TinyModel(Section):
    """A randomly initialised Qwen3-MoE built locally: the CPU default and the test model."""

    type: Literal["tiny"] = Field("tiny", description="tiny: a random model made under trainer.output_dir/model")
    model_type: Literal["qwen3_moe"] = Field("qwen3_moe", description="the HF architecture it is built as")
    num_layers: PositiveInt = Field(2, description="transformer layers")
    hidden_size: PositiveInt = Field(64, description="model width")
    num_attention_heads: PositiveInt = Field(4, description="query heads")
    num_key_value_heads: PositiveInt = Field(2, description="key/value heads (grouped-query attention)")
    head_dim: PositiveInt = Field(16, description="width of one attention head")
    moe_intermediate_size: PositiveInt = Field(32, description="FFN width of one expert")
    num_experts: PositiveInt = Field(4, description="routed experts per MoE layer")
    num_experts_per_tok: PositiveInt = Field(2, description="router top-k")
    norm_topk_prob: bool = Field(True, description="renormalise the top-k routing weights to sum to 1")
    tie_word_embeddings: bool = Field(False, description="share the input embedding with the output layer")
    vocab_size: PositiveInt | None = Field(
        None, description="None: the tokenizer's size (set when the tokenizer is built)"
    )
    init_seed: int = Field(1234, description="seed of the random initialisation")
    tokenizer_chars: str = Field(
        "0123456789+*-=. ",
        min_length=1,
        description="characters of the character-level tokenizer made "
        "with the model (one token each; role tokens and <bos>/<eos>/<pad>/<unk> are added)",
    )

    @model_validator(mode="after")
    def _check(self) -> TinyModel:
        problems = []
        if self.num_experts_per_tok > self.num_experts:
            problems.append(
                f"model.num_experts_per_tok = {self.num_experts_per_tok}: must be <= "
                f"model.num_experts ({self.num_experts})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"model.num_key_value_heads = {self.num_key_value_heads}: must divide "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        _raise(problems)
        return self


class HFModel(Section):
    """An HF checkpoint directory (config.json + safetensors) to start the run from."""

    type: Literal["hf"] = Field("hf", description="hf: an HF checkpoint directory")
    path: str = Field(description="directory holding config.json and *.safetensors")
    mcore_checkpoint: str | None = Field(
        None,
        description="the learner's first weights from this Megatron checkpoint (`megatron-rlvr "
        "convert hf-to-mcore`, any layout) instead of path's safetensors; path still gives the config, "
        "tokenizer and the engines' first weights, so both must hold the same model",
    )


ModelConfig = Annotated[TinyModel | HFModel, Field(discriminator="type")]


class ModelDims(BaseModel):
    """The shape facts that layout checks need, read from either model source."""

    model_type: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int


def model_dims(model: TinyModel | HFModel) -> ModelDims:
    """Reads the dimensions of the configured model (config.json for an HF checkpoint)."""
    if isinstance(model, TinyModel):
        return ModelDims(
            model_type=model.model_type,
            num_layers=model.num_layers,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_key_value_heads,
            num_experts=model.num_experts,
            num_experts_per_tok=model.num_experts_per_tok,
        )
    config_path = Path(model.path) / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError([f"model.path = {model.path!r}: no config.json in that directory"]) from None
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError([f"model.path = {model.path!r}: cannot read config.json ({err})"]) from err
    model_type = hf.get("model_type")
    if family_name(model_type) is None:
        raise ConfigError([f"model.path = {model.path!r}: " + unsupported_message(model_type, "config.json")])
    try:
        if num_experts(hf) is None:
            raise KeyError(" or ".join(EXPERT_COUNT_KEYS))
        return ModelDims(
            model_type=family_name(model_type),
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            num_experts=num_experts(hf),
            num_experts_per_tok=hf["num_experts_per_tok"],
        )
    except KeyError as err:
        raise ConfigError([f"model.path = {model.path!r}: config.json lacks {err.args[0]!r}"]) from err
