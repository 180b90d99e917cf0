"""Connections on real redis-servers: Sentinel URLs followed across a failover (RQ included), appends that wait for
replicas, and TLS with a CA (and client certificate) the test makes."""

from __future__ import annotations

import gc
import signal
import time
import weakref
from pathlib import Path

import pytest
import redis
from rq import Queue, SimpleWorker

from core import keys
from core.connections import RedisOptions, RedisUnavailable, connect, quick_client, same_server
from core.event_store import EventStore
from core.queueing import SERIALIZER
from core.redis_urls import parse_sentinel_url, redact_url
from core.replication import NotReplicated
from core.sentinel import _follow, _sentinels
from core.settings import SettingError, Settings
from schemas.events import ClusterMetadataSet
from simulators.waiting import wait_until
from tests.support.ports import free_port
from tests.support.sentinel import RedisProcess, SentinelSet, Tls


def metadata(key: str) -> ClusterMetadataSet:
    return ClusterMetadataSet(experiment_id="exp1", key=key, value="v")


def test_sentinel_urls_parse_and_hide_their_password() -> None:
    parsed = parse_sentinel_url("rediss+sentinel://app:s%3Acret@10.0.0.1:26379,[::1]:26380/mymaster/3")
    assert parsed is not None
    assert parsed.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (parsed.master, parsed.db, parsed.username, parsed.password, parsed.tls) == (
        "mymaster",
        3,
        "app",
        "s:cret",
        True,
    )
    assert parse_sentinel_url("redis://127.0.0.1:6379/0") is None
    assert redact_url("redis+sentinel://app:secret@h:1,h:2/m") == "redis+sentinel://app:***@h:1,h:2/m"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://user:p@ss@h:1/0", "redis://user:***@h:1/0"),
        ("redis://127.0.0.1:1/0?password=QueryPW", "redis://127.0.0.1:1/0?password=***"),  # redis-py takes it
        ("unix:///run/redis.sock?db=2&Password=pw#x", "unix:///run/redis.sock?db=2&Password=***#x"),
        ("redis://h:1/0", "redis://h:1/0"),
    ],
)
def test_a_password_in_a_url_is_hidden_wherever_it_is_written(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://:secret@h:26379", "name the master"),
        ("redis+sentinel://:secret@h/m", "is not host:port"),
        ("redis+sentinel://h:1/m/x", "name the master"),
        ("http://:secret@h:1/0", "unknown scheme"),
        ("redis://:secret@h:port/0", "Port could not be cast"),
    ],
)
def test_a_malformed_url_names_the_setting_and_the_fix(url: str, problem: str) -> None:
    with pytest.raises(SettingError) as error:
        Settings.from_environment({"TRIALSTREAM_REDIS_URL": url})
    message = str(error.value)
    assert message.startswith("TRIALSTREAM_REDIS_URL (--redis) ") and problem in message
    assert "redis+sentinel://[user:password@]host:port" in message and "secret" not in message
    assert "\n" not in message


def test_a_sentinel_failing_the_master_over_is_not_taken_at_its_word() -> None:
    """The failover leader names the old master until its failover ends, even once that master answers again."""
    url = parse_sentinel_url("redis+sentinel://127.0.0.1:1/trialstream")
    assert url is not None
    sentinels = _sentinels(url, {})
    state = {"is_master": True, "is_sdown": False, "is_odown": False, "num-other-sentinels": 2, "flags": "master"}
    assert sentinels.check_master_state(state, "trialstream")
    assert not sentinels.check_master_state({**state, "flags": "master,failover_in_progress"}, "trialstream")


def test_the_pools_on_one_master_follow_the_one_that_finds_a_new_master() -> None:
    """Grouped by sentinel set (in any order) and service name; a pool is not kept alive by its group."""
    master, moved = ("10.0.0.1", 6379), ("10.0.0.2", 6379)
    found = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/trialstream", check=False)
    same = [found, same_server(found, decode=False), quick_client(found, 0.5)]
    same.append(connect("redis+sentinel://127.0.0.1:2,127.0.0.1:1/trialstream", check=False))
    other_service = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/other", check=False)
    other_set = connect("redis+sentinel://127.0.0.1:1/trialstream", check=False)
    clients = [*same, other_service, other_set]
    for client in clients:
        client.connection_pool.proxy.master_address = master  # type: ignore[attr-defined]
    _follow(found.connection_pool.proxy, moved)  # type: ignore[attr-defined]
    assert [client.connection_pool.master_address for client in clients] == [moved] * 4 + [master] * 2  # type: ignore[attr-defined]
    pool = weakref.ref(same[-1].connection_pool)
    del same, clients
    gc.collect()
    assert pool() is None


