"""The layout table (docs/developers.md, "Layout") matches the tree: every path it names
exists, and every package and top-level module of megatron_rlvr, and every top-level folder,
is in it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layout_rows() -> list[str]:
    text = (REPO / "docs" / "developers.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def named_paths() -> list[str]:
    """The backquoted paths in the table's first column (`a/`, `b.py`, `c/d.py`)."""
    paths = []
    for row in layout_rows():
        first = row.split("|")[1]
        paths += re.findall(r"`([^`]+)`", first)
    return paths


def test_every_path_the_layout_names_exists():
    for path in named_paths():
        candidates = [REPO / path, REPO / "megatron_rlvr" / path]
        assert any(p.exists() for p in candidates), f"the layout table names {path!r}, which is not in the tree"


def test_every_package_module_and_folder_is_in_the_layout():
    named = set(named_paths())
    flat = {Path(p).name.rstrip("/") for p in named} | {p.rstrip("/") for p in named}
    package = REPO / "megatron_rlvr"
    for item in sorted(package.iterdir()):
        if item.name.startswith(("_", ".")):
            continue
        if item.is_dir() or item.suffix == ".py":
            assert item.name in flat, f"megatron_rlvr/{item.name} is not in the layout table (docs/developers.md)"
    for folder in ("benchmarks", "configs", "docs", "scripts", "slurm", "tests", "tools"):
        assert f"{folder}/" in named, f"{folder}/ is not in the layout table (docs/developers.md)"
