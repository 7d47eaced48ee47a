"""Per-domain numbers of a step (a record's domain is its verifier: data/selection.py):
reward/<d>/mean and /samples over the responses scored, reward/<d>/groups and
/zero_std_share over the groups filed, so a mixed run shows each domain's progress and how
much of its generation carried no signal."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence


class DomainStats:
    """Per domain since the last take: the rewards scored and the groups filed (kept or zero-std)."""

    def __init__(self, domains: list[str]):
        self.domains = sorted(set(domains))  # every step names each (samples 0 when none was scored)
        self._rewards: dict[str, list[float]] = defaultdict(list)
        self._groups: Counter[str] = Counter()
        self._zero_std: Counter[str] = Counter()

    def add(self, domain: str, rewards: Sequence[float | None], verdict: str) -> None:
        """A group filed with the buffer's verdict; None rewards (a judge's unscored group) are left out."""
        self._rewards[domain].extend(r for r in rewards if r is not None)
        if verdict in ("kept", "zero_std"):  # scored groups; failed and aborted ones say nothing of the domain
            self._groups[domain] += 1
            self._zero_std[domain] += verdict == "zero_std"

    def take(self) -> dict[str, float]:
        """reward/<d>/samples and /groups every step; /mean and /zero_std_share when it had any."""
        out: dict[str, float] = {}
        for domain in sorted(set(self.domains) | set(self._rewards)):
            rewards, groups = self._rewards.get(domain, []), self._groups[domain]
            out[f"reward/{domain}/samples"] = len(rewards)
            out[f"reward/{domain}/groups"] = groups
            if rewards:
                out[f"reward/{domain}/mean"] = sum(rewards) / len(rewards)
            if groups:
                out[f"reward/{domain}/zero_std_share"] = self._zero_std[domain] / groups
        self._rewards.clear()
        self._groups.clear()
        self._zero_std.clear()
        return out
