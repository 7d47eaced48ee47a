"""What each prompt's recent groups taught, and which prompts to skip before rollout.

Late in training most prompts give zero-std groups: every sample right (always solved) or
every sample wrong (never solved), at this temperature and group size. Such a group carries no
gradient, yet costs a full rollout. Following GRESO (Zheng et al., 2025: "Act Only When It
Pays"), a prompt whose last k groups were all zero-std is skipped with probability
1 − explore^k, capped below 1 so that it is always probed again (a prompt the policy has
just learned, or just forgotten, comes back). Always-solved and never-solved prompts have
separate explore rates: the first are usually done, the second may become solvable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SOLVED, UNSOLVED = "solved", "unsolved"


@dataclass
class PromptOutcome:
    streak: int = 0  # consecutive zero-std groups, most recent last
    kind: str = ""  # SOLVED or UNSOLVED while streak > 0


class PromptHistory:
    def __init__(
        self, *, enabled: bool, explore_solved: float, explore_unsolved: float, max_skip_probability: float, seed: int
    ):
        self.enabled = enabled
        self.explore = {SOLVED: explore_solved, UNSOLVED: explore_unsolved}
        self.max_skip_probability = max_skip_probability
        self._rng = random.Random(seed)  # skip draws only: the data order does not depend on them
        self.outcomes: dict[str, PromptOutcome] = {}
        self.skipped = 0  # since the last take_skipped()

    def record(self, prompt_id: str, rewards: list[float], zero_std: bool) -> None:
        """A scored group of this prompt. Solved means every sample earned the same positive
        reward; never solved, every sample earned 0."""
        outcome = self.outcomes.setdefault(prompt_id, PromptOutcome())
        if not zero_std or not rewards:
            outcome.streak, outcome.kind = 0, ""
            return
        kind = SOLVED if rewards[0] > 0 else UNSOLVED
        outcome.streak = outcome.streak + 1 if outcome.kind == kind else 1
        outcome.kind = kind

    def skip_probability(self, prompt_id: str) -> float:
        outcome = self.outcomes.get(prompt_id)
        if not self.enabled or outcome is None or outcome.streak == 0:
            return 0.0
        return min(self.max_skip_probability, 1.0 - self.explore[outcome.kind] ** outcome.streak)

    def should_skip(self, prompt_id: str) -> bool:
        """Draws whether to skip this prompt now (counted when skipped)."""
        probability = self.skip_probability(prompt_id)
        skip = probability > 0.0 and self._rng.random() < probability
        self.skipped += skip
        return skip

    def counts(self) -> dict[str, int]:
        """Prompts whose latest group was all right (always solved) or all wrong (never solved)."""
        kinds = [o.kind for o in self.outcomes.values() if o.streak > 0]
        return {"always_solved": kinds.count(SOLVED), "never_solved": kinds.count(UNSOLVED)}

    def take_skipped(self) -> int:
        skipped, self.skipped = self.skipped, 0
        return skipped

    def state(self) -> dict:
        return {"rng": self._rng.getstate(), "outcomes": {pid: (o.streak, o.kind) for pid, o in self.outcomes.items()}}

    def load_state(self, state: dict) -> None:
        self._rng.setstate(state["rng"])
        self.outcomes = {pid: PromptOutcome(streak, kind) for pid, (streak, kind) in state["outcomes"].items()}
