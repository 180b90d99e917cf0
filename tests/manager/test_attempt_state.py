"""State that only serves a running attempt goes when the attempt ends: the log and the views stay."""

from __future__ import annotations

from typing import Any

import redis

from core import keys
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
    wait_until(lambda: len(metric_keys(client, service.experiment_id, trial_id)) == 5, what="5 metrics appended")
    service.cancel_trial_job(trial_id)
    assert wait_for_status(service, trial_id, "USER_CANCELED").status is TrialJobStatus.USER_CANCELED

    assert metric_keys(client, service.experiment_id, trial_id) == []
    Projector(client).catch_up(service.experiment_id)
    assert [m.sequence for m in service.views.metrics(trial_id)] == [0, 1, 2, 3, 4]  # the log keeps them all
    assert client.hexists(keys.idempotency(service.experiment_id), f"submit:{trial_id}")  # finds the trial
