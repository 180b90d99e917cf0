"""Reads that depend on a write made through another pool of the same Redis, across a failover: the master is paused
until the sentinels promote a replica, then resumed as a deposed master that still answers reads, and held so (its
REPLICAOF refused by ACL, as a partition from the sentinels would hold it), with the process's other pools still
idle on it. Each operation must read the master it wrote to.

One Sentinel set for the module, with a replica to promote for each test; each test deposes the master of its time.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core import keys
from core.connections import connect, quick_client, same_server
from core.event_store import EventStore
from core.leases import AttemptRef, Lease
from core.queueing import load_submission, queued_attempts
from core.reaper import unclaimed_attempts
from manager.archive.moves import archive, restore
from manager.archive.stores import open_store
from manager.experiments import finish_experiment
from manager.projector import Projector
from schemas.events import ClusterMetadataSet
from simulators.waiting import wait_until
from tests.conftest import form, new_service
from tests.support.sentinel import RedisProcess, SentinelSet
from workers.runtime.control import LogTrialControl

LEASE_S = 2.0
TESTS = 4  # each deposes one master: the set has a replica to promote for each, and one left to take writes


@pytest.fixture(scope="module")
def sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelSet]:
    """Down after 1.5 s: quick failovers, with a margin over this loaded machine's stalls (docs/reliability.md)."""
    sentinels = SentinelSet(
        tmp_path_factory.mktemp("cross-pool"), replicas=TESTS + 1, down_after_ms=1500, failover_timeout_ms=3000
    )
    try:
        sentinels.start()
        yield sentinels
    finally:
        sentinels.stop()


def depose(sentinels: SentinelSet, then: Callable[[], object]) -> RedisProcess:
    """Pause the master until the sentinels promote a replica and move the others to it, run `then`, and resume the
    old master, deposed: it answers reads (writes need a replica), and refuses the sentinels' REPLICAOF."""
    old = sentinels.master()
    with old.client() as probe:
        probe.execute_command("ACL", "SETUSER", "default", "-replicaof", "-slaveof")
    old.signal(signal.SIGSTOP)
    try:
        new = wait_until(lambda: m if (m := sentinels.master()) is not old else None, 30, what="a failover")
        live = {node.port for node in sentinels.nodes if node not in (new, old) and node.role() == "slave"}
        wait_until(lambda: live <= new.replicas_online(), 30, what="the replicas to follow the new master")
    finally:
        old.signal(signal.SIGCONT)
    # Until it has seen its replicas go, the old master still takes writes: `then` would not meet the failover.
    wait_until(lambda: not old.replicas_online(), 10, what="the old master to lose its replicas")
    then()
    return old


def still_deposed(old: RedisProcess) -> None:
    """The old master answered as a master throughout: the test met the window it is about."""
    assert old.role() == "master"


def test_an_archive_moves_the_log_of_the_master_it_deletes_it_from(sentinels: SentinelSet, tmp_path: Path) -> None:
    client = connect(sentinels.url, retry_s=20)
    service = new_service(client, same_server(client, decode=False), tmp_path, tmp_path)
    finish_experiment(client, same_server(client, decode=False), service.experiment_id, "local", "DONE")
    Projector(client).catch_up(service.experiment_id)
    same_server(client, decode=False).ping()  # the process's bytes client, idle on the master
    store = EventStore(client, service.experiment_id)
    late = ClusterMetadataSet(experiment_id=service.experiment_id, key="late", value="x")
    old = depose(sentinels, lambda: store.append(late))  # on the new master: the client meets the failover
    length = store.length()
    archive(client, service.experiment_id, open_store(str(tmp_path / "archive")))
    restore(client, service.experiment_id)
    assert store.length() == length, "the archive took the deposed master's log; the new master's was deleted"
    still_deposed(old)


def test_a_lease_claimed_through_a_client_is_renewed_through_its_quick_sibling(
    sentinels: SentinelSet, tmp_path: Path
) -> None:
    client = connect(sentinels.url, retry_s=20)
    service = new_service(client, same_server(client, decode=False), tmp_path, tmp_path)
    trial = service.submit_trial_job(form())
    quick_client(client, max(0.2, LEASE_S / 2)).ping()  # the trials' shared quick client, idle on the master
    old = depose(sentinels, lambda: client.set("housekeeping", 1))  # the client meets the failover
    store = EventStore(client, service.experiment_id)
    ref = AttemptRef(service.experiment_id, trial.id, 1)
    lease = Lease(client, ref, "w", LEASE_S)
    assert lease.acquire()  # a worker's pick-up, on the new master
    claimed = client.zscore(keys.LEASES, ref.member)
    control = LogTrialControl(store, load_submission(store, trial.id), lease, [])
    try:
        wait_until(
            lambda: control.stop_request() or (client.zscore(keys.LEASES, ref.member) or 0) > (claimed or 0),
            10,
            what="a renewal, or the lease declared lost",
        )
        assert control.stop_request() is None, "a renewal read the deposed master and stopped a live attempt"
    finally:
        control.close()
    still_deposed(old)


def test_a_log_read_again_as_bytes_is_read_where_the_text_read_was(sentinels: SentinelSet, tmp_path: Path) -> None:
    """The projector reads a batch on its watched connection; an entry that is not UTF-8 makes it read it again."""
    client = connect(sentinels.url, retry_s=20)
    store = EventStore(client, "exp1")
    store.append(ClusterMetadataSet(experiment_id="exp1", key="before", value="v"))
    same_server(client, decode=False).ping()  # the process's bytes client, idle on the master
    old = depose(sentinels, lambda: client.execute_command("XADD", store.stream, "*", "type", b"\xff"))
    expected = client.xlen(store.stream)
    with client.pipeline() as pipe:
        pipe.watch(store.stream)
        read = EventStore(pipe, "exp1").raw_range()
        pipe.unwatch()
    assert len(read) == expected == 2, "the log was read again on the deposed master"
    assert read[-1].not_utf8
    still_deposed(old)


def test_a_job_queued_through_the_runners_client_is_seen_queued(sentinels: SentinelSet, tmp_path: Path) -> None:
    client = connect(sentinels.url, retry_s=20)
    rq = same_server(client, decode=False)
    service = new_service(client, rq, tmp_path, tmp_path)
    queued_attempts(rq, {"local"})  # the runner's RQ client, idle on the master
    trials = []
    old = depose(sentinels, lambda: trials.append(service.submit_trial_job(form())))  # queued on the new master
    assert unclaimed_attempts(client, trials) == [], "the queue was read on the deposed master: requeued"
    still_deposed(old)
