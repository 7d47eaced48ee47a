"""The config sections for a run's data: where prompts come from and how they are read
(data), how responses are scored (verifier) and which held-out sets are evaluated while
training (eval). Part of the one config tree; megatron_rlvr.config re-exports every name here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from megatron_rlvr.config.base import PositiveInt, Section
from megatron_rlvr.config.base import raise_problems as _raise
from megatron_rlvr.config.judge import JudgeConfig
from megatron_rlvr.config.selection import PromptSelection

# ----------------------------------------------------------------------------- verifier
# Verifiers every run has (megatron_rlvr.rewards.registry implements them); user functions in
# verifier.functions add their own names.
BUILTIN_VERIFIERS = ("math", "code", "ifeval")


class CodeVerifierConfig(Section):
    """Python solutions run against the record's tests in the sandbox (no network, no child
    processes, writes only in a temporary directory)."""

    reward: Literal["all_pass", "fraction"] = Field(
        "all_pass", description="all_pass: 1 when every test passes, else 0; fraction: tests passed / tests"
    )
    max_output_kb: PositiveInt = Field(1024, description="stdout one test may write (more: a 0, output_limit)")


class IFEvalVerifierConfig(Section):
    """Instruction following: IFEval's and IFBench's checkers (the if-verifiable package) on the
    record's instruction ids and kwargs (docs/data-and-verifiers.md, Instruction following)."""

    grading: Literal["binary", "fraction"] = Field(
        "binary",
        description="binary: 1 when every instruction is followed, else 0; fraction: instructions followed / instructions",
    )
    loose: bool = Field(
        False,
        description="false: IFEval's strict reading (the response as it is); true: its loose one (also "
        "passes with the first or last line dropped or '*' removed)",
    )


class VerifierConfig(Section):
    """Which verifier scores each record, and the sandbox they run in."""

    kind: str = Field(
        "math",
        description="the verifier of records that name none and whose data_source is not in "
        "by_data_source: math, code, ifeval, judge (with verifier.judge), or a name in verifier.functions",
    )
    by_data_source: dict[str, str] = Field(
        default_factory=dict,
        description="data_source → verifier (e.g. {openai/gsm8k: math, long_answers: my_fn}); wins over a file row's "
        "own verifier column, and applies to the built-in tasks (data_source arithmetic, long_answers) too",
    )
    functions: dict[str, str] = Field(
        default_factory=dict,
        description="your own verifiers: name → 'module:function' or "
        "'path/to/file.py:function', called as function(response, record) -> float in the sandbox",
    )
    timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="hard wall-time limit per answer")
    num_workers: PositiveInt = Field(2, description="sandboxed verifier processes")
    memory_mb: PositiveInt = Field(
        1024, description="address-space limit of one sandboxed code test or function call, MiB"
    )
    code: CodeVerifierConfig = Field(default_factory=CodeVerifierConfig, description="the code verifier")
    ifeval: IFEvalVerifierConfig = Field(
        default_factory=IFEvalVerifierConfig, description="the instruction-following verifier"
    )
    judge: JudgeConfig | None = Field(None, description="the LLM judge (verifier `judge`); None: no judge")

    @model_validator(mode="after")
    def _check(self) -> VerifierConfig:
        problems = []
        for name, spec in self.functions.items():
            if name in (*BUILTIN_VERIFIERS, "judge"):
                problems.append(f"verifier.functions.{name}: {name!r} is a built-in verifier (pick another name)")
            module, sep, function = spec.rpartition(":")
            if not sep or not module or not function.isidentifier():
                problems.append(
                    f"verifier.functions.{name} = {spec!r}: expected 'module:function' or 'path/to/file.py:function'"
                )
        names = self.names
        allowed = f"(known: {', '.join(names)})"
        if self.kind not in names:
            problems.append(f"verifier.kind = {self.kind!r}: unknown verifier {allowed}")
        for source, name in self.by_data_source.items():
            if name not in names:
                problems.append(f"verifier.by_data_source.{source} = {name!r}: unknown verifier {allowed}")
        _raise(problems)
        return self

    @property
    def names(self) -> tuple[str, ...]:
        """Every verifier a record may name."""
        return (*BUILTIN_VERIFIERS, *(("judge",) if self.judge else ()), *self.functions)


