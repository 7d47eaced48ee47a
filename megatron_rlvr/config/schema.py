"""The sections of a run's config besides model and data (parallel, algo, rollout, buffer,
weight sync, trainer, logging, launch) and `Config`, the whole tree a YAML file validates into."""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, model_validator

from megatron_rlvr.config.agent import AgentConfig
from megatron_rlvr.config.base import PositiveInt, Section
from megatron_rlvr.config.base import raise_problems as _raise
from megatron_rlvr.config.data import ArithmeticData, EvalConfig, FileData, LongAnswerData, VerifierConfig
from megatron_rlvr.config.model import ModelConfig, TinyModel
from megatron_rlvr.config.rejection import parse_rejection
from megatron_rlvr.config.sft import SftConfig


# ----------------------------------------------------------------------------- parallel
class ParallelConfig(Section):
    """Learner layout. World size = tp · pp · dp; experts are split ep · etp ways."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu uses gloo, cuda uses NCCL")
    tp: PositiveInt = Field(1, description="tensor-parallel size")
    pp: PositiveInt = Field(1, description="pipeline-parallel size")
    ep: PositiveInt = Field(1, description="expert-parallel size")
    etp: PositiveInt | None = Field(None, description="expert tensor-parallel size; None: tp")
    dp: PositiveInt | None = Field(None, description="data-parallel size; None: the smallest that fits ep · etp")
    sequence_parallel: bool | None = Field(
        None, description="None: on exactly when tp > 1 (Megatron MoE requires it then)"
    )


# ----------------------------------------------------------------------------- algo
LossKind = Literal["grpo", "gspo", "minirl", "rec", "opmd", "asymre"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# Clip ranges each loss is designed for: PPO-style token clip with clip-higher (DAPO) for
# GRPO and MiniRL; GSPO's sequence ratio lives within ~1e-3 of 1, so its range is tiny; REC's
# symmetric ε = 0.2 (Trinity-RFT); OPMD and AsymRE do not clip (the values are unused).
DEFAULT_CLIP = {
    "grpo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
    "minirl": (0.2, 0.28),
    "rec": (0.2, 0.2),
    "opmd": (0.2, 0.2),
    "asymre": (0.2, 0.2),
}
ASYMRE_SHIFT = -0.1  # AsymRE's baseline: the group mean shifted down by 0.1


class RolloutCorrectionConfig(Section):
    """Correction for the engine's policy μ differing from the learner's π_old (numerics,
    staleness), with verl 0.9.1's `algorithm.rollout_correction` names and meanings."""

    rollout_is: Literal["token", "sequence", "geometric"] | None = Field(
        "token",
        description="importance weights pi_old/mu per token, per sequence (product of the tokens'), or the "
        "sequence's geometric mean (ours, not verl's); None: no weights",
    )
    rollout_is_threshold: float = Field(
        2.0, gt=0.0, le=1e6, description="upper threshold of the weights: truncated to it (TIS), or see _lower"
    )
    rollout_is_threshold_lower: float | None = Field(
        None,
        ge=0.0,
        description="IcePop: weights outside [lower, upper] are zeroed instead of truncated (verl's "
        "'lower_upper' string); 0 zeroes only those above upper (AReaL's behav_imp_weight_cap); None: TIS",
    )
    rollout_is_batch_normalize: bool = Field(
        False,
        description="divide the weights by their mean over the step's whole batch so they average 1 (bypass mode: per micro-batch)",
    )
    rollout_rs: str | None = Field(
        None,
        description="rejection: comma-separated verl options token_k1..3, seq_sum_k1..3, seq_mean_k1..3, "
        "seq_max_k2..3 (token: mask the token; seq: drop the sequence); None: off",
    )
    rollout_rs_threshold: str | float | None = Field(
        None,
        description="one threshold, or one per rollout_rs option, comma-separated; k1: 'lower_upper' ratio "
        "bounds or an upper u (lower 1/u); k2, k3: an upper bound on the divergence",
    )
    bypass_mode: bool = Field(
        False,
        description="use the engine's logprobs as the old ones and skip the learner's old-logprob pass",
    )
    loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip",
        description="bypass mode's loss: ppo_clip (the ratio pi/mu, no weights) or reinforce (-w·A·log pi)",
    )


