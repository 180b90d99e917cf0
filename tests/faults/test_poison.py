"""Poison input: entries that cannot be read, and events whose fold raises, are recorded and skipped.

A running projector never stops on them: it records each in the `unreadable` view, with why, in the
same transaction as the position that passes it, and goes on with the events after it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from core import keys
from core.event_store import EventStore, UnreadableEvent, encode_event
from core.variables import REDIS_URL_ENV
from manager.projection import apply_to_experiment, apply_to_trial
from manager.projector import Projector
from manager.replay import read_log
from manager.transfer import export_log
from manager.views import ViewStore
from schemas.events import ClusterMetadataSet, TrialEnded, TrialMetricReported, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import REPO, Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.faults.test_fault_redis import assert_views_match_rebuild


def started(experiment_id: str, trial_id: str) -> TrialStarted:
    return TrialStarted(experiment_id=experiment_id, trial_id=trial_id, attempt=1, working_directory="/w")


def final(experiment_id: str, trial_id: str, sequence: int, value: float) -> TrialMetricReported:
    return TrialMetricReported(
        experiment_id=experiment_id,
        trial_id=trial_id,
        attempt=1,
        parameter_id="0",
        metric_type="FINAL",
        sequence=sequence,
        data=json.dumps(json.dumps(value)),
    )


def ended(experiment_id: str, trial_id: str) -> TrialEnded:
    return TrialEnded(
        experiment_id=experiment_id, trial_id=trial_id, attempt=1, status=TrialJobStatus.SUCCEEDED, exit_code=0
    )


def wait_for_head(client: redis.Redis, experiment_id: str) -> None:
    head = EventStore(client, experiment_id).head()
    wait_until(lambda: ViewStore(client, experiment_id).position() == head, 20, what="the projector to pass the head")


def test_unreadable_entries_are_recorded_and_skipped_by_a_running_projector(
    client: redis.Redis, redis_url: str, make_service: ServiceFactory, processes: Processes
) -> None:
    service = make_service()
    exp = service.experiment_id
    trial_id = service.submit_trial_job(form(0)).id
    projector = processes.projector()
    stream = keys.events(exp)
    raw = redis.Redis.from_url(redis_url)  # bytes in, bytes out
    future = json.loads(encode_event(started(exp, trial_id))["json"]) | {"v": 99}
    bad: dict[str, Any] = {  # entry ids, as the decoding client answers (redis-py types them bytes | str)
        "corrupt JSON": client.xadd(stream, {"type": "TrialStarted", "trial": trial_id, "json": '{"type": "Tri'}),
        "no json field": client.xadd(stream, {"type": "TrialStarted", "trial": trial_id}),
        "unknown type": client.xadd(
            stream, {"type": "TrialTeleported", "json": json.dumps({"type": "TrialTeleported", "v": 1})}
        ),
        "future version": client.xadd(stream, {"type": "TrialStarted", "trial": trial_id, "json": json.dumps(future)}),
        "not UTF-8": cast(
            bytes, raw.xadd(stream, {"type": "TrialStarted", "trial": trial_id, "json": b'{"\xff\xfe"}'})
        ).decode(),
        "nested too deep": client.xadd(stream, {"type": "TrialStarted", "json": "[" * 100_000 + "]" * 100_000}),
        "lone surrogate": client.xadd(  # workers refuse it; read, no UTF-8 view could hold it
            stream, {"type": "TrialMetricReported", "trial": trial_id, "json": '[2,5,"w",1,"0","P",0,"\\ud800"]'}
        ),
    }
    service.store.append(started(exp, trial_id))  # the events after the poison are applied
    service.store.append(final(exp, trial_id, 0, 0.5))
    other = service.submit_trial_job(form(1)).id
    service.store.append(started(exp, other))
    wait_for_head(client, exp)  # the timeline is kept from here on: the next batch reads it
    end = encode_event(ended(exp, other))["json"]
    bad["an end without its trial field"] = client.xadd(stream, {"type": "TrialEnded", "json": end})  # by hand
    service.store.append(final(exp, trial_id, 1, 0.75))
    wait_for_head(client, exp)

    views = ViewStore(client, exp)
    unreadable = views.unreadable()
    assert sorted(unreadable) == sorted(bad.values())
    assert "'json'" in unreadable[bad["no json field"]]
    assert "not UTF-8" in unreadable[bad["not UTF-8"]]
    assert all(unreadable.values())
    trial = views.trial(trial_id)
    assert trial is not None and trial.status is TrialJobStatus.RUNNING and trial.final_metric == 0.75
    assert [(m.type, m.sequence) for m in views.metrics(trial_id)] == [("FINAL", 0), ("FINAL", 1)]
    assert "lone surrogate" in unreadable[bad["lone surrogate"]]
    assert unreadable[bad["an end without its trial field"]] == f"its trial field None is not its trial {other!r}"
    assert projector.poll() is None, processes.logs()
    assert_views_match_rebuild(client, exp)  # a rebuild skips exactly the same entries


# A projector whose trial fold has a bug: it raises on FINAL metrics with sequence 666.
POISONED_FOLD = """
import manager.projector as projector

