"""The pieces every config section is made of, and the error a config that cannot run raises."""

from __future__ import annotations

import sys
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from megatron_rlvr.errors import UserError


class ConfigError(UserError, ValueError):
    """A config that cannot run; `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))

    def report(self, command: str = "") -> int:
        """Prints one `config error:` line per problem on stderr; returns the exit code, 2."""
        for line in self.problems:
            print(f"config error: {line}", file=sys.stderr)
        return self.exit_code


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


PositiveInt = Annotated[int, Field(ge=1)]


def raise_problems(problems: list[str]) -> None:
    """Validators only raise: every problem found, one line each, in one ConfigError."""
    if problems:
        raise ConfigError(problems)