class StaleNegativesConfig(Section):
    """Separate weight bounds by the sign of the advantage: off-policy positive samples are
    kept up to positive_cap, negative ones clamped into [negative_floor, negative_cap]."""

    enabled: bool = Field(False, description="replace the truncation of rollout_correction's weights")
    positive_cap: float = Field(10.0, ge=1.0, le=1e6, description="upper bound of a positive-advantage weight")
    negative_cap: float = Field(1.0, gt=0.0, le=1e6, description="upper bound of a negative-advantage weight")
    negative_floor: float = Field(0.5, ge=0.0, description="lower bound of a negative-advantage weight")


class RecConfig(Section):
    """REC (kind rec), Trinity-RFT's RECPolicyLossFn with its default arguments; its ε_low/ε_high
    are algo.clip_low/clip_high."""

    clip_mode: Literal["none", "one-side", "two-side", "ring", "gspo-one-side"] = Field(
        "none",
        description="which tokens keep a gradient, by their detached ratio pi/pi_old (gspo-one-side: by the "
        "sequence's geometric-mean ratio; its loss is seq-mean-token-mean, so algo.agg must say so)",
    )
    weight: Literal[
        "none", "importance_sampling", "truncated_importance_sampling", "gspo_importance_sampling", "advantage"
    ] = Field(
        "none",
        description="what multiplies the advantage: 1, r, clamp(r, 1 - epsilon_low_prime, 1 + epsilon_high_prime), "
        "the sequence's geometric-mean r, exp(A/temp)",
    )
    regularizer: Literal["none", "k2", "forward-kl"] = Field(
        "none", description="k2: coef·(log pi - log pi_old)^2; forward-kl: -coef·log pi"
    )
    regularizer_coef: float = Field(0.0, ge=0.0, le=1e3, description="the regulariser's weight")
    epsilon_low_prime: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="ring: A >= 0 also kept where r <= 1 - this; truncated_importance_sampling: the lower bound "
        "1 - this",
    )
    epsilon_high_prime: float = Field(
        2.0,
        gt=0.0,
        le=1e3,
        description="ring: A <= 0 also kept where r >= 1 + this; truncated_importance_sampling: the upper bound "
        "1 + this",
    )
    temp: float = Field(1.0, gt=0.0, le=1e3, description="weight advantage: the temperature of exp(A/temp)")


class AdvantageConfig(Section):
    """How rewards become advantages: reward shaping, then the baseline of the group."""

    baseline_type: Literal["group_mean", "group_median", "rloo", "log_avg_exp", "exponential_moving_average"] = Field(
        "group_mean",
        description="group_mean (GRPO), group_median, rloo (the others' mean), log_avg_exp (OPMD, "
        "temperature algo.opmd.tau), exponential_moving_average (per prompt, of past group means)",
    )
    baseline_shift: float | None = Field(
        None, ge=-1e3, le=1e3, description="added to the baseline; None: -0.1 for kind asymre, else 0"
    )
    ema_decay: float = Field(0.9, ge=0.0, lt=1.0, description="exponential_moving_average: weight of the past")
    reward_scale: float = Field(1.0, gt=0.0, le=1e6, description="rewards are multiplied by this first")
    reward_clip: float | None = Field(
        None, gt=0.0, description="then clipped to [-reward_clip, reward_clip]; None: not clipped"
    )


class OpmdConfig(Section):
    """OPMD and AsymRE (kinds opmd, asymre): the loss -A·log pi divided by 1 + tau."""

    tau: float = Field(1.0, gt=0.0, le=1e3, description="regularisation strength (and log_avg_exp's temperature)")