fold = projector.apply_to_trial


def poisoned(view, event):
    if getattr(event, "metric_type", None) == "FINAL" and event.sequence == 666:
        raise RuntimeError("fold bug: cannot handle sequence 666")
    return fold(view, event)


projector.apply_to_trial = poisoned
"""


def test_an_event_whose_fold_raises_is_recorded_and_skipped_by_a_running_projector(
    client: redis.Redis,
    make_service: ServiceFactory,
    processes: Processes,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = make_service()
    exp = service.experiment_id
    trial_id = service.submit_trial_job(form(0)).id
    (tmp_path / "poisoned.py").write_text(textwrap.dedent(POISONED_FOLD))
    launcher = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import poisoned; from manager.cli import main; main()"
    )
    with (tmp_path / "projector.log").open("wb") as log:
        projector = subprocess.Popen(
            [sys.executable, "-c", launcher, "projector"],
            env={**os.environ, REDIS_URL_ENV: processes.redis_url},
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    processes.running.append(projector)  # stopped at teardown
    store = service.store
    store.append(started(exp, trial_id))
    poison = store.append(final(exp, trial_id, 666, 9.0))
    store.append(final(exp, trial_id, 0, 0.5))
    store.append(ended(exp, trial_id))
    wait_for_head(client, exp)

    views = ViewStore(client, exp)
    assert list(views.unreadable()) == [poison]
    assert views.unreadable()[poison] == "fold failed: RuntimeError: fold bug: cannot handle sequence 666"
    trial = views.trial(trial_id)
    assert trial is not None and trial.status is TrialJobStatus.SUCCEEDED
    assert trial.final_metric == 0.5 and len(trial.final_metric_data) == 1  # the poisoned metric counts nowhere
    assert [(m.type, m.sequence) for m in views.metrics(trial_id)] == [("FINAL", 0)]
    assert not any("666" in key for key in client.smembers(views.keys.metric_keys))
    assert projector.poll() is None, (tmp_path / "projector.log").read_text()

    monkeypatch.setattr("manager.projector.apply_to_trial", poisoned_trial_fold)
    assert_views_match_rebuild(client, exp)  # the same code rebuilds the same views, poison skipped


def poisoned_trial_fold(view: Any, event: Any) -> Any:
    """POISONED_FOLD's fold, for this process."""
    if getattr(event, "metric_type", None) == "FINAL" and event.sequence == 666:
        raise RuntimeError("fold bug: cannot handle sequence 666")
    return apply_to_trial(view, event)


def test_an_experiment_fold_that_raises_is_skipped_too(client: redis.Redis, make_service, monkeypatch) -> None:
    service = make_service()

    def poisoned(view: Any, event: Any) -> Any:
        if isinstance(event, ClusterMetadataSet) and event.key == "poison":
            raise ValueError("cannot fold this")
        return apply_to_experiment(view, event)

    monkeypatch.setattr("manager.projector.apply_to_experiment", poisoned)
    poison = service.store.append(ClusterMetadataSet(experiment_id=service.experiment_id, key="poison", value="x"))
    service.store.append(ClusterMetadataSet(experiment_id=service.experiment_id, key="after", value="y"))
    Projector(client).catch_up(service.experiment_id)
    views = ViewStore(client, service.experiment_id)
    assert views.unreadable() == {poison: "fold failed: ValueError: cannot fold this"}
    experiment = views.experiment()
    assert experiment is not None and "poison" not in experiment.metadata and experiment.metadata["after"] == "y"


