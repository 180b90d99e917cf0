"""The projector on a real redis-server: fold, resume, rebuild, state machine, metric dedup."""

from __future__ import annotations

import json
import secrets
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from core import keys
from core.connections import connect, same_server
from core.event_store import EventStore, RawEntry
from core.keys import ViewKeys
from manager.experiments import create_experiment, finish_experiment
from manager.projection import metric_record
from manager.projector import Projector
from manager.replay import SCRATCH_PREFIX
from manager.timeline_views import TimelineBatch
from manager.views import ViewStore
from schemas.compact import compact_record
from schemas.compact import metric_record as compact_metric_record
from schemas.events import ExperimentResumed, TrialAttemptLost, TrialEnded, TrialMetricReported, TrialStarted
from schemas.trial import MetricRecord, TrialJobStatus
from tests.conftest import ServiceFactory, form, metric, stream_entries, wait_until


def write_history(make_service: ServiceFactory) -> tuple[str, str]:
    """A trial that ran, reported metrics (some delivered twice) and ended; then a stale start."""
    service = make_service()
    trial_id = service.submit_trial_job(form(0, x=1)).id
    store = service.store
    exp = service.experiment_id
    store.append(TrialStarted(experiment_id=exp, trial_id=trial_id, attempt=1, working_directory="/w"))
    for sequence in (0, 1, 1, 2, 0):  # redelivered metrics, as after a worker restart
        store.append(metric(exp, trial_id, sequence))
    store.append(metric(exp, trial_id, 0, "FINAL"))
    store.append(metric(exp, trial_id, 0, "FINAL"))
    store.append(
        TrialEnded(experiment_id=exp, trial_id=trial_id, attempt=1, status=TrialJobStatus.SUCCEEDED, exit_code=0)
    )
    store.append(TrialStarted(experiment_id=exp, trial_id=trial_id, attempt=1, working_directory="/late"))
    store.append(TrialEnded(experiment_id=exp, trial_id=trial_id, attempt=1, status=TrialJobStatus.FAILED, exit_code=1))
    return exp, trial_id


def snapshot(client: redis.Redis, experiment_id: str, namespace: str = keys.LOG_PREFIX) -> dict:
    views = ViewStore(client, experiment_id, namespace)
    trials = views.trials()
    return {
        "trials": [trial.to_json() for trial in trials],
        "metrics": {trial.id: [m.to_json() for m in views.metrics(trial.id)] for trial in trials},
        "experiment": views.experiment(),
        "position": views.position(),
    }


def test_fold_keeps_terminal_status_and_counts_each_metric_once(client: redis.Redis, make_service) -> None:
    exp, trial_id = write_history(make_service)
    Projector(client).catch_up(exp)
    views = ViewStore(client, exp)
    trial = views.trial(trial_id)
    assert trial is not None
    assert trial.status is TrialJobStatus.SUCCEEDED  # the stale start and the late FAILED changed nothing
    assert trial.exit_code == 0 and trial.working_directory == "/w"
    assert [(m.type, m.sequence) for m in views.metrics(trial_id)] == [
        ("PERIODICAL", 0),
        ("PERIODICAL", 1),
        ("PERIODICAL", 2),
        ("FINAL", 0),
    ]
    assert len(trial.final_metric_data) == 1 and trial.final_metric == 0.0
    assert views.position() == EventStore(client, exp).head()


def test_a_metric_after_the_end_is_listed_late_and_never_the_result(client: redis.Redis, make_service) -> None:
    """A13: submitted, started, attempt lost (FAILED), then FINAL 0.9: the trial stays FAILED, no result."""
    service = make_service()
    exp, trial_id = service.experiment_id, service.submit_trial_job(form(0)).id
    store = service.store
    store.append(TrialStarted(experiment_id=exp, trial_id=trial_id, attempt=1, working_directory="/w"))
    store.append(metric(exp, trial_id, 0))
    lost = TrialAttemptLost(
        experiment_id=exp, trial_id=trial_id, attempt=1, reason="lease expired", status=TrialJobStatus.FAILED
    )
    store.append(lost)
    store.append(metric(exp, trial_id, 0))  # a redelivery of a metric listed before the end: not late
    store.append(metric(exp, trial_id, 1))  # an intermediate one after the end: late too
    store.append(metric(exp, trial_id, 9, "FINAL"))
    Projector(client).catch_up(exp)
    trial = ViewStore(client, exp).trial(trial_id)
    assert trial is not None and trial.status is TrialJobStatus.FAILED and trial.final_metric is None
    listed = ViewStore(client, exp).metric_records([trial_id])[trial_id]
    assert [(m["type"], m.get("late", False)) for m in listed] == [
        ("PERIODICAL", False),
        ("PERIODICAL", True),
        ("FINAL", True),
    ]