class AlgoConfig(Section):
    """Policy-gradient algorithm: advantages, loss, clipping, importance correction, replay."""

    kind: LossKind = Field(
        "grpo",
        description="grpo: token ratio; gspo: sequence ratio; minirl: token ratio with MiniRL's mask; "
        "rec, opmd, asymre: the off-policy REINFORCE family",
    )
    normalize_std: bool = Field(True, description="divide advantages by the group std (GRPO); false: Dr.GRPO")
    clip_low: float | None = Field(None, description="ratio clip 1 - clip_low; None: per kind")
    clip_high: float | None = Field(None, description="ratio clip 1 + clip_high; None: per kind")
    clip_ratio_c: float | None = Field(None, description="dual-clip bound for negative advantages (> 1), None: off")
    agg: AggMode = Field("token-mean", description="how per-token losses become one loss")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="importance weights and rejection for pi_old vs mu"
    )
    stale_negatives: StaleNegativesConfig = Field(
        default_factory=StaleNegativesConfig, description="weight bounds by the advantage's sign"
    )
    rec: RecConfig = Field(default_factory=RecConfig, description="REC's options (kind rec)")
    opmd: OpmdConfig = Field(default_factory=OpmdConfig, description="OPMD/AsymRE's options")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="baseline and reward shaping")
    routing_replay: Literal["none", "r2", "r3"] = Field(
        "none", description="r2: replay the learner's own routing; r3: the engine's"
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        description="entropy bonus weight (aggregated like the loss); keeps "
        "exploration alive where groups would collapse to one answer",
    )
    num_minibatches: PositiveInt = Field(1, description="optimizer steps per rollout batch (>1 is off-policy)")
    epochs: int = Field(
        1,
        ge=1,
        le=64,
        description="passes over each rollout batch (verl's ppo_epochs), each split into num_minibatches "
        "optimizer steps in the same order; passes after the first train off-policy (train/last_epoch/* "
        "says how far they drifted)",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: object) -> object:
        if isinstance(data, dict):
            moved = {
                "tis_cap": "algo.rollout_correction.rollout_is_threshold (rollout_is: null turns it off)",
                "tis_level": "algo.rollout_correction.rollout_is",
            }
            _raise([f"algo.{key}: moved to {where}" for key, where in moved.items() if key in data])
        return data

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        problems = []
        if self.clip_low is not None and not 0.0 < self.clip_low < 1.0:
            problems.append(f"algo.clip_low = {self.clip_low}: must be in (0, 1)")
        if self.clip_high is not None and not 0.0 < self.clip_high <= 10.0:
            problems.append(f"algo.clip_high = {self.clip_high}: must be in (0, 10]")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            problems.append(f"algo.clip_ratio_c = {self.clip_ratio_c}: must be > 1 or null")
        if self.kind == "rec" and self.rec.clip_mode == "gspo-one-side" and self.agg != "seq-mean-token-mean":
            problems.append(
                f"algo.agg = {self.agg}: algo.rec.clip_mode = gspo-one-side aggregates seq-mean-token-mean "
                "(as Trinity-RFT does); set algo.agg = seq-mean-token-mean"
            )
        rc = self.rollout_correction
        key = "algo.rollout_correction"
        if rc.rollout_is_threshold_lower is not None and rc.rollout_is_threshold_lower > rc.rollout_is_threshold:
            problems.append(
                f"{key}.rollout_is_threshold_lower = {rc.rollout_is_threshold_lower}: must be <= "
                f"rollout_is_threshold ({rc.rollout_is_threshold})"
            )
        if rc.rollout_rs is not None or rc.rollout_rs_threshold is not None:
            try:
                parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
            except ValueError as err:
                problems.append(f"{key}.rollout_rs = {rc.rollout_rs!r}: {err}")
        if rc.rollout_rs is None and rc.rollout_rs_threshold is not None:
            problems.append(f"{key}.rollout_rs_threshold = {rc.rollout_rs_threshold!r}: set rollout_rs too")
        if rc.bypass_mode and rc.loss_type == "reinforce" and self.kind != "grpo":
            problems.append(f"{key}.loss_type = reinforce: it replaces the loss of algo.kind = {self.kind}; use grpo")
        if rc.bypass_mode and self.routing_replay == "r2":
            problems.append(f"{key}.bypass_mode = true: r2 records its routing in the old-logprob pass it skips")
        sn = self.stale_negatives
        if sn.enabled and rc.rollout_is is None:
            problems.append("algo.stale_negatives.enabled = true: needs algo.rollout_correction.rollout_is")
        if sn.enabled and rc.bypass_mode and rc.loss_type == "ppo_clip":
            problems.append(
                "algo.stale_negatives.enabled = true: bypass ppo_clip applies no weights (loss_type reinforce does)"
            )
        if sn.negative_floor > sn.negative_cap:
            problems.append(
                f"algo.stale_negatives.negative_floor = {sn.negative_floor}: must be <= negative_cap ({sn.negative_cap})"
            )
        _raise(problems)
        return self


