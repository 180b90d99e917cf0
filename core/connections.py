"""Redis connections, and errors that say which server could not be reached.

Every client rides out a Redis restart: a command that meets a dropped connection reconnects and
is sent again with exponential backoff (`retry_policy`), for about `OUTAGE_BUDGET_S` in all
($TRIALSTREAM_REDIS_RETRY_S to change it) before the error reaches the caller. Only the first
ping of `connect(check=True)` fails at once, so a wrong URL is reported straight away instead of
after a minute of retries.

No read waits for ever: every connection has a socket timeout longer than the longest blocking read
issued on it (`SOCKET_TIMEOUT_S`; RQ's blocking dequeue on the bytes client, `RQ_SOCKET_TIMEOUT_S`)
and TCP keepalive, so a server that accepts but never answers (a silent partition) surfaces as a
timeout, not as a thread blocked for ever.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from urllib.parse import unquote

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.connection import SSLConnection
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool, SentinelManagedConnection

from core import keys
from core.variables import REDIS_URL_ENV, TLS_CA_ENV

log = logging.getLogger(__name__)
T = TypeVar("T")

OUTAGE_BUDGET_ENV = "TRIALSTREAM_REDIS_RETRY_S"

RETRY_BASE_S = 0.05  # the first retry waits 2 * base, then each wait doubles...
RETRY_CAP_S = 2.0  # ...up to this
OUTAGE_BUDGET_S = 60.0  # how long a command keeps retrying before its error reaches the caller (default)
CHECK_CONNECT_TIMEOUT_S = 5.0
# Longer than any `block=` trialstream issues (at most 1 s: `events --follow`, the projector, the
# runner's wait, a trial's watcher), so a timeout means the server did not answer.
SOCKET_TIMEOUT_S = 30.0
# RQ's blocking dequeue waits up to its worker TTL (420 s) minus 15 s on the bytes client.
RQ_SOCKET_TIMEOUT_S = 450.0
_KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}  # a dead peer is noticed in ~25 s
_RETRIED_ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout)  # BusyLoadingError is a ConnectionError


class RedisUnavailable(ConnectionError):
    def __init__(self, url: str, cause: Exception) -> None:
        reason = str(cause)
        if "CERTIFICATE_VERIFY_FAILED" in reason:  # one line that says which setting to fix
            reason = f"its TLS certificate is not trusted: set {TLS_CA_ENV} to the CA that signed it ({reason})"
        super().__init__(f"cannot reach Redis at {redact_url(url)}: {reason}")


class InvalidRedisUrl(ValueError):
    """A Redis URL that cannot be used; the message names the setting and how to write it."""

    def __init__(self, url: str, problem: str) -> None:
        super().__init__(f"{REDIS_URL_ENV} (--redis) {redact_url(url)}: {problem}; write {URL_FORMS}")


URL_FORMS = (
    "redis://[user:password@]host:port[/db], rediss://... (TLS), unix:///path, or "
    "redis+sentinel://[user:password@]host:port[,host:port...]/master_name[/db] (rediss+sentinel:// for TLS)"
)
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
PLAIN_SCHEMES = ("redis", "rediss", "unix")


def redact_url(url: str) -> str:
    """Hide a password in a Redis URL (any scheme, Sentinel's included) before it is printed or logged."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user + ':' if user else ':'}***@{host}"


@dataclass(frozen=True)
class SentinelUrl:
    """`redis+sentinel://[user:password@]host:port[,host:port...]/master_name[/db]`: the credentials are the
    master's (the sentinels take none), TLS (`rediss+sentinel`) is to the sentinels and the master alike."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int
    username: str | None
    password: str | None
    tls: bool


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The Sentinel URL's parts, None for another scheme; InvalidRedisUrl when it is malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES:
        if scheme not in PLAIN_SCHEMES or not sep:
            raise InvalidRedisUrl(url, f"unknown scheme {scheme + '://' if sep else '(none)'}")
        return None
    credentials, _, rest = rest.rpartition("@")
    username, _, password = credentials.partition(":")
    hosts, _, path = rest.partition("/")
    master, _, db = path.strip("/").partition("/")
    sentinels = []
    for item in filter(None, hosts.split(",")):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise InvalidRedisUrl(url, f"sentinel {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    if not sentinels:
        raise InvalidRedisUrl(url, "no sentinel host:port")
    if not master or "/" in db or (db and not db.isdigit()):
        raise InvalidRedisUrl(url, "name the master after the sentinels (/master_name, then /db if not 0)")
    return SentinelUrl(
        tuple(sentinels),
        unquote(master),
        int(db or 0),
        unquote(username) or None,
        unquote(password) or None,
        SENTINEL_SCHEMES[scheme],
    )


def check_redis_url(url: str) -> str:
    """`url` if trialstream can use it, else InvalidRedisUrl naming the setting."""
    if parse_sentinel_url(url) is None:
        try:
            redis.connection.parse_url(url)
        except ValueError as error:
            raise InvalidRedisUrl(url, str(error).split(" (")[0]) from None
    return url


def retries_within(budget_s: float, base_s: float = RETRY_BASE_S, cap_s: float = RETRY_CAP_S) -> int:
    """How many retries of `ExponentialBackoff(cap_s, base_s)` it takes for their waits to add up to `budget_s`."""
    waited, retries = 0.0, 0
    while waited < budget_s:
        retries += 1
        waited += min(cap_s, base_s * 2**retries)  # ExponentialBackoff.compute(failures)
    return retries


def outage_budget_s() -> float:
    """How long a command retries: $TRIALSTREAM_REDIS_RETRY_S seconds, else OUTAGE_BUDGET_S."""
    return float(os.environ.get(OUTAGE_BUDGET_ENV) or OUTAGE_BUDGET_S)


def retry_policy(budget_s: float | None = None) -> Retry:
    """Reconnect and resend on connection errors and timeouts, backing off from 0.1 s to 2 s, for ~`budget_s`
    (default: `outage_budget_s()`).

    It is applied per connection: a command, a pipeline (a transaction is re-sent whole), and the
    connect itself. While a pipeline WATCHes, redis-py does not resend: it raises WatchError, and
    the caller re-reads and tries again, as after any conflict.
    """
    budget = outage_budget_s() if budget_s is None else budget_s
    return Retry(ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), retries_within(budget), _RETRIED_ERRORS)


def _socket_options(url: str, decode: bool) -> dict[str, Any]:
    """Socket timeouts for every connection, and TCP keepalive where it is TCP."""
    timeout = SOCKET_TIMEOUT_S if decode else RQ_SOCKET_TIMEOUT_S
    options: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": CHECK_CONNECT_TIMEOUT_S}
    if not url.startswith("unix:"):
        options["socket_keepalive"] = True
        options["socket_keepalive_options"] = {
            getattr(socket, name): value for name, value in _KEEPALIVE.items() if hasattr(socket, name)
        }
    return options


# Per pool. redis-py caps a pool at 100 unless told; a worker following a few hundred trials on a
# remote platform holds a blocking command watcher and a lease renewer per trial.
MAX_CONNECTIONS = 4096
SENTINEL_TIMEOUT_S = 2.0  # a sentinel answers in milliseconds; one that does not is skipped for the next


@dataclass(frozen=True)
class RedisOptions:
    """What a process's settings (`Settings.redis_options`) say about its Redis connections beyond the URL."""

    tls_ca_file: str | None = None  # verify the server (and sentinels) against this CA; else the system's
    tls_cert_file: str | None = None  # a client certificate, for servers with `tls-auth-clients yes`
    tls_key_file: str | None = None
    replicas: int | None = None  # replicas an append waits for; None: 1 with Sentinel or replicas connected
    replica_timeout_s: float = 1.0  # how long one WAIT waits for them

    def tls_kwargs(self) -> dict[str, Any]:
        """redis-py's arguments for a TLS connection that verifies its server."""
        kwargs: dict[str, Any] = {"ssl_cert_reqs": "required"}
        if self.tls_ca_file:
            kwargs["ssl_ca_certs"] = self.tls_ca_file
        if self.tls_cert_file:
            kwargs["ssl_certfile"] = self.tls_cert_file
            kwargs["ssl_keyfile"] = self.tls_key_file
        return kwargs


class NotReplicated(redis.ConnectionError):
    """An append that fewer replicas than required confirmed within the timeout: not acknowledged.

    A ConnectionError, so the client's retry policy sends it again (appends are idempotent) on a fresh
    connection, which asks the sentinels for the master; past that budget it reaches the caller.
    """


_ACKED_SCRIPTS: dict[str, str] = {}  # SHA1 -> text of the scripts whose calls are appends (core.event_store's)


def acknowledge_after(script: str) -> None:
    """Calls of `script` (by EVALSHA, alone or in a pipeline) return only once replicated (`ReplicaAcks`)."""
    _ACKED_SCRIPTS[hashlib.sha1(script.encode()).hexdigest()] = script


def _has_append(commands: Sequence[tuple[tuple[Any, ...], Any]]) -> bool:
    return any(len(args) > 1 and args[0] == "EVALSHA" and args[1] in _ACKED_SCRIPTS for args, _ in commands)


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


class AckingPipeline(redis.client.Pipeline):
    """A pipeline whose appends are acknowledged only once replicated (`ReplicaAcks`)."""

    acks: ReplicaAcks = NO_ACKS

    def _execute_transaction(self, connection: redis.Connection, commands: Any, raise_on_error: bool) -> list[Any]:
        try:
            result: list[Any] = super()._execute_transaction(connection, commands, raise_on_error)
        except redis.ResponseError as error:  # inside EXEC's reply, past `_MasterConnection.read_response`
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


class _MasterConnection(SentinelManagedConnection):
    """A connection to the master the sentinels name, asked again on every (re)connect.

    redis-py 8.1 reconnects a dropped connection inside a command's retries straight to its last
    address (`send_packed_command` -> `connect_check_health`, past the Sentinel lookup in
    `connect`): after a failover each retry would meet the old master, now a replica, until the
    budget ran out. A master that lost its role or its replicas answers with errors that say so
    (READONLY, UNBLOCKED, NOREPLICAS): they drop the connection and count as connection errors, so
    the command is sent again to the master named then.
    """

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if not self._sock:
            self.host, self.port = self.connection_pool.get_master_address()
        super().connect_check_health(check_health, retry_socket_connect)

    def on_connect_check_health(self, check_health: bool = True) -> None:
        """Load the append scripts first: a promoted replica has an empty script cache, and a pipeline
        resent inside its retries would meet NOSCRIPT there (with the rest of its MULTI applied)."""
        super().on_connect_check_health(check_health)
        for script in _ACKED_SCRIPTS.values():
            self.send_command("SCRIPT", "LOAD", script)  # type: ignore[no-untyped-call]
            self.read_response()

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        """As a plain connection: one left by any error while reading is dropped (redis-py's Sentinel
        connection keeps it by default, so a blocking read cut short by a signal, RQ's warm shutdown,
        went back to the pool with its reply pending: the next command waited out the block, then
        read that reply as its own)."""
        kwargs.setdefault("disconnect_on_error", True)
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as error:
            if not _no_longer_master(error):
                raise
            self.disconnect()  # type: ignore[no-untyped-call]
            raise redis.ConnectionError(f"the master cannot take this now ({error}); asking the sentinels") from error


_NOT_MASTER_ANYMORE = ("UNBLOCKED", "NOREPLICAS", "READONLY")


def _no_longer_master(error: redis.ResponseError) -> bool:
    """A refusal that means the node is not the master now (or has lost its replicas): the command goes again
    to the master named then. redis-py raises READONLY as ReadOnlyError without its code, inside EXEC's reply
    (a script's error) too."""
    return isinstance(error, redis.ReadOnlyError) or any(reason in str(error) for reason in _NOT_MASTER_ANYMORE)


class _MasterSSLConnection(_MasterConnection, SSLConnection):
    pass


def connect(
    url: str,
    *,
    options: RedisOptions | None = None,
    check: bool = True,
    decode: bool = True,
    retry_s: float | None = None,
) -> AckingRedis:
    """A client (decoded strings unless `decode=False`, which RQ needs); `check` pings so a wrong URL fails here.
    Commands retry for `retry_s` seconds (`Settings.redis_retry_s`; default: `outage_budget_s()`).

    A Sentinel URL gives a client on the master the sentinels name, asked again after every dropped
    connection, so it follows a failover. The retry policy, socket and TLS options are in the
    pool's connection kwargs, so clients made by `same_server` keep them.
    """
    options = options or RedisOptions()
    sentinel = parse_sentinel_url(url)
    tls = sentinel.tls if sentinel else url.startswith("rediss:")
    kwargs: dict[str, Any] = {
        "decode_responses": decode,
        "health_check_interval": 30,
        "retry": retry_policy(retry_s),
        "max_connections": MAX_CONNECTIONS,
        **_socket_options(url, decode),
        **(options.tls_kwargs() if tls else {}),
    }
    if check:
        _probe(url, sentinel, options.tls_kwargs() if tls else {})
    if sentinel is None:
        client = cast(AckingRedis, AckingRedis.from_url(url, **kwargs))
    else:
        sentinels = _sentinels(sentinel, options.tls_kwargs() if tls else {})
        auth = {"db": sentinel.db, "username": sentinel.username, "password": sentinel.password}
        kwargs["connection_class"] = _MasterSSLConnection if tls else _MasterConnection
        client = cast(AckingRedis, sentinels.master_for(sentinel.master, redis_class=AckingRedis, **auth, **kwargs))
    wanted = options.replicas if options.replicas is not None else (1 if sentinel else None)
    client.acks = ReplicaAcks(wanted, options.replica_timeout_s)
    return client


class _Sentinels(Sentinel):
    """Sentinels whose answer is not taken from one that is failing the master over.

    The leader of a failover names the old master (SENTINEL MASTERS) until its failover ends, a second
    or more after it promoted a replica and the others switched. An old master that was only paused
    answers again meanwhile (no s_down): a client sent there writes to, and reads from, a master whose
    data the promoted one does not have and which it will discard. The next sentinel is asked instead.
    """

    def check_master_state(self, state: dict[str, Any], service_name: str) -> bool:
        flags = state.get("flags", "")
        if "failover_in_progress" in (flags if isinstance(flags, set) else str(flags).split(",")):
            return False
        return bool(super().check_master_state(state, service_name))  # type: ignore[no-untyped-call]


def _sentinels(url: SentinelUrl, tls_kwargs: dict[str, Any]) -> Sentinel:
    """The sentinel set of `url`, asked with short timeouts (TLS as to the master)."""
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
        "retry": Retry(NoBackoff(), 0),  # the master's client retries; a sentinel that fails is skipped
    }
    if url.tls:
        sentinel_kwargs |= {"ssl": True, **tls_kwargs}
    return _Sentinels(list(url.sentinels), sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]


