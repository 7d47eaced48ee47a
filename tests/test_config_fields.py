"""Every field of the config tree is documented (its description is what the docs and a
reader of the schema see) and read by the code (a field nothing reads is a knob that does
nothing), for every shipped config in configs/ and for the schema as a whole.

"Read" is found in the code's syntax trees, per section: `cfg.trainer.seed` is a read of
trainer.seed and of nothing else (a check by name alone counted `.seed`, `.dtype` or
`.enabled` read anywhere as a read of that field in every section). See `unread`."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from megatron_rlvr.config import Config, ResolvedConfig, load_config

REPO = Path(__file__).resolve().parents[1]
EVERY_FIELD = "*"  # a section dumped whole (model_dump) reads every one of its fields
PACKAGE = REPO / "megatron_rlvr"
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def schema_fields(root: type[BaseModel]) -> list[tuple[str, str, type[BaseModel], str]]:
    """(dotted path, field name, section class, the name the section hangs under in its parent:
    "" at the root) of every field reachable from root: every member of a union, the values of
    dicts (eval.sets.NAME hangs under "sets"), nested sections."""
    found, seen = [], set()

    def walk(model: type[BaseModel], prefix: str, under: str) -> None:
        for name, field in model.model_fields.items():
            found.append((prefix + name, name, model, under))
            for sub in _models_in(field.annotation):
                if (sub, name) not in seen:
                    seen.add((sub, name))
                    walk(sub, f"{prefix}{name}.", name)

    walk(root, "", "")
    return found


def instance_fields(node: BaseModel, prefix: str = "", under: str = "") -> list[tuple[str, str, type[BaseModel], str]]:
    """The same, for the sections a loaded config actually holds."""
    found = []
    for name in type(node).model_fields:
        found.append((prefix + name, name, type(node), under))
        value = getattr(node, name)
        children = value.items() if isinstance(value, dict) else [(None, value)]
        for key, child in children:
            if isinstance(child, BaseModel):
                found += instance_fields(child, f"{prefix}{name}." + (f"{key}." if key is not None else ""), name)
    return found


def package_modules() -> list[Path]:
    """The package's code outside the config package itself (which defines and checks
    fields, and so would count every field as read)."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.parent != PACKAGE / "config"]


def _chain_end(node: ast.expr) -> str | None:
    """The name an expression ends in: `cfg.rollout.engine` → engine, `engine` → engine."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _annotation_names(node: ast.expr | None) -> set[str]:
    """Class names in an annotation (`VerifierConfig | None`, "ResolvedConfig")."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _annotation_names(ast.parse(node.value, mode="eval").body)
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def reads_in(tree: ast.Module) -> dict[str, set[str]]:
    """{receiver: attribute names read from it} for one module. A receiver is the name an
    expression ends in (`cfg.rollout.engine.tp`: `tp` read from `engine`), followed through
    local names: one assigned from such an expression (`skip = cfg.buffer.skip_prompts`), a
    loop variable over a section dict (`for name, source in cfg.eval.sets.items()`: `sets`),
    or one annotated with a section class (`cfg: VerifierConfig`: `class:VerifierConfig`)."""
    alias: dict[str, set[str]] = defaultdict(set)
    assigned: list[tuple[str, str]] = []  # (name assigned to, the name its value ends in)
    params = {
        f.name: [a.arg for a in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs)]
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            pairs = [(t, node.value) for t in targets]
            for target in targets:  # a, b = x, y
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts))
            # `self.cfg = cfg` makes `self.cfg.x` a read of whatever `cfg` is
            for target, value in pairs:
                t, end = _chain_end(target), _chain_end(value)
                if t and end and t != end:
                    assigned.append((t, end))
        if isinstance(node, ast.Call) and (callee := _chain_end(node.func)) in params:
            # a value passed to a function of this module: its parameter is that value
            names = params[callee][1:] if isinstance(node.func, ast.Attribute) else params[callee]
            passed = [*zip(names, node.args), *((k.arg, k.value) for k in node.keywords if k.arg)]
            assigned += [(name, end) for name, value in passed if (end := _chain_end(value)) and end != name]
        if isinstance(node, ast.AnnAssign) and (target := _chain_end(node.target)):
            alias[target] |= {f"class:{c}" for c in _annotation_names(node.annotation)}
        if isinstance(node, ast.arg):
            alias[node.arg] |= {f"class:{c}" for c in _annotation_names(node.annotation)}
        if isinstance(node, ast.For | ast.comprehension) and isinstance(node.iter, ast.Call):
            func = node.iter.func
            if isinstance(func, ast.Attribute) and func.attr in ("items", "values") and _chain_end(func.value):
                loop_vars = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
                if isinstance(loop_vars[-1], ast.Name):
                    alias[loop_vars[-1].id].add(_chain_end(func.value) or "")
    for _ in range(3):  # follow chains of assignments (a = cfg.x; b = a)
        for target, end in assigned:
            alias[target] |= {end} | alias.get(end, set())
    reads: dict[str, set[str]] = defaultdict(set)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            end = _chain_end(node.value)
            if end:
                for receiver in {end} | alias.get(end, set()):
                    reads[receiver].add(node.attr)
        if isinstance(node, ast.Call):
            # `SomeOptions(**algo.rec.model_dump())` hands every field of the section on, by name
            for unpacked in (k.value for k in node.keywords if k.arg is None):
                if (
                    isinstance(unpacked, ast.Call)
                    and isinstance(unpacked.func, ast.Attribute)
                    and unpacked.func.attr == "model_dump"
                    and (end := _chain_end(unpacked.func.value))
                ):
                    for receiver in {end} | alias.get(end, set()):
                        reads[receiver].add(EVERY_FIELD)
        if isinstance(node, ast.Call) and _chain_end(node.func) == "getattr" and len(node.args) >= 2:
            name, end = node.args[1], _chain_end(node.args[0])
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and end:
                for receiver in {end} | alias.get(end, set()):
                    reads[receiver].add(name.value)
    return reads


