"""State that only serves a running attempt goes when the attempt ends: the log and the views stay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from core import keys
from core.event_store import EventStore
from manager.projector import Projector
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until

RECORD = '{\\"parameter_id\\": 0, \\"type\\": \\"PERIODICAL\\", \\"sequence\\": $i, \\"value\\": \\"$i\\"}'
METRICS = f"for i in 0 1 2 3 4; do echo \"NNISDK_MEb'{RECORD}'\"; done"


def metric_keys(client: redis.Redis, experiment_id: str, trial_id: str) -> list[str]:
    found: Any = client.hkeys(keys.idempotency(experiment_id))
    return [key for key in found if key.startswith(f"metric:{trial_id}:")]


def test_an_ended_attempt_leaves_no_metric_idempotency_keys(
    make_service: ServiceFactory, processes: Processes, client: redis.Redis
) -> None:
    service = make_service(f"{METRICS}; sleep 30")
    processes.worker()
    trial_id = service.submit_trial_job(form(0)).id
    store = EventStore(client, service.experiment_id)
    wait_until(lambda: len(store.read(where=lambda f: f["type"] == "TrialMetricReported")) == 5, what="5 metrics")
    service.cancel_trial_job(trial_id)
    assert wait_for_status(service, trial_id, "USER_CANCELED").status is TrialJobStatus.USER_CANCELED

    assert metric_keys(client, service.experiment_id, trial_id) == []
    Projector(client).catch_up(service.experiment_id)
    assert [m.sequence for m in service.views.metrics(trial_id)] == [0, 1, 2, 3, 4]  # the log keeps them all
    assert client.hexists(keys.idempotency(service.experiment_id), f"submit:{trial_id}")  # finds the trial


def test_a_running_attempt_holds_the_idempotency_keys_of_its_last_metrics_only(
    make_service: ServiceFactory, processes: Processes, client: redis.Redis, tmp_path: Path
) -> None:
    """Each append of metrics drops the keys of the one before (they only made its retry safe): a trial running
    for hours holds a batch's keys, not one per metric it reported. Each metric waits for the test's go."""
    gate = tmp_path / "gate"
    gate.mkdir()
    step = f"echo \"NNISDK_MEb'{RECORD}'\"; while [ ! -e {gate}/$i ]; do sleep 0.01; done"
    service = make_service(f"for i in 0 1 2 3 4; do {step}; done; sleep 30")
    processes.worker()
    trial_id = service.submit_trial_job(form(0)).id
    store = EventStore(client, service.experiment_id)

    def appended() -> int:
        return len(store.read(where=lambda fields: fields["type"] == "TrialMetricReported"))

    for sequence in range(5):
        wait_until(lambda: appended() == sequence + 1, what=f"metric {sequence} in the log")  # noqa: B023
        assert metric_keys(client, service.experiment_id, trial_id) == [f"metric:{trial_id}:1:0:PERIODICAL:{sequence}"]
        (gate / str(sequence)).touch()
    service.cancel_trial_job(trial_id)
    wait_for_status(service, trial_id, "USER_CANCELED")
    assert metric_keys(client, service.experiment_id, trial_id) == []