# ----------------------------------------------------------------------------- data
class ArithmeticSource(Section):
    """The built-in tiny task: small sums and products with integer answers."""

    type: Literal["arithmetic"] = Field("arithmetic", description="arithmetic: the built-in task")
    num_prompts: PositiveInt = Field(512, description="distinct problems")
    max_operand: PositiveInt = Field(9, description="operands are drawn from 0..max_operand")
    seed: int = Field(0, description="seed of the problems drawn (data: not given, trainer.seed)")


class LongAnswerSource(Section):
    """The built-in long-answer task, every step written out: a remainder by repeated
    subtraction ("45%7=" → "45-7=38 38-7=31 … #### 3") or the running count of the odd digits
    of a labelled list ("a5b8c3=" → "a5=1 b8=1 c3=2 #### 2"); the number of steps is long-tailed
    (a truncated power law), so responses are too (megatron_rlvr.data.long_answers)."""

    type: Literal["long_answers"] = Field("long_answers", description="long_answers: the built-in long-answer task")
    problem: Literal["remainder", "odd_count"] = Field(
        "remainder",
        description="remainder: n%d by subtraction (a few hundred problems: a tiny model recalls them); "
        "odd_count: the running count of odd digits (10^k problems of k digits: learned as a rule or not at all)",
    )
    num_prompts: PositiveInt = Field(512, description="distinct problems")
    max_divisor: int = Field(9, ge=2, le=99, description="divisors are drawn from 2..max_divisor (remainder)")
    max_steps: PositiveInt = Field(
        24, description="the most steps one problem takes: subtractions, or digits (odd_count: at most 52)"
    )
    tail_exponent: float = Field(
        1.2, gt=0.0, le=10.0, description="P(steps = k) ∝ k^-tail_exponent on 1..max_steps: smaller, longer tail"
    )
    split: Literal["train", "train_sft", "train_rl", "heldout", "all"] = Field(
        "train",
        description="train: problems outside the held-out eighth (chosen by a hash of the problem); "
        "train_sft / train_rl: the two halves of train (by another hash), for a cold start and an RL "
        "run that never share a problem; heldout: the held-out eighth; all: every problem",
    )
    seed: int = Field(0, description="seed of the problems drawn (data: not given, trainer.seed)")

    @model_validator(mode="after")
    def _check(self) -> LongAnswerSource:
        if self.problem == "odd_count" and self.max_steps > 52:
            _raise([f"max_steps = {self.max_steps}: an odd_count problem has at most 52 digits (labels a-z, A-Z)"])
        return self


# Where each field of a record is found, per data.format (dotted paths into a row).
DATA_FORMATS = {
    "plain": {
        "prompt_key": "prompt",
        "answer_key": "answer",
        "verifier_key": "verifier",
        "data_source_key": "data_source",
        "id_key": "id",
        "extra_key": "extra_info",
    },
    "verl": {
        "prompt_key": "prompt",
        "answer_key": "reward_model.ground_truth",
        "verifier_key": "ability",
        "data_source_key": "data_source",
        "id_key": "extra_info.index",
        "extra_key": "extra_info",
    },
}


class FileSource(Section):
    """Prompts from JSONL or Parquet files. A prompt is a string or a list of {role, content}
    messages; keys are dotted paths into a row (reward_model.ground_truth)."""

    type: Literal["file"] = Field("file", description="file: prompts from JSONL or Parquet files")
    path: str | list[str] = Field(description="a .jsonl or .parquet file, or a list of them")
    weights: list[float] | None = Field(
        None,
        description="mixing weight per file (the share of prompts drawn from it); None: every row once",
    )
    format: Literal["plain", "verl"] = Field(
        "plain",
        description="key names: plain (prompt, answer, verifier, data_source, id, extra_info) or "
        "verl (prompt, reward_model.ground_truth, ability, data_source, extra_info.index, extra_info)",
    )
    prompt_key: str | None = Field(None, description="None: per format")
    answer_key: str | None = Field(None, description="the ground truth (tests for code); None: per format")
    verifier_key: str | None = Field(None, description="names the record's verifier; None: per format")
    data_source_key: str | None = Field(None, description="None: per format")
    id_key: str | None = Field(None, description="None: per format (missing: the row number)")
    extra_key: str | None = Field(None, description="extra info given to custom verifiers; None: per format")
    seed: int = Field(0, description="seed of the mixing draw (data: not given, trainer.seed)")

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)

    def problems(self, where: str) -> list[str]:
        """Checks of one source; `where` is its dotted name (data, eval.sets.NAME)."""
        problems = [] if self.paths else [f"{where}.path = []: give at least one file"]
        if self.weights is not None:
            if len(self.weights) != len(self.paths):
                problems.append(
                    f"{where}.weights = {self.weights}: one weight per file in {where}.path ({len(self.paths)})"
                )
            elif any(w <= 0 for w in self.weights):
                problems.append(f"{where}.weights = {self.weights}: every weight must be > 0")
        return problems

    def fill_keys(self) -> None:
        """The keys left None take data.format's names."""
        for key, name in DATA_FORMATS[self.format].items():
            if getattr(self, key) is None:
                setattr(self, key, name)


