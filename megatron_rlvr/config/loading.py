"""A config from a YAML file and dotted command-line overrides, validated and resolved;
pydantic's errors turned into one line per problem naming the dotted field."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from megatron_rlvr.config.base import ConfigError
from megatron_rlvr.config.resolve import ResolvedConfig, resolve
from megatron_rlvr.config.schema import Config


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