# ----------------------------------------------------------------------------- rollout
class CpuEngine(Section):
    """The project's own engine server: SGLang's HTTP API on top of HF transformers."""

    type: Literal["cpu"] = Field("cpu", description="cpu: the project's own engine server")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="engine weights dtype (bf16 makes routing differ from fp32)"
    )


class SglangEngine(Section):
    """Real SGLang 0.5.23 servers: on GPUs (device cuda), or on CPU (device cpu: tests and small
    runs, from the interpreter scripts/setup_sglang_cpu.sh builds)."""

    type: Literal["sglang"] = Field("sglang", description="sglang: real SGLang servers")
    device: Literal["cuda", "cpu"] = Field(
        "cuda", description="cpu: the launcher adds SGLang's CPU flags and environment itself"
    )
    python: str | None = Field(
        None,
        description="interpreter that has SGLang (e.g. .venv-sglang/bin/python); None: the "
        "project's own. Checked when the config loads",
    )
    tp: PositiveInt = Field(1, description="tensor-parallel size of each server")
    ep: PositiveInt = Field(1, description="expert-parallel size of each server")
    mem_fraction_static: float = Field(
        0.7, gt=0.0, lt=1.0, description="share of GPU memory for weights and KV cache (SGLang's flag)"
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="engine weights dtype")
    gpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        description="launch.mode = local only: the GPU ids the engines use, tp of them per "
        "engine in order; None: the GPUs after the learner's GPU 0",
    )
    extra_args: list[str] = Field(default_factory=list, description="passed to launch_server")


