"""Replica acknowledgements: an append is acknowledged only once the replicas have it.

Every trialstream client is an `AckingRedis`: after each call of a script registered with
`acknowledge_after` (core.event_store's append), alone or in a pipeline, it sends WAIT on the
connection that sent it (`ReplicaAcks`). An append too few replicas confirmed is refused as a
connection error (`NotReplicated`), so the client's retry policy sends it again; so is a transaction
the master refused because it is the master no longer, or has lost its replicas (`_no_longer_master`).

How a client is made is core.connections; how it follows a Sentinel master is core.sentinel, which
takes from here the scripts to load on every connection and what such a refusal looks like (this
module imports neither).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import redis

from core import keys

log = logging.getLogger(__name__)


class NotReplicated(redis.ConnectionError):
    """An append that fewer replicas than required confirmed within the timeout: not acknowledged.

    A ConnectionError, so the client's retry policy sends it again (appends are idempotent) on a fresh
    connection, which asks the sentinels for the master; past that budget it reaches the caller.
    """


_ACKED_SCRIPTS: dict[str, str] = {}  # SHA1 -> text of the scripts whose calls are appends (core.event_store's)
_ACKED_TEXTS: set[str] = set()  # their texts: a pipeline sends them by text (`AckingPipeline.load_scripts`)


def acknowledge_after(script: str) -> None:
    """Calls of `script` (alone by EVALSHA, in a pipeline by EVAL) return only once replicated (`ReplicaAcks`)."""
    _ACKED_SCRIPTS[hashlib.sha1(script.encode()).hexdigest()] = script
    _ACKED_TEXTS.add(script)


def _has_append(commands: Sequence[tuple[tuple[Any, ...], Any]]) -> bool:
    return any(
        len(args) > 1
        and (args[1] in _ACKED_SCRIPTS if args[0] == "EVALSHA" else args[0] == "EVAL" and args[1] in _ACKED_TEXTS)
        for args, _ in commands
    )


class ReplicaAcks:
    """`WAIT n timeout` after each append, on the connection that sent it (WAIT counts that
    connection's writes; inside MULTI or a script it would not block, so it follows EXEC).

    n is every replica connected to the master then (ROLE), and at least `wanted` (None: 1 when
    there are replicas). Waiting for only one of two would not do: Sentinel promotes by the offsets
    it last read, which may be the replica without the append (seen in tests/faults/test_failover.py).

    With `wanted` None (a plain URL, the replicas setting unset) a connection asks ROLE once, when
    it is made: on a server without replicas its appends then cost no round trip more. A replica
    attached later is waited for from the next connection on; set the replicas setting to wait for it at once.

    When fewer than n replicas answer in time, the append is refused (`NotReplicated`: retried by
    the client's policy, then raised), the timeout counted in Redis (`keys.REPLICATION_TIMEOUTS`,
    served as a Prometheus counter by the manager) and logged: what was told "recorded" is on n
    replicas, never only on a master that may be lost with its disk.
    """

    def __init__(self, wanted: int | None, timeout_s: float) -> None:
        self.wanted = wanted
        self.timeout_ms = max(1, int(timeout_s * 1000))

    def after(self, connection: redis.Connection, commands: Sequence[tuple[tuple[Any, ...], Any]]) -> None:
        if self.wanted == 0 or not _has_append(commands):
            return
        if self.wanted is None and not _replicas_when_connected(connection):
            return
        connected = _replicas(connection)  # the replicas connected now: each must have it, whichever is promoted
        wanted = max(connected, self.wanted if self.wanted is not None else min(connected, 1))
        if wanted == 0:
            return
        connection.send_command("WAIT", wanted, self.timeout_ms)
        acked = int(connection.read_response())
        if acked < wanted:
            connection.send_command("INCR", keys.REPLICATION_TIMEOUTS)
            connection.read_response()
            log.warning("an append reached %d of %d replicas in %d ms; sent again", acked, wanted, self.timeout_ms)
            raise NotReplicated(f"{acked} of {wanted} replicas confirmed the append within {self.timeout_ms} ms")


NO_ACKS = ReplicaAcks(0, 1.0)
_SEEN = "_trialstream_replicas"  # on a connection: (its socket then, replicas connected to its server then)


def _replicas(connection: redis.Connection) -> int:
    """How many replicas the connection's server streams to now (ROLE; 0 when it is one)."""
    connection.send_command("ROLE")
    role = connection.read_response()
    return len(role[2]) if len(role) > 2 else 0


def _replicas_when_connected(connection: redis.Connection) -> int:
    """`_replicas` once per connection: asked again only when it has reconnected (a new socket)."""
    seen = getattr(connection, _SEEN, None)
    if seen is None or seen[0] is not connection._sock:
        seen = (connection._sock, _replicas(connection))
        setattr(connection, _SEEN, seen)
    return int(seen[1])


_NOT_MASTER_ANYMORE = ("UNBLOCKED", "NOREPLICAS", "READONLY")


def _no_longer_master(error: redis.ResponseError) -> bool:
    """A refusal that means the node is not the master now (or has lost its replicas): the command goes again
    to the master named then. redis-py raises READONLY as ReadOnlyError without its code, inside EXEC's reply
    (a script's error) too."""
    return isinstance(error, redis.ReadOnlyError) or any(reason in str(error) for reason in _NOT_MASTER_ANYMORE)


class AckingPipeline(redis.client.Pipeline):
    """A pipeline whose appends are acknowledged only once replicated (`ReplicaAcks`)."""

    acks: ReplicaAcks = NO_ACKS

    def load_scripts(self) -> None:
        """Send the scripts queued here by their text (EVAL) rather than by SHA after a SCRIPT EXISTS, as
        redis-py does: one round trip less for every pipeline that appends or claims, and never a NOSCRIPT
        inside a MULTI (whose other commands would still apply) from a server restarted or promoted with an
        empty script cache. Redis keeps a script compiled by its hash either way; the texts are short."""
        texts = {script.sha: script.script for script in self.scripts}
        self.command_stack[:] = [
            (
                (("EVAL", texts[args[1]], *args[2:]), options)
                if args[0] == "EVALSHA" and args[1] in texts
                else (args, options)
            )
            for args, options in self.command_stack
        ]

    def _execute_transaction(self, connection: redis.Connection, commands: Any, raise_on_error: bool) -> list[Any]:
        try:
            result: list[Any] = super()._execute_transaction(connection, commands, raise_on_error)
        except redis.ResponseError as error:  # in EXEC's reply, past `core.sentinel._MasterConnection.read_response`
            if not _no_longer_master(error):
                raise
            connection.disconnect()
            raise redis.ConnectionError(f"the master refused a transaction ({error}); sending it again") from error
        self.acks.after(connection, commands)
        return result

    def _execute_pipeline(self, connection: redis.Connection, commands: Any, raise_on_error: bool) -> list[Any]:
        result: list[Any] = super()._execute_pipeline(connection, commands, raise_on_error)  # type: ignore[no-untyped-call]
        self.acks.after(connection, commands)
        return result


class AckingRedis(redis.Redis):
    """The client of every trialstream process: appends, alone or in its pipelines, wait for replicas."""

    acks: ReplicaAcks = NO_ACKS

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> AckingPipeline:
        pipe = AckingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.acks = self.acks
        return pipe

    def _send_command_parse_response(self, conn: Any, command_name: str, *args: Any, **options: Any) -> Any:
        reply = super()._send_command_parse_response(conn, command_name, *args, **options)  # type: ignore[no-untyped-call]
        self.acks.after(conn, [(args, options)])
        return reply
