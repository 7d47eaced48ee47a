"""One typed config tree for a run: YAML file + dotted command-line overrides.

The schema imports no torch, so the CLI can validate a config (and `submit` can check a
layout) in a fraction of a second. Validators only raise; every derived value is filled in
one explicit step, `resolve()`. Every error names the dotted field, the bad value and what
is allowed, one line per problem.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from megatron_rlvr.config_base import ConfigError, PositiveInt, Section
from megatron_rlvr.config_base import raise_problems as _raise

# the rest of the data, verifier and eval sections, so that the whole tree imports from here
from megatron_rlvr.config_data import (  # noqa: F401
    BUILTIN_VERIFIERS,
    DATA_FORMATS,
    ArithmeticData,
    ArithmeticSource,
    CodeVerifierConfig,
    EvalConfig,
    FileData,
    FileSource,
    PromptFormat,
    VerifierConfig,
)

# HF `model_type`s the learner's architecture registry can build. Kept here (not imported
# from learner/) so that validating a config never imports Megatron.
SUPPORTED_MODEL_TYPES = ("qwen3_moe",)


# ----------------------------------------------------------------------------- model
class TinyModel(Section):
    """A randomly initialised Qwen3-MoE built locally: the CPU default and the test model."""

    type: Literal["tiny"] = "tiny"
    model_type: Literal["qwen3_moe"] = "qwen3_moe"
    num_layers: PositiveInt = Field(2, description="transformer layers")
    hidden_size: PositiveInt = Field(64, description="model width")
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt = 2
    head_dim: PositiveInt = 16
    moe_intermediate_size: PositiveInt = Field(32, description="FFN width of one expert")
    num_experts: PositiveInt = Field(4, description="routed experts per MoE layer")
    num_experts_per_tok: PositiveInt = Field(2, description="router top-k")
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    vocab_size: PositiveInt | None = Field(
        None, description="None: the tokenizer's size (set when the tokenizer is built)"
    )
    init_seed: int = Field(1234, description="seed of the random initialisation")
    tokenizer_chars: str = Field(
        "0123456789+*-=. ", min_length=1, description="characters of the character-level tokenizer made "
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

    type: Literal["hf"] = "hf"
    path: str = Field(description="directory holding config.json and *.safetensors")
    mcore_checkpoint: str | None = Field(
        None, description="the learner's first weights from this Megatron checkpoint (`megatron-rlvr "
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
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            [
                f"model.path = {model.path!r}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            ]
        )
    try:
        if "num_experts" not in hf and "num_local_experts" not in hf:
            raise KeyError("num_experts")
        return ModelDims(
            model_type=model_type,
            num_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            num_experts=hf.get("num_experts", hf.get("num_local_experts")),  # transformers 5 spells it so
            num_experts_per_tok=hf["num_experts_per_tok"],
        )
    except KeyError as err:
        raise ConfigError([f"model.path = {model.path!r}: config.json lacks {err.args[0]!r}"]) from err


# ----------------------------------------------------------------------------- parallel
class ParallelConfig(Section):
    """Learner layout. World size = tp · pp · dp; experts are split ep · etp ways."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu uses gloo, cuda uses NCCL")
    tp: PositiveInt = Field(1, description="tensor-parallel size")
    pp: PositiveInt = Field(1, description="pipeline-parallel size")
    ep: PositiveInt = Field(1, description="expert-parallel size")
    etp: PositiveInt | None = Field(None, description="expert tensor-parallel size; None: tp")
    dp: PositiveInt | None = Field(
        None, description="data-parallel size; None: the smallest that fits ep · etp"
    )
    sequence_parallel: bool | None = Field(
        None, description="None: on exactly when tp > 1 (Megatron MoE requires it then)"
    )