def test_a_restarted_projector_resumes_where_it_stopped(client: redis.Redis, make_service) -> None:
    exp, _trial_id = write_history(make_service)
    store = EventStore(client, exp)
    halfway = store.read()[6].id
    Projector(client).catch_up(exp, until=halfway)
    assert ViewStore(client, exp).position() == halfway
    Projector(client, batch_size=3).catch_up(exp)  # a new process, smaller batches
    resumed = snapshot(client, exp)
    Projector(client, namespace="scratch").rebuild(exp)
    assert snapshot(client, exp, "scratch") == resumed


def test_a_rebuild_gives_identical_views(client: redis.Redis, make_service) -> None:
    exp, _ = write_history(make_service)
    live = Projector(client)
    live.catch_up(exp)
    before = snapshot(client, exp)
    live.rebuild(exp)
    assert snapshot(client, exp) == before
    Projector(client, namespace="scratch").rebuild(exp)
    assert snapshot(client, exp, "scratch") == before


def test_a_rebuild_that_fails_keeps_the_live_views_and_leaves_no_scratch_keys(
    client: redis.Redis, redis_url: str, make_service: ServiceFactory
) -> None:
    """The swap refused by Redis (a user that may not RENAME): the scratch views folded so far are dropped."""
    exp, _ = write_history(make_service)
    Projector(client).catch_up(exp)
    before = snapshot(client, exp)
    user = f"no-rename-{secrets.token_hex(4)}"
    client.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all", "-rename"])
    try:
        with pytest.raises(redis.RedisError, match="rename"):
            Projector(connect(redis_url.replace("redis://", f"redis://{user}:pw@"))).rebuild(exp)
    finally:
        client.acl_deluser(user)
    assert snapshot(client, exp) == before
    assert list(client.scan_iter(match=f"{SCRATCH_PREFIX}*")) == []


def test_two_projectors_at_once_never_apply_an_event_twice(client: redis.Redis, make_service) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    service.store.append_all([metric(service.experiment_id, trial_id, n) for n in range(300)])
    racers = [threading.Thread(target=Projector(client, batch_size=7).catch_up, args=(service.experiment_id,))]
    racers.append(threading.Thread(target=Projector(client, batch_size=11).catch_up, args=(service.experiment_id,)))
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join()
    views = ViewStore(client, service.experiment_id)
    applied = client.hget(views.keys.position, "applied")
    assert applied is not None and int(applied) == service.store.length()
    assert [m.sequence for m in views.metrics(trial_id)] == list(range(300))


def test_unreadable_entries_are_recorded_and_skipped(client: redis.Redis, make_service) -> None:
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    bad = client.xadd(keys.events(service.experiment_id), {"type": "TrialEnded", "json": "garbage"})
    service.store.append(
        TrialStarted(experiment_id=service.experiment_id, trial_id=trial_id, attempt=1, working_directory="/w")
    )
    Projector(client).catch_up(service.experiment_id)
    views = ViewStore(client, service.experiment_id)
    assert list(views.unreadable()) == [bad]
    trial = views.trial(trial_id)
    assert trial is not None and trial.status is TrialJobStatus.RUNNING


def test_the_running_projector_serves_new_events_and_heartbeats(client: redis.Redis, make_service) -> None:
    service = make_service()
    stop = threading.Event()
    runner = threading.Thread(target=Projector(client).run, args=(stop,), kwargs={"block_ms": 100})
    runner.start()
    try:
        trial_id = service.submit_trial_job(form(0)).id
        wait_until(lambda: ViewStore(client, service.experiment_id).trial(trial_id), 5, what="projection")
        assert client.exists(keys.PROJECTOR_HEARTBEAT)
    finally:
        stop.set()
        runner.join(5)
    assert not runner.is_alive()