@functools.cache
def package_reads() -> dict[str, frozenset[str]]:
    merged: dict[str, set[str]] = defaultdict(set)
    for path in package_modules():
        for receiver, names in reads_in(ast.parse(path.read_text())).items():
            merged[receiver] |= names
    return {receiver: frozenset(names) for receiver, names in merged.items()}


def _subclasses(model: type) -> list[type]:
    return [sub for direct in model.__subclasses__() for sub in (direct, *_subclasses(direct))]


@functools.cache
def _properties_reading(model: type[BaseModel], name: str) -> frozenset[str]:
    """The section's properties that read the field (`FileSource.paths` reads `path`): reading
    one of them outside the config package reads the field."""
    found = set()
    for cls in model.__mro__:
        for prop_name, prop in vars(cls).items():
            if isinstance(prop, property) and prop.fget is not None:
                body = ast.parse(textwrap.dedent(inspect.getsource(prop.fget)))
                if any(isinstance(n, ast.Attribute) and n.attr == name for n in ast.walk(body)):
                    found.add(prop_name)
    return frozenset(found)


def _is_read(name: str, model: type[BaseModel], under: str, reads: dict[str, frozenset[str]]) -> bool:
    """Read (itself, or through a property of its section) from the name the section hangs
    under, or from a value annotated with a class that declares the field or a subclass of one
    (the Resolved* types, the data sections made of a source and a prompt format)."""
    declaring = [c for c in model.__mro__ if name in getattr(c, "__annotations__", {})]
    receivers = {under} if under else {"cfg", "config"}
    receivers |= {f"class:{cls.__name__}" for c in declaring for cls in (c, *_subclasses(c))}
    names = {name, EVERY_FIELD} | _properties_reading(model, name)
    return any(names & reads.get(receiver, frozenset()) for receiver in receivers)


def undocumented(fields) -> list[str]:
    return sorted({dotted for dotted, name, model, _ in fields if not model.model_fields[name].description})


def unread(fields, reads: dict[str, frozenset[str]] | None = None) -> list[str]:
    """A field is read when code outside the config package reads that attribute from an
    expression that denotes its section: `cfg.trainer.seed` reads trainer.seed, and so do
    `trainer.seed`, `t.seed` after `t = cfg.trainer`, and `x.seed` where `x: TrainerConfig`;
    `cfg.rollout.seed` or `other.seed` do not (a field name two sections share counts for the
    section it is read from, not for both). `type` is the discriminator pydantic reads to pick
    a union member."""
    reads = package_reads() if reads is None else reads
    return sorted(
        {dotted for dotted, name, model, under in fields if name != "type" and not _is_read(name, model, under, reads)}
    )


# Fields the check finds read by nothing outside the config package, each with why it stays
# for now. The list may only shrink: a field on it that code starts reading fails the test
# below, so the entry is removed when the field is wired.
KNOWN_UNREAD: set[str] = set()  # megatron_rlvr/plan reads the last two (sequence parallelism, model type)


@pytest.mark.parametrize("root", [Config, ResolvedConfig], ids=["Config", "ResolvedConfig"])
def test_every_field_of_the_schema_is_documented_and_read(root):
    fields = schema_fields(root)
    assert len(fields) > 100  # the walk reaches every section
    assert undocumented(fields) == []
    assert set(unread(fields)) == KNOWN_UNREAD


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_field_of_a_shipped_config_is_documented_and_read(path, shipped_overrides):
    fields = instance_fields(load_config(path, shipped_overrides(path)))
    assert undocumented(fields) == []
    assert set(unread(fields)) <= KNOWN_UNREAD


def test_the_checks_catch_a_field_nothing_reads_or_documents():
    class Knob(BaseModel):
        turns_nothing: int = 0

    fields = schema_fields(Knob)
    assert undocumented(fields) == ["turns_nothing"] and unread(fields) == ["turns_nothing"]


def test_a_field_is_read_only_from_its_own_section():
    """`.seed` read from the trainer section is no read of rollout.seed: the old check, by
    name anywhere in the code, counted it for both (and `.enabled`, `.dtype` for every section)."""

    class Rollout(BaseModel):
        seed: int = 0

    class Trainer(BaseModel):
        seed: int = 0
        dtype: str = "float32"

    class Root(BaseModel):
        rollout: Rollout = Rollout()
        trainer: Trainer = Trainer()

    code = """
def step(cfg, t: Trainer):
    torch.manual_seed(cfg.trainer.seed)
    alias = cfg.trainer
    return alias.dtype, cfg.rollout.temperature
"""
    reads = {receiver: frozenset(names) for receiver, names in reads_in(ast.parse(code)).items()}
    assert unread(schema_fields(Root), reads) == ["rollout.seed"]
    # an annotated parameter, a loop over a section dict and getattr count as reads too
    code = """
def f(t: Trainer, cfg):
    for name, source in cfg.eval.sets.items():
        source.path
    return t.seed + getattr(cfg.rollout, "seed")
"""
    reads = {receiver: frozenset(names) for receiver, names in reads_in(ast.parse(code)).items()}
    assert unread(schema_fields(Root), reads) == ["trainer", "trainer.dtype"]  # nothing reads cfg.trainer
    assert "path" in reads["sets"]
