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

The parts of a client live beside this module: what a URL may be (core.redis_urls), how a client
follows a Sentinel master (core.sentinel) and how an append waits for replicas (core.replication).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

from core.redis_urls import SentinelUrl, parse_sentinel_url, redact_url
from core.replication import NO_ACKS, AckingRedis, ReplicaAcks
from core.sentinel import _MasterConnection, _MasterPool, _MasterSSLConnection, _sentinels
from core.variables import TLS_CA_ENV

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


class RedisGone(redis.ConnectionError):
    """The server a client retried for was given up on by whoever runs it (`connect`'s `gone`)."""


class _BackoffUntilGone(ExponentialBackoff):
    """ExponentialBackoff that ends the retries once `gone` is set. redis-py deep-copies a Retry into each
    connection: this one is shared by every copy, so one switch reaches the retries already waiting."""

    def __init__(self, gone: threading.Event) -> None:
        super().__init__(cap=RETRY_CAP_S, base=RETRY_BASE_S)
        self.gone = gone

    def __deepcopy__(self, memo: dict[int, Any]) -> _BackoffUntilGone:
        return self

    def compute(self, failures: int) -> float:
        if self.gone.is_set():
            raise RedisGone("Redis was given up on: it cannot start again (see the error that says why)")
        return float(super().compute(failures))


def retry_policy(budget_s: float | None = None, gone: threading.Event | None = None) -> Retry:
    """Reconnect and resend on connection errors and timeouts, backing off from 0.1 s to 2 s, for ~`budget_s`
    (default: `outage_budget_s()`), or until `gone` is set (a server that will not come back).

    It is applied per connection: a command, a pipeline (a transaction is re-sent whole), and the
    connect itself. While a pipeline WATCHes, redis-py does not resend: it raises WatchError, and
    the caller re-reads and tries again, as after any conflict.
    """
    budget = outage_budget_s() if budget_s is None else budget_s
    backoff = ExponentialBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S) if gone is None else _BackoffUntilGone(gone)
    return Retry(backoff, retries_within(budget), _RETRIED_ERRORS)


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


# Per pool. redis-py caps a pool at 100 unless told, and a pool grows to the most commands ever in flight
# at once: a worker's trials share one commands reader and a group commit (workers.runtime.trial_links),
# but its jobs' own starts and ends may still come by the hundred.
MAX_CONNECTIONS = 4096


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


def connect(
    url: str,
    *,
    options: RedisOptions | None = None,
    check: bool = True,
    decode: bool = True,
    retry_s: float | None = None,
    gone: threading.Event | None = None,
) -> AckingRedis:
    """A client (decoded strings unless `decode=False`, which RQ needs); `check` pings so a wrong URL fails here.
    Commands retry for `retry_s` seconds (`Settings.redis_retry_s`; default: `outage_budget_s()`), or until
    `gone` is set: then they raise RedisGone (an embedded Redis its stack gave up starting again).

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
        "retry": retry_policy(retry_s, gone),
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
        client = cast(
            AckingRedis,
            sentinels.master_for(
                sentinel.master, redis_class=AckingRedis, connection_pool_class=_MasterPool, **auth, **kwargs
            ),
        )
    wanted = options.replicas if options.replicas is not None else (1 if sentinel else None)
    client.acks = ReplicaAcks(wanted, options.replica_timeout_s)
    return client


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
        new_pool = type(pool)(  # a `_MasterPool`, on the same master as the pools it follows
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


def _text(value: str | bytes) -> str:
    """A reply's string, whether its client decodes replies or returns bytes."""
    return value.decode() if isinstance(value, bytes) else value


def text_fields(raw: Mapping[Any, Any]) -> dict[str, str]:
    """A hash, or a stream entry's fields, as text whichever its client returns."""
    return {_text(name): _text(value) for name, value in raw.items()}


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