def test_metric_records_are_stored_compact_and_read_back_as_the_model_writes_them() -> None:
    """The projector stores a metric as a compact array (its hottest line); read back, it is the model's own."""
    for data in ('"0.5"', '"{\\"default\\": 1, \\"note\\": \\"é ✓\\"}"', "3"):
        event = metric("exp1", "tr1", 7, "FINAL").model_copy(update={"data": data, "attempt": 2})
        stored = compact_record(event)
        assert compact_metric_record(stored, "tr1") == json.loads(metric_record(event).to_json())
        assert MetricRecord.model_validate(compact_metric_record(stored, "tr1")) == metric_record(event)
        assert len(stored) + 60 < len(metric_record(event).to_json())
        late = compact_metric_record(compact_record(event, late=True), "tr1")
        assert late == {**json.loads(metric_record(event).to_json()), "late": True}
        old = metric_record(event).to_json()  # views written before the compact form read as ever
        assert compact_metric_record(old, "tr1") == json.loads(old)


def commands_served(client: redis.Redis) -> int:
    """Commands the server has run so far (INFO commandstats), less the INFO that asks."""
    stats: Any = client.info("commandstats")
    return sum(int(entry["calls"]) for entry in stats.values()) + 1


def test_finished_experiments_leave_the_round_until_their_log_grows(client: redis.Redis, tmp_path: Path) -> None:
    finished = []
    for n in range(60):
        experiment_id = create_experiment(client, {"n": n}, tmp_path)
        finish_experiment(
            client, same_server(client, decode=False), experiment_id, "local", ("DONE", "STOPPED", "ERROR")[n % 3]
        )
        finished.append(experiment_id)
    active = [create_experiment(client, {"n": "live"}, tmp_path) for _ in range(2)]
    projector = Projector(client)
    projector.serve_round(block_ms=1)  # the first round folds and sees every experiment
    projector.serve_round(block_ms=1)

    before = commands_served(client)
    projector.serve_round(block_ms=1)
    issued = commands_served(client) - before - 1
    assert issued <= 5 * len(active) + 5, f"an idle round issued {issued} commands for {len(active)} live experiments"

    resumed = finished[7]
    EventStore(client, resumed).append(ExperimentResumed(experiment_id=resumed))
    projector.serve_round(block_ms=1)
    view = ViewStore(client, resumed).experiment()
    assert view is not None and view.status == "RUNNING"
    assert ViewStore(client, resumed).position() == EventStore(client, resumed).head()


def bytes_sent(client: redis.Redis) -> int:
    stats: Any = client.info("stats")
    return int(stats["total_net_output_bytes"])


def test_with_the_projector_down_repeated_reads_fetch_only_what_is_new(client: redis.Redis, make_service) -> None:
    service = make_service()
    exp, trial_id = service.experiment_id, service.submit_trial_job(form(0)).id
    service.store.append_all([metric(exp, trial_id, n) for n in range(2000)])  # no projector: all of it is tail
    tail_bytes = sum(len(fields["json"]) for _, fields in stream_entries(client, keys.events(exp)))
    assert service.list_trial_jobs()[0].status is TrialJobStatus.WAITING

    before = bytes_sent(client)
    assert service.list_trial_jobs()[0].status is TrialJobStatus.WAITING
    assert service.get_trial_job(trial_id).status is TrialJobStatus.WAITING
    assert service.experiment_view().id == exp
    sent = bytes_sent(client) - before
    assert sent < tail_bytes / 10, f"three reads fetched {sent} bytes again of a {tail_bytes}-byte tail"

    service.store.append(TrialStarted(experiment_id=exp, trial_id=trial_id, attempt=1, working_directory="/w"))
    assert service.get_trial_job(trial_id).status is TrialJobStatus.RUNNING  # what is new is still read
    Projector(client).catch_up(exp)
    service.store.append(TrialEnded(experiment_id=exp, trial_id=trial_id, attempt=1, status=TrialJobStatus.FAILED))
    assert [trial.status for trial in service.list_trial_jobs()] == [TrialJobStatus.FAILED]


