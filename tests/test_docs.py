"""The docs cannot drift from the code: the site builds with `mkdocs build --strict` (a broken
link, anchor or a page missing from the nav fails), docs/configuration.md is what
tools/gen_config_docs.py writes from the schema, the README stays a short front page whose
every link resolves inside the repository, and no tracked file names a path outside it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_config_docs = _load_tool("gen_config_docs")
README = REPO / "README.md"
DOC_PAGES = sorted((REPO / "docs").rglob("*.md"))
MAX_README_LINES = 200


def test_the_site_builds_strictly(tmp_path):
    # no --quiet: it silences the warnings before --strict counts them, so nothing would fail
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert "WARNING" not in build.stdout + build.stderr, build.stdout + build.stderr
    for page in ("index.html", "design/index.html", "configuration/index.html", "api/algo/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # the API pages are made from the docstrings, not left empty
    assert "group_advantages" in (tmp_path / "site" / "api/algo/index.html").read_text()


def test_the_configuration_page_is_generated_from_the_schema():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == gen_config_docs.render(), "docs/configuration.md is stale: run tools/gen_config_docs.py"


def test_the_configuration_page_names_every_field():
    from test_config_fields import schema_fields

    from megatron_rlvr.config import Config

    page = (REPO / "docs" / "configuration.md").read_text()
    named = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.M)) | set(re.findall(r"^## `(\w+)`", page, flags=re.M))
    missing = sorted({dotted for dotted, name, _, _ in schema_fields(Config) if name not in named})
    assert missing == []


def test_the_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor GitHub and MkDocs' toc give a heading (lower case, punctuation dropped)."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return re.sub(r"\s+", "-", text)


def _anchors(page: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """Relative links of a page (its text, or `text` as if it were the page's) that name no
    file in the repository, or no heading in it."""
    broken = []
    for target in LINK.findall(page.read_text() if text is None else text):
        if re.match(r"[a-z]+:", target) or target.startswith("#") and page != README:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(target)
    return broken


def test_every_link_of_the_readme_resolves_inside_the_repository():
    assert broken_links(README) == []
    assert LINK.findall(README.read_text()), "the README links to its docs"


def test_the_link_check_catches_a_broken_link():
    text = "[ok](design.md) [gone](nowhere.md) [outside](../../etc/passwd) [bad anchor](design.md#no-such-heading)"
    assert broken_links(REPO / "docs" / "index.md", text) == [
        "nowhere.md",
        "../../etc/passwd",
        "design.md#no-such-heading",
    ]


OUTSIDE = ("../" + "shared", "/wo" + "rk/")  # spelt apart so this file does not match itself


def test_no_tracked_file_names_a_path_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True)
    offenders = []
    for name in files.stdout.split("\0"):
        path = REPO / name
        if not name or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        offenders += [f"{name}: {needle}" for needle in OUTSIDE if needle in text]
    assert offenders == []