DataSource = Annotated[ArithmeticSource | LongAnswerSource | FileSource, Field(discriminator="type")]


class PromptFormat(Section):
    """How records become the prompt the engines see; the same for training and eval sets."""

    system_prompt: str | None = Field(None, description="a system message for records that have none")
    instruction: str | None = Field(
        None,
        description="appended (after a space) to the last user message, e.g. 'Put the final answer within \\boxed{}.'",
    )
    apply_chat_template: bool | None = Field(
        None,
        description="render with the tokenizer's chat template (add_generation_prompt); None: when "
        "there is one (or data.chat_template); false: the prompt text itself after <bos>",
    )
    chat_template: str | None = Field(
        None, description="a Jinja chat template, or a path to a .jinja file, instead of the tokenizer's"
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra template arguments, e.g. {enable_thinking: false}"
    )
    max_prompt_tokens: PositiveInt | None = Field(
        None, description="longer prompts are dropped (counted, reported once); None: no limit"
    )
    skip_bad_rows: bool = Field(
        False,
        description="false: a bad row stops the run before it starts, naming file:line; true: bad "
        "rows are skipped, counted and logged",
    )


class ArithmeticData(PromptSelection, PromptFormat, ArithmeticSource):
    """The built-in arithmetic task as training data."""


class LongAnswerData(PromptSelection, PromptFormat, LongAnswerSource):
    """The built-in long-answer task as training data."""


class FileData(PromptSelection, PromptFormat, FileSource):
    """Prompt files as training data."""


# ----------------------------------------------------------------------------- eval
class EvalConfig(Section):
    """Held-out sets scored while training: pass@1, pass@k, avg@n, response length and
    truncation, at step 0, every `interval` steps and at the end. Prompts are formatted as
    data's; evaluation never touches the training data's order."""

    sets: dict[str, DataSource] = Field(
        default_factory=dict, description="name → source (type: file, arithmetic or long_answers); empty: no evaluation"
    )
    interval: int = Field(0, ge=0, description="steps between evaluations; 0: at step 0 and the end only")
    at_start: bool = Field(True, description="evaluate the initial policy (step 0) of a fresh run")
    n_samples: PositiveInt = Field(1, description="samples per prompt (n of pass@k and avg@n)")
    temperature: float = Field(0.0, ge=0.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling of eval samples; 1: off")
    max_new_tokens: PositiveInt | None = Field(None, description="None: rollout.max_new_tokens")
    pass_k: list[PositiveInt] | None = Field(
        None, description="k values of pass@k (each <= n_samples); None: 1 and n_samples"
    )
    max_prompts: PositiveInt | None = Field(None, description="the first N prompts of each set; None: all")
    seed: int = Field(
        0, description="sampling seeds of eval prompts (the same at every evaluation); not given: trainer.seed"
    )

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        bad = [k for k in self.pass_k or [] if k > self.n_samples]
        if bad:
            _raise([f"eval.pass_k = {self.pass_k}: k must be <= eval.n_samples ({self.n_samples})"])
        bad_names = [n for n in self.sets if not n or "/" in n]
        if bad_names:
            _raise([f"eval.sets.{bad_names[0]}: a set name must be non-empty and without '/'"])
        return self