class RolloutConfig(Section):
    """Engine servers and how training rollouts are sampled from them."""

    engine: Annotated[CpuEngine | SglangEngine, Field(discriminator="type")] = Field(
        default_factory=CpuEngine, description="the engine servers: cpu (the project's own) or sglang"
    )
    num_engines: PositiveInt = Field(1, description="engine servers (one per DP replica)")
    host: str = Field("127.0.0.1", description="address the engines bind to")
    n_samples_per_prompt: int = Field(8, ge=2, description="group size n (>= 2) of the constant group_size_schedule")
    group_size_schedule: Literal["constant", "linear"] = Field(
        "constant",
        description="samples per prompt over training: constant (n_samples_per_prompt at every step); linear "
        "(min_group_size at step 1 to max_group_size at trainer.steps, rounded). Sizes that vary lay the "
        "batch out with masked padding rows (docs/algorithms.md, Group size)",
    )
    min_group_size: int | None = Field(
        None, ge=2, description="the linear schedule's first size; None: n_samples_per_prompt"
    )
    max_group_size: int | None = Field(
        None,
        ge=2,
        description="the linear schedule's last size, and the size of an extra_samples_on_equal resample; "
        "None: n_samples_per_prompt",
    )
    extra_samples_on_equal: bool = Field(
        False,
        description="a group whose rewards all came back equal (dropped as zero-std) samples its prompt once "
        "more, with max_group_size samples, if that is larger (sampler/resampled_on_equal counts them)",
    )
    max_new_tokens: PositiveInt = Field(16, description="longest response (longer ones are cut: finish_reason length)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of training rollouts")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling of training rollouts; 1: off")
    return_routed_experts: bool | None = Field(
        None, description="capture the engine's routing; None: on exactly for r3"
    )
    request_timeout_s: float = Field(
        120.0, gt=0.0, description="how long one generate request may take before its engine counts as unanswering"
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="how long one engine server may take to answer /health (large "
        "checkpoints load slowly); progress goes to the log every 30 s",
    )
    seeded_sampling: bool | None = Field(
        None,
        description="a sampling seed per group from trainer.seed, for reproducible rollouts; "
        "None: on for the CPU engine (which derives one per sample), off for SGLang",
    )
    updates: Literal["between_batches", "in_flight"] = Field(
        "between_batches",
        description="when new weights reach generation: between_batches (synchronous, or one step "
        "ahead with buffer.async_rollout); in_flight: engines never drain, a sync pauses them "
        "(weight_sync.pause_mode), sequences continue under the new weights, groups are filed as "
        "they finish and unfinished ones serve a later step (docs/in-flight.md)",
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
    """Which generated groups a step trains on, and how much it may generate for them."""

    batch_groups: PositiveInt = Field(8, description="useful prompt groups per step")
    zero_std_eps: float = Field(1e-6, ge=0.0, description="groups with reward std <= eps drop")
    max_staleness: int = Field(1, ge=0, description="policy versions a group may lag")
    async_rollout: bool = Field(False, description="generate step k+1 while training step k")
    max_generated_groups_per_step: PositiveInt | None = Field(
        None,
        description="most prompt groups one step may generate; at the bound the step trains on the "
        "useful groups it has (a short batch, counted), and a bound spent without enough useful groups "
        "ends the run with a checkpoint; None: 64 x batch_groups",
    )
    skip_prompts: PromptSkipConfig = Field(
        default_factory=PromptSkipConfig, description="skipping prompts that keep giving zero-std groups"
    )


# ----------------------------------------------------------------------------- weight sync
class WeightSyncConfig(Section):
    """How the learner's weights reach the engines after each step, and how that is checked."""

    bucket_mb: float = Field(512.0, gt=0.0, description="max bytes of one flat bucket, MiB")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="auto: nccl when the learner and the engines are all on cuda, else gloo"
    )
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract",
        description="what engines do with requests in flight during a sync; after "
        "abort or retract the engines' prefix cache is flushed before they resume",
    )
    checksum: bool | None = Field(
        None,
        description="engines verify a per-bucket sha256 (a CPU-engine extension SGLang has "
        "not got); None: on for the CPU engine, off for SGLang",
    )
    parity_tolerance: float | Literal["auto"] | None = Field(
        "auto",
        description="max |logprob diff| of the post-sync probe; auto: from the engine's and "
        "learner's dtypes (see PARITY_TOLERANCE); None: probe off",
    )
    engine_wait_s: float | None = Field(
        None,
        gt=0.0,
        description="how long a sync waits for an engine to answer when none does (every one "
        "restarting, loading the model); None: rollout.start_timeout_s + 60 (a restart is a "
        "start, and the restart is noticed first)",
    )
    refusal_wait_s: float = Field(
        0.5,
        ge=0.0,
        le=60.0,
        description="how long the first bucket of a sync waits for an "
        "engine's refusal before its broadcast is posted (an unmatched NCCL broadcast hangs)",
    )


