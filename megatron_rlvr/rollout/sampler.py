"""Active sampling: keep enough prompt groups in flight to fill the next batch, adapting to
the fraction of groups that turn out useful, score each group as it finishes, and file it in
the buffer. Surplus useful groups stay in the buffer for the next step.

Groups are filed in the order they were submitted, whatever order the engines finish them
in, and every group carries a sampling seed derived from the run's seed and its submission
number. With `drain` (synchronous training) nothing is left in flight between steps, so the
groups a step trains on depend only on the seed and the weights: a resumed run sees the
same rollouts as an uninterrupted one.

One step generates at most `max_groups` groups. Late in training most groups have zero reward
std, and "until the batch is full" would otherwise mean hours of rollouts for nothing: at the
bound the step gets the useful groups there are (a short batch), and a bound spent without
enough of them ends the run (NothingToLearn) with what the prompts' histories say.

In flight (rollout.updates = in_flight) the engines never wait for the learner: groups are
filed as they finish (a slow group holds back no other), and the sampler keeps one batch's
worth of groups generating (batch_groups at the useful fraction) while it fills a batch and
between fills, so the engines' slots stay full through a batch's tail, and groups still
generating when a batch is taken go on across weight updates and serve a later step.
Generation runs at most one batch ahead: once the next batch's useful groups are there, no
more are submitted (they would only wait in the buffer and go stale).

Group sizes follow GroupSizes: a size per step (the step whose batch a group is generated
for), and optionally one resample, larger, of a prompt whose group came back all equal. A
resample's samples take seeds from a range no scheduled group's reach, so it never repeats
the samples it replaces."""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rlvr.data import PromptRecord
from megatron_rlvr.errors import UserError
from megatron_rlvr.rollout.manager import PromptItem, RolloutManager
from megatron_rlvr.rollout.prompt_history import PromptHistory
from megatron_rlvr.samples import Group, Sample

if TYPE_CHECKING:
    from megatron_rlvr.config.resolve import ResolvedRollout


class RolloutFailed(UserError, RuntimeError):
    """Every recent group failed: no engine can serve (the run stops instead of spinning)."""


class SamplerStateMismatch(UserError, ValueError):
    """A checkpoint's sampler state names prompts this run's data does not have."""


class NothingToLearn(RuntimeError):
    """A step's generation bound was spent without the useful groups one batch needs."""


Score = Callable[[list[str], PromptRecord], Awaitable[list[float]]]  # responses, their record → rewards

_RESAMPLE_SEEDS = 2**61  # a resample's seeds start here: scheduled groups' seeds (seed + submission + index) never do


@dataclass(frozen=True)
class GroupSizes:
    """Samples per prompt: `first` at step 1 to `last` at step `steps`, linearly (rounded);
    first = last: a constant size. resample: the size of a second group for a prompt whose
    group came back all equal, when larger than that group (None: no resamples)."""

    first: int
    last: int
    steps: int = 1
    resample: int | None = None

    @classmethod
    def of(cls, rollout: ResolvedRollout, steps: int) -> GroupSizes:
        """From the resolved rollout section and trainer.steps."""
        linear = rollout.group_size_schedule == "linear"
        return cls(
            first=rollout.min_group_size if linear else rollout.n_samples_per_prompt,
            last=rollout.max_group_size if linear else rollout.n_samples_per_prompt,
            steps=steps,
            resample=rollout.max_group_size if rollout.extra_samples_on_equal else None,
        )

    def at(self, step: int) -> int:
        """The size of a group generated for `step` (from 1; past the last step, the last size)."""
        done = min(max(step - 1, 0), self.steps - 1) / max(self.steps - 1, 1)
        return round(self.first + (self.last - self.first) * done)

    @property
    def smallest(self) -> int:
        return min(self.first, self.last)


