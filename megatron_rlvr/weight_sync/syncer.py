"""The learner's source rank pushes new weights to every engine.

One sync: check every engine holds the previous version (an engine that skipped or repeated
an update is caught here) → pause generation (retract by default) → open the update session
→ for each flattened dtype bucket: announce it to every engine through
/update_weights_from_distributed, then ONE broadcast, while the next bucket is already being
exported and packed (memory: two buckets) → close the session → flush the engines' prefix
cache (KV and routed experts computed under the old weights; SGLang 0.5.23 flushes only when
an update asks it to, and its end_weight_update does not) → resume → check every engine now
reports the new version. Any engine error stops the sync with the engine named.

An engine refuses a bucket before it posts its side of the broadcast (no session, unknown
group, a malformed request) or not at all. A refusal after rank 0 posted an NCCL broadcast
would leave it waiting for the NCCL watchdog, so the first bucket of each sync waits up to
weight_sync.refusal_wait_s for refusals before its broadcast is posted; the conditions a
refusal depends on are the same for every bucket of a sync.

Engines come and go: one that stopped answering leaves the update group at the next sync,
and one that answers again (restarted, so holding its initial weights) joins it and gets
the full model; the group is re-formed over the engines alive at that moment. An engine
that dies during a sync, before or after buckets were broadcast, ends it with EnginesLost:
the export is finished, the group torn down, the survivors' update session closed (they
stay paused), and the next sync of the same version, over the engines alive then, sends
the whole model again to survivors that may hold part of it.

Dead is judged by EngineClient.state, which tells a paused engine (every member, during a
sync) from a dead one: SGLang's /health generates a token, which waits while paused. A
survivor that does not answer the session's close within SESSION_CLOSE_S is still inside
the broadcast that lost its peer (NCCL: until its group's timeout, 30 minutes in SGLang
0.5.23; gloo survivors leave once the group is dropped): EnginesLost names it in `restart`, with the dead, and it stays out of the group
until the run says it restarted it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_rlvr.config import WeightSyncConfig
from megatron_rlvr.errors import UserError
from megatron_rlvr.learner.parallel import free_port
from megatron_rlvr.rollout import protocol as p
from megatron_rlvr.rollout.client import EngineClient, EngineRequestError, EngineState
from megatron_rlvr.weight_sync.buckets import Bucket, buckets
from megatron_rlvr.weight_sync.transport import (
    abort_group,
    broadcast,
    bucket_device,
    group_layout,
    in_daemon_thread,
    open_group,
)

log = logging.getLogger(__name__)


class WeightSyncError(UserError):
    """A sync that could not complete, naming the engine and what it said."""


class EnginesLost(WeightSyncError):
    """Engines died during a sync. The export the learner ranks are inside was finished and
    the survivors' update session closed, so the run can sync the same version again once
    the engines in `restart` are restarted (survivors may hold part of it: every sync sends
    all). restart: indices of the dead engines and of survivors stuck inside the broadcast."""

    def __init__(self, message: str, restart: Iterable[int] = ()):
        super().__init__(message)
        self.restart = tuple(restart)

    def __reduce__(self):  # crosses Ray with its engine list
        return (type(self), (str(self), self.restart))


UNRESOLVED_ENGINE_WAIT_S = 600.0  # a config not through resolve() (tests): the default start timeout
SESSION_CLOSE_S = 30.0  # how long survivors of a lost sync get to close their update session


@dataclass
class SyncReport:
    version: int
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    engine_version: int | None = None  # what every engine reports after the sync


class WeightSyncer:
    def __init__(
        self,
        clients: list[EngineClient],
        cfg: WeightSyncConfig,
        *,
        master_address: str = "127.0.0.1",
        engine_ranks: list[int] | None = None,
        group_name: str = "weight_update_group",
        initial_version: int | None = None,
        checksums: bool | None = None,
        session_close_s: float = SESSION_CLOSE_S,
    ):
        """engine_ranks: the ranks each engine brings to the update group (its tp size; see
        transport.engine_rank_count); None: one each. checksums: send per-bucket checksums (a
        CPU-engine extension SGLang refuses as an unknown field); None: weight_sync.checksum.
        session_close_s: how long survivors of a lost sync get to close their session."""
        if engine_ranks is not None and len(engine_ranks) != len(clients):
            raise ValueError(f"{len(engine_ranks)} engine rank counts for {len(clients)} engines")
        self.clients = clients
        self.cfg = cfg
        self.master_address = master_address
        self.engine_ranks = engine_ranks or [1] * len(clients)
        self.group_name = group_name
        self.version = initial_version
        self.checksums = bool(cfg.checksum) if checksums is None else checksums
        self.backend = "nccl" if cfg.backend == "nccl" else "gloo"
        self.group = None
        self.connected = False
        self.members: list[int] = []  # indices of the engines in the current group
        self.initial_version = initial_version  # what a (re)started engine holds
        # the version whose sync lost an engine after buckets went out: the survivors hold
        # it (SGLang takes a bucket's version as it loads it) or the one before
        self.interrupted: int | None = None
        # how long a sync waits for any engine to answer when none does (every one restarting)
        self.engine_wait_s = cfg.engine_wait_s if cfg.engine_wait_s is not None else UNRESOLVED_ENGINE_WAIT_S
        self.stuck: set[int] = set()  # left inside a lost broadcast: out until restarted
        self.session_close_s = session_close_s

    @property
    def member_clients(self) -> list[EngineClient]:
        return [self.clients[i] for i in self.members]

    async def connect(self, members: list[int] | None = None) -> None:
        """Forms the update group over `members` (default: every engine): this process is
        rank 0, engine e's ranks start at 1 + Σ ranks of the members before it (SGLang's
        rank_offset)."""
        members = list(range(len(self.clients))) if members is None else members
        layout = group_layout([self.engine_ranks[i] for i in members])
        port = free_port(self.master_address)
        opening = in_daemon_thread(  # a join that never comes waits out the timeout there
            open_group, self.master_address, port, 0, layout.world_size, self.group_name, self.backend
        )
        joins = [
            self.clients[i].init_weights_update_group(
                p.InitWeightsUpdateGroupReqInput(
                    master_address=self.master_address,
                    master_port=port,
                    rank_offset=offset,
                    world_size=layout.world_size,
                    group_name=self.group_name,
                    backend=self.backend,
                )
            )
            for i, offset in zip(members, layout.offsets)
        ]
        self.group, *_ = await asyncio.gather(opening, *joins)
        self.members, self.connected = members, True
        if self.version is None:  # adopt the engines' version; they must agree
            versions = set(await self.engine_versions())
            if len(versions) != 1 or not next(iter(versions)).lstrip("-").isdigit():
                raise WeightSyncError(
                    f"engines report weight versions {sorted(versions)}: they must start from one numeric version"
                )
            self.version = int(versions.pop())
        if self.initial_version is None:
            self.initial_version = self.version

    async def engine_versions(self) -> list[str]:
        """The weight version each member of the group holds."""
        return [info["weight_version"] for info in await asyncio.gather(*(c.model_info() for c in self.member_clients))]

    async def _survey(self, wait_s: float) -> dict[int, str]:
        """The weight version of every engine that answers; with none answering (all
        restarting, or a loaded machine), waits up to wait_s. An engine that refuses the
        question (HTTP 4xx: another run's engine, or a wrong API key) ends the sync at once:
        waiting would not change its answer."""
        deadline = time.monotonic() + wait_s
        while True:
            infos = await asyncio.gather(*(c.model_info(retries=0) for c in self.clients), return_exceptions=True)
            refused = [str(info) for info in infos if isinstance(info, EngineRequestError)]
            if refused:
                raise WeightSyncError(f"an engine refused the run's request: {refused[0]}")
            held = {i: info["weight_version"] for i, info in enumerate(infos) if isinstance(info, dict)}
            if held or time.monotonic() > deadline:
                return held
            await asyncio.sleep(1.0)

    async def _refresh_members(self, restarted_by_run: tuple[int, ...] = ()) -> tuple[list[int], dict[int, str]]:
        """Re-forms the group when engines died or came back; returns those that joined and
        the version every live engine holds. A member back at the initial version after
        later syncs was restarted (its old process left the group): it needs the full
        model, which every sync sends, so it simply joins again. Before any sync a restart
        does not show in the version: the run says which engines it restarted. An engine
        left stuck in a lost broadcast stays out until the run says it restarted it."""
        self.stuck -= set(restarted_by_run)
        held = {i: v for i, v in (await self._survey(self.engine_wait_s)).items() if i not in self.stuck}
        if not held:
            raise WeightSyncError(
                f"no engine is alive to receive weights after {self.engine_wait_s:.0f} s "
                "(weight_sync.engine_wait_s): " + ", ".join(c.base_url for c in self.clients)
            )
        live = sorted(held)
        restarted = [
            i
            for i in live
            if i in self.members
            and (
                i in restarted_by_run or (self.version != self.initial_version and held[i] == str(self.initial_version))
            )
        ]
        if live == self.members and not restarted and self.group is not None:
            return [], held
        lost = [self.clients[i].base_url for i in self.members if i not in live]
        joined = [i for i in live if i not in self.members or i in restarted]
        log.warning(
            "weight update group re-formed: lost %s, joined %s",
            lost or "none",
            [self.clients[i].base_url for i in joined] or "none",
        )
        await asyncio.gather(
            *(self.clients[i].destroy_weights_update_group(self.group_name) for i in self.members if i in live),
            return_exceptions=True,
        )
        await self.connect(live)
        return joined, held

    async def _check_versions(
        self,
        expected: int | None,
        when: str,
        skip: tuple[int, ...] = (),
        held: dict[int, str] | None = None,
        partial: int | None = None,
    ) -> None:
        """held: versions already read (index → version); otherwise they are asked for.
        partial: a version an engine may also hold (an interrupted sync of it reached it)."""
        if expected is None:
            return
        if held is None:
            held = dict(zip(self.members, await self.engine_versions()))
        accepted = {str(expected)} | ({str(partial)} if partial is not None else set())
        for index in self.members:
            client, version = self.clients[index], held[index]
            if index not in skip and version not in accepted:
                raise WeightSyncError(
                    f"engine {client.base_url} holds weight version {version} {when}, expected "
                    f"{' or '.join(sorted(accepted))}: it skipped or repeated an update"
                )

    async def sync(
        self, named: Iterable[tuple[str, torch.Tensor]], version: int, restarted: Iterable[int] = ()
    ) -> SyncReport:
        """Pushes the (HF name, tensor) stream to every engine as `version`. restarted: engines
        the run restarted since they last got weights (they rejoin the group)."""
        if not self.connected:
            raise WeightSyncError("connect() first")
        if self.version is not None and version <= self.version:
            raise WeightSyncError(f"version {version} is not newer than the last sync ({self.version})")
        joined, held = await self._refresh_members(tuple(restarted))  # joiners hold initial weights: not checked
        partial, self.interrupted = (version if self.interrupted == version else None), None
        await self._check_versions(self.version, "before the sync", skip=tuple(joined), held=held, partial=partial)
        start = time.perf_counter()
        await self._all("pause", lambda c: c.pause(self.cfg.pause_mode))
        try:
            await self._all("begin_weight_update", lambda c: c.begin_weight_update())
            report = await self._send(named, version)
            await self._all("end_weight_update", lambda c: c.end_weight_update())
            if self.cfg.pause_mode != "in_place":  # in place: no prefix cache (config checks)
                await self._all("flush_cache", lambda c: c.flush_cache())
        except EnginesLost as lost:
            # buckets went out: the survivors may hold part of `version` and stay paused
            # until the sync of it again (generation on a mix of two versions is neither)
            silent = await self._recover(resume=self.interrupted is None, skip=lost.restart)
            if not silent:
                raise
            self.stuck |= set(silent)
            raise EnginesLost(
                f"{lost}; engine {', '.join(self.clients[i].base_url for i in silent)} did not close its "
                f"update session within {self.session_close_s:.0f} s (still inside the lost broadcast): restart it too",
                (*lost.restart, *silent),
            ) from lost
        except BaseException:
            await self._recover()
            raise
        await self._all("continue_generation", lambda c: c.resume())
        versions = await self.engine_versions()
        await self._check_versions(version, "after the sync", held=dict(zip(self.members, versions)))
        self.version = version
        report.engine_version = int(versions[0])
        report.seconds = time.perf_counter() - start
        return report

    async def _send(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        stream: Iterator[Bucket] = buckets(named, int(self.cfg.bucket_mb * 2**20), bucket_device(self.backend))
        report = SyncReport(version, 0, 0, 0, 0.0)
        current = await asyncio.to_thread(next, stream, None)
        while current is not None:
            upcoming = asyncio.create_task(asyncio.to_thread(next, stream, None))  # double buffer
            try:
                await self._send_bucket(current, version, report.buckets)
            except EnginesLost:
                # every learner rank is inside the export's collectives: finish it, sending nothing
                await upcoming
                await asyncio.to_thread(lambda: [None for _ in stream])
                raise
            except BaseException:
                upcoming.cancel()
                raise
            report.buckets += 1
            report.tensors += len(current.names)
            report.bytes += current.nbytes
            current = await upcoming
        return report

    async def _send_bucket(self, bucket: Bucket, version: int, index: int) -> None:
        """Announces the bucket to every engine, then broadcasts it. The flush is left to the
        end of the sync (one flush, once every bucket is in)."""
        request = p.UpdateWeightsFromDistributedReqInput(
            names=bucket.names,
            dtypes=[bucket.dtype_name] * len(bucket.names),
            shapes=bucket.shapes,
            group_name=self.group_name,
            weight_version=str(version),
            load_format="flattened_bucket",
            flush_cache=False,
            checksum=bucket.checksum() if self.checksums else None,
        )
        clients, members = self.member_clients, self.members
        announced = [asyncio.create_task(c.update_weights_from_distributed(request)) for c in clients]
        what = f"bucket {index} ({len(bucket.names)} tensors, first {bucket.names[0]})"
        if index == 0 and self.cfg.refusal_wait_s > 0:  # refusals come before the engine posts its side
            done, _ = await asyncio.wait(announced, timeout=self.cfg.refusal_wait_s)
            refused = [(c, t.exception()) for c, t in zip(clients, announced) if t in done and t.exception()]
            if refused:
                for task in announced:
                    task.cancel()
                self.group = None  # the others posted their side: dropping the group ends their wait (gloo)
                states = await asyncio.gather(*(c.state() for c, _ in refused))
                answered = [(c, e) for (c, e), state in zip(refused, states) if state is not EngineState.DOWN]
                if answered:  # paused for this sync, or serving: a refusal, not a death
                    client, err = answered[0]
                    raise WeightSyncError(
                        f"engine {client.base_url} refused {what} before its broadcast was posted: {err}"
                    )
                dead = [members[clients.index(c)] for c, _ in refused]  # nothing was broadcast yet
                raise EnginesLost(
                    f"engine {', '.join(self.clients[i].base_url for i in dead)} died before {what} was "
                    f"broadcast: {refused[0][1]}",
                    dead,
                )
        # a daemon thread: a broadcast nobody matches must not keep the process alive at exit
        sending = asyncio.create_task(in_daemon_thread(broadcast, self.group, bucket.buffer))
        await asyncio.wait([sending, *announced], return_when=asyncio.FIRST_EXCEPTION)
        failures = [(c, t.exception()) for c, t in zip(clients, announced) if t.done() and t.exception()]
        if not sending.done() or sending.exception() is not None or failures:
            cause = failures[0][1] if failures else sending.exception() if sending.done() else None
            await self._raise_if_lost(members, version, what, cause, sending, announced)
        if not sending.done():  # a live engine failed while the broadcast waits: nobody will match it
            self._tear_down(sending, announced)
            client, err = failures[0]
            raise WeightSyncError(
                f"engine {client.base_url} rejected {what} after its broadcast was posted "
                f"(update group torn down): {err}"
            )
        if sending.exception() is not None:
            for task in announced:
                task.cancel()
            raise WeightSyncError(f"broadcast of {what} failed: {sending.exception()}")
        results = await asyncio.gather(*announced, return_exceptions=True)
        failed = [(c, r) for c, r in zip(clients, results) if isinstance(r, BaseException)]
        if failed:
            client, err = failed[0]
            await self._raise_if_lost(members, version, what, err, sending, announced)
            raise WeightSyncError(f"engine {client.base_url} rejected {what}: {err}")

    async def _raise_if_lost(
        self,
        members: list[int],
        version: int,
        what: str,
        cause: BaseException | None,
        sending: asyncio.Task,
        announced: list[asyncio.Task],
    ) -> None:
        """After a posted broadcast or an engine's answer failed: if an engine is down (its
        state is the judge: the others are paused for this sync, which is not dead), the sync
        is lost, not refused, and the run can sync again."""
        states = await asyncio.gather(*(self.clients[i].state() for i in members))
        dead = [i for i, state in zip(members, states) if state is EngineState.DOWN]
        if not dead:
            return
        self._tear_down(sending, announced)
        self.interrupted = version  # the survivors may have loaded earlier buckets, maybe this one
        raise EnginesLost(
            f"engine {', '.join(self.clients[i].base_url for i in dead)} died during the sync, at {what} "
            f"(its broadcast posted; update group torn down): {cause}",
            dead,
        )

    def _tear_down(self, sending: asyncio.Task, announced: list[asyncio.Task]) -> None:
        """Drops the update group after a broadcast that cannot complete as posted: NCCL's
        communicator is aborted; a gloo broadcast still waiting ends in its daemon thread
        (at once when the peer it waits for is dead). The next sync forms a new group."""
        for task in announced:
            task.cancel()
        if not sending.done():
            abort_group(self.group)
            sending.cancel()
        self.group = None

    async def _recover(self, *, resume: bool = True, skip: tuple[int, ...] = ()) -> list[int]:
        """After a failed sync, best effort: close the update session (SGLang refuses to open
        a new one while one is open) and resume generation unless told not to, each bounded
        by session_close_s. Returns the members (not in `skip`: the dead) that did not answer
        the close: still waiting inside a broadcast."""
        members = [i for i in self.members if i not in skip]
        silent: list[int] = []
        steps = [lambda c: c.end_weight_update()] + ([lambda c: c.resume()] if resume else [])
        for step in steps:
            asking = [i for i in members if i not in silent]
            if not asking:
                break
            tasks = [asyncio.create_task(step(self.clients[i])) for i in asking]
            _, pending = await asyncio.wait(tasks, timeout=self.session_close_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            late = [i for i, task in zip(asking, tasks) if task in pending]
            if late:
                log.warning(
                    "engine %s did not answer within %.0f s after a failed sync",
                    ", ".join(self.clients[i].base_url for i in late),
                    self.session_close_s,
                )
            silent += late
        return silent

    async def _all(self, what: str, call) -> None:
        results = await asyncio.gather(*(call(c) for c in self.member_clients), return_exceptions=True)
        for client, result in zip(self.member_clients, results):
            if isinstance(result, Exception):
                raise WeightSyncError(f"engine {client.base_url}: {what} failed: {result}")

    async def close(self) -> None:
        await asyncio.gather(
            *(c.destroy_weights_update_group(self.group_name) for c in self.member_clients), return_exceptions=True
        )
        self.group = None