# Default post-sync parity tolerance by the lowest precision of engine and learner. fp32 on
# both sides agrees to ~1e-5; bf16 differs by ~0.02 per token and ~0.3 where a MoE routing
# flips (measured on CPU, configs/compare-replay-cpu.yaml); a broken sync is off by nats.
PARITY_TOLERANCE = {"float32": 1e-3, "float16": 0.1, "bfloat16": 0.5}


class TrainerConfig(Section):
    """Steps, optimizer and schedule, learner precision, checkpoints."""

    output_dir: str = Field("runs/tiny-moe-cpu", description="checkpoints, logs, metrics")
    steps: PositiveInt = Field(20, description="training steps (one rollout batch each)")
    lr: float = Field(1e-3, gt=0.0, description="peak learning rate (Adam)")
    min_lr: float = Field(0.0, ge=0.0, description="the learning rate a decay ends at")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up from 0 to lr")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay")
    adam_beta2: float = Field(
        0.999,
        gt=0.0,
        lt=1.0,
        description="Adam's second-moment decay; 0.95 (as most LLM pre-training) adapts faster to a large learning rate",
    )
    grad_clip: float = Field(1.0, gt=0.0, description="max global gradient norm")
    micro_batch_size: PositiveInt = Field(
        8, description="sequences per forward/backward, each padded to the batch's longest; unused under a token budget"
    )
    max_tokens_per_microbatch: PositiveInt | None = Field(
        None,
        description="token budget of a training micro-batch (rows × its longest row): a rank's rows are cut "
        "longest first into as few micro-batches as fit (first-fit decreasing), each padded only to its own "
        "longest row; a longer row goes alone. None: micro_batch_size rows per micro-batch",
    )
    max_tokens_per_logprob_microbatch: PositiveInt | None = Field(
        None,
        description="token budget of a micro-batch of the forward-only logprob pass (no activations kept for "
        "backward: it can take more); None: max_tokens_per_microbatch",
    )
    pack_sequences: bool = Field(
        False,
        description="concatenate each budgeted micro-batch's rows into one sequence (Megatron's THD layout, "
        "PackedSeqParams) instead of padding them to its longest row; a micro-batch then costs the sum of its "
        "rows. Needs parallel.device = cuda with transformer-engine, trainer.dtype = bfloat16 (TE has no fp32 "
        "THD attention) and trainer.max_tokens_per_microbatch",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="learner weights")
    distributed_optimizer: bool = Field(True, description="shard optimizer state over DP")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="lr after warm-up: constant, or decayed to min_lr over the run"
    )
    recompute_activations: bool = Field(
        False, description="recompute each layer's activations in backward (saves memory)"
    )
    seed: int = Field(
        0,
        description="the run's seed: Megatron's RNGs, the prompt order, the rollouts' sampling, and data.seed "
        "and eval.seed where the config does not give them",
    )
    expert_bias_update_rate: float = Field(
        0.0,
        ge=0.0,
        description="for routers with an expert score bias (DeepSeek-V3, Kimi-K2, GLM-4.5): "
        "Megatron's per-step bias update from the load imbalance, outside the gradient. 0 (default): the "
        "bias stays as the checkpoint has it, so the policy changes only through the loss and the "
        "engines route as the learner does; pretraining's 1e-3 would drift the routing every step",
    )
    save_interval: int = Field(0, ge=0, description="steps between checkpoints; 0: last only")
    keep_checkpoints: int = Field(
        2,
        ge=1,
        description="complete checkpoints kept under output_dir/checkpoint (one step_NNNNNN/ folder each); "
        "older ones are removed only once a newer one is complete",
    )
    resume: bool = Field(
        False,
        description="continue from output_dir's checkpoint (weights, optimizer, sampler and "
        "buffer; a synchronous CPU run then logs what an uninterrupted one would); false: start afresh",
    )


