"""A trial that cannot start yet (its GPUs are busy, or no machine serving its queue has enough) is parked, not
re-queued in a loop, and starts as soon as what it waits for is freed."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
from pathlib import Path
from typing import Any, TypeVar

from rq.registry import FinishedJobRegistry

from core import keys
from core.event_store import StoredEvent
from core.queueing import attempt_job_prefix, recheck_delay_s, trial_queue
from manager.training_service import TrainingService
from schemas.events import TrialDeferred, TrialEvent, TrialRequeued, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.platforms.test_gpu_scheduling import GPU_TRIAL, gpu_file, release

RECHECKS = 3
EventT = TypeVar("EventT", bound=TrialEvent)


def events_of(service: TrainingService, trial_id: str, kind: type[EventT]) -> list[EventT]:
    return [
        entry.event
        for entry in service.store.read()
        if isinstance(entry, StoredEvent) and isinstance(entry.event, kind) and entry.event.trial_id == trial_id
    ]


def deliveries(rq_connection, service, trial_id: str) -> int:
    """How many times a worker ran a job of the trial's first attempt."""
    registry = FinishedJobRegistry(queue=trial_queue("local", rq_connection))
    prefix = attempt_job_prefix(service.experiment_id, trial_id, 1)
    return sum(1 for job_id in registry.get_job_ids() if job_id.startswith(prefix))


def parked(service: TrainingService, trial_id: str) -> bool:
    members: Any = service.store.client.zrange(keys.parked("local"), 0, -1)
    return any(json.loads(member)[:2] == [service.experiment_id, trial_id] for member in members)


def test_a_waiting_trial_backs_off_then_starts_when_the_gpu_is_freed(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, tmp_path: Path, rq_connection
) -> None:
    (code_dir / "gpu_trial.py").write_text(textwrap.dedent(GPU_TRIAL))
    service = make_service(
        f"{sys.executable} gpu_trial.py", platform_config={"platform": "local", "useActiveGpu": False}, gpu_number=1
    )
    fake = {"TRIALSTREAM_FAKE_GPUS": str(gpu_file(tmp_path, [0]))}
    for _ in range(2):
        processes.worker(env=fake)
    holder = service.submit_trial_job(form(0)).id
    wait_for_status(service, holder, "RUNNING")
    waiting = service.submit_trial_job(form(1)).id

    rechecks = lambda: [e for e in events_of(service, waiting, TrialRequeued) if e.reason == "re-check"]  # noqa: E731
    wait_until(lambda: len(rechecks()) >= RECHECKS, 10 + sum(map(recheck_delay_s, range(RECHECKS + 1))))
    # Parked again after its last re-check: released before that, its re-check itself would find the GPU free.
    wait_until(lambda: parked(service, waiting), 30, what="the waiting trial parked again after its re-check")
    # Before parking, a waiting trial's job ran again twice a second: ~14 times by now.
    assert deliveries(rq_connection, service, waiting) <= RECHECKS + 2
    assert len(events_of(service, waiting, TrialDeferred)) == 1  # one record of the wait, not one per re-check
    assert service.get_trial_job(waiting).status is TrialJobStatus.WAITING

    release(service)  # the holder ends: the waiting trial is woken at once, not at its next re-check
    assert wait_for_status(service, waiting, "SUCCEEDED", "FAILED").status is TrialJobStatus.SUCCEEDED
    started = events_of(service, waiting, TrialStarted)[0]
    last_requeue = [e for e in events_of(service, waiting, TrialRequeued) if e.time <= started.time][-1]
    assert last_requeue.reason == "a trial ended"


def test_a_trial_no_machine_has_the_gpus_for_waits_parked_saying_why(
    make_service: ServiceFactory, processes: Processes, code_dir: Path, tmp_path: Path, rq_connection
) -> None:
    """The check before an experiment refuses one asking for more GPUs than the machines serving it have; a trial
    that gets here all the same (the machine that had them went away) waits for one, without failing or looping."""
    (code_dir / "gpu_trial.py").write_text(textwrap.dedent(GPU_TRIAL))
    service = make_service(
        f"{sys.executable} gpu_trial.py", platform_config={"platform": "local", "useActiveGpu": True}, gpu_number=3
    )
    processes.worker(env={"TRIALSTREAM_FAKE_GPUS": str(gpu_file(tmp_path, [0, 0])), "TRIALSTREAM_MACHINE_ID": "box"})
    waiting = service.submit_trial_job(form(0)).id
    message = wait_until(lambda: service.get_trial_job(waiting).message, 10, what="a deferral message")
    assert message == (
        f"host {socket.gethostname()}: trial asks for 3 GPUs but this machine has 2 (GPUs: 0,1);"
        " no other machine with a live local"
        " worker has enough: waiting for a worker of one that has"
    )
    rechecks = lambda: [e for e in events_of(service, waiting, TrialRequeued) if e.reason == "re-check"]  # noqa: E731
    wait_until(lambda: len(rechecks()) >= 2, 10 + recheck_delay_s(1) + recheck_delay_s(2))
    wait_until(lambda: parked(service, waiting), 30, what="the waiting trial parked again after its re-check")
    assert deliveries(rq_connection, service, waiting) <= 2 + 2
    assert len(events_of(service, waiting, TrialDeferred)) == 1
    assert service.get_trial_job(waiting).status is TrialJobStatus.WAITING
