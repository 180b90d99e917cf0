"""What the running trials of one worker process share on Redis: one commands reader, one lease renewer and
a few connections for their writes, so a worker holds a handful of connections however many trials it follows.

A watcher blocked in XREAD and a renewer per trial held ~2 connections per running trial (each ~23 kB of
Redis memory; `maxclients` capped a Redis near 5,000 running trials: docs/benchmarks.md, load). Now:

- `CommandsReader` follows every trial's commands stream in one blocking `XREAD ... STREAMS k1 k2 ...` and
  hands each command to its trial's control. A trial that starts while that read blocks is followed at once:
  a waker thread adds an entry to the reader's own wake stream, read in the same XREAD, so the read
  returns and the next one includes the new trial. Trials starting together share one wake (at most one
  per WAKE_SPACING_S: each new read re-sends every trial's key), and the wake is not on a trial's way to
  its start. (A short block would delay a new trial's cancel by up to the block and re-send every key many
  times a second; CLIENT UNBLOCK needs the blocked connection's id, which changes on every reconnect, and
  is an admin command the worker's ACL user lacks.)
- `LeaseRenewer` renews every attempt's lease of one length in one script call (`core.leases.renew_all`)
  each quarter of the lease, and tells each trial's control how it went: the local deadline and the lost
  lease stay per trial (workers.runtime.control).
- `commits` carries the trials' writes (appends, offsets) with a bounded number of round trips in flight, those
  made while all are busy together in the next (workers.runtime.group_commit): a Redis connection pool grows
  to the most commands that were ever in flight together and keeps them, so 1,000 trials reporting in the
  same second would hold ~1,000 idle connections.

The reader and the renewer start with the first trial and end with the last, so an idle process holds
nothing; the waker, once started, waits for the next new trial without holding a connection.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from core import keys
from core.connections import quick_client
from core.event_store import LogEntry, commands_in_log, stream_position
from core.leases import Lease, renew_all
from workers.runtime.group_commit import GroupCommit

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # a read returns at once on a command or a new trial; the timeout only ends an idle reader
WAKE_TTL_MS = 3_600_000  # a wake stream left by a process that died goes within the hour
WAKE_SPACING_S = 0.05  # trials starting within this share one wake of the reader
RETRY_S = 0.5  # after a failed read, before the next


class Follower(Protocol):
    """A trial's control, as the reader and the renewer see it."""

    def deliver(self, entries: list[LogEntry]) -> None:
        """New commands to the trial, in their order (never one twice)."""

    def renewed(self, sent: float, renewed: bool) -> bool:
        """Its lease's renewal sent at `sent` (monotonic) answered `renewed`; False: renew it no more."""

    def not_renewed(self, sent: float, error: redis.RedisError) -> None:
        """Its lease's renewal sent at `sent` failed with `error`."""


@dataclass
class _Followed:
    experiment_id: str
    stream: str
    cursor: str