class WandbConfig(Section):
    """Weights & Biases, beside metrics.jsonl and TensorBoard (pip install -e '.[wandb]')."""

    project: str = Field(description="W&B project")
    entity: str | None = Field(None, description="team or user; None: your default")
    name: str | None = Field(None, description="run name; None: trainer.output_dir's folder name")
    group: str | None = Field(None, description="W&B group of runs; None: none")
    tags: list[str] = Field(default_factory=list, description="W&B tags")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: written under output_dir/wandb, synced later with `wandb sync`"
    )


class LoggingConfig(Section):
    """Log level and where metrics go beside metrics.jsonl."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="the run's log level")
    tensorboard: bool = Field(True, description="scalars also to output_dir/tensorboard")
    wandb: WandbConfig | None = Field(None, description="None: no Weights & Biases")


class LaunchConfig(Section):
    """Where the run's components live (launch/placement.py) and the local Ray they may start."""

    mode: Literal["ray", "local"] = Field(
        "ray",
        description="ray: learner ranks, engines, buffer and verifiers as Ray actors; "
        "local: one learner rank in this process, no Ray (debugging)",
    )
    ray_address: str | None = Field(None, description="None: start a local Ray")
    num_cpus: PositiveInt | None = Field(None, description="local Ray CPUs; None: all")
    object_store_mb: PositiveInt = Field(512, description="local Ray object store size")
    learner_cpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="cores the learner runs on, its torch threads as many (local mode: this process, the loop "
        "and verifiers with it; ray: each learner rank's actor); None: not pinned",
    )
    engine_cpus: list[Annotated[int, Field(ge=0)]] | None = Field(
        None,
        min_length=1,
        description="cores the engine servers run on, in contiguous shares one per engine, a CPU engine's torch "
        "threads and SGLang's SGLANG_CPU_OMP_THREADS_BIND to match; apart from learner_cpus, generation and "
        "training do not compete for cores, as on separate GPUs; None: not pinned",
    )

    @model_validator(mode="after")
    def _check(self) -> LaunchConfig:
        _raise([problem for name in ("learner_cpus", "engine_cpus") for problem in self._core_problems(name)])
        return self

    def _core_problems(self, name: str) -> list[str]:
        """Cores listed twice, or (when this machine runs the run: no ray_address) not ones this
        process may run on."""
        cores = getattr(self, name)
        if cores is None:
            return []
        twice = sorted({c for c in cores if cores.count(c) > 1})
        if twice:
            return [f"launch.{name} = {cores}: core {twice[0]} is listed twice"]
        if not hasattr(os, "sched_getaffinity"):
            return [f"launch.{name}: pinning to cores needs Linux (os.sched_setaffinity)"]
        allowed = sorted(os.sched_getaffinity(0))
        missing = [c for c in cores if c not in allowed]
        if missing and self.ray_address is None:
            return [f"launch.{name} = {cores}: core {missing[0]} is not one this process may run on {allowed}"]
        return []


class Config(Section):
    """The whole run."""

    model: ModelConfig = Field(default_factory=TinyModel, description="the policy: tiny (random) or hf")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="the learner's layout")
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="the policy-gradient algorithm")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="engines and sampling")
    buffer: BufferConfig = Field(default_factory=BufferConfig, description="which groups a step trains on")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="how the learner's weights reach the engines"
    )
    verifier: VerifierConfig = Field(default_factory=VerifierConfig, description="how responses are scored")
    data: Annotated[ArithmeticData | LongAnswerData | FileData, Field(discriminator="type")] = Field(
        default_factory=ArithmeticData,
        description="the training prompts: arithmetic or long_answers (built in), or file",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out sets scored while training")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="steps, optimizer, checkpoints")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="where metrics go")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="where the components run")
    sft: SftConfig | None = Field(None, description="supervised fine-tuning (the sft command); train ignores it")
    agent: AgentConfig | None = Field(None, description="multi-turn episodes with tool calls; None: one answer each")
