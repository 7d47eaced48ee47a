"""resolve(): every derived value filled in one explicit step, then the checks that span
sections. What it returns is a ResolvedConfig, whose filled values are no longer Optional."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from megatron_rlvr.config.base import PositiveInt
from megatron_rlvr.config.base import raise_problems as _raise
from megatron_rlvr.config.colocation import colocation_problems
from megatron_rlvr.config.data import (
    ArithmeticData,
    ArithmeticSource,
    EvalConfig,
    FileData,
    FileSource,
    LongAnswerData,
    LongAnswerSource,
)
from megatron_rlvr.config.model import ModelDims, model_dims
from megatron_rlvr.config.schema import (
    DEFAULT_CLIP,
    PARITY_TOLERANCE,
    AlgoConfig,
    BufferConfig,
    Config,
    CpuEngine,
    ParallelConfig,
    RolloutConfig,
    SglangEngine,
    WeightSyncConfig,
)

LEARNER_GPU = 0  # launch.mode = local: the learner's one rank is on this GPU


# ----------------------------------------------------------------------------- resolved
# What resolve() returns: the same tree with every value it fills no longer Optional, so code
# that runs after it reads `cfg.parallel.dp` as an int, not `int | None`.
def _filled(section: type[BaseModel], name: str) -> Any:
    """A field resolve() fills: required here, documented as the section's own field is."""
    return Field(description=section.model_fields[name].description)


class ResolvedParallel(ParallelConfig):
    etp: PositiveInt = _filled(ParallelConfig, "etp")
    dp: PositiveInt = _filled(ParallelConfig, "dp")
    sequence_parallel: bool = _filled(ParallelConfig, "sequence_parallel")


class ResolvedAlgo(AlgoConfig):
    clip_low: float = _filled(AlgoConfig, "clip_low")
    clip_high: float = _filled(AlgoConfig, "clip_high")


class ResolvedRollout(RolloutConfig):
    min_group_size: int = _filled(RolloutConfig, "min_group_size")
    max_group_size: int = _filled(RolloutConfig, "max_group_size")
    return_routed_experts: bool = _filled(RolloutConfig, "return_routed_experts")
    seeded_sampling: bool = _filled(RolloutConfig, "seeded_sampling")


class ResolvedBuffer(BufferConfig):
    max_generated_groups_per_step: PositiveInt = _filled(BufferConfig, "max_generated_groups_per_step")


class ResolvedWeightSync(WeightSyncConfig):
    backend: Literal["gloo", "nccl"] = _filled(WeightSyncConfig, "backend")
    checksum: bool = _filled(WeightSyncConfig, "checksum")
    parity_tolerance: float | None = _filled(WeightSyncConfig, "parity_tolerance")
    engine_wait_s: float = _filled(WeightSyncConfig, "engine_wait_s")


class ResolvedFileSource(FileSource):
    prompt_key: str = _filled(FileSource, "prompt_key")
    answer_key: str = _filled(FileSource, "answer_key")
    verifier_key: str = _filled(FileSource, "verifier_key")
    data_source_key: str = _filled(FileSource, "data_source_key")
    id_key: str = _filled(FileSource, "id_key")
    extra_key: str = _filled(FileSource, "extra_key")


class ResolvedFileData(ResolvedFileSource, FileData):
    """data of type file after resolve(): every key named."""


ResolvedDataSource = Annotated[ArithmeticSource | LongAnswerSource | ResolvedFileSource, Field(discriminator="type")]


class ResolvedEval(EvalConfig):
    # a narrower value type than EvalConfig's dict, which mypy (dicts being invariant) flags
    sets: dict[str, ResolvedDataSource] = _filled(EvalConfig, "sets")  # type: ignore[assignment]


class ResolvedConfig(Config):
    """A Config after resolve(): the type everything past loading reads."""

    parallel: ResolvedParallel = _filled(Config, "parallel")
    algo: ResolvedAlgo = _filled(Config, "algo")
    rollout: ResolvedRollout = _filled(Config, "rollout")
    buffer: ResolvedBuffer = _filled(Config, "buffer")
    weight_sync: ResolvedWeightSync = _filled(Config, "weight_sync")
    data: Annotated[ArithmeticData | LongAnswerData | ResolvedFileData, Field(discriminator="type")] = _filled(
        Config, "data"
    )
    eval: ResolvedEval = _filled(Config, "eval")


