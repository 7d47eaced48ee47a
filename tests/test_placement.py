"""Where components live is decided in one module: every component is started through a
Placement and called through Handles the same way wherever it runs."""

from __future__ import annotations

import asyncio
import re
import typing
from pathlib import Path

import pytest

from megatron_rlvr.config import Config, LaunchConfig
from megatron_rlvr.launch.placement import (
    PLACEMENTS,
    InProcess,
    LocalHandle,
    RayActors,
    Role,
    call_all,
    close_all,
    placement_for,
)

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rlvr"


class Component:
    def __init__(self, name: str, *, fail_close: bool = False):
        self.name, self.fail_close, self.closed = name, fail_close, False

    def hello(self, who: str) -> str:
        return f"{self.name} greets {who}"

    async def later(self, value: int) -> int:
        await asyncio.sleep(0)
        return value * 2

    def broken(self) -> None:
        raise ValueError(f"{self.name} is broken")

    def close(self) -> None:
        self.closed = True
        if self.fail_close:
            raise RuntimeError(f"{self.name} could not close")


def test_every_launch_mode_the_config_accepts_has_a_placement():
    modes = set(typing.get_args(LaunchConfig.model_fields["mode"].annotation))
    assert modes == set(PLACEMENTS)
    assert isinstance(placement_for(Config.model_validate({"launch": {"mode": "local"}})), InProcess)
    assert isinstance(placement_for(Config.model_validate({"launch": {"mode": "ray"}})), RayActors)


def test_in_process_components_answer_calls_in_order_and_raise_their_own_errors():
    placement = InProcess(Config())
    handles = [placement.place(Role.SERVICE, Component, f"c{i}", index=i) for i in range(3)]
    assert call_all(handles, "hello", "you") == ["c0 greets you", "c1 greets you", "c2 greets you"]
    with pytest.raises(ValueError, match="c0 is broken"):
        call_all(handles, "broken")
    assert asyncio.run(handles[1].proxy().later(21)) == 42  # async methods stay awaitable
    assert asyncio.run(handles[2].call_async("hello", "me")) == "c2 greets me"  # sync ones run off the loop


def test_closing_tries_every_component_and_reports_the_first_failure():
    handles = [
        LocalHandle(Component("a")),
        LocalHandle(Component("b", fail_close=True)),
        LocalHandle(Component("c", fail_close=True)),
        LocalHandle(Component("d")),
    ]
    with pytest.raises(RuntimeError, match="b could not close"):
        close_all(handles, grace_s=0.0)
    assert all(h.obj.closed for h in handles)


def test_no_component_asks_where_it_lives():
    """Ray actors are made, and launch.mode read, only by the placement module (the config
    package defines and checks the field): adding a placement kind does not touch the components."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "placement.py" or path.parent == PACKAGE / "config":
            continue
        code = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
        code = re.sub(r'"""(.|\n)*?"""', "", code)  # docstrings may say where things run
        assert "ray.remote" not in code, path
        assert not re.search(r"launch\.mode(?!=)", code), path  # read; setting it (`launch.mode=local`) is not asking
        assert not re.search(r"\bremote\s*[:=]", code), path