def test_views_that_cannot_be_updated_stall_only_their_experiment(
    client: redis.Redis, make_service: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Not an event but the views themselves (here a corrupt trial view): logged once, the others go on."""
    caplog.set_level(logging.WARNING, logger="manager.projector")
    broken, healthy = make_service(), make_service()
    broken_trial = broken.submit_trial_job(form(0)).id
    healthy_trial = healthy.submit_trial_job(form(0)).id
    stop = threading.Event()
    runner = threading.Thread(target=Projector(client).run, args=(stop,), kwargs={"block_ms": 50})
    runner.start()
    try:
        wait_for_head(client, broken.experiment_id)
        client.hset(ViewStore(client, broken.experiment_id).keys.trials, broken_trial, "{corrupt")
        broken.store.append(started(broken.experiment_id, broken_trial))
        wait_until(lambda: "cannot update its views" in caplog.text, 10, what="the failure to be logged")
        healthy.store.append(started(healthy.experiment_id, healthy_trial))
        wait_for_head(client, healthy.experiment_id)
        assert runner.is_alive()
        assert caplog.text.count("cannot update its views") == 1  # retried each round, logged once

        Projector(client).rebuild(broken.experiment_id)  # the repair: views are disposable
        broken.store.append(final(broken.experiment_id, broken_trial, 0, 1.0))
        wait_for_head(client, broken.experiment_id)
        wait_until(lambda: "views updated again" in caplog.text, 10, what="the recovery to be logged")
    finally:
        stop.set()
        runner.join(10)
    assert not runner.is_alive()
    trial = ViewStore(client, broken.experiment_id).trial(broken_trial)
    assert trial is not None and trial.status is TrialJobStatus.RUNNING and trial.final_metric == 1.0


def test_an_invalid_event_in_a_batch_stores_none_of_the_batch(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    stray = ClusterMetadataSet(experiment_id="other", key="k", value="v")
    good = ClusterMetadataSet(experiment_id="exp1", key="k", value="v")
    with pytest.raises(ValueError, match="appended to exp1"):
        store.append_all([good, stray, good])
    assert store.length() == 0


def test_an_entry_that_is_not_utf8_breaks_no_reader(
    redis_url: str, make_service: ServiceFactory, processes: Processes
) -> None:
    service = make_service("sleep 30")
    worker = processes.worker()  # the default lease (10 s): a cancel must reach the trial through its watcher
    try:
        trial_id = service.submit_trial_job(form(0)).id
        wait_for_status(service, trial_id, "RUNNING")
        raw = redis.Redis.from_url(redis_url)
        raw.xadd(keys.events(service.experiment_id), {"type": "X", "trial": trial_id, "json": b"\xff"})
        service.cancel_trial_job(trial_id)  # reads the log past the views (no projector here): steps over the entry
        trial = wait_for_status(service, trial_id, "USER_CANCELED", "FAILED", timeout=8)
        assert trial.status is TrialJobStatus.USER_CANCELED and "lost" not in (trial.message or ""), trial.message
        client = service.store.client  # the inspection commands read it too: `events`, `--history`, `export`
        unreadable = [e for e in read_log(client, service.experiment_id) if isinstance(e, UnreadableEvent)]
        assert [e.error.split(":")[0] for e in unreadable] == ["not UTF-8"]
        exported = io.StringIO()
        assert export_log(client, service.experiment_id, exported) == service.store.length()
        assert "\\xff" in exported.getvalue()  # moved backslash-escaped: still unreadable after an import
    finally:
        worker.kill()  # not a warm shutdown that waits for the trial: its keeper kills it