# ----------------------------------------------------------------------------- algo
LossKind = Literal["grpo", "gspo"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# Clip ranges each loss is designed for: PPO-style token clip with clip-higher (DAPO) for
# GRPO; GSPO's sequence ratio lives within ~1e-3 of 1, so its range is tiny.
DEFAULT_CLIP = {"grpo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


class AlgoConfig(Section):
    """Policy-gradient algorithm: advantages, loss, clipping, importance correction, replay."""

    kind: LossKind = Field("grpo", description="grpo: token ratio; gspo: sequence ratio")
    normalize_std: bool = Field(
        True, description="divide advantages by the group std (GRPO); false: Dr.GRPO"
    )
    clip_low: float | None = Field(None, description="ratio clip 1 - clip_low; None: per kind")
    clip_high: float | None = Field(None, description="ratio clip 1 + clip_high; None: per kind")
    clip_ratio_c: float | None = Field(
        None, description="dual-clip bound for negative advantages (> 1), None: off"
    )
    agg: AggMode = Field("token-mean", description="how per-token losses become one loss")
    tis_cap: float | None = Field(
        2.0, description="truncated importance sampling cap on pi_old/pi_rollout; None: off"
    )
    tis_level: Literal["token", "sequence"] = "token"
    routing_replay: Literal["none", "r2", "r3"] = Field(
        "none", description="r2: replay the learner's own routing; r3: the engine's"
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="entropy bonus weight (aggregated like the loss); keeps "
        "exploration alive where groups would collapse to one answer",
    )
    num_minibatches: PositiveInt = Field(
        1, description="optimizer steps per rollout batch (>1 is off-policy)"
    )

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        problems = []
        if self.clip_low is not None and not 0.0 < self.clip_low < 1.0:
            problems.append(f"algo.clip_low = {self.clip_low}: must be in (0, 1)")
        if self.clip_high is not None and not 0.0 < self.clip_high <= 10.0:
            problems.append(f"algo.clip_high = {self.clip_high}: must be in (0, 10]")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            problems.append(f"algo.clip_ratio_c = {self.clip_ratio_c}: must be > 1 or null")
        if self.tis_cap is not None and self.tis_cap < 1.0:
            problems.append(f"algo.tis_cap = {self.tis_cap}: must be >= 1 or null")
        _raise(problems)
        return self


# ----------------------------------------------------------------------------- rollout
class CpuEngine(Section):
    """The project's own engine server: SGLang's HTTP API on top of HF transformers."""

    type: Literal["cpu"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="engine weights dtype (bf16 makes routing differ from fp32)"
    )


class SglangEngine(Section):
    """Real SGLang 0.5.23 servers: on GPUs (device cuda), or on CPU (device cpu: tests and small
    runs, from the interpreter scripts/setup_sglang_cpu.sh builds)."""

    type: Literal["sglang"] = "sglang"
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cpu: the launcher adds SGLang's CPU flags and environment itself"
    )
    python: str | None = Field(
        None, description="interpreter that has SGLang (e.g. .venv-sglang/bin/python); None: the "
        "project's own. Checked when the config loads",
    )
    tp: PositiveInt = Field(1, description="tensor-parallel size of each server")
    ep: PositiveInt = Field(1, description="expert-parallel size of each server")
    mem_fraction_static: float = Field(0.7, gt=0.0, lt=1.0)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="launch.mode = local only: the GPU ids the engines use, tp of them per "
        "engine in order; None: the GPUs after the learner's GPU 0",
    )
    extra_args: list[str] = Field(default_factory=list, description="passed to launch_server")


class RolloutConfig(Section):
    engine: Annotated[CpuEngine | SglangEngine, Field(discriminator="type")] = Field(
        default_factory=CpuEngine
    )
    num_engines: PositiveInt = Field(1, description="engine servers (one per DP replica)")
    host: str = Field("127.0.0.1", description="address the engines bind to")
    base_port: int = Field(30000, ge=1024, le=65000)
    n_samples_per_prompt: int = Field(8, ge=2, description="group size n (needs >= 2)")
    max_new_tokens: PositiveInt = 16
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    return_routed_experts: bool | None = Field(
        None, description="capture the engine's routing; None: on exactly for r3"
    )
    request_timeout_s: float = Field(120.0, gt=0.0)
    start_timeout_s: float = Field(
        600.0, gt=0.0, description="how long one engine server may take to answer /health (large "
        "checkpoints load slowly); progress goes to the log every 30 s",
    )
    seeded_sampling: bool | None = Field(
        None, description="a sampling seed per group from trainer.seed, for reproducible rollouts; "
        "None: on for the CPU engine (which derives one per sample), off for SGLang",
    )