# ----------------------------------------------------------------------------- checks
def data_sources(
    cfg: ResolvedConfig,
) -> list[tuple[str, ArithmeticSource | LongAnswerSource | ResolvedFileSource]]:
    """(dotted name, source) of the training data and of every eval set."""
    return [("data", cfg.data), *((f"eval.sets.{name}", s) for name, s in cfg.eval.sets.items())]


def _cross_field_problems(cfg: ResolvedConfig, dims: ModelDims, dp_derived: bool = False) -> list[str]:
    """Checks that span sections; run on the resolved config. A check on a derived value
    (dp, from ep) is skipped when what it derives from is already wrong: an error names only
    what the user got wrong."""
    p, a, r = cfg.parallel, cfg.algo, cfg.rollout
    problems = []
    if dims.num_experts % p.ep:
        problems.append(f"parallel.ep = {p.ep}: must divide the model's {dims.num_experts} experts")
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
    elif p.ep * p.etp < p.tp:
        # experts replicated over part of the tensor-parallel group: each TP rank's expert
        # gradients stay partial (measured at tp 2, etp 1, ep 1: logprobs after one step 0.2 from
        # world 1's; tp 2 with etp 2, or with ep 2 and etp 1, agree to 1e-5)
        problems.append(
            f"parallel.ep = {p.ep}, parallel.etp = {p.etp}: with parallel.tp = {p.tp}, ep · etp must be "
            f">= tp (Megatron-Core leaves expert gradients partial otherwise); use etp = tp or ep >= {p.tp}"
        )
    problems += _engine_problems(cfg) + colocation_problems(cfg)
    if a.routing_replay == "r3" and r.return_routed_experts is False:
        problems.append(
            "rollout.return_routed_experts = false: algo.routing_replay = r3 replays the "
            "engine's routing, so the engine must capture it (set true or leave null)"
        )
    if r.updates == "in_flight" and cfg.weight_sync.pause_mode == "abort":
        problems.append(
            "weight_sync.pause_mode = abort: rollout.updates = in_flight continues sequences across "
            "a sync, abort would end them (use in_place or retract)"
        )
    elif a.routing_replay == "r3" and cfg.weight_sync.pause_mode == "retract" and (straddle := _straddles(cfg)):
        # a sync lands while sequences are generating: retract re-prefills them under the new
        # weights, and the engine then reports the new weights' routing for their earlier tokens
        problems.append(
            f"weight_sync.pause_mode = retract: with {straddle} and algo.routing_replay = r3 the pause must be "
            + ("in_place" if r.updates == "in_flight" else "in_place (or abort, which ends them)")
            + "; a retracted sequence is routed again under the new weights, so the routing "
            "replayed for its earlier tokens would not be the one that produced them"
        )
    if a.clip_ratio_c is not None and a.kind != "grpo":
        problems.append(f"algo.clip_ratio_c = {a.clip_ratio_c}: dual clip is for kind grpo")
    layout_wrong = bool(problems)
    problems.extend(_group_size_problems(r))
    samples = cfg.buffer.batch_groups * r.n_samples_per_prompt
    per_step = a.num_minibatches * p.dp
    # sizes that vary (a schedule, resamples) lay their batches out with padding rows instead
    fixed = r.group_size_schedule == "constant" and not r.extra_samples_on_equal
    if fixed and samples % per_step and not (dp_derived and layout_wrong):
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
    t = cfg.trainer
    if t.pack_sequences and (p.device != "cuda" or t.dtype != "bfloat16" or t.max_tokens_per_microbatch is None):
        problems.append(
            "trainer.pack_sequences = true: packed sequences run only on transformer-engine's bf16 attention "
            "(parallel.device = cuda, trainer.dtype = bfloat16) and pack budgeted micro-batches "
            "(set trainer.max_tokens_per_microbatch)"
        )
    if cfg.trainer.min_lr > cfg.trainer.lr:
        problems.append(f"trainer.min_lr = {cfg.trainer.min_lr}: must be <= trainer.lr ({cfg.trainer.lr})")
    return problems


def _straddles(cfg: Config) -> str | None:
    """The setting under which sequences are generating while a weight sync lands (None:
    the engines are drained before every sync)."""
    if cfg.rollout.updates == "in_flight":
        return "rollout.updates = in_flight"
    if cfg.buffer.async_rollout:
        return "buffer.async_rollout = true"
    return None