def test_each_metric_is_projected_once_whatever_the_order_gaps_and_batches(client: redis.Redis, make_service) -> None:
    """Sequences in order, out of order, after gaps, delivered again, across two attempts: the views hold each
    metric once, in the order it first came, however the log is cut into batches; an in-order stream costs one
    range and no per-metric key."""
    import random

    service = make_service()
    exp, store = service.experiment_id, service.store
    trial_id = service.submit_trial_job(form(0, x=1)).id
    store.append(TrialStarted(experiment_id=exp, trial_id=trial_id, attempt=1, working_directory="/w"))
    rng = random.Random(7)
    in_order = list(range(30))
    shuffled = rng.sample(range(100, 140), 40)
    delivered = [*in_order, *rng.choices(in_order, k=10), *shuffled, *rng.choices(shuffled, k=10), 50, 52, 51, 52]
    for sequence in delivered:
        store.append(metric(exp, trial_id, sequence))
    first_seen = list(dict.fromkeys(delivered))
    for batch_size in (1, 3, 17, 2000):
        projector = Projector(client, namespace=f"batches{batch_size}", batch_size=batch_size)
        projector.catch_up(exp)
        views = ViewStore(client, exp, f"batches{batch_size}")
        assert [m.sequence for m in views.metrics(trial_id)] == first_seen, batch_size
        marks: Any = client.hgetall(ViewKeys(exp, f"batches{batch_size}").metric_marks)
        assert marks[f"{trial_id}|1|0|PERIODICAL"].split()[0] == "0"
        outside: Any = client.smembers(ViewKeys(exp, f"batches{batch_size}").metric_keys)
        assert not {f"{trial_id}|1|0|PERIODICAL|{n}" for n in in_order} & set(outside)

    store.append(metric(exp, trial_id, 3))  # the live projector, then more of the same
    Projector(client).catch_up(exp)
    assert [m.sequence for m in ViewStore(client, exp).metrics(trial_id)] == first_seen


def test_a_batch_lists_thousands_of_one_trials_metrics_in_order(client: redis.Redis, make_service) -> None:
    """A batch's records go to their lists in one script call, pushed a thousand at a time (Lua's unpack has a
    limit): a trial reporting more than Lua takes at once in one batch, beside another, lists them all, in order."""
    service = make_service()
    exp, store = service.experiment_id, service.store
    first, second = service.submit_trial_job(form(0, x=1)).id, service.submit_trial_job(form(1, x=2)).id
    store.append_all([metric(exp, first, sequence) for sequence in range(9000)] + [metric(exp, second, 0)])
    Projector(client, batch_size=10_000).catch_up(exp)
    views = ViewStore(client, exp)
    assert [m.sequence for m in views.metrics(first)] == list(range(9000))
    assert [m.sequence for m in views.metrics(second)] == [0]


def test_metrics_known_by_their_keys_of_before_the_ranges_are_not_listed_again(
    client: redis.Redis, make_service
) -> None:
    """Views written before the ranges hold each metric as a `trial|dedup key` member of `metric-keys`: a metric
    delivered again is known by that text, whatever form the projector keys its candidates in."""
    service = make_service()
    exp, store = service.experiment_id, service.store
    trial_id = service.submit_trial_job(form(0, x=1)).id
    view_keys = ViewKeys(exp)
    old = [metric(exp, trial_id, sequence) for sequence in (0, 1, 5)]
    client.sadd(view_keys.metric_keys, *(f"{trial_id}|{event.dedup_key}" for event in old))
    for sequence in (0, 1, 2, 5, 6, 5):
        store.append(metric(exp, trial_id, sequence))
    Projector(client).catch_up(exp)
    assert [m.sequence for m in ViewStore(client, exp).metrics(trial_id)] == [2, 6]
    outside: Any = client.smembers(view_keys.metric_keys)
    assert set(outside) == {f"{trial_id}|1|0|PERIODICAL|{sequence}" for sequence in (5, 6)}


def _views_as_stored(client: redis.Redis, experiment_id: str, namespace: str) -> dict[str, Any]:
    """Every key of the views, named without their namespace, as the bytes Redis holds."""
    raw = same_server(client, decode=False)
    view_keys = ViewKeys(experiment_id, namespace)
    found: dict[str, Any] = {}
    readers: dict[str, Any] = {
        "hash": raw.hgetall,
        "list": lambda name: raw.lrange(name, 0, -1),
        "string": raw.get,
        "set": raw.smembers,
        "zset": lambda name: raw.zrange(name, 0, -1, withscores=True),
    }
    for name in sorted(client.scan_iter(match=view_keys.pattern, count=1000)):
        kind = str(client.type(name))
        value = readers[kind](name)
        found[name[len(view_keys.pattern) - 1 :]] = (kind, value)
    return found