# ----------------------------------------------------------------------------- buffer
class PromptSkipConfig(Section):
    """Skip, before rollout, prompts whose recent groups were all zero-std (GRESO): a prompt
    with k such groups in a row is skipped with probability min(max_probability,
    1 - explore^k), so it is still probed now and then."""

    enabled: bool = Field(False, description="skip prompts that keep giving zero-std groups")
    explore_solved: float = Field(
        0.5, gt=0.0, le=1.0, description="explore rate of always-solved prompts (1: never skip them)"
    )
    explore_unsolved: float = Field(
        0.5, gt=0.0, le=1.0, description="explore rate of never-solved prompts (1: never skip them)"
    )
    max_probability: float = Field(
        0.9, ge=0.0, lt=1.0, description="cap on the skip probability (< 1: every prompt is probed again)"
    )


class BufferConfig(Section):
    batch_groups: PositiveInt = Field(8, description="useful prompt groups per step")
    zero_std_eps: float = Field(1e-6, ge=0.0, description="groups with reward std <= eps drop")
    max_staleness: int = Field(1, ge=0, description="policy versions a group may lag")
    async_rollout: bool = Field(False, description="generate step k+1 while training step k")
    max_generated_groups_per_step: PositiveInt | None = Field(
        None, description="most prompt groups one step may generate; at the bound the step trains on the "
        "useful groups it has (a short batch, counted), and a bound spent without enough useful groups "
        "ends the run with a checkpoint; None: 64 x batch_groups",
    )
    skip_prompts: PromptSkipConfig = Field(default_factory=PromptSkipConfig)


# ----------------------------------------------------------------------------- weight sync
class WeightSyncConfig(Section):
    bucket_mb: float = Field(512.0, gt=0.0, description="max bytes of one flat bucket, MiB")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl when the learner and the engines are all on cuda, else gloo"
    )
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="what engines do with requests in flight during a sync; after "
        "abort or retract the engines' prefix cache is flushed before they resume",
    )
    checksum: bool | None = Field(
        None, description="engines verify a per-bucket sha256 (a CPU-engine extension SGLang has "
        "not got); None: on for the CPU engine, off for SGLang",
    )
    parity_tolerance: float | Literal["auto"] | None = Field(
        "auto", description="max |logprob diff| of the post-sync probe; auto: from the engine's and "
        "learner's dtypes (see PARITY_TOLERANCE); None: probe off",
    )
    refusal_wait_s: float = Field(
        0.5, ge=0.0, le=60.0, description="how long the first bucket of a sync waits for an "
        "engine's refusal before its broadcast is posted (an unmatched NCCL broadcast hangs)",
    )


# Default post-sync parity tolerance by the lowest precision of engine and learner. fp32 on
# both sides agrees to ~1e-5; bf16 differs by ~0.02 per token and ~0.3 where a MoE routing
# flips (measured on CPU, configs/compare-replay-cpu.yaml); a broken sync is off by nats.
PARITY_TOLERANCE = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}


class TrainerConfig(Section):
    output_dir: str = Field("runs/tiny-moe-cpu", description="checkpoints, logs, metrics")
    steps: PositiveInt = 20
    lr: float = Field(1e-3, gt=0.0)
    min_lr: float = Field(0.0, ge=0.0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    micro_batch_size: PositiveInt = Field(8, description="sequences per forward/backward")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="learner weights")
    distributed_optimizer: bool = Field(True, description="shard optimizer state over DP")
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    recompute_activations: bool = Field(
        False, description="recompute each layer's activations in backward (saves memory)"
    )
    seed: int = 0
    save_interval: int = Field(0, ge=0, description="steps between checkpoints; 0: last only")
    resume: bool = Field(
        False, description="continue from output_dir's checkpoint (weights, optimizer, sampler and "
        "buffer; a synchronous CPU run then logs what an uninterrupted one would); false: start afresh",
    )


class WandbConfig(Section):
    """Weights & Biases, beside metrics.jsonl and TensorBoard (pip install -e '.[wandb]')."""

    project: str = Field(description="W&B project")
    entity: str | None = Field(None, description="team or user; None: your default")
    name: str | None = Field(None, description="run name; None: trainer.output_dir's folder name")
    group: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: written under output_dir/wandb, synced later with `wandb sync`"
    )