def test_clients_rq_and_siblings_follow_the_master_across_a_failover(sentinel_set: SentinelSet) -> None:
    client = connect(sentinel_set.url, retry_s=20)
    raw, quick = same_server(client, decode=False), quick_client(client, 0.5)
    store = EventStore(client, "exp1")
    store.append(metadata("before"))
    queue = Queue("trialstream.test", connection=raw, serializer=SERIALIZER)
    queue.enqueue_call("builtins.len", args=("abc",), job_id="before")
    old = sentinel_set.master()
    old.kill()
    new = wait_until(lambda: (m := sentinel_set.master()) is not old and m, 15, what="a failover")
    assert store.append(metadata("after"), idempotency_key="after")  # acknowledged: on a replica of the new master
    assert [e.event.key for e in store.read()] == ["before", "after"]  # type: ignore[union-attr]
    assert quick.ping() and raw.ping()
    assert client.connection_pool.get_master_address()[1] == new.port  # type: ignore[attr-defined]
    queue.enqueue_call("builtins.len", args=("abcd",), job_id="after")
    worker = SimpleWorker([queue], connection=raw, serializer=SERIALIZER)
    assert worker.work(burst=True)
    assert set(queue.finished_job_registry.get_job_ids()) == {"before", "after"}  # the job queued before it too


def test_an_append_no_replica_confirms_is_refused_and_counted(sentinel_set: SentinelSet) -> None:
    """The stated choice: retried for the client's retry budget, then refused (NotReplicated), never acknowledged
    with fewer replicas than required; each timed-out WAIT is counted in Redis for the manager's /metrics."""
    client = connect(sentinel_set.url, options=RedisOptions(replica_timeout_s=0.2), retry_s=0.5)
    store = EventStore(client, "exp1")
    store.append(metadata("replicated"))
    replicas = [node for node in sentinel_set.nodes if node is not sentinel_set.master()]
    for replica in replicas:
        replica.signal(signal.SIGSTOP)
    try:
        with pytest.raises(NotReplicated, match="0 of 2 replicas"):
            store.append(metadata("alone"), idempotency_key="alone")
        with client.pipeline() as pipe:  # a pipeline holding an append waits too
            store.append(metadata("piped"), pipeline=pipe)
            with pytest.raises(NotReplicated):
                pipe.execute()
        assert int(client.get(keys.REPLICATION_TIMEOUTS) or 0) >= 2
        unacked = connect(sentinel_set.url, options=RedisOptions(replicas=0))  # a stated N of 0 waits for nothing
        assert EventStore(unacked, "exp1").append(metadata("unwaited"))
    finally:
        for replica in replicas:
            replica.signal(signal.SIGCONT)
    assert store.append(metadata("alone"), idempotency_key="alone")  # sent again: stored once, now replicated
    assert [e.event.key for e in store.read()].count("alone") == 1  # type: ignore[union-attr]


def test_without_replicas_an_append_waits_for_none(redis_url: str) -> None:
    """The default single server: ROLE once per connection, then appends cost no round trip more."""
    client = connect(redis_url)
    client.config_resetstat()
    store = EventStore(client, "exp1")
    for key in "abc":
        assert store.append(metadata(key))
    calls = client.info("commandstats")
    assert calls["cmdstat_role"]["calls"] == 1 and "cmdstat_wait" not in calls
    assert client.get(keys.REPLICATION_TIMEOUTS) is None  # the master has no replica: no WAIT, none timed out