def _probe(url: str, sentinel: SentinelUrl | None, tls_kwargs: dict[str, Any]) -> None:
    """One ping with no retries, so that a wrong URL, password or CA is reported at once."""
    once = {"retry": Retry(NoBackoff(), 0), "socket_connect_timeout": CHECK_CONNECT_TIMEOUT_S, **tls_kwargs}
    if sentinel is None:
        probe = redis.Redis.from_url(url, **once)
    else:
        sentinels = _sentinels(sentinel, tls_kwargs)
        _probe_sentinels(url, sentinels)
        auth = {"db": sentinel.db, "username": sentinel.username, "password": sentinel.password}
        probe = sentinels.master_for(sentinel.master, ssl=sentinel.tls, **auth, **once)
    try:
        probe.ping()
    except MasterNotFoundError:
        raise RedisUnavailable(url, Exception(f"no sentinel names a master {sentinel.master!r}")) from None  # type: ignore[union-attr]
    except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
        raise RedisUnavailable(url, error) from error
    finally:
        probe.close()


def _probe_sentinels(url: str, sentinels: Sentinel) -> None:
    """At least one sentinel answers; else the first one's error (refused, or its certificate not trusted)."""
    errors: list[Exception] = []
    for node in sentinels.sentinels:
        try:
            node.ping()
            return
        except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
            errors.append(error)
    raise RedisUnavailable(url, errors[0])