def answer_text(sample: Sample, decode: Callable[[list[int]], str]) -> str:
    """What the verifier scores: an episode's final model turn, or the whole response."""
    return sample.episode.final_text if sample.episode is not None else decode(sample.response_ids)


class EpisodeTally:
    """Episode figures of the samples scored since the last take() (agent/... metrics)."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def add(self, sample: Sample) -> None:
        if sample.episode is not None:
            self.samples.append(sample)

    def take(self) -> dict[str, float]:
        samples, self.samples = self.samples, []
        if not samples:
            return {}
        stats = [s.episode for s in samples if s.episode is not None]
        return {
            "agent/turns_mean": sum(e.turns for e in stats) / len(stats),
            "agent/tool_calls": sum(e.tool_calls for e in stats),
            "agent/tool_errors": sum(e.tool_errors for e in stats),
            "agent/tool_s": sum(e.tool_s for e in stats),
            "agent/prefix_breaks": sum(e.prefix_breaks for e in stats),
            "agent/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "agent/max_turns_reached": sum(e.ended == "max_turns" for e in stats) / len(stats),
        }


class ActiveSampler:
    def __init__(
        self,
        manager: RolloutManager,
        buffer,
        prompts: list[PromptRecord],
        *,
        encode: Callable[[PromptRecord], list[int]],
        decode: Callable[[list[int]], str],
        score: Score,
        seed: int = 0,
        seeded: bool = True,
        max_in_flight: int = 256,
        max_failed_in_a_row: int = 64,
        max_groups: int = 2**31,
        min_groups: int = 1,
        history: PromptHistory | None = None,
        in_flight: bool = False,
        group_sizes: GroupSizes | None = None,
        messages: Callable[[PromptRecord], list[dict]] | None = None,
    ):
        """buffer: a Buffer, or a proxy with the same async methods (the Ray actor).
        max_groups: groups one fill may generate; min_groups: the fewest useful groups a
        (short) batch may have. history: each prompt's recent outcomes, and which to skip.
        group_sizes: samples per prompt by step (None: the manager's sampling n). messages: a
        record's conversation, given when groups run as episodes (the manager's agent)."""
        self.manager, self.buffer, self.score = manager, buffer, score
        self.prompts, self.encode, self.decode = prompts, encode, decode
        self.messages = messages
        self.episodes = EpisodeTally()
        self._by_id = {r.prompt_id: r for r in prompts}  # a finished group's record, for its verifier
        self.seed, self.seeded, self.max_in_flight = seed, seeded, max_in_flight
        self.max_failed_in_a_row, self._failed_in_a_row = max_failed_in_a_row, 0
        self.max_groups, self.min_groups = max_groups, min_groups
        self.history = history or PromptHistory(
            enabled=False, explore_solved=1.0, explore_unsolved=1.0, max_skip_probability=0.0, seed=seed
        )
        self._rng = random.Random(seed)
        self._order: list[PromptRecord] = []
        self._recent: deque[bool] = deque(maxlen=256)  # kept or not, for the latest groups
        self._pending: deque[str] = deque()  # group ids in flight, in submission order
        self._scoring: list[str] = []  # group ids taken from the engines, not yet in the buffer
        self._prompt_of: dict[str, str] = {}  # a group in flight or being scored → its prompt id
        self._filing = asyncio.Lock()  # held while a group enters the buffer, a batch leaves it, or a snapshot
        self._drawn: list[Group] | None = None  # the batch the latest fill drew from the buffer
        self._finished: dict[str, Group] = {}  # finished ahead of their turn
        self.submitted = 0
        self.rewards: list[float] = []  # every scored sample since the last take_rewards()
        self.tokens = 0  # response tokens generated since then
        self.short_batches = 0  # steps that got fewer than batch_groups groups at the bound
        self._generated = 0  # groups submitted by the latest fill
        self.in_flight = in_flight
        self.group_sizes = group_sizes
        self.fills = 0  # batches drawn: groups submitted now are for step fills + 1
        self.resampled = 0  # resamples submitted over the run (their seeds follow from it)
        self._resamples: set[str] = set()  # resample group ids in flight or being scored
        self._sizes: list[int] = []  # scheduled sizes submitted since the last step_stats()
        self._resample_counts = {"resampled_on_equal": 0, "resampled_useful": 0}  # since then too
        self._stopping = False
        self._keep_busy_task: asyncio.Task | None = None  # in flight: generating between fills
        self._keep_going = False

    def useful_fraction(self) -> float:
        """Kept / generated over the latest groups (the policy changes, so the fraction does),
        smoothed so a cold start neither stalls nor floods."""
        return (sum(self._recent) + 1) / (len(self._recent) + 2)

    def _draw(self) -> PromptRecord:
        if not self._order:
            self._order = list(self.prompts)
            self._rng.shuffle(self._order)
        return self._order.pop()

    def _next_prompt(self) -> PromptRecord:
        """The next prompt of the shuffled pass over the data that the history does not skip
        (a skipped prompt waits for the next pass). After a whole pass's worth of skips the
        next prompt is taken anyway: skipping never stalls sampling."""
        for _ in range(len(self.prompts)):
            record = self._draw()
            if not self.history.should_skip(record.prompt_id):
                return record
        return self._draw()

    def _top_up(self, needed: int, room: int) -> None:
        """Submits groups until enough are in flight for `needed` useful ones at the measured
        useful fraction; at most `room` more."""
        target = min(self.max_in_flight, math.ceil(needed / self.useful_fraction()), len(self._pending) + room)
        size = self.group_sizes.at(self.fills + 1) if self.group_sizes else None
        while len(self._pending) < target:
            self._submit(self._next_prompt(), size, self.submitted)
            self.submitted += 1
            if size is not None:
                self._sizes.append(size)

    def _submit(self, record: PromptRecord, size: int | None, seed_offset: int) -> str:
        seed = (self.seed * 1_000_003 + seed_offset) % 2**62 if self.seeded else None
        item = PromptItem(record.prompt_id, self.encode(record), seed=seed)
        if self.messages is not None:
            item.messages, item.extra = self.messages(record), record.extra
        group_id = self.manager.submit(item, size)
        self._pending.append(group_id)
        self._prompt_of[group_id] = record.prompt_id
        self._generated += 1
        return group_id

    def _resample_if_equal(self, group: Group, verdict: str) -> None:
        """A group dropped because its rewards were all equal: its prompt once more, with the
        resample size, if that is larger and the fill's bound leaves room."""
        size = self.group_sizes.resample if self.group_sizes else None
        if (
            verdict != "zero_std"
            or size is None
            or len(group.samples) >= size
            or self._generated >= self.max_groups
            or self._stopping
        ):
            return
        offset = _RESAMPLE_SEEDS + self.resampled * size
        self._resamples.add(self._submit(self._by_id[group.prompt_id], size, offset))
        self.resampled += 1
        self._resample_counts["resampled_on_equal"] += 1

    async def _next_in_order(self) -> Group:
        head = self._pending[0]
        while head not in self._finished:
            group = await self.manager.next_group()
            self._finished[group.group_id] = group
        self._scoring.append(self._pending.popleft())
        return self._finished.pop(head)

    async def _next_finished(self) -> Group:
        """The next group to file: in submission order, or in flight the first to finish."""
        if not self.in_flight:
            return await self._next_in_order()
        group = await self.manager.next_group()
        self._pending.remove(group.group_id)
        self._scoring.append(group.group_id)
        return group

    async def _keep_busy(self, batch_groups: int, policy_version: int) -> None:
        """Between fills (in flight): keeps one batch's worth generating toward the next batch
        (for policy_version) and files each group as it finishes, until the next fill takes
        over; no new groups once that batch's useful groups are there (more would go stale)."""
        while self._keep_going:
            if await self.buffer.useful(policy_version) < batch_groups:
                self._top_up(batch_groups, self.max_in_flight)
            if not self._pending:
                return
            await self._file(await self._next_finished())

    async def _stop_keeping_busy(self) -> None:
        """Lets the keep-busy task file the group it waits for, then end (never cancelled
        mid-file: a group taken from the engines is always filed)."""
        self._keep_going = False
        if self._keep_busy_task is not None:
            task, self._keep_busy_task = self._keep_busy_task, None
            await task

    async def stop_generating(self) -> None:
        """Ends generation with nothing unaccounted for: no more top-ups, every group in
        flight aborted, and each filed (the buffer counts them under dropped_aborted)."""
        await self._stop_keeping_busy()
        self._stopping = True
        await self.manager.abort_all()
        while self._pending:
            await self._file(await self._next_finished())

    async def _file(self, group: Group) -> None:
        """Scores a group taken from the engines and puts it in the buffer. Until it is there
        it stays in _scoring, so a snapshot taken meanwhile records its prompt."""
        self._failed_in_a_row = self._failed_in_a_row + 1 if group.error is not None else 0
        if self._failed_in_a_row >= self.max_failed_in_a_row:
            raise RolloutFailed(f"the last {self._failed_in_a_row} groups all failed; latest: {group.error}")
        rewards: list[float] = []
        if group.samples and group.error is None:
            rewards = await self.score(
                [answer_text(s, self.decode) for s in group.samples], self._by_id[group.prompt_id]
            )
            if self.manager.agent is not None:
                rewards = [self.manager.agent.reward(r, s) for r, s in zip(rewards, group.samples)]
            for sample, reward in zip(group.samples, rewards):
                sample.reward = reward
                self.tokens += sample.sampled_tokens()
                self.episodes.add(sample)
            self.rewards.extend(rewards)
        async with self._filing:
            verdict = await self.buffer.put(group)
            self._scoring.remove(group.group_id)
            self._prompt_of.pop(group.group_id, None)
            if verdict in ("kept", "zero_std"):
                self.history.record(group.prompt_id, rewards, zero_std=verdict == "zero_std")
            self._recent.append(verdict == "kept")
            if group.group_id in self._resamples:
                self._resamples.discard(group.group_id)
                self._resample_counts["resampled_useful"] += verdict == "kept"
            self._resample_if_equal(group, verdict)

    async def fill(self, batch_groups: int, policy_version: int, *, drain: bool = False) -> list[Group]:
        """batch_groups useful groups for training `policy_version`, generating at most
        max_groups groups for them: at that bound, the useful groups there are (at least
        min_groups, else NothingToLearn). drain: also wait for every group still in flight
        (they go to the buffer), so none straddles a step."""
        self._drawn = None  # first, before any await: a snapshot from now on sees this fill's draw
        await self._stop_keeping_busy()
        self._generated = 0
        while (useful := await self.buffer.useful(policy_version)) < batch_groups:
            room = self.max_groups - self._generated
            if room <= 0 and not self._pending:
                break
            self._top_up(batch_groups if self.in_flight else batch_groups - useful, room)
            await self._file(await self._next_finished())
        while drain and self._pending:
            await self._file(await self._next_finished())
        useful = await self.buffer.useful(policy_version)
        if useful < batch_groups:
            if useful < self.min_groups:
                raise NothingToLearn(self._nothing_to_learn(useful))
            self.short_batches += 1
        async with self._filing:
            batch = self._drawn = await self.buffer.get_batch(min(useful, batch_groups), policy_version)
            self.fills += 1
        if self.in_flight:
            self._keep_going = True
            self._keep_busy_task = asyncio.create_task(self._keep_busy(batch_groups, policy_version + 1))
        return batch

    def _nothing_to_learn(self, useful: int) -> str:
        counts = self.history.counts()
        found = "no useful group" if useful == 0 else f"only {useful} useful groups (a batch needs {self.min_groups})"
        return (
            f"{found} among {self._generated} generated (buffer.max_generated_groups_per_step = "
            f"{self.max_groups}): of {len(self.prompts)} prompts, {counts['always_solved']} were always "
            f"solved and {counts['never_solved']} never solved the last time they were sampled, at this "
            "rollout.temperature and rollout.n_samples_per_prompt; the policy has nothing left to learn "
            "from this data"
        )

    def step_stats(self) -> dict[str, float]:
        """Sampling figures for the step's metrics (skips, resamples and the scheduled group
        size, as the mean over groups submitted, since the last call; no size when none was)."""
        sizes, self._sizes = self._sizes, []
        resamples = {f"sampler/{k}": v for k, v in self._resample_counts.items()}
        self._resample_counts = dict.fromkeys(self._resample_counts, 0)
        return {
            "sampler/groups_generated": self._generated,
            "sampler/skipped_prompts": self.history.take_skipped(),
            **{f"sampler/{k}": v for k, v in self.history.counts().items()},
            "buffer/short_batches": self.short_batches,
            **({"rollout/group_size": sum(sizes) / len(sizes)} if sizes else {}),
            **(resamples if self.group_sizes and self.group_sizes.resample else {}),
            **self.episodes.take(),
        }

    def take_rewards(self) -> tuple[list[float], int]:
        """Rewards and response tokens since the last call."""
        rewards, tokens, self.rewards, self.tokens = self.rewards, self.tokens, [], 0
        return rewards, tokens

    def state(self) -> dict:
        """What a resumed run needs to submit the same groups next. Exact between drained
        steps. Groups still generating or being scored (async and in-flight runs) cannot be
        saved half-made: their prompts are recorded, and a resumed run generates them again
        first. With the buffer's state, taken at one point: snapshot()."""
        return {
            "rng": self._rng.getstate(),
            "order": [r.prompt_id for r in self._order],
            "in_flight": [self._prompt_of[group_id] for group_id in (*self._scoring, *self._pending)],
            "recent": list(self._recent),
            "submitted": self.submitted,
            "short_batches": self.short_batches,
            "history": self.history.state(),
            "fills": self.fills,
            "resampled": self.resampled,
        }

    async def snapshot(self) -> tuple[dict, dict, list[Group] | None]:
        """The sampler's state, the buffer's and the batch the latest fill drew (None before
        it draws), taken while no group enters the buffer and no batch leaves it: every group
        generated is in exactly one of them (in flight or being scored; waiting in the buffer
        or counted as dropped; drawn) or was drawn by an earlier fill."""
        async with self._filing:
            return self.state(), await self.buffer.state(), self._drawn

    def load_state(self, state: dict) -> int:
        """Restores `state`; returns how many groups were still generating when it was taken
        (their prompts are drawn again before any other)."""
        in_flight = state.get("in_flight", [])
        unknown = [i for i in [*state["order"], *in_flight] if i not in self._by_id]
        if unknown:  # other data, or ids of an older form (several files with one name shared one id)
            raise SamplerStateMismatch(
                f"the checkpoint's sampler state names {len(unknown)} prompt ids this run's data does not "
                f"have (e.g. {unknown[0]!r}): data.path changed since it was saved (restore it, or set "
                "trainer.resume=false)"
            )
        self._rng.setstate(state["rng"])
        # _draw pops from the end: the prompts cut off in flight are drawn first, in submission order
        self._order = [self._by_id[i] for i in [*state["order"], *reversed(in_flight)]]
        self._recent = deque(state["recent"], maxlen=self._recent.maxlen)
        self.submitted = state["submitted"]
        self.short_batches = state.get("short_batches", 0)
        self.fills, self.resampled = state.get("fills", 0), state.get("resampled", 0)
        if "history" in state:
            self.history.load_state(state["history"])
        return len(in_flight)