def test_a_plain_url_whose_master_has_a_replica_waits_for_it(tmp_path: Path) -> None:
    master = RedisProcess(tmp_path / "master", free_port(), ["--save", ""], None)
    replica = RedisProcess(tmp_path / "replica", free_port(), ["--save", ""], None)
    try:
        master.start()
        replica.start(("--replicaof", "127.0.0.1", str(master.port)))
        with master.client() as probe:
            wait_until(lambda: len(probe.execute_command("ROLE")[2]) == 1, 10, what="the replica online")
        client = connect(f"redis://127.0.0.1:{master.port}/0", retry_s=0)
        store = EventStore(client, "exp1")
        assert store.append(metadata("replicated"))  # within 1 s: a replica just synced acks once a second
        replica.signal(signal.SIGSTOP)
        with pytest.raises(NotReplicated, match="0 of 1 replicas"):
            store.append(metadata("alone"))
    finally:
        replica.stop()
        master.stop()


def test_a_replica_refusing_an_append_inside_a_transaction_is_a_connection_error(tmp_path: Path) -> None:
    """What a worker meets when a demoted master's address answers: a connection error (sent again to the master
    named then), not a ReadOnlyError that fails the trial (the compose stack's failover test found it)."""
    master = RedisProcess(tmp_path / "master", free_port(), ["--save", ""], None)
    replica = RedisProcess(tmp_path / "replica", free_port(), ["--save", ""], None)
    try:
        master.start()
        replica.start(("--replicaof", "127.0.0.1", str(master.port)))
        client = connect(f"redis://127.0.0.1:{replica.port}/0", retry_s=0)
        with client.pipeline(transaction=True) as pipe:
            EventStore(client, "exp1").append(metadata("refused"), pipeline=pipe)
            with pytest.raises(redis.ConnectionError, match="read only replica"):
                pipe.execute()
    finally:
        replica.stop()
        master.stop()


@pytest.fixture
def tls(tmp_path: Path) -> Tls:
    return Tls.make(tmp_path / "pki")


def test_tls_only_redis_with_a_ca_and_a_client_certificate(tmp_path: Path, tls: Tls) -> None:
    server = RedisProcess(tmp_path / "tls", free_port(), ["--save", ""], tls)
    server.start(("--tls-auth-clients", "yes"))  # after the set's `optional`: a client certificate is required
    url = f"rediss://127.0.0.1:{server.port}/0"
    try:
        options = Settings.from_environment(
            {
                "TRIALSTREAM_REDIS_URL": url,
                "TRIALSTREAM_REDIS_TLS_CA_FILE": str(tls.ca),
                "TRIALSTREAM_REDIS_TLS_CERT_FILE": str(tls.ca),
                "TRIALSTREAM_REDIS_TLS_KEY_FILE": str(tls.key),
            }
        ).redis_options()
        client = connect(url, options=options)
        assert EventStore(client, "exp1").append(metadata("k")) and same_server(client, decode=False).ping()
        with pytest.raises(RedisUnavailable):  # no client certificate: refused
            connect(url, options=RedisOptions(tls_ca_file=str(tls.ca)))
        other = Tls.make(tmp_path / "other-pki")
        with pytest.raises(RedisUnavailable) as wrong_ca:
            connect(
                url,
                options=RedisOptions(tls_ca_file=str(other.ca), tls_cert_file=str(tls.ca), tls_key_file=str(tls.key)),
            )
        message = str(wrong_ca.value)
        assert "TRIALSTREAM_REDIS_TLS_CA_FILE" in message and "\n" not in message
    finally:
        server.stop()


def test_tls_to_the_sentinels_and_the_master(tmp_path: Path, tls: Tls) -> None:
    sentinels = SentinelSet(tmp_path / "set", replicas=0, sentinels=1, tls=tls)
    try:
        sentinels.start()
        client = connect(sentinels.url, options=RedisOptions(tls_ca_file=str(tls.ca), replicas=0))
        assert EventStore(client, "exp1").append(metadata("k"))
        with pytest.raises(RedisUnavailable, match="TRIALSTREAM_REDIS_TLS_CA_FILE"):
            connect(sentinels.url)  # the system's CAs do not know the test's
    finally:
        sentinels.stop()


class Interrupted(Exception):
    """Raised by a signal handler, as RQ's warm shutdown raises StopRequested inside a blocking dequeue."""


def test_a_blocking_read_cut_short_leaves_no_reply_pending_for_the_next_command(sentinel_set: SentinelSet) -> None:
    client = connect(sentinel_set.url)
    client.set("k", "v")

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            client.blpop(["nothing"], timeout=5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    started = time.monotonic()
    assert client.get("k") == "v"  # not the BLPOP's nil, 5 s later
    assert time.monotonic() - started < 2
