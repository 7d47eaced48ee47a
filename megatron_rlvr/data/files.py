"""Prompt files as people keep them: JSONL (one object per line) or Parquet (one row per
prompt), in a plain or verl layout, keys as dotted paths into a row, several files mixed by
weight. Every row is checked as it is read: a bad one is an error naming file:line and what is
wrong, or, with data.skip_bad_rows, skipped and counted.

A prompt's id is its row's id (id_key) or else file:row; with several files it starts with the
file's shortest distinct path (a/train.jsonl:0, b/train.jsonl:0), so two data sets that number
their rows alike stay apart, and reordering data.path keeps every id (a resume still maps)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_rlvr.config import ResolvedFileSource, VerifierConfig
from megatron_rlvr.data.records import ROLES, DataError, LoadedPrompts, PromptRecord
from megatron_rlvr.rewards.code.verifier import CodeTestError, parse_tests

SUFFIXES = (".jsonl", ".json", ".parquet")
_MISSING = object()


class BadRow(ValueError):
    """What is wrong with one row (the caller adds where it is)."""


def lookup(row: dict, key: str) -> Any:
    """row[key] for a column literally named so, else the dotted path through nested objects
    (`reward_model.ground_truth`); _MISSING when absent."""
    if key in row:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _messages(prompt: Any, key: str) -> str | list[dict[str, Any]]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"{key!r} is empty")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise BadRow(
            f"{key!r} must be a string or a non-empty list of {{role, content}} messages (got {type(prompt).__name__})"
        )
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise BadRow(f"{key!r} message {i}: needs a string 'content'")
        if message.get("role") not in ROLES:
            raise BadRow(f"{key!r} message {i}: role {message.get('role')!r} is not one of {', '.join(ROLES)}")
    if not any(m["role"] == "user" for m in prompt):
        raise BadRow(f"{key!r} has no user message")
    return [dict(m) for m in prompt]


def _verifier(row: dict, source: ResolvedFileSource, verifiers: VerifierConfig, data_source: str) -> str:
    if data_source in verifiers.by_data_source:
        return verifiers.by_data_source[data_source]
    named = lookup(row, source.verifier_key)
    if named is _MISSING or named in (None, ""):
        return verifiers.kind
    for name in (str(named).strip(), str(named).strip().lower()):  # verl writes "math", some sets "MATH"
        if name in verifiers.names:
            return name
    raise BadRow(f"unknown verifier {named!r} in {source.verifier_key!r} (known: {', '.join(verifiers.names)})")


def parse_row(row: Any, source: ResolvedFileSource, verifiers: VerifierConfig) -> PromptRecord:
    """A row → PromptRecord; raises BadRow saying what is wrong. The prompt id is the row's
    id_key, or "" when it has none (the caller numbers it)."""
    if not isinstance(row, dict):
        raise BadRow(f"not an object (a {type(row).__name__})")
    prompt = lookup(row, source.prompt_key)
    if prompt is _MISSING or prompt is None:
        raise BadRow(f"missing {source.prompt_key!r}")
    prompt = _messages(prompt, source.prompt_key)
    data_source = lookup(row, source.data_source_key)
    data_source = "" if data_source in (_MISSING, None) else str(data_source)
    verifier = _verifier(row, source, verifiers, data_source)
    answer = lookup(row, source.answer_key)
    if verifier == "ifeval":  # its ground truth, or Google's IFEval columns of the row itself
        from megatron_rlvr.rewards.instruction.ground_truth import ConstraintError, read_constraints  # NLTK: only here

        try:
            answer = read_constraints(None if answer in (_MISSING, None, "") else answer, row)
        except ConstraintError as err:
            raise BadRow(f"ifeval instructions: {err}") from None
    elif answer is _MISSING or answer is None or answer == "":
        if verifier not in verifiers.functions:  # your own function may need no ground truth
            raise BadRow(f"missing {source.answer_key!r}")
        answer = None
    elif verifier == "math":
        answer = answer if isinstance(answer, str) else json.dumps(answer)
    elif verifier == "code":
        try:
            parse_tests(answer)
        except CodeTestError as err:
            raise BadRow(f"{source.answer_key!r} holds no usable code tests: {err}") from None
    extra = lookup(row, source.extra_key)
    ident = lookup(row, source.id_key)
    return PromptRecord(
        "" if ident in (_MISSING, None) else str(ident),
        prompt,
        answer,
        verifier,
        data_source,
        extra if isinstance(extra, dict) else None,
    )


def _rows(path: Path, source: ResolvedFileSource) -> Iterator[tuple[str, int, Any]]:
    """(where, number, row) for every row: where is file:line for JSONL and file:row N for Parquet. A
    line that is not JSON comes as a BadRow in place of its row."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        keys = [
            source.prompt_key,
            source.answer_key,
            source.verifier_key,
            source.data_source_key,
            source.id_key,
            source.extra_key,
        ]
        columns = sorted({k if k in schema.names else k.split(".")[0] for k in keys} & set(schema.names))
        for number, row in enumerate(pq.read_table(path, columns=columns).to_pylist(), start=1):
            yield f"{path}:row {number}", number, row
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        for number, row in enumerate(rows, start=1):
            yield f"{path}:item {number}", number, row
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{number}", number, json.loads(line)
        except json.JSONDecodeError as err:
            yield f"{path}:{number}", number, BadRow(f"not valid JSON ({err.msg})")


