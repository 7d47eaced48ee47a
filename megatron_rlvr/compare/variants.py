"""`--vary algo.KEY=V1,V2,...`: any algo setting as one more axis of a comparison, as the replay
modes are one. Each --vary is an axis; several form every combination (a variant), and each
variant runs under every algorithm, off-policy degree, mode and seed.

Values are YAML scalars, as in a `key=value` override (`token`, `0.5`, `true`, `null`), written
as a YAML flow list without its brackets, so a value holding a comma is quoted:
`algo.rollout_correction.rollout_rs="token_k1,seq_mean_k3",null`. A value is kept as the YAML
text that reads back to it, which names the variant in run folders, tables and verdicts and
sets it in each run's config as an override would."""

from __future__ import annotations

import argparse
import itertools
import re
from dataclasses import dataclass

import yaml

# the algo settings the command sweeps with flags of its own
SET_BY_FLAGS = {"algo.kind": "--algos", "algo.routing_replay": "--modes", "algo.num_minibatches": "--off-policy"}
UNSAFE_IN_FOLDER_NAMES = re.compile(r"[^\w.=+-]")  # no '%': Slurm's --output expands it


def yaml_text(value: str | int | float | bool | None) -> str:
    """The YAML text that reads back to `value` (`null`, `0.5`, `token`, `'null'` for the string)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1_000_000).removesuffix("\n...\n").strip()


@dataclass(frozen=True)
class Vary:
    """One --vary axis: a dotted algo key and the YAML texts of its values, in the order given."""

    key: str
    values: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.key}={','.join(self.values)}"


def parse_vary(text: str) -> Vary:
    """The argparse type of --vary: a one-line error for a key outside algo, a key another flag
    sweeps, or a value that is not a YAML scalar."""
    key, _, raw = (part.strip() for part in text.partition("="))
    if not key or not raw:
        raise argparse.ArgumentTypeError(f"{text!r}: expected algo.KEY=VALUE,VALUE,...")
    if not key.startswith("algo.") or key == "algo.":
        raise argparse.ArgumentTypeError(f"{text!r}: {key} is not an algo setting; only algo.* can be varied")
    if key in SET_BY_FLAGS:
        raise argparse.ArgumentTypeError(f"{text!r}: {key} is swept by {SET_BY_FLAGS[key]}")
    try:
        values = yaml.safe_load(f"[{raw}]")
    except yaml.YAMLError:
        values = None
    if not values or not all(isinstance(v, (str, int, float, bool)) or v is None for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: values are comma-separated YAML scalars (token, 0.5, true, null; quote one with a comma)"
        )
    texts = list(dict.fromkeys(yaml_text(v) for v in values))
    by_folder: dict[str, str] = {}
    for value in texts:
        other = by_folder.setdefault(UNSAFE_IN_FOLDER_NAMES.sub("_", value), value)
        if other != value:
            raise argparse.ArgumentTypeError(
                f"{text!r}: values {other} and {value} would name the same run folder "
                "(it keeps letters, digits and . _ = + -)"
            )
    return Vary(key, tuple(texts))


@dataclass(frozen=True, order=True)
class Variant:
    """One combination of the --vary values: the settings a run adds to its config. Ordered by
    `position`, its place in the grid, so tables and plots follow the order the values were given."""

    position: int = 0
    settings: tuple[tuple[str, str], ...] = ()  # (dotted key, YAML text)

    @property
    def label(self) -> str:
        """`rollout_correction.rollout_is=token, stale_negatives.enabled=true`; '' without --vary."""
        return ", ".join(f"{key.removeprefix('algo.')}={value}" for key, value in self.settings)

    @property
    def folder_name(self) -> str:
        """The label as a part of a run folder's name: settings joined by '+'."""
        return UNSAFE_IN_FOLDER_NAMES.sub(
            "_", "+".join(f"{key.removeprefix('algo.')}={value}" for key, value in self.settings)
        )

    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.settings]


NO_VARIANT = Variant()


def grid(axes: list[Vary]) -> list[Variant]:
    """Every combination of the axes' values, the first axis slowest; one empty variant without axes."""
    combos = itertools.product(*[[(axis.key, value) for value in axis.values] for axis in axes])
    return [Variant(position, settings) for position, settings in enumerate(combos)]