def _sibling(client: redis.Redis, **overrides: Any) -> AckingRedis:
    """A client on `client`'s server (or Sentinel master) with its settings and `overrides`, in a pool of its own."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides}
    new_pool: redis.ConnectionPool
    if isinstance(pool, SentinelConnectionPool):
        del kwargs["connection_pool"]  # the proxy of the pool it was made for; the new pool makes its own
        new_pool = SentinelConnectionPool(
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            max_connections=MAX_CONNECTIONS,
            **kwargs,
        )
    else:
        new_pool = redis.ConnectionPool(
            connection_class=pool.connection_class, max_connections=MAX_CONNECTIONS, **kwargs
        )
    sibling = AckingRedis(connection_pool=new_pool)
    sibling.acks = getattr(client, "acks", NO_ACKS)
    return sibling


_siblings: weakref.WeakKeyDictionary[redis.ConnectionPool, dict[bool, AckingRedis]] = weakref.WeakKeyDictionary()
_siblings_lock = threading.Lock()


def same_server(client: redis.Redis, *, decode: bool) -> AckingRedis:
    """A client on `client`'s server (the same Sentinel master) with its settings (retries and
    replica acks included), decoding replies or not.

    RQ needs bytes; the log's readers want strings, except to read an entry that is not UTF-8.
    One per pool and mode, made once: a worker asks for one per trial, and every new connection
    costs redis-py a few milliseconds.
    """
    pool = client.connection_pool
    with _siblings_lock:
        made = _siblings.setdefault(pool, {})
        if decode not in made:
            overrides: dict[str, Any] = {"decode_responses": decode}
            if "socket_timeout" in pool.connection_kwargs:  # only the bytes client issues RQ's long blocking dequeue
                overrides["socket_timeout"] = SOCKET_TIMEOUT_S if decode else RQ_SOCKET_TIMEOUT_S
            made[decode] = _sibling(client, **overrides)
        return made[decode]


_quick: weakref.WeakKeyDictionary[redis.ConnectionPool, dict[float, AckingRedis]] = weakref.WeakKeyDictionary()


def quick_client(client: redis.Redis, timeout_s: float) -> AckingRedis:
    """A client on `client`'s server whose every command gives up within about `timeout_s` (one
    resend, no back-off): for a caller that must act on its own deadline, such as a lease renewal.
    One per pool and timeout, made once."""
    pool = client.connection_pool
    with _siblings_lock:
        made = _quick.setdefault(pool, {})
        if timeout_s not in made:
            made[timeout_s] = _sibling(
                client,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 1, _RETRIED_ERRORS),
            )
        return made[timeout_s]


def until_redis_answers(action: Callable[[], T], what: str, give_up: Callable[[], bool] = lambda: False) -> T:
    """`action`, retried for as long as Redis cannot be reached (beyond the client's own retries),
    or until `give_up()` says the result no longer matters (then the last error is raised).

    For writes that are safe to repeat (an idempotency key, a transaction that sets absolute
    values): a trial must not die because Redis was away longer than a client retries.
    """
    delay, failures = 0.1, 0
    while True:
        try:
            return action()
        except (redis.ConnectionError, redis.TimeoutError) as error:
            if give_up():
                raise
            failures += 1
            if failures == 1:
                log.warning("%s: Redis unreachable (%s); retrying until it answers", what, error)
            time.sleep(delay)
            delay = min(RETRY_CAP_S, delay * 2)
