"""The SGLang HTTP API subset this system uses, as typed models with SGLang's field names
(sglang 0.5.23: srt/managers/io_struct.py, srt/entrypoints/http_server.py). The CPU engine
serves these and the client speaks them to the CPU engine and to real SGLang alike.

Unknown fields are refused (SGLang builds its request dataclasses from the JSON body, so an
unknown key fails there too): a typo never silently changes sampling.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(Strict):
    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1: no top-k truncation")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, description="samples per prompt")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    # not a field: the CPU engine's chat endpoint constrains a reply (rollout/openai_api.TokenConstraint)
    _constraint: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k = {self.top_k}: must be -1 (off) or >= 1")
        return self


class GenerateReqInput(Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, description="-1: output tokens only")
    top_logprobs_num: int = Field(0, ge=0)
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)
    stream: bool = False

    @model_validator(mode="after")
    def _check(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids is required")
        return self

    @property
    def is_batch(self) -> bool:
        prompts = self.text if self.text is not None else self.input_ids
        return isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], int)


class FinishReason(BaseModel):
    type: Literal["length", "stop", "abort"]
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None


class MetaInfo(BaseModel):
    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    output_token_logprobs: list[list[Any]] | None = None  # [[logprob, token_id, text|None], ...]
    weight_version: str
    weight_versions: list[dict[str, Any]] | None = None  # [{"version", "start", "end"}, ...]
    e2e_latency: float
    routed_experts: str | None = None  # base64 int32 [seq_len - 1 - start, layers, top_k]


class GenerateResponse(BaseModel):
    text: str = ""  # absent when the server runs with --skip-tokenizer-init
    output_ids: list[int]
    meta_info: MetaInfo


class InitWeightsUpdateGroupReqInput(Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"


class DestroyWeightsUpdateGroupReqInput(Strict):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReqInput(Strict):
    selector: Literal["target", "draft", "all"] = "target"


class EndWeightUpdateReqInput(Strict):
    pass


class UpdateWeightsFromDistributedReqInput(Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    selector: Literal["target", "draft", "all"] = "target"
    torch_empty_cache: bool = False
    checksum: str | None = Field(None, description="this project's extension: sha256 of the bucket")

    @model_validator(mode="after")
    def _check(self) -> UpdateWeightsFromDistributedReqInput:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names ({len(self.names)}), dtypes ({len(self.dtypes)}) and shapes "
                f"({len(self.shapes)}) must have the same length"
            )
        return self


class GetWeightsByNameReqInput(Strict):
    name: str
    truncate_size: int = Field(100, ge=1)


class PauseGenerationReqInput(Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortReqInput(Strict):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionReqInput(Strict):
    new_version: str


MemoryTag = Literal["kv_cache", "weights", "cuda_graph"]


class ReleaseMemoryOccupationReqInput(Strict):
    tags: list[MemoryTag] | None = Field(None, description="None or empty: everything")


class ResumeMemoryOccupationReqInput(Strict):
    tags: list[MemoryTag] | None = Field(None, description="None or empty: everything released")


class UpdateWeightsFromTensorReqInput(Strict):
    serialized_named_tensors: list[str] = Field(
        description="one MultiprocessingSerializer payload (ForkingPickler + base64) per engine TP rank"
    )
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False
