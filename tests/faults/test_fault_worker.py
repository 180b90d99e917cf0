"""Workers that die or stall mid-trial: real worker processes killed with SIGKILL or frozen with SIGSTOP.

Each attempt is held by a lease the worker renews (TRIALSTREAM_TRIAL_LEASE_S, 1 s here); another
worker reaps expired leases. Bounds are deadlines on conditions, not sleeps.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import cast

import redis

from core import keys
from core.event_store import StoredEvent
from core.leases import AttemptRef, Lease
from core.queueing import TrialJob, enqueue, queue_name
from core.reaper import pause_grace_s, reap_lost_attempts
from schemas.events import TrialAttemptLost, TrialEnded, TrialRequeued, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.platforms.test_local_platform import pid_alive, script

LEASE_S = 1.0
FAST_LEASE = {"TRIALSTREAM_TRIAL_LEASE_S": str(LEASE_S)}
DETECTION_BOUND_S = LEASE_S + 1.0 + 15.0  # the lease, the reaper's interval, and slack for a loaded machine

# The first attempt starts a child and hangs; a retry (same working directory) finishes at once.
TRIAL = """
import os, subprocess, time, trialstream_sdk as nni
sys_dir = os.environ["NNI_SYS_DIR"]
nni.get_next_parameter()
marker = os.path.join(sys_dir, "attempted")
first = not os.path.exists(marker)
open(marker, "a").close()
nni.report_intermediate_result(1.0 if first else 2.0)
if first:
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(sys_dir, ".pids"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.replace(os.path.join(sys_dir, ".pids"), os.path.join(sys_dir, "pids"))
    time.sleep(300)
nni.report_final_result(42.0)
"""


def running_trial(
    service, processes: Processes, code_dir: Path, lease_flag: bool = False
) -> tuple[str, list[int], subprocess.Popen[bytes]]:
    """A trial running its first attempt on a worker of its own; returns the trial, its pids, the worker."""
    victim = processes.worker(args=("--lease", str(LEASE_S))) if lease_flag else processes.worker(env=FAST_LEASE)
    trial_id = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, trial_id, "RUNNING")
    assert running.worker is not None
    pid_file = Path(running.working_directory) / "pids"
    pids = [int(pid) for pid in wait_until(lambda: pid_file.read_text() if pid_file.exists() else None, 15).split()]
    assert running.worker == f"{running.worker.split(':')[0]}:{victim.pid}"
    return trial_id, pids, victim


def events_of(service, trial_id: str) -> list:
    entries = service.store.read()
    return [e.event for e in entries if isinstance(e, StoredEvent) and getattr(e.event, "trial_id", None) == trial_id]


def test_a_killed_worker_s_trial_fails_within_the_lease_and_leaves_no_orphans(
    make_service: ServiceFactory, processes: Processes, code_dir: Path
) -> None:
    service = make_service(script(code_dir, "trial.py", TRIAL))
    trial_id, pids, victim = running_trial(service, processes, code_dir, lease_flag=True)
    processes.worker(env=FAST_LEASE)  # the survivor that notices

    victim.send_signal(signal.SIGKILL)
    trial = wait_for_status(service, trial_id, "FAILED", "SUCCEEDED", timeout=DETECTION_BOUND_S)

    assert trial.status is TrialJobStatus.FAILED
    assert f"worker {trial.worker} stopped renewing the lease of attempt 1" in (trial.message or "")
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), 5, what="the trial and its child to be gone")
    lost = [event for event in events_of(service, trial_id) if isinstance(event, TrialAttemptLost)]
    assert len(lost) == 1 and lost[0].status is TrialJobStatus.FAILED and lost[0].source != trial.worker


def test_a_killed_worker_s_trial_is_retried_as_a_new_attempt(
    make_service: ServiceFactory, processes: Processes, code_dir: Path
) -> None:
    service = make_service(script(code_dir, "trial.py", TRIAL), max_retries=1)
    processes.projector()
    trial_id, pids, victim = running_trial(service, processes, code_dir)
    processes.worker(env=FAST_LEASE)

    victim.send_signal(signal.SIGKILL)
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=DETECTION_BOUND_S + 10)

    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 2
    assert trial.final_metric == 42.0
    history = events_of(service, trial_id)
    assert [e.attempt for e in history if isinstance(e, TrialStarted)] == [1, 2]
    assert [(e.attempt, e.status) for e in history if isinstance(e, TrialAttemptLost)] == [(1, TrialJobStatus.WAITING)]
    wait_until(lambda: len(service.views.metrics(trial_id)) == 3, 10, what="the projector to list every metric")
    metrics = {(m.attempt, m.type, m.value) for m in service.views.metrics(trial_id)}
    assert metrics == {(1, "PERIODICAL", 1.0), (2, "PERIODICAL", 2.0), (2, "FINAL", 42.0)}
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), 5, what="the first attempt's processes to be gone")


def test_a_stalled_worker_loses_its_attempt_and_stops_it_when_it_wakes(
    make_service: ServiceFactory, processes: Processes, code_dir: Path
) -> None:
    service = make_service(script(code_dir, "trial.py", TRIAL))
    trial_id, pids, frozen = running_trial(service, processes, code_dir)
    processes.worker(env=FAST_LEASE)

    frozen.send_signal(signal.SIGSTOP)
    try:
        lost = wait_for_status(service, trial_id, "FAILED", timeout=DETECTION_BOUND_S)
    finally:
        frozen.send_signal(signal.SIGCONT)

    # Awake again, the worker finds its lease gone and stops the trial; its late end changes nothing.
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), 15, what="the woken worker to stop its trial")
    assert service.get_trial_job(trial_id) == lost
    history = events_of(service, trial_id)
    assert [type(e) for e in history if isinstance(e, TrialAttemptLost | TrialEnded)] == [TrialAttemptLost]
    assert frozen.poll() is None  # it lost a trial, not its life


def test_reapers_race_and_exactly_one_declares_the_attempt_lost(
    make_service: ServiceFactory, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    service = make_service("true", max_retries=1)
    trial_id = service.submit_trial_job(form(0)).id  # no worker serves the queue: the job just waits
    held = Lease(client, AttemptRef(service.experiment_id, trial_id, 1), "ghost:1", seconds=30)
    assert held.acquire() and held.acquire()  # again by its holder (a resent script): still its own
    assert not Lease(client, held.ref, "other:2", seconds=30).acquire()
    assert not Lease(client, held.ref, "ghost:1", seconds=30).acquire()  # its job again, in the worker's other slot
    grace = pause_grace_s(LEASE_S)  # a server that just started holds reaping back that long
    wait_until(lambda: int(client.info("server")["uptime_in_seconds"]) >= grace, 2 * grace, what="redis uptime")
    assert reap_lost_attempts(client, rq_connection, "reaper", LEASE_S) == []  # alive: nothing to reap

    client.zadd(keys.LEASES, {held.ref.member: 0})  # as if it expired long ago
    verdicts: list[list[TrialAttemptLost | TrialRequeued]] = []
    threads = [
        threading.Thread(
            target=lambda name: verdicts.append(reap_lost_attempts(client, rq_connection, name, LEASE_S)),
            args=(name,),
        )
        for name in ("reaper-1", "reaper-2", "reaper-3", "reaper-4")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sum(len(found) for found in verdicts) == 1
    lost = next(verdict for found in verdicts for verdict in found)
    assert isinstance(lost, TrialAttemptLost) and lost.worker == "ghost:1"  # the worker's name, not its claim
    assert not held.renew()  # the holder learns its attempt is gone
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING
    assert service.get_trial_job(trial_id).attempt == 2
    jobs = [
        job_id.decode() for job_id in cast(list[bytes], rq_connection.lrange(f"rq:queue:{queue_name('local')}", 0, -1))
    ]
    assert any(job.startswith(f"{service.experiment_id}-{trial_id}-2-run-") for job in jobs)
    assert client.zcard(keys.LEASES) == 0


def test_a_retry_of_a_trial_canceled_meanwhile_ends_it_as_canceled(
    make_service: ServiceFactory, processes: Processes, client: redis.Redis, rq_connection: redis.Redis
) -> None:
    """A cancel can land between a reaper's look at the log and its verdict: the retry then ends the trial."""
    service = make_service("sleep 30", max_retries=1)
    trial_id = service.submit_trial_job(form(0)).id  # no worker yet: attempt 1 is played by hand
    experiment_id = service.experiment_id
    service.store.append(
        TrialStarted(experiment_id=experiment_id, trial_id=trial_id, attempt=1, working_directory="/w")
    )
    service.cancel_trial_job(trial_id)
    service.store.append(
        TrialAttemptLost(
            experiment_id=experiment_id,
            trial_id=trial_id,
            attempt=1,
            reason="a racing reaper",
            status=TrialJobStatus.WAITING,
        )
    )
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING
    with client.pipeline(transaction=True) as pipe:
        pipe.multi()
        record = TrialRequeued(experiment_id=experiment_id, trial_id=trial_id, attempt=2, reason="a test")
        enqueue(pipe, rq_connection, service.store, record, [TrialJob("local", experiment_id, trial_id, 2)])
        pipe.execute()

    processes.worker()
    # the retry first waits out its lost predecessor (one lease and the stop margin: workers/control.py)
    trial = wait_for_status(service, trial_id, "USER_CANCELED", "SUCCEEDED", "FAILED", timeout=45)
    assert trial.status is TrialJobStatus.USER_CANCELED and trial.attempt == 2
