"""Inputs checked in the config stage, before Ray or a model starts (a few seconds at most
for ordinary sizes): every data file of the run (training data and eval sets) is read and
every row checked; the user functions it names are found; the sandbox is probed when code or
functions are to run; the wandb package is there when logging.wandb asks for it."""

from __future__ import annotations

import dataclasses
import logging
import os

from megatron_rlvr.config import (
    DATA_FORMATS,
    ArithmeticSource,
    LongAnswerSource,
    ResolvedConfig,
    ResolvedFileSource,
    VerifierConfig,
    data_sources,
)
from megatron_rlvr.data.arithmetic import arithmetic_prompts
from megatron_rlvr.data.chat import EncodedPrompts
from megatron_rlvr.data.files import load_source
from megatron_rlvr.data.long_answers import long_answer_prompts
from megatron_rlvr.data.records import LoadedPrompts
from megatron_rlvr.data.selection import check_set_names, select_prompts

log = logging.getLogger(__name__)


def load_data(
    source: ArithmeticSource | LongAnswerSource | ResolvedFileSource,
    verifiers: VerifierConfig,
    *,
    where: str = "data",
    skip_bad_rows: bool = False,
) -> LoadedPrompts:
    """The records of one source; `where` is its dotted config name (data, eval.sets.NAME)."""
    if isinstance(source, ArithmeticSource):
        return _by_data_source(arithmetic_prompts(source), verifiers)
    if isinstance(source, LongAnswerSource):
        return _by_data_source(long_answer_prompts(source), verifiers)
    if any(getattr(source, key) is None for key in DATA_FORMATS[source.format]):  # not resolved yet
        source = source.model_copy()
        source.fill_keys()
    return load_source(source, verifiers, where=where, skip_bad_rows=skip_bad_rows)


def _by_data_source(loaded: LoadedPrompts, verifiers: VerifierConfig) -> LoadedPrompts:
    """A built-in task's records take the verifier that verifier.by_data_source names for their
    data_source, as file rows do (long_answers → the working verifier of the shipped configs)."""
    mapped = [
        dataclasses.replace(r, verifier=verifiers.by_data_source.get(r.data_source, r.verifier)) for r in loaded.records
    ]
    return dataclasses.replace(loaded, records=mapped)


def load_all(cfg: ResolvedConfig, *, report: bool = True, select: bool = True) -> dict[str, LoadedPrompts]:
    """dotted name → records, for the training data and every eval set. With `report`,
    skipped rows are logged: one warning per source with the count and the first. With
    `select`, the training data is mixed by data.mixing, less what data.difficulty_file skips."""
    loaded = {}
    for where, source in data_sources(cfg):
        loaded[where] = load_data(source, cfg.verifier, where=where, skip_bad_rows=cfg.data.skip_bad_rows)
        if where == "data" and select:
            loaded[where].records = select_prompts(loaded[where].records, cfg.data, cfg.data.seed)
        skipped = loaded[where].skipped
        if skipped and report:
            log.warning(
                "%s: %d bad rows skipped (data.skip_bad_rows), the first: %s: %s", where, len(skipped), *skipped[0]
            )
            for at, reason in skipped[1:]:
                log.debug("skipped %s: %s", at, reason)
    return loaded


def data_counts(loaded: dict[str, LoadedPrompts], train: EncodedPrompts) -> dict[str, int]:
    """The data/* metrics a run logs once: training prompts (and, with several files in
    data.path, how many each gave, so a file that gives none shows), prompts over the length
    limit, bad rows skipped."""
    counts = {
        "data/prompts": len(train.ids),
        "data/too_long": train.too_long,
        "data/skipped_rows": sum(len(part.skipped) for part in loaded.values()),
    }
    if len(loaded["data"].by_file) > 1:
        for label, ids in loaded["data"].by_file.items():
            counts[f"data/prompts/{label}"] = sum(i in train.ids for i in ids)
    return counts


def check_inputs(cfg: ResolvedConfig, *, select: bool = True) -> dict[str, LoadedPrompts]:
    """Raises a UserError (one line) for a missing, empty or unreadable data file, a bad row
    (file:line, unless data.skip_bad_rows), a verifier function that is not there, a sandbox
    this machine cannot give, or a missing wandb. Returns what load_all read (`select`: see there)."""
    from megatron_rlvr.rewards.custom import check_function, resolve_function

    loaded = load_all(cfg, select=select)
    check_set_names({name: loaded[f"eval.sets.{name}"].records for name in cfg.eval.sets})
    used = {r.verifier for prompts in loaded.values() for r in prompts.records}
    for name in sorted(used & set(cfg.verifier.functions)):
        check_function(name, resolve_function(cfg.verifier.functions[name], os.getcwd()))
    if used - {"math"}:
        from megatron_rlvr.rewards.isolation import check_available

        check_available()
    if cfg.logging.wandb is not None:
        from megatron_rlvr.reporting import wandb_module

        wandb_module(check_only=True)
    return loaded