def test_intermediate_metrics_read_without_their_events_project_as_their_events_do(
    client: redis.Redis, make_service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most entries take the projector's fast path (listed, and put on the timeline, without an event): the views,
    timeline and metric marks included, are byte for byte those of the general path (every entry decoded into its
    event), over odd strings, two attempts, redeliveries, gaps, late metrics, a trial not submitted, any batches."""
    service = make_service()
    exp, store = service.experiment_id, service.store
    first, second = service.submit_trial_job(form(0, x=1)).id, service.submit_trial_job(form(1, x=2)).id

    def reported(trial_id: str, sequence: int, attempt: int = 1, parameter_id: str = "0") -> TrialMetricReported:
        data = json.dumps(json.dumps({"default": sequence / 3, "odd": 'q"\\ \u2028 ü 😀 |\t'}))
        return TrialMetricReported(
            experiment_id=exp,
            trial_id=trial_id,
            attempt=attempt,
            source='w|"1"',
            parameter_id=parameter_id,
            metric_type="PERIODICAL",
            sequence=sequence,
            data=data,
        )

    store.append(TrialStarted(experiment_id=exp, trial_id=first, attempt=1, working_directory="/w"))
    store.append(TrialStarted(experiment_id=exp, trial_id=second, attempt=1, working_directory="/w"))
    for sequence in (0, 1, 2, 1, 5, 3, 4, 4, 9):
        store.append(reported(first, sequence, parameter_id="p|é\n"))
        store.append(reported(second, sequence))
    store.append(reported("not-submitted", 0))
    store.append(
        TrialAttemptLost(
            experiment_id=exp, trial_id=first, attempt=1, status=TrialJobStatus.WAITING, reason="gone", time=5
        )
    )
    store.append(reported(first, 10))  # the lost attempt's, listed as its own
    store.append(TrialStarted(experiment_id=exp, trial_id=first, attempt=2, working_directory="/w2"))
    store.append(reported(first, 0, attempt=2))
    store.append(metric(exp, second, 0, "FINAL"))
    store.append(TrialEnded(experiment_id=exp, trial_id=second, attempt=1, status=TrialJobStatus.SUCCEEDED))
    for sequence in (10, 6, 11, 10):
        store.append(reported(second, sequence))  # late
    for batch_size in (1, 4, 2000):
        Projector(client, namespace=f"fast{batch_size}", batch_size=batch_size).catch_up(exp)
    with monkeypatch.context() as patched:
        patched.setattr(RawEntry, "listed", RawEntry.decode)
        Projector(client, namespace="general", batch_size=3).catch_up(exp)
    general = _views_as_stored(client, exp, "general")
    assert {"metrics", "timeline", "metric-marks"} <= {name.partition(":")[0] for name in general}, general.keys()
    for batch_size in (1, 4, 2000):
        assert _views_as_stored(client, exp, f"fast{batch_size}") == general, batch_size


@pytest.mark.parametrize("read_in", ["the batch", "the log the timeline folds"])
def test_a_batch_whose_reads_met_an_entry_that_is_not_utf8_still_yields_to_another_projector(
    client: redis.Redis, make_service, monkeypatch: pytest.MonkeyPatch, read_in: str
) -> None:
    """redis-py drops the connection whose reply fails to decode, and with it the batch's WATCH: another projector's
    batch written meanwhile must still void this one's, or both are applied. The entry is read in the batch itself,
    or in the log up to the position, which the timeline folds where views were projected before it was kept."""
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    service.store.append_all([metric(service.experiment_id, trial_id, n) for n in range(5)])
    raw = same_server(client, decode=False)
    raw.xadd(keys.events(service.experiment_id), {"type": "TrialStarted", "trial": trial_id, "json": b"\xff"})
    if read_in == "the log the timeline folds":
        Projector(client).catch_up(service.experiment_id)
        client.hdel(ViewKeys(service.experiment_id).timeline, "header")  # as views projected before timelines
    service.store.append_all([metric(service.experiment_id, trial_id, n) for n in range(5, 10)])
    overtaken: list[str] = []
    read_timeline = TimelineBatch.read

    def read_then_overtaken(*args: Any) -> TimelineBatch:
        """The batch's reads done: another projector catches up before this one writes."""
        batch = read_timeline(*args)
        if not overtaken:
            overtaken.append(service.experiment_id)
            Projector(client).catch_up(service.experiment_id)
        return batch

    monkeypatch.setattr(TimelineBatch, "read", read_then_overtaken)
    Projector(client).catch_up(service.experiment_id)
    assert overtaken
    views = ViewStore(client, service.experiment_id)
    applied = client.hget(views.keys.position, "applied")
    assert applied is not None and int(applied) == service.store.length()
    assert [m.sequence for m in views.metrics(trial_id)] == list(range(10))
    assert len(list(views.unreadable())) == 1
