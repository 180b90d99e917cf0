"""A worker's report whose transaction ran but whose answer was lost (the connection dropped before the reply) is
sent again, and lands once: every report a trial's control makes carries an idempotency key, the rare ones
(unreachable, deferred, a metric rejected) as much as its start and its metrics."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from core import keys
from core.connections import connect
from core.event_store import StoredEvent
from core.platform import ParsedMetric
from tests.conftest import ServiceFactory, form
from tests.support.reply_dropper import ReplyDropper
from tests.workers.test_trial_links import _control
from workers.runtime.control import LogTrialControl

METRIC = ParsedMetric("p0", "PERIODICAL", 0, json.dumps("0.5"))  # NNI's data: the JSON of the JSON-encoded value


@pytest.fixture
def dropper(redis_proc: Any) -> Iterator[ReplyDropper]:
    proxy = ReplyDropper(redis_proc.port)
    yield proxy
    proxy.close()


def test_each_report_whose_answer_was_lost_lands_once(make_service: ServiceFactory, dropper: ReplyDropper) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    client = connect(dropper.url)
    control = _control(client, service, trial_id)
    reports: list[tuple[str, Callable[[LogTrialControl], None]]] = [
        ("TrialStarted", lambda control: control.started("/tmp/trial")),
        ("TrialUnreachable", lambda control: control.unreachable("the host does not answer")),
        ("TrialUnreachable", lambda control: control.unreachable(None)),  # reachable again: a report of its own
        ("TrialDeferred", lambda control: control.waiting("waiting for 1 free GPU")),
        ("TrialMetricRejected", lambda control: control.rejected("a metric that is not JSON")),
        ("TrialMetricReported", lambda control: control.metrics([METRIC])),
    ]
    try:
        for number, (_, report) in enumerate(reports, start=1):
            dropper.arm()
            report(control)
            assert dropper.dropped == number, "the answer of the report's transaction was not lost"
    finally:
        control.close()
    logged: Counter[str] = Counter(
        entry.event.type
        for entry in service.store.read()
        if isinstance(entry, StoredEvent) and getattr(entry.event, "trial_id", None) == trial_id
    )
    assert {kind: logged[kind] for kind, _ in reports} == Counter(kind for kind, _ in reports)
    held: Any = client.hkeys(keys.idempotency(service.experiment_id))
    reports_held = [key for key in held if key.split(":")[0] in ("unreachable", "deferred", "rejected")]
    assert len(reports_held) == 1, held  # each report's key goes with the next: one is kept, the last
    client.close()


def test_the_dropper_loses_an_answer_the_client_then_sends_again(dropper: ReplyDropper, client: redis.Redis) -> None:
    """The fixture itself: a transaction through it runs twice when its first answer is lost (what the keys guard)."""
    proxied = connect(dropper.url)
    dropper.arm()
    with proxied.pipeline(transaction=True) as pipe:
        pipe.incr("reply-dropper:count")
        pipe.execute()
    assert dropper.dropped == 1
    assert client.get("reply-dropper:count") == "2"
    proxied.close()