def _engine_problems(cfg: Config) -> list[str]:
    """Engine placement and what an SGLang engine cannot honour."""
    p, r, sync = cfg.parallel, cfg.rollout, cfg.weight_sync
    engine = r.engine
    problems = []
    if sync.backend == "nccl" and p.device == "cpu":
        problems.append("weight_sync.backend = nccl: NCCL needs parallel.device = cuda")
    elif sync.backend == "nccl" and (isinstance(engine, CpuEngine) or engine.device == "cpu"):
        problems.append("weight_sync.backend = nccl: the engines run on CPU and receive over gloo (set gloo or auto)")
    cores = cfg.launch.engine_cpus
    if cores is not None and len(cores) < r.num_engines:
        problems.append(
            f"launch.engine_cpus = {cores}: fewer cores than rollout.num_engines ({r.num_engines}), one share each"
        )
    if not isinstance(engine, SglangEngine):
        return problems
    if engine.tp % engine.ep:
        problems.append(
            f"rollout.engine.ep = {engine.ep}: must divide rollout.engine.tp ({engine.tp}); "
            "SGLang places its expert-parallel ranks on its tensor-parallel ranks"
        )
    if engine.device == "cuda" and p.device == "cpu":
        problems.append(
            "rollout.engine.device = cuda: a CPU learner (parallel.device = cpu) runs "
            "SGLang on CPU (device: cpu) or the learner on cuda"
        )
    judge = cfg.verifier.judge
    if engine.device == "cuda" and judge is not None and judge.model_path is not None and judge.gpus is None:
        problems.append("verifier.judge.gpus: a judge served by SGLang on CUDA needs GPU ids of its own")
    if sync.checksum:
        problems.append(
            "weight_sync.checksum = true: SGLang has no per-bucket checksum (the CPU "
            "engine's extension); leave it null: the post-sync parity probe checks the weights"
        )
    if sync.pause_mode == "in_place" and "--disable-radix-cache" not in engine.extra_args:
        problems.append(
            "weight_sync.pause_mode = in_place: SGLang cannot flush its prefix cache while "
            "paused requests hold it, so new requests would reuse KV of the old weights; use "
            "retract or abort, or add --disable-radix-cache to rollout.engine.extra_args"
        )
    if any(arg.split("=")[0] == "--hicache-storage-backend" for arg in engine.extra_args):
        # SGLang 0.5.23's flush (the one that ends every sync) resets the radix tree and the host
        # tier but not the storage tier, whose keys name the model and not its weight version
        problems.append(
            "rollout.engine.extra_args: --hicache-storage-backend keeps KV across the cache flush that "
            "ends every weight sync, so requests would reuse KV of old weights; remove it"
        )
    if engine.gpus is not None:
        if cfg.launch.mode != "local":
            problems.append("rollout.engine.gpus: only for launch.mode = local (Ray assigns GPUs to engine actors)")
        elif engine.device != "cuda" or len(engine.gpus) != r.num_engines * engine.tp:
            problems.append(
                f"rollout.engine.gpus = {engine.gpus}: needs rollout.num_engines × "
                f"rollout.engine.tp = {r.num_engines * engine.tp} GPU ids on device cuda"
            )
        elif sync.backend == "nccl" and LEARNER_GPU in engine.gpus:
            problems.append(
                f"weight_sync.backend = nccl: rollout.engine.gpus = {engine.gpus} shares the learner's GPU "
                f"{LEARNER_GPU}, and NCCL cannot hold two ranks of the update group on one GPU (use gloo or auto)"
            )
    if engine.python is not None:
        problems += _engine_python_problems(engine.python, sync.backend)
    return problems


def sglang_install(python: str) -> dict:
    """The SGLang and torch versions `python` has, read from package metadata without importing
    either (a fraction of a second). Raises OSError (missing) or RuntimeError (unreadable)."""
    import subprocess

    probe = (
        "import importlib.metadata as m, importlib.util as u, json\n"
        "v = lambda n: m.version(n) if u.find_spec(n) else None\n"
        "print(json.dumps({'sglang': v('sglang'), 'torch': v('torch')}))"
    )
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
        return [
            f"{where}: has no SGLang (build one with bash scripts/setup_sglang_cpu.sh, or bash scripts/setup.sh --gpu)"
        ]
    ours = importlib.metadata.version("torch")
    if backend == "nccl" and found["torch"] != ours:
        return [
            f"{where}: torch {found['torch']} there, {ours} here: one NCCL weight-update group "
            "needs the same torch build on both sides (install the learner's torch there)"
        ]
    return []