def _open_check(path: Path, where: str) -> None:
    if path.suffix not in SUFFIXES:
        raise DataError(f"{where} = '{path}': unsupported file type (use {', '.join(SUFFIXES)})")
    if not path.exists():
        raise DataError(f"{where} = '{path}': no such file")
    if not path.is_file():
        raise DataError(f"{where} = '{path}': not a file")
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        raise DataError(f"{where} = '{path}': cannot read it ({err.strerror})") from None
    if path.stat().st_size == 0:
        raise DataError(f"{where} = '{path}': the file is empty")


def load_file(
    path: Path,
    source: ResolvedFileSource,
    verifiers: VerifierConfig,
    *,
    where: str,
    skip_bad_rows: bool,
    label: str = "",
    seen: dict[str, str] | None = None,
) -> LoadedPrompts:
    """Every row of one file; `where` names its config field (data.path, eval.sets.X.path),
    `label` (several files) prefixes its prompt ids and `seen` (id → where) is shared by the
    files of one source, so an id repeated anywhere in it is an error."""
    _open_check(path, where)
    loaded = LoadedPrompts([])
    seen = {} if seen is None else seen
    try:
        rows = list(_rows(path, source))
    except (OSError, UnicodeDecodeError, ValueError) as err:  # pyarrow's errors are ValueErrors / OSErrors
        raise DataError(f"{where} = '{path}': cannot read it ({type(err).__name__}: {err})") from None
    if not rows:
        raise DataError(f"{where} = '{path}': the file holds no rows")
    for at, number, row in rows:
        try:
            if isinstance(row, BadRow):
                raise row
            record = parse_row(row, source, verifiers)
            if label:
                ident = f"{label}:{record.prompt_id or number}"
            else:
                ident = record.prompt_id or f"{path.name}:{number}"
            if ident in seen:
                raise BadRow(f"id {ident!r} repeats the one at {seen[ident]}")
            seen[ident] = at
            loaded.records.append(PromptRecord(ident, *_fields(record)))
        except BadRow as err:
            if not skip_bad_rows:
                raise DataError(f"{at}: {err} (or set data.skip_bad_rows=true to skip bad rows)") from None
            loaded.skipped.append((at, str(err)))
    if not loaded.records:
        first = loaded.skipped[0]
        raise DataError(
            f"{where} = '{path}': no usable prompts ({len(loaded.skipped)} bad rows skipped; "
            f"first: {first[0]}: {first[1]})"
        )
    return loaded


def file_labels(paths: list[Path], where: str) -> list[str]:
    """What names each file in prompt ids and metrics: the shortest tail of its path that tells
    the files apart (train.jsonl, or a/train.jsonl and b/train.jsonl when two share a name).
    A file listed twice is an error: its rows would be one data set under two names."""
    first: dict[Path, int] = {}
    for i, path in enumerate(paths):
        j = first.setdefault(path.resolve(), i)
        if j != i:
            raise DataError(f"{where}: '{paths[j]}' and '{path}' are the same file (list it once; weights mix files)")
    for tail in range(1, max(len(p.parts) for p in paths)):
        labels = [str(Path(*p.parts[-tail:])) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]  # whole paths: distinct, as they resolve to distinct files


def _fields(record: PromptRecord) -> tuple:
    return record.prompt, record.answer, record.verifier, record.data_source, record.extra


def load_source(
    source: ResolvedFileSource, verifiers: VerifierConfig, *, where: str, skip_bad_rows: bool
) -> LoadedPrompts:
    """Every file of a source; with weights, each file's share of the mixture (files drawn
    more often than they have rows repeat whole, then a seeded sample of the rest)."""
    paths = [Path(p) for p in source.paths]
    labels = file_labels(paths, f"{where}.path")
    seen: dict[str, str] = {}
    per_file = [
        load_file(
            path,
            source,
            verifiers,
            where=f"{where}.path",
            skip_bad_rows=skip_bad_rows,
            label=label if len(paths) > 1 else "",
            seen=seen,
        )
        for path, label in zip(paths, labels)
    ]
    skipped = [s for loaded in per_file for s in loaded.skipped]
    by_file = {label: [r.prompt_id for r in loaded.records] for label, loaded in zip(labels, per_file)}
    if source.weights is None:
        return LoadedPrompts([r for loaded in per_file for r in loaded.records], skipped, by_file)
    total = sum(len(loaded.records) for loaded in per_file)
    rng = random.Random(source.seed)
    mixed: list[PromptRecord] = []
    for loaded, weight in zip(per_file, source.weights):
        want = round(total * weight / sum(source.weights))
        whole, rest = divmod(want, len(loaded.records))
        mixed.extend(loaded.records * whole + rng.sample(loaded.records, rest))
    return LoadedPrompts(mixed, skipped, by_file)
