"""The config of the LLM judge (verifier `judge`, in verifier.judge): where the judge model is
served (by the run itself, or an external OpenAI-compatible endpoint), the prompt it is given
and how its score is read. megatron_rlvr.rewards.judge implements it."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from megatron_rlvr.config.base import PositiveInt, Section
from megatron_rlvr.config.base import raise_problems as _raise

BUILTIN_TEMPLATES = ("reference", "open_ended")
TEMPLATE_FIELDS = ("prompt", "response", "reference", "min_score", "max_score")  # placeholders a template may use


class JudgeConfig(Section):
    """An LLM judge: a model that reads the prompt, the response (and the record's answer as a
    reference) and replies `Score: N`, N in [min_score, max_score], normalised to [0, 1].
    Served by the run (model_path: started by the rollout engines' launcher with
    rollout.engine's kind, the run's API key, outside the weight-sync group, so its weights
    never change) or an external endpoint (base_url, its key in the environment variable
    api_key_env). Greedy (temperature 0) with a fixed seed; the reply constrained to the score
    format where the server can (docs/data-and-verifiers.md, LLM judge)."""

    model_path: str | None = Field(
        None, description="served by the run: the judge model's HF folder (rollout.engine's kind serves it)"
    )
    base_url: str | None = Field(
        None, description="an external OpenAI-compatible endpoint instead (e.g. http://host:8000/v1)"
    )
    model: str | None = Field(
        None, description="external: the model name it serves (required); served: not given (model_path names it)"
    )
    api_key_env: str | None = Field(
        None, description="external: the environment variable that holds the endpoint's key (never the key itself)"
    )
    template: str = Field(
        "reference",
        description="reference: score against the record's answer; open_ended: no reference; or a path to a "
        "text file with {prompt}, {response} and optionally {reference}, {min_score}, {max_score}",
    )
    min_score: int = Field(1, ge=0, le=99, description="the lowest score the judge may give (normalised to 0)")
    max_score: int = Field(10, ge=1, le=100, description="the highest score the judge may give (normalised to 1)")
    constrained: bool = Field(
        True,
        description="send the score format as a regex (SGLang's structured output; the CPU engine masks "
        "the tokens outside it); false: parse whatever the judge writes",
    )
    max_tokens: PositiveInt = Field(32, description="tokens the judge may write per reply")
    seed: int = Field(0, description="the judge's sampling seed (greedy anyway; fixed for engines that sample)")
    request_timeout_s: float = Field(60.0, gt=0.0, le=3600.0, description="one request's limit")
    max_attempts: PositiveInt = Field(
        3, description="tries per request (judge dead, timed out, or 5xx); then the group is dropped and counted"
    )
    concurrency: PositiveInt = Field(16, description="requests in flight to the judge at once, per verifier worker")
    cache_entries: int = Field(100_000, ge=0, description="verdicts kept per verifier worker (0: no cache)")
    gpus: list[int] | None = Field(
        None,
        description="served on SGLang CUDA: the GPU ids its server sees (apart from the learner's and engines'); "
        "None: as the environment says",
    )
    start_timeout_s: float = Field(600.0, gt=0.0, description="served: how long the judge engine may take to start")

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        p = "verifier.judge"
        problems = []
        if (self.model_path is None) == (self.base_url is None):
            problems.append(f"{p}: give exactly one of model_path (served by the run) and base_url (external)")
        if self.base_url is not None:
            if self.model is None:
                problems.append(f"{p}.model: an external endpoint needs the model name it serves")
            if self.api_key_env is None:
                problems.append(f"{p}.api_key_env: name the environment variable that holds the endpoint's key")
        else:
            if self.api_key_env is not None:
                problems.append(f"{p}.api_key_env: a judge served by the run uses the run's own key; remove it")
            if self.model is not None:
                problems.append(f"{p}.model: a judge served by the run is named by its model_path; remove it")
        if self.model_path is not None and not (Path(self.model_path) / "config.json").is_file():
            problems.append(f"{p}.model_path = {self.model_path!r}: no config.json there (an HF model folder)")
        if self.min_score >= self.max_score:
            problems.append(f"{p}.min_score = {self.min_score}: must be below max_score ({self.max_score})")
        if self.template not in BUILTIN_TEMPLATES:
            path = Path(self.template)
            if not path.is_file():
                problems.append(
                    f"{p}.template = {self.template!r}: neither {' nor '.join(BUILTIN_TEMPLATES)} nor a file"
                )
            elif "{response}" not in path.read_text():
                problems.append(f"{p}.template = {self.template!r}: the file has no {{response}} placeholder")
        _raise(problems)
        return self