# what a restart adds to an engine's start before it loads: the run sees the engine dead
# (EngineClient.state, a few 5 s questions) and the old process is stopped (launch/engines.py)
RESTART_NOTICE_S = 60.0


def _seeds_follow_trainer(cfg: Config) -> None:
    """trainer.seed is the run's one seed: data.seed and eval.seed that the config does not
    give take its value, so runs that differ in trainer.seed alone differ in the problems
    drawn, the prompt order, the rollouts' sampling and the evaluation's samples. The eval
    sets' own problems (eval.sets.*.seed) stay as given: every seed is scored on the same ones."""
    if "seed" not in cfg.data.model_fields_set:
        cfg.data.seed = cfg.trainer.seed
    if "seed" not in cfg.eval.model_fields_set:
        cfg.eval.seed = cfg.trainer.seed


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
        cfg.parallel.dp = next(dp for dp in range(1, expert_ranks + 1) if (cfg.parallel.tp * dp) % expert_ranks == 0)
    if cfg.parallel.sequence_parallel is None:
        cfg.parallel.sequence_parallel = cfg.parallel.tp > 1
    if cfg.rollout.return_routed_experts is None:
        cfg.rollout.return_routed_experts = cfg.algo.routing_replay == "r3"
    if cfg.rollout.seeded_sampling is None:
        cfg.rollout.seeded_sampling = isinstance(cfg.rollout.engine, CpuEngine)
    if cfg.rollout.min_group_size is None:
        cfg.rollout.min_group_size = cfg.rollout.n_samples_per_prompt
    if cfg.rollout.max_group_size is None:
        cfg.rollout.max_group_size = cfg.rollout.n_samples_per_prompt
    if cfg.buffer.max_generated_groups_per_step is None:
        cfg.buffer.max_generated_groups_per_step = 64 * cfg.buffer.batch_groups
    engine, sync = cfg.rollout.engine, cfg.weight_sync
    on_gpus = isinstance(engine, SglangEngine) and engine.device == "cuda" and cfg.parallel.device == "cuda"
    if sync.backend == "auto":
        # NCCL puts one rank on a GPU: an engine on the learner's GPU takes gloo
        local = cfg.launch.mode == "local"
        shares_gpu = isinstance(engine, SglangEngine) and local and LEARNER_GPU in (engine.gpus or [])
        sync.backend = "nccl" if on_gpus and not shares_gpu else "gloo"
    if sync.checksum is None:
        sync.checksum = isinstance(engine, CpuEngine)
    if isinstance(engine, SglangEngine) and engine.python is not None and "/" in engine.python:
        engine.python = os.path.abspath(engine.python)  # not resolve(): a venv's python is a symlink
    if sync.engine_wait_s is None:
        sync.engine_wait_s = cfg.rollout.start_timeout_s + RESTART_NOTICE_S
    if sync.parity_tolerance == "auto":
        dtypes = {engine.dtype, cfg.trainer.dtype}
        sync.parity_tolerance = max(PARITY_TOLERANCE[d] for d in dtypes)
    for source in [cfg.data, *cfg.eval.sets.values()]:
        if isinstance(source, FileSource):
            source.fill_keys()
    _seeds_follow_trainer(cfg)
    resolved = ResolvedConfig.model_validate(cfg.model_dump())
    _raise(_cross_field_problems(resolved, model_dims(resolved.model), dp_derived))
    return resolved


def _group_size_problems(r: ResolvedRollout) -> list[str]:
    """The group size settings against each other (schedule, its bounds, resampling)."""
    problems = []
    if r.min_group_size > r.max_group_size:
        problems.append(
            f"rollout.min_group_size = {r.min_group_size}: must be <= rollout.max_group_size ({r.max_group_size})"
        )
    elif r.group_size_schedule == "constant" and not r.min_group_size <= r.n_samples_per_prompt <= r.max_group_size:
        problems.append(
            f"rollout.n_samples_per_prompt = {r.n_samples_per_prompt}: the constant schedule's size must lie in "
            f"rollout.min_group_size .. max_group_size ({r.min_group_size} .. {r.max_group_size})"
        )
    smallest = r.n_samples_per_prompt if r.group_size_schedule == "constant" else r.min_group_size
    if r.extra_samples_on_equal and smallest >= r.max_group_size and not problems:
        problems.append(
            f"rollout.extra_samples_on_equal = true: a resample has rollout.max_group_size = {r.max_group_size} "
            "samples, which no scheduled group falls short of (raise max_group_size)"
        )
    return problems
