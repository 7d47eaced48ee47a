"""Every field of the config tree is documented (its description is what the docs and a
reader of the schema see) and read by the code (a field nothing reads is a knob that does
nothing), for every shipped config in configs/ and for the schema as a whole."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from megatron_rlvr.config import Config, ResolvedConfig, load_config

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_rlvr"
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def schema_fields(root: type[BaseModel]) -> list[tuple[str, str, type[BaseModel]]]:
    """(dotted path, field name, section class) of every field reachable from root: every
    member of a union, the values of dicts (eval.sets.NAME), nested sections."""
    found, seen = [], set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            found.append((prefix + name, name, model))
            for sub in _models_in(field.annotation):
                if sub not in seen:
                    seen.add(sub)
                    walk(sub, f"{prefix}{name}.")

    walk(root, "")
    return found


def instance_fields(node: BaseModel, prefix: str = "") -> list[tuple[str, str, type[BaseModel]]]:
    """The same, for the sections a loaded config actually holds."""
    found = []
    for name in type(node).model_fields:
        found.append((prefix + name, name, type(node)))
        value = getattr(node, name)
        children = value.items() if isinstance(value, dict) else [(None, value)]
        for key, child in children:
            if isinstance(child, BaseModel):
                found += instance_fields(child, f"{prefix}{name}." + (f"{key}." if key is not None else ""))
    return found


def package_code() -> str:
    """The package's code outside the config package itself (which defines and checks
    fields, and so would count every field as read)."""
    return "\n".join(p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if p.parent != PACKAGE / "config")


def undocumented(fields) -> list[str]:
    return sorted({dotted for dotted, name, model in fields if not model.model_fields[name].description})


def unread(fields) -> list[str]:
    """A field is read when the code outside the config package names it as an attribute
    (`.name`) or a key (`"name"`). `type` is the discriminator pydantic reads to pick a
    union member. The check is by name: a name two sections share counts as read when
    either is (logging.interval was found unread by hand, and removed)."""
    code = package_code()
    return sorted(
        {
            dotted
            for dotted, name, _ in fields
            if name != "type" and not re.search(rf"\.{name}\b|[\"']{name}[\"']", code)
        }
    )


@pytest.mark.parametrize("root", [Config, ResolvedConfig], ids=["Config", "ResolvedConfig"])
def test_every_field_of_the_schema_is_documented_and_read(root):
    fields = schema_fields(root)
    assert len(fields) > 100  # the walk reaches every section
    assert undocumented(fields) == []
    assert unread(fields) == []


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_field_of_a_shipped_config_is_documented_and_read(path, shipped_overrides):
    fields = instance_fields(load_config(path, shipped_overrides(path)))
    assert undocumented(fields) == []
    assert unread(fields) == []


def test_the_checks_catch_a_field_nothing_reads_or_documents():
    class Knob(BaseModel):
        turns_nothing: int = 0

    fields = schema_fields(Knob)
    assert undocumented(fields) == ["turns_nothing"] and unread(fields) == ["turns_nothing"]
