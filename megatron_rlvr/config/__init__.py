"""One typed config tree for a run: YAML file + dotted command-line overrides.

The schema imports no torch, so the CLI can validate a config (and `submit` can check a
layout) in a fraction of a second. Validators only raise; every derived value is filled in
one explicit step, `resolve()`, which returns a ResolvedConfig. Every error names the dotted
field, the bad value and what is allowed, one line per problem.

    base      ConfigError, Section: what every section is made of
    model     the model section (tiny or HF) and the shape facts layout checks need
    data      data, verifier and eval sections
    schema    the other sections and Config, the whole tree
    resolve   resolve(), the Resolved* types it returns, and the checks across sections
    loading   load_config(): YAML + overrides → ResolvedConfig; to_yaml()

Everything is imported from here (`from megatron_rlvr.config import load_config`).
"""

from megatron_rlvr.config.base import ConfigError, PositiveInt, Section
from megatron_rlvr.config.data import (
    BUILTIN_VERIFIERS,
    DATA_FORMATS,
    ArithmeticData,
    ArithmeticSource,
    CodeVerifierConfig,
    EvalConfig,
    FileData,
    FileSource,
    LongAnswerData,
    LongAnswerSource,
    PromptFormat,
    VerifierConfig,
)
from megatron_rlvr.config.loading import apply_overrides, load_config, parse_override, to_yaml
from megatron_rlvr.config.model import SUPPORTED_MODEL_TYPES, HFModel, ModelDims, TinyModel, model_dims
from megatron_rlvr.config.resolve import (
    ResolvedAlgo,
    ResolvedBuffer,
    ResolvedConfig,
    ResolvedEval,
    ResolvedFileData,
    ResolvedFileSource,
    ResolvedParallel,
    ResolvedRollout,
    ResolvedWeightSync,
    data_sources,
    resolve,
)
from megatron_rlvr.config.schema import (
    DEFAULT_CLIP,
    PARITY_TOLERANCE,
    AlgoConfig,
    BufferConfig,
    Config,
    CpuEngine,
    LaunchConfig,
    LoggingConfig,
    ParallelConfig,
    PromptSkipConfig,
    RolloutConfig,
    SglangEngine,
    TrainerConfig,
    WandbConfig,
    WeightSyncConfig,
)

__all__ = [
    "BUILTIN_VERIFIERS",
    "DATA_FORMATS",
    "DEFAULT_CLIP",
    "PARITY_TOLERANCE",
    "SUPPORTED_MODEL_TYPES",
    "AlgoConfig",
    "ArithmeticData",
    "ArithmeticSource",
    "BufferConfig",
    "CodeVerifierConfig",
    "Config",
    "ConfigError",
    "CpuEngine",
    "EvalConfig",
    "FileData",
    "FileSource",
    "LongAnswerData",
    "LongAnswerSource",
    "HFModel",
    "LaunchConfig",
    "LoggingConfig",
    "ModelDims",
    "ParallelConfig",
    "PositiveInt",
    "PromptFormat",
    "PromptSkipConfig",
    "ResolvedAlgo",
    "ResolvedBuffer",
    "ResolvedConfig",
    "ResolvedEval",
    "ResolvedFileData",
    "ResolvedFileSource",
    "ResolvedParallel",
    "ResolvedRollout",
    "ResolvedWeightSync",
    "RolloutConfig",
    "Section",
    "SglangEngine",
    "TinyModel",
    "TrainerConfig",
    "VerifierConfig",
    "WandbConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "data_sources",
    "load_config",
    "model_dims",
    "parse_override",
    "resolve",
    "to_yaml",
]