class LoggingConfig(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    interval: PositiveInt = Field(1, description="steps between metric lines")
    tensorboard: bool = True
    wandb: WandbConfig | None = Field(None, description="None: no Weights & Biases")


class LaunchConfig(Section):
    mode: Literal["ray", "local"] = Field(
        "ray", description="ray: learner ranks, engines, buffer and verifiers as Ray actors; "
        "local: one learner rank in this process, no Ray (debugging)",
    )
    ray_address: str | None = Field(None, description="None: start a local Ray")
    num_cpus: PositiveInt | None = Field(None, description="local Ray CPUs; None: all")
    object_store_mb: PositiveInt = Field(512, description="local Ray object store size")


class Config(Section):
    """The whole run."""

    model: ModelConfig = Field(default_factory=TinyModel)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    data: Annotated[ArithmeticData | FileData, Field(discriminator="type")] = Field(
        default_factory=ArithmeticData
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)


# ----------------------------------------------------------------------------- resolved
# What resolve() returns: the same tree with every value it fills no longer Optional, so code
# that runs after it reads `cfg.parallel.dp` as an int, not `int | None`.
class ResolvedParallel(ParallelConfig):
    etp: PositiveInt
    dp: PositiveInt
    sequence_parallel: bool


class ResolvedAlgo(AlgoConfig):
    clip_low: float
    clip_high: float


class ResolvedRollout(RolloutConfig):
    return_routed_experts: bool
    seeded_sampling: bool


class ResolvedBuffer(BufferConfig):
    max_generated_groups_per_step: PositiveInt


class ResolvedWeightSync(WeightSyncConfig):
    backend: Literal["gloo", "nccl"]
    checksum: bool
    parity_tolerance: float | None


class ResolvedFileSource(FileSource):
    prompt_key: str
    answer_key: str
    verifier_key: str
    data_source_key: str
    id_key: str
    extra_key: str


class ResolvedFileData(ResolvedFileSource, FileData):
    """data of type file after resolve(): every key named."""


ResolvedDataSource = Annotated[ArithmeticSource | ResolvedFileSource, Field(discriminator="type")]


class ResolvedEval(EvalConfig):
    sets: dict[str, ResolvedDataSource]  # type: ignore[assignment]  # narrower values: resolve() made them


class ResolvedConfig(Config):
    """A Config after resolve(): the type everything past loading reads."""

    parallel: ResolvedParallel
    algo: ResolvedAlgo
    rollout: ResolvedRollout
    buffer: ResolvedBuffer
    weight_sync: ResolvedWeightSync
    data: Annotated[ArithmeticData | ResolvedFileData, Field(discriminator="type")]
    eval: ResolvedEval


# ----------------------------------------------------------------------------- checks
def data_sources(cfg: ResolvedConfig) -> list[tuple[str, ArithmeticSource | ResolvedFileSource]]:
    """(dotted name, source) of the training data and of every eval set."""
    return [("data", cfg.data), *((f"eval.sets.{name}", s) for name, s in cfg.eval.sets.items())]


def _cross_field_problems(cfg: ResolvedConfig, dims: ModelDims, dp_derived: bool = False) -> list[str]:
    """Checks that span sections; run on the resolved config. A check on a derived value
    (dp, from ep) is skipped when what it derives from is already wrong: an error names only
    what the user got wrong."""
    p, a, r = cfg.parallel, cfg.algo, cfg.rollout
    problems = []
    if dims.num_experts % p.ep:
        problems.append(
            f"parallel.ep = {p.ep}: must divide the model's {dims.num_experts} experts"
        )
    if dims.num_attention_heads % p.tp or dims.num_key_value_heads % p.tp:
        problems.append(
            f"parallel.tp = {p.tp}: must divide the attention heads "
            f"({dims.num_attention_heads}) and key/value heads ({dims.num_key_value_heads})"
        )
    if dims.num_layers % p.pp:
        problems.append(f"parallel.pp = {p.pp}: must divide the {dims.num_layers} layers")
    if p.tp > 1 and p.sequence_parallel is False:
        problems.append(
            f"parallel.sequence_parallel = false: MoE with parallel.tp = {p.tp} needs "
            "sequence parallel (set true or leave null)"
        )
    expert_dp_world = p.tp * p.dp
    if expert_dp_world % (p.ep * p.etp):
        problems.append(
            f"parallel.ep = {p.ep}, parallel.etp = {p.etp}: ep · etp must divide tp · dp "
            f"= {expert_dp_world} (the ranks of one pipeline stage)"
        )
    problems += _engine_problems(cfg)
    if a.routing_replay == "r3" and r.return_routed_experts is False:
        problems.append(
            "rollout.return_routed_experts = false: algo.routing_replay = r3 replays the "
            "engine's routing, so the engine must capture it (set true or leave null)"
        )
    if a.clip_ratio_c is not None and a.kind != "grpo":
        problems.append(f"algo.clip_ratio_c = {a.clip_ratio_c}: dual clip is for kind grpo")
    layout_wrong = bool(problems)
    samples = cfg.buffer.batch_groups * r.n_samples_per_prompt
    per_step = a.num_minibatches * p.dp
    if samples % per_step and not (dp_derived and layout_wrong):
        dp = f"parallel.dp = {p.dp}, derived from parallel.ep · etp / tp" if dp_derived else "parallel.dp"
        problems.append(
            f"algo.num_minibatches = {a.num_minibatches}: buffer.batch_groups · "
            f"rollout.n_samples_per_prompt = {samples} samples must split evenly into "
            f"num_minibatches · {dp} = {per_step} parts"
        )
    bound = cfg.buffer.max_generated_groups_per_step
    if bound is not None and bound < cfg.buffer.batch_groups:
        problems.append(
            f"buffer.max_generated_groups_per_step = {bound}: must be >= buffer.batch_groups "
            f"({cfg.buffer.batch_groups}), or no step could fill its batch"
        )
    if cfg.launch.mode == "local" and p.tp * p.pp * p.dp != 1:
        problems.append(
            f"launch.mode = local: runs one learner rank, but tp·pp·dp = {p.tp}·{p.pp}·{p.dp} "
            "(use launch.mode = ray for multi-rank layouts)"
        )
    for where, source in data_sources(cfg):
        if isinstance(source, FileSource):
            problems.extend(source.problems(where))
    if cfg.trainer.min_lr > cfg.trainer.lr:
        problems.append(
            f"trainer.min_lr = {cfg.trainer.min_lr}: must be <= trainer.lr ({cfg.trainer.lr})"
        )
    return problems


def _engine_problems(cfg: Config) -> list[str]:
    """Engine placement and what an SGLang engine cannot honour."""
    p, r, sync = cfg.parallel, cfg.rollout, cfg.weight_sync
    engine = r.engine
    problems = []
    if sync.backend == "nccl" and p.device == "cpu":
        problems.append("weight_sync.backend = nccl: NCCL needs parallel.device = cuda")
    elif sync.backend == "nccl" and (isinstance(engine, CpuEngine) or engine.device == "cpu"):
        problems.append("weight_sync.backend = nccl: the engines run on CPU and receive over gloo "
                        "(set gloo or auto)")
    if not isinstance(engine, SglangEngine):
        return problems
    if engine.tp % engine.ep:
        problems.append(f"rollout.engine.ep = {engine.ep}: must divide rollout.engine.tp ({engine.tp}); "
                        "SGLang places its expert-parallel ranks on its tensor-parallel ranks")
    if engine.device == "cuda" and p.device == "cpu":
        problems.append("rollout.engine.device = cuda: a CPU learner (parallel.device = cpu) runs "
                        "SGLang on CPU (device: cpu) or the learner on cuda")
    if sync.checksum:
        problems.append("weight_sync.checksum = true: SGLang has no per-bucket checksum (the CPU "
                        "engine's extension); leave it null: the post-sync parity probe checks the weights")
    if sync.pause_mode == "in_place" and "--disable-radix-cache" not in engine.extra_args:
        problems.append("weight_sync.pause_mode = in_place: SGLang cannot flush its prefix cache while "
                        "paused requests hold it, so new requests would reuse KV of the old weights; use "
                        "retract or abort, or add --disable-radix-cache to rollout.engine.extra_args")
    if engine.gpus is not None:
        if cfg.launch.mode != "local":
            problems.append("rollout.engine.gpus: only for launch.mode = local (Ray assigns GPUs to "
                            "engine actors)")
        elif engine.device != "cuda" or len(engine.gpus) != r.num_engines * engine.tp:
            problems.append(f"rollout.engine.gpus = {engine.gpus}: needs rollout.num_engines × "
                            f"rollout.engine.tp = {r.num_engines * engine.tp} GPU ids on device cuda")
    if engine.python is not None:
        problems += _engine_python_problems(engine.python, sync.backend)
    return problems


def sglang_install(python: str) -> dict:
    """The SGLang and torch versions `python` has, read from package metadata without importing
    either (a fraction of a second). Raises OSError (missing) or RuntimeError (unreadable)."""
    import subprocess

    probe = ("import importlib.metadata as m, importlib.util as u, json\n"
             "v = lambda n: m.version(n) if u.find_spec(n) else None\n"
             "print(json.dumps({'sglang': v('sglang'), 'torch': v('torch')}))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise RuntimeError((done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1])
    return json.loads(done.stdout)


def _engine_python_problems(python: str, backend: str) -> list[str]:
    import importlib.metadata

    where = f"rollout.engine.python = {python!r}"
    try:
        found = sglang_install(python)
    except (OSError, RuntimeError, ValueError) as err:
        return [f"{where}: cannot run it ({err})"]
    if found["sglang"] is None:
        return [f"{where}: has no SGLang (build one with bash scripts/setup_sglang_cpu.sh, or "
                "bash scripts/setup.sh --gpu)"]
    ours = importlib.metadata.version("torch")
    if backend == "nccl" and found["torch"] != ours:
        return [f"{where}: torch {found['torch']} there, {ours} here: one NCCL weight-update group "
                "needs the same torch build on both sides (install the learner's torch there)"]
    return []


def resolve(cfg: Config) -> ResolvedConfig:
    """Fills every derived value (clip ranges per loss kind, etp, sequence parallel, routed
    expert capture), then runs the cross-section checks. Returns a new config."""
    cfg = cfg.model_copy(deep=True)
    clip_low, clip_high = DEFAULT_CLIP[cfg.algo.kind]
    if cfg.algo.clip_low is None:
        cfg.algo.clip_low = clip_low
    if cfg.algo.clip_high is None:
        cfg.algo.clip_high = clip_high
    if cfg.parallel.etp is None:
        cfg.parallel.etp = cfg.parallel.tp
    dp_derived = cfg.parallel.dp is None
    if dp_derived:
        # experts are carved out of the tp · dp ranks of a stage: ep=2 alone means 2 ranks
        expert_ranks = cfg.parallel.ep * cfg.parallel.etp
        cfg.parallel.dp = next(
            dp for dp in range(1, expert_ranks + 1) if (cfg.parallel.tp * dp) % expert_ranks == 0
        )
    if cfg.parallel.sequence_parallel is None:
        cfg.parallel.sequence_parallel = cfg.parallel.tp > 1
    if cfg.rollout.return_routed_experts is None:
        cfg.rollout.return_routed_experts = cfg.algo.routing_replay == "r3"
    if cfg.rollout.seeded_sampling is None:
        cfg.rollout.seeded_sampling = isinstance(cfg.rollout.engine, CpuEngine)
    if cfg.buffer.max_generated_groups_per_step is None:
        cfg.buffer.max_generated_groups_per_step = 64 * cfg.buffer.batch_groups
    engine, sync = cfg.rollout.engine, cfg.weight_sync
    on_gpus = isinstance(engine, SglangEngine) and engine.device == "cuda" and cfg.parallel.device == "cuda"
    if sync.backend == "auto":
        sync.backend = "nccl" if on_gpus else "gloo"
    if sync.checksum is None:
        sync.checksum = isinstance(engine, CpuEngine)
    if isinstance(engine, SglangEngine) and engine.python is not None and "/" in engine.python:
        engine.python = os.path.abspath(engine.python)  # not resolve(): a venv's python is a symlink
    if sync.parity_tolerance == "auto":
        dtypes = {engine.dtype, cfg.trainer.dtype}
        sync.parity_tolerance = max(PARITY_TOLERANCE[d] for d in dtypes)
    for source in [cfg.data, *cfg.eval.sets.values()]:
        if isinstance(source, FileSource):
            source.fill_keys()
    resolved = ResolvedConfig.model_validate(cfg.model_dump())
    _raise(_cross_field_problems(resolved, model_dims(resolved.model), dp_derived))
    return resolved


# ----------------------------------------------------------------------------- loading
def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` → (["a", "b", "c"], value), the value parsed as YAML (so `2` is an int,
    `null` is None and `[1, 2]` a list)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"override {text!r}: expected dotted.key=value"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _default_kind(path: list[str]) -> str | None:
    """The `type` a section of the schema takes when the config does not say (a
    discriminated union's default member), e.g. ["data"] → "arithmetic"."""
    model: type[BaseModel] = Config
    for depth, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return None
        default = field.get_default(call_default_factory=True)
        if not isinstance(default, BaseModel):
            return None
        if depth == len(path) - 1:
            return getattr(default, "type", None)
        model = type(default)
    return None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Sets each dotted key in the raw config dict, creating sections as needed. Setting a
    section's `type` to another kind starts that section afresh (`data.type=file
    data.path=x.jsonl` over a YAML with arithmetic data): the old kind's fields would not
    belong to the new one. Kinds are set first, so the order of the overrides does not matter."""
    parsed = [(text, *parse_override(text)) for text in overrides]
    parsed.sort(key=lambda item: item[1][-1] != "type")  # stable: kinds first, then the rest in order
    for text, path, value in parsed:
        node = raw
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                dotted = ".".join(path[: depth + 1])
                raise ConfigError([f"override {text!r}: {dotted} is a value, not a section"])
            node = child
        if path[-1] == "type" and node.get("type", _default_kind(path[:-1])) != value:
            node.clear()
        node[path[-1]] = value
    return raw


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (one, or each member of a union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _walk(loc: tuple) -> tuple[list[str], list[str]]:
    """Follows a pydantic error location through the schema. Returns the user-facing dotted
    parts (union tags dropped) and the field names allowed at the last step."""
    model: type[BaseModel] | None = Config
    dotted: list[str] = []
    allowed: list[str] = []
    i = 0
    while i < len(loc):
        part = str(loc[i])
        dotted.append(part)
        i += 1
        if model is None:
            continue
        allowed = list(model.model_fields)
        field = model.model_fields.get(part)
        members = _models_in(field.annotation) if field else []
        model = members[0] if len(members) == 1 else None
        if len(members) > 1:  # discriminated union: the next loc part is the member tag
            tags = {m.model_fields["type"].default: m for m in members}
            if i < len(loc) and loc[i] in tags:
                model = tags[loc[i]]
                i += 1
    return dotted, allowed


def _format_validation_error(err: ValidationError) -> list[str]:
    lines = []
    for item in err.errors():
        ctx_error = item.get("ctx", {}).get("error")
        if isinstance(ctx_error, ConfigError):
            lines.extend(ctx_error.problems)
            continue
        parts, names = _walk(tuple(item["loc"]))
        dotted = ".".join(parts) or "<root>"
        if item["type"] == "extra_forbidden":
            hint = difflib.get_close_matches(str(item["loc"][-1]), names, n=1)
            allowed = f"did you mean {hint[0]}?" if hint else f"allowed: {', '.join(names)}"
            lines.append(f"{dotted}: unknown field ({allowed})")
        elif item["type"] == "missing":
            lines.append(f"{dotted}: required field is missing")
        else:
            lines.append(f"{dotted} = {item.get('input')!r}: {item['msg']}")
    return lines


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ResolvedConfig:
    """YAML file (or defaults when None) + dotted overrides → validated, resolved Config.
    Raises ConfigError with one line per problem."""
    raw: dict = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError([f"config file {str(path)!r}: {err.strerror}"]) from err
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError([f"config file {str(path)!r}{where}: not valid YAML"]) from None
        if not isinstance(raw, dict):
            raise ConfigError([f"config file {str(path)!r}: top level must be a mapping"])
    raw = apply_overrides(raw, list(overrides))
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from err
    return resolve(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
