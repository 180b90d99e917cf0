"""A paused redis-server (SIGSTOP/SIGCONT: a VM pause, a slow fsync, a huge transaction) is not the
death of every worker: reapers hold back after it, and workers that renew as soon as it answers
again keep their attempts. A worker that really died meanwhile is still declared lost afterwards.

The test runs its own redis-server (it freezes it), on a free loopback port.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from core import keys
from core.connections import connect
from core.event_store import EventStore, StoredEvent
from core.leases import AttemptRef, Lease
from core.reaper import pause_grace_s, reap_lost_attempts, reaping_allowed
from schemas.events import TrialAttemptLost
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, RedisServer, form, wait_for_status, wait_until
from tests.faults.test_fault_redis import local_experiment

LEASE_S = 4.0  # the local deadline is two leases: a pause between one and two leases is ridden out
PAUSE_S = 4.5  # longer than the lease, longer than the reapers' quiet gap (2 s), 3.5 s short of the deadline
TRIALS = 6
LEASE = {"TRIALSTREAM_TRIAL_LEASE_S": str(LEASE_S)}


@pytest.mark.timeout(180)
def test_a_redis_pause_longer_than_the_lease_loses_no_live_attempt(
    own_redis: RedisServer, own_processes: Processes, tmp_path: Path
) -> None:
    client, rq_connection = connect(own_redis.url), connect(own_redis.url, decode=False)
    service = local_experiment(client, rq_connection, tmp_path, "sleep 20")  # runs through the pause
    own_processes.projector()
    workers = [own_processes.worker(env=LEASE) for _ in range(TRIALS + 1)]
    trial_ids = [service.submit_trial_job(form(index)).id for index in range(TRIALS + 1)]
    for trial_id in trial_ids:
        wait_for_status(service, trial_id, "RUNNING", timeout=60)
    running = {trial.worker: trial.id for trial in service.list_trial_jobs()}
    # Long enough after the server's start that a restart's grace does not hide what a pause does.
    up_for = pause_grace_s(LEASE_S) + 1
    wait_until(lambda: int(client.info("server")["uptime_in_seconds"]) >= up_for, 2 * up_for, what="redis uptime")
    # A reaper whose round was sent during the pause runs first when Redis answers again.
    reaper = threading.Thread(target=reap_lost_attempts, args=(client, rq_connection, "reaper", LEASE_S))

    assert own_redis.process is not None
    own_redis.process.send_signal(signal.SIGSTOP)
    try:
        doomed = workers[-1]  # dies during the pause: its attempt must still be declared lost
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        reaper.start()
        time.sleep(PAUSE_S)  # the length of the fault itself, not a wait for a condition
    finally:
        own_redis.process.send_signal(signal.SIGCONT)
    reaper.join(30)

    terminal = [str(status) for status in TrialJobStatus if status.is_terminal]
    ended = {trial_id: wait_for_status(service, trial_id, *terminal, timeout=90) for trial_id in trial_ids}
    entries = EventStore(client, service.experiment_id).read()
    lost = [e.event for e in entries if isinstance(e, StoredEvent) and isinstance(e.event, TrialAttemptLost)]
    doomed_trial = next(
        trial_id for worker, trial_id in running.items() if worker and worker.endswith(f":{doomed.pid}")
    )
    assert [event.trial_id for event in lost] == [doomed_trial], [event.reason for event in lost]
    assert ended.pop(doomed_trial).status is TrialJobStatus.FAILED
    for trial in ended.values():
        assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 1, trial.message
    assert all(worker.poll() is None for worker in workers[:-1]), "a live worker died on the pause"


def test_the_first_reap_round_after_a_pause_holds_back(own_redis: RedisServer, tmp_path: Path) -> None:
    """Deterministic: the holder cannot renew during the pause; the first reaper after it must wait."""
    client, rq_connection = connect(own_redis.url), connect(own_redis.url, decode=False)
    service = local_experiment(client, rq_connection, tmp_path, "true")
    trial_id = service.submit_trial_job(form(0)).id  # no worker: the attempt is held by hand
    held = Lease(client, AttemptRef(service.experiment_id, trial_id, 1), "holder:1", seconds=1.0)
    assert held.acquire()
    up_for = pause_grace_s(1.0) + 1
    wait_until(lambda: int(client.info("server")["uptime_in_seconds"]) >= up_for, 2 * up_for, what="redis uptime")
    assert held.renew()
    assert reap_lost_attempts(client, rq_connection, "reaper", 1.0) == []  # a round before the pause

    assert own_redis.process is not None
    own_redis.process.send_signal(signal.SIGSTOP)
    time.sleep(PAUSE_S)  # the length of the fault itself
    own_redis.process.send_signal(signal.SIGCONT)

    assert reap_lost_attempts(client, rq_connection, "reaper", 1.0) == []  # expired, but held back
    assert held.renew()  # the holder renews as soon as Redis answers: its attempt is still its own
    held.end(pipe := client.pipeline())
    pipe.execute()


def test_the_first_reap_round_on_a_promoted_replica_holds_back(own_redis: RedisServer, tmp_path: Path) -> None:
    """A failover is a pause too, however quick: the reapers may reach the new master while the workers'
    renewals still wait on the old one. A round recorded by another server process holds reaping back."""
    master = connect(own_redis.url)
    master.config_set("repl-diskless-sync-delay", 0)  # the replica's first sync at once, not after 5 s
    replica = RedisServer(tmp_path / "replica-data", "--replicaof", "127.0.0.1", str(own_redis.port))
    replica.start()
    try:
        promoted = connect(replica.url)
        wait_until(lambda: promoted.role()[3] == "connected", 30, what="the replica's first sync")
        assert reaping_allowed(master, LEASE_S) and reaping_allowed(master, LEASE_S)  # rounds on one server
        assert master.wait(1, 10_000) == 1 and promoted.get(keys.REAP_ROUND) == master.get(keys.REAP_ROUND)
        promoted.replicaof("NO", "ONE")  # what Sentinel does to the replica it elects
        assert not reaping_allowed(promoted, LEASE_S)  # milliseconds after the last round, on another server
        assert reaping_allowed(master, LEASE_S)  # the old one, still answering, saw no change of server
    finally:
        replica.kill()  # a SIGTERM waits 10 s in its shutdown here
