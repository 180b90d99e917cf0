"""Connections that follow the master the Redis Sentinels name, across a failover.

redis-py's own Sentinel connections reconnect to the last master's address inside a command's
retries, keep a connection whose read was cut short, and take the answer of a sentinel that is
failing the master over. `_MasterConnection` and `_Sentinels` mend that; `core.connections.connect`
uses them for a `redis+sentinel://` URL (core.redis_urls), so a client follows the master named now;
`_MasterPool` makes every pool of the process on that master follow the first that finds a new one.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import SSLConnection
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelConnectionPoolProxy, SentinelManagedConnection

from core.redis_urls import SentinelUrl
from core.replication import _no_longer_master

SENTINEL_TIMEOUT_S = 2.0  # a sentinel answers in milliseconds; one that does not is skipped for the next


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
            _follow(self.connection_pool, (self.host, self.port))
        super().connect_check_health(check_health, retry_socket_connect)

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


class _MasterSSLConnection(_MasterConnection, SSLConnection):
    pass


class _MasterPool(SentinelConnectionPool):
    """A pool on the master that moves when any pool of the process on the same master (same sentinel set and
    service name) finds a new one.

    redis-py drops the idle connections of the pool whose connection found the new master, not those of the
    other pools on it (a client's `same_server` and `quick_client` siblings, another `connect`): they stayed
    on a deposed master, which answers reads for ~10 s after a pause and for as long as a partition lasts,
    so an operation that wrote through one pool read the old master's data through another.
    """

    def __init__(self, service_name: str, sentinel_manager: _Sentinels, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self.group: _Group = (sentinel_manager.addresses, service_name)
        with _pools_lock:
            _pools.setdefault(self.group, weakref.WeakSet()).add(self)


_Group = tuple[frozenset[tuple[str, int]], str]  # a sentinel set and the service name the pools ask it for
_pools: dict[_Group, weakref.WeakSet[_MasterPool]] = {}  # each pool until it is collected
_pools_lock = threading.Lock()


def _follow(proxy: SentinelConnectionPoolProxy, address: tuple[str, int]) -> None:
    """The pools on the master of `proxy`'s pool leave the one they recorded for `address`, which a connection of
    that pool was just given: their idle connections are dropped, and those in use are when released (a pool
    keeps only connections to the address it records). A pool yet to connect asks the sentinels itself."""
    found_by = proxy.connection_pool_ref()
    if not isinstance(found_by, _MasterPool):
        return
    with _pools_lock:
        moved = [pool for pool in _pools[found_by.group] if pool.proxy.master_address not in (None, address)]
        for pool in moved:
            pool.proxy.master_address = address
    for pool in moved:
        pool.disconnect(inuse_connections=False)


class _Sentinels(Sentinel):
    """Sentinels whose answer is not taken from one that is failing the master over.

    The leader of a failover names the old master (SENTINEL MASTERS) until its failover ends, a second
    or more after it promoted a replica and the others switched. An old master that was only paused
    answers again meanwhile (no s_down): a client sent there writes to, and reads from, a master whose
    data the promoted one does not have and which it will discard. The next sentinel is asked instead.
    """

    def __init__(self, sentinels: list[tuple[str, int]], **kwargs: Any) -> None:
        super().__init__(sentinels, **kwargs)  # type: ignore[no-untyped-call]
        self.addresses = frozenset(sentinels)  # the set, for `_MasterPool.group`

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
    return _Sentinels(list(url.sentinels), sentinel_kwargs=sentinel_kwargs)