class CommandsReader:
    """One blocking read over the commands streams of every trial a process runs (on one Redis)."""

    def __init__(self, client: redis.Redis, waker: redis.Redis) -> None:
        self._client = client  # the read blocks one connection of its pool
        self._waker = waker
        self._wake_key = keys.commands_wake(secrets.token_hex(8))
        self._wake_cursor = "0-0"
        self._followed: dict[Follower, _Followed] = {}
        self._lock = threading.Lock()
        self._running = False
        self._failed = threading.Event()  # never set: a wait between failed reads
        self._wake_wanted = threading.Event()  # trials registered since the last wake
        self._waking = False

    def follow(self, follower: Follower, experiment_id: str, trial_id: str, after: str) -> None:
        """Hand `follower` every command to the trial appended after position `after` of its commands stream."""
        with self._lock:
            self._followed[follower] = _Followed(experiment_id, keys.trial_commands(experiment_id, trial_id), after)
            if not self._running:  # its first read includes the trial
                self._running = True
                threading.Thread(target=self._run, name="commands-reader", daemon=True).start()
                return
            self._wake_wanted.set()
            if not self._waking:
                self._waking = True
                threading.Thread(target=self._wake, name="commands-waker", daemon=True).start()

    def _wake(self) -> None:
        """End the blocked read for the trials registered since the last wake, at most once per WAKE_SPACING_S."""
        while True:
            self._wake_wanted.wait()
            self._wake_wanted.clear()
            try:
                with self._waker.pipeline(transaction=False) as pipe:
                    pipe.xadd(self._wake_key, {"new": "trials"}, maxlen=1, approximate=False)
                    pipe.pexpire(self._wake_key, WAKE_TTL_MS)
                    pipe.execute()
            except redis.RedisError as error:  # followed all the same, from the read after the one blocked now
                log.warning("cannot wake the commands reader (%s)", error)
            time.sleep(WAKE_SPACING_S)

    def unfollow(self, follower: Follower) -> None:
        """No more commands for `follower`; the read blocked now may still name its stream, for up to a block."""
        with self._lock:
            self._followed.pop(follower, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._followed:
                    self._running = False
                    return
                followed = dict(self._followed)
            try:
                self._read(followed)
            except Exception as error:  # the reader must outlive anything: a cancel may come later
                log.warning("cannot read %d trials' commands (%s); retrying", len(followed), error)
                self._failed.wait(RETRY_S)

    def _read(self, followed: dict[Follower, _Followed]) -> None:
        streams: dict[Any, Any] = {}
        for each in followed.values():  # two attempts of a trial in one process: from the earlier cursor
            known = streams.get(each.stream)
            if known is None or stream_position(each.cursor) < stream_position(known):
                streams[each.stream] = each.cursor
        streams[self._wake_key] = self._wake_cursor
        answer: Any = self._client.xread(streams, block=READ_BLOCK_MS)
        found = {str(stream): entries for stream, entries in answer or []}
        if woken := found.pop(self._wake_key, None):
            self._wake_cursor = woken[-1][0]
        news = [
            (follower, each, [e for e in found.get(each.stream, []) if _after(e[0], each.cursor)])
            for follower, each in followed.items()
        ]
        news = [(follower, each, index) for follower, each, index in news if index]
        if not news:
            return
        commands = commands_in_log(self._client, [(each.experiment_id, index) for _, each, index in news])
        for (follower, each, index), entries in zip(news, commands, strict=True):
            with self._lock:
                if self._followed.get(follower) is not each:
                    continue  # closed meanwhile
                each.cursor = index[-1][0]  # moved on only once the commands are read: none is lost to an error
            try:
                follower.deliver(entries)
            except Exception:  # one trial's failure is not the others'
                log.exception("cannot hand commands to a trial")


def _after(entry_id: str, cursor: str) -> bool:
    return stream_position(entry_id) > stream_position(cursor)


class LeaseRenewer:
    """Renews the leases (of one length) of every attempt a process runs, all in one call, every quarter lease."""

    def __init__(self, client: redis.Redis, seconds: float) -> None:
        self._client = client  # a quick client: no silent server blocks a renewal for long
        self.seconds = seconds
        self._leases: dict[Follower, Lease] = {}
        self._lock = threading.Lock()
        self._running = False
        self._failing = False  # warned once per outage, not once per round
        self._tick = threading.Event()  # never set: the wait between rounds

    def add(self, follower: Follower, lease: Lease) -> None:
        """Renew `lease` from the next round on, until `remove` or `follower.renewed` says to stop."""
        with self._lock:
            self._leases[follower] = lease
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name=f"lease-renewer-{self.seconds:g}s", daemon=True).start()

    def remove(self, follower: Follower) -> None:
        with self._lock:
            self._leases.pop(follower, None)

    def _run(self) -> None:
        while True:
            self._tick.wait(self.seconds / 4)
            with self._lock:
                if not self._leases:
                    self._running = False
                    return
                held = list(self._leases.items())
            self._round(held)

    def _round(self, held: Sequence[tuple[Follower, Lease]]) -> None:
        sent = time.monotonic()
        try:
            answers = renew_all(self._client, [lease for _, lease in held])
        except redis.RedisError as error:
            if not self._failing:
                log.warning("cannot renew %d leases (%s); retrying", len(held), error)
            self._failing = True
            for follower, _ in held:
                follower.not_renewed(sent, error)
            return
        self._failing = False
        for (follower, _), renewed in zip(held, answers, strict=True):
            if not follower.renewed(sent, renewed):
                self.remove(follower)


@dataclass
class TrialLinks:
    """What the trials of one process with leases of one length share (`links`)."""

    reader: CommandsReader
    renewer: LeaseRenewer
    writes: redis.Redis  # a quick client: a write gives up within about half a lease
    commits: GroupCommit  # the trials' writes, on `writes`


_links: dict[tuple[int, float], TrialLinks] = {}
_readers: dict[int, CommandsReader] = {}
_links_lock = threading.Lock()


def links(client: redis.Redis, lease_s: float) -> TrialLinks:
    """The reader, renewer and write client that the trials on `client`'s server with `lease_s` leases share."""
    pool = id(client.connection_pool)
    with _links_lock:
        made = _links.get((pool, lease_s))
        if made is None:
            writes = quick_client(client, max(0.2, lease_s / 2))
            reader = _readers.get(pool)
            if reader is None:
                reader = _readers[pool] = CommandsReader(client, writes)
            renewer = LeaseRenewer(writes, lease_s)
            made = _links[(pool, lease_s)] = TrialLinks(reader, renewer, writes, GroupCommit(writes))
        return made
