"""The timeline's fold (manager.timeline): lanes, attempts, retries, re-attachments, UNKNOWN periods, clusters, and
the trial table at any point, which must be what `replay --until` shows there (checked on a real redis-server)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

import pytest
import redis

from core.event_store import EventStore, encode_event
from manager.projector import Projector
from manager.replay import check, replayed
from manager.timeline import MAX_ATTEMPTS, Timeline
from manager.timeline_page import attempt_detail, file_data, file_page, served_page
from manager.timeline_views import restore
from manager.transfer import LogFile, import_log
from manager.views import ViewStore
from schemas.events import (
    Event,
    ExperimentCreated,
    ExperimentFinished,
    ExperimentResumed,
    TrialAttemptLost,
    TrialCancelRequested,
    TrialEnded,
    TrialMetricReported,
    TrialReattached,
    TrialStarted,
    TrialUnreachable,
)
from schemas.trial import TrialJobStatus, metric_score
from tests.manager.test_projection import submitted
from tests.support.experiment_log import START_MS, synthetic_log

S = TrialJobStatus
EXP, TRIAL = "exp1", "t1"  # as tests.manager.test_projection builds its events


def entries(events: Iterable[Event], start: int = START_MS) -> list[tuple[str, dict[str, str]]]:
    """Log entries one second apart."""
    return [(f"{start + 1000 * index}-0", encode_event(event)) for index, event in enumerate(events)]


def trial_event(kind: type[Any], **fields: Any) -> Any:
    return kind(experiment_id=EXP, trial_id=TRIAL, **fields)


def started(attempt: int, worker: str, url: str | None = None) -> TrialStarted:
    return trial_event(TrialStarted, attempt=attempt, source=worker, working_directory="/w", url=url)


def metric(attempt: int, sequence: int, kind: str = "PERIODICAL", value: float = 0.5) -> TrialMetricReported:
    return trial_event(
        TrialMetricReported, attempt=attempt, parameter_id="0", metric_type=kind, sequence=sequence, data=f'"{value}"'
    )


# what a trial's history looks like on the timeline: a remote attempt cut off, taken over by another worker,
# lost, then retried on a local worker where it ends with a result
HISTORY: list[Event] = [
    submitted().model_copy(update={"platform": "remote"}),
    started(1, "w1", "ssh://u@10.0.0.2:22/home/u/x"),
    metric(1, 0),
    trial_event(TrialUnreachable, attempt=1, reason="10.0.0.2 unreachable"),
    trial_event(TrialUnreachable, attempt=1, reason=None),
    trial_event(TrialReattached, attempt=1, source="w2"),
    metric(1, 1),
    trial_event(TrialAttemptLost, attempt=1, worker="w2", reason="lease expired", status=S.WAITING),
    trial_event(TrialEnded, attempt=1, status=S.FAILED),  # late, from the lost attempt: changes nothing
    started(2, "w3", "ssh://u@10.0.0.3:22/home/u/x"),
    metric(2, 0),
    metric(2, 1, "FINAL", 0.93),
    trial_event(TrialEnded, attempt=2, status=S.SUCCEEDED, exit_code=0),
]


def test_an_attempt_is_drawn_where_it_ran_with_its_unknown_period_its_takeover_and_its_retry() -> None:
    timeline = Timeline(EXP)
    assert timeline.feed(entries(HISTORY)) == len(HISTORY)
    window = timeline.window()
    lanes = {lane["id"]: lane["label"] for lane in window["lanes"]}
    first, second = window["attempts"]
    assert (first["key"], first["outcome"], first["message"]) == ("t1/1", "LOST", "lease expired")
    assert [lanes[s["lane"]] for s in first["segments"]] == [
        "remote · 10.0.0.2:22 · worker w1",
        "remote · 10.0.0.2:22 · worker w2",
    ]
    assert first["segments"][0]["to"] == first["segments"][1]["from"] == START_MS + 5000  # the takeover
    assert first["unknown"] == [[START_MS + 3000, START_MS + 4000]]
    assert (first["ended"], first["metrics"]) == (START_MS + 7000, 2)
    assert (second["key"], second["outcome"], second["retryOf"]) == ("t1/2", "SUCCEEDED", "t1/1")
    assert second["submitted"] == START_MS + 7000  # waiting again from the loss
    assert [lanes[s["lane"]] for s in second["segments"]] == ["remote · 10.0.0.3:22 · worker w3"]
    assert second["events"] == [[START_MS + 10000, "PERIODICAL"], [START_MS + 11000, "FINAL"]]


def test_a_trial_canceled_before_it_started_is_drawn_in_its_platform_s_not_started_lane() -> None:
    timeline = Timeline(EXP)
    timeline.feed(
        entries(
            [
                submitted(),
                trial_event(TrialCancelRequested, status=S.USER_CANCELED),
                trial_event(TrialEnded, attempt=1, status=S.USER_CANCELED),
            ]
        )
    )
    [attempt] = timeline.window()["attempts"]
    assert attempt["outcome"] == "USER_CANCELED" and attempt["started"] is None
    lane = timeline.window()["lanes"][attempt["segments"][0]["lane"]]
    assert lane["label"] == "local · not started" and lane["worker"] is None
    assert attempt["events"] == [[START_MS + 1000, "cancel"]]


def test_a_running_and_a_cut_off_attempt_stay_open_to_the_head() -> None:
    timeline = Timeline(EXP)
    timeline.feed(entries(HISTORY[:4]))
    [attempt] = timeline.window()["attempts"]
    assert attempt["outcome"] == "UNKNOWN" and attempt["unknown"] == [[START_MS + 3000, None]]
    assert attempt["segments"][-1]["to"] is None and attempt["ended"] is None
    timeline.feed(entries(HISTORY[4:5], start=START_MS + 4000))  # fed later, as a live page is
    assert timeline.window()["attempts"][0]["outcome"] == "RUNNING"


def test_entries_already_folded_are_skipped() -> None:
    timeline = Timeline(EXP)
    timeline.feed(entries(HISTORY[:5]))
    assert timeline.feed(entries(HISTORY)) == len(HISTORY) - 5
    assert timeline.views() == _folded_at_once(HISTORY).views()


def _folded_at_once(events: list[Event]) -> Timeline:
    timeline = Timeline(EXP)
    timeline.feed(entries(events))
    return timeline


def test_an_attempt_s_detail_is_its_trial_s_history_and_its_own_metrics() -> None:
    log = entries(HISTORY)
    timeline = _folded_at_once(HISTORY)
    by_id = dict(log)
    trial_entries = [(entry_id, by_id[entry_id]) for entry_id in timeline.entry_ids(TRIAL)]
    detail = attempt_detail(timeline, TRIAL, 2, trial_entries, {"error": "none here"})
    assert [line["type"] for line in detail["history"]] == [f["type"] for _, f in log]
    assert [(m["type"], m["sequence"], m["value"]) for m in detail["metrics"]] == [
        ("PERIODICAL", 0, 0.5),
        ("FINAL", 1, 0.93),
    ]
    with pytest.raises(LookupError):
        attempt_detail(timeline, TRIAL, 3, trial_entries, None)
    with pytest.raises(LookupError):
        timeline.entry_ids("nope")


def test_a_zoomed_out_window_over_many_attempts_comes_as_clusters_that_count_them_all() -> None:
    trials = MAX_ATTEMPTS + 500
    timeline = Timeline("big")
    timeline.feed(synthetic_log("big", trials, metrics=1, lost_every=100))
    whole = timeline.window(px=1000)
    assert whole["attempts"] == [] and whole["clusters"]
    assert sum(cluster["count"] for cluster in whole["clusters"]) == trials + trials // 100  # retries too
    assert sum(c["outcomes"].get("LOST", 0) for c in whole["clusters"]) == trials // 100
    assert len(whole["lanes"]) == 8
    zoomed = timeline.window(whole["start"], whole["start"] + 10_000)
    assert zoomed["clusters"] == [] and 0 < len(zoomed["attempts"]) <= 40  # 3 s waves of 8
    assert zoomed["markersOmitted"] == 0 and any(a["events"] for a in zoomed["attempts"])


def _position(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def _table_at(views: dict[str, Any], position: tuple[int, int]) -> dict[str, tuple[str, int, float | None]]:
    """The trial table at `position` from the views' change lists, as the page computes it."""
    table = {}
    for trial_id, changes in views["trials"].items():
        before = [change for change in changes if _position(change[0]) <= position]
        if before:
            table[trial_id] = (before[-1][1], before[-1][2], before[-1][3])
    return table


def test_the_table_at_any_point_is_what_replay_until_shows_there(client: redis.Redis) -> None:
    """Retries of lost attempts included; the positions are every view change (a dozen of them replayed)."""
    import_log(client, LogFile("replayed", list(synthetic_log("replayed", 24, metrics=2, workers=4, lost_every=5)), {}))
    timeline = Timeline("replayed")
    timeline.feed((entry.id, entry.fields) for entry in EventStore(client, "replayed").raw_range())
    views = timeline.views()
    points = sorted({change[0] for changes in views["trials"].values() for change in changes}, key=_position)
    assert any(change[1] == "WAITING" and change[2] == 2 for changes in views["trials"].values() for change in changes)
    for point in [*points[:: max(1, len(points) // 12)], points[-1]]:
        with replayed(client, "replayed", point) as replay:
            trials = ViewStore(client, "replayed", replay.namespace).trials()
        expected = {trial.id: (str(trial.status), trial.attempt, metric_score(trial.final_metric)) for trial in trials}
        assert _table_at(views, _position(point)) == expected, point


MARKUP = "</script><img src=x onerror=alert(1)><!-- \u2028"


def test_trial_text_in_the_offline_file_stays_data_and_only_its_own_scripts_may_run() -> None:
    events = [*HISTORY[:2], trial_event(TrialEnded, attempt=1, status=S.FAILED, message=MARKUP)]
    log = entries(events)
    page = file_page({"mode": "file", "experimentId": EXP}, file_data(EXP, log, "log " + MARKUP, {}))
    assert MARKUP not in page
    found = re.search(r'<script id="timeline-data" type="application/json">(.*?)</script>', page, re.S)
    assert found is not None and "<" not in found.group(1)  # nothing in the data can end its element
    data = json.loads(found.group(1))
    assert data["timeline"]["attempts"][0]["message"] == MARKUP
    assert gzip.decompress(base64.b64decode(data["log"])).decode() == "log " + MARKUP
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', page)
    assert csp is not None and "connect-src 'none'" in csp.group(1)
    inline = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(inline) == 2  # echarts and the page's own code, nothing else runs
    for script in inline:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp.group(1)


def test_the_served_page_loads_its_scripts_from_the_manager_alone() -> None:
    page = served_page(
        {"mode": "server", "experimentId": EXP, "api": "/api/v1/experiments/" + EXP}, "/p/timeline/assets/"
    )
    assert re.findall(r'<script src="([^"]+)"', page) == [
        "/p/timeline/assets/echarts.min.js",
        "/p/timeline/assets/timeline.js",
    ]
    assert "<script>" not in page


def test_a_resume_of_an_experiment_its_runner_never_ended_is_marked_as_a_takeover() -> None:
    created = ExperimentCreated(experiment_id=EXP, config={}, working_directory="/w")
    events: list[Event] = [
        created,
        ExperimentResumed(experiment_id=EXP),  # RUNNING: the runner before it crashed or lost its claim
        ExperimentFinished(experiment_id=EXP, status="STOPPED"),
        ExperimentResumed(experiment_id=EXP),  # a stopped experiment taken up again
    ]
    timeline = Timeline(EXP)
    timeline.feed(entries(events))
    assert [(m["kind"], m["text"]) for m in timeline.window()["markers"]] == [
        ("ExperimentCreated", "created"),
        ("ExperimentResumed", "taken over: its runner had stopped without ending it (crashed, or lost its claim)"),
        ("ExperimentFinished", "STOPPED"),
        ("ExperimentResumed", "resumed"),
    ]


# the timeline the projector keeps (manager.timeline_views): what a first look reads instead of the whole log


def _kept_log(client: redis.Redis, experiment_id: str) -> list[str]:
    """A log with lost and retried attempts, then a trial cut off, taken over, lost and retried (HISTORY); its ids."""
    import_log(client, LogFile(experiment_id, list(synthetic_log(experiment_id, 12, metrics=3, lost_every=5)), {}))
    store = EventStore(client, experiment_id)
    for event in HISTORY:
        store.append(event.model_copy(update={"experiment_id": experiment_id}))
    return [entry.id for entry in store.raw_range()]


def _fresh(client: redis.Redis, experiment_id: str, until: str = "+") -> Timeline:
    timeline = Timeline(experiment_id)
    timeline.feed((entry.id, entry.fields) for entry in EventStore(client, experiment_id).raw_range("-", until))
    return timeline


def _assert_same(kept: Timeline | None, fresh: Timeline) -> None:
    assert kept is not None
    assert (kept.head, kept.start, kept.end) == (fresh.head, fresh.start, fresh.end)
    assert kept.window(px=1400) == fresh.window(px=1400)
    assert kept.window(cluster=False) == fresh.window(cluster=False)  # every attempt, every marker
    assert kept.views() == fresh.views()
    for trial_id in fresh.trials:
        assert kept.entry_ids(trial_id) == fresh.entry_ids(trial_id)


def test_the_timeline_the_projector_keeps_is_the_fold_of_its_log_whatever_its_batches(client: redis.Redis) -> None:
    """Batches of 7 entries split trials, attempts and metrics between them; a reader restores the kept fold at
    the views' position and folds only what follows; `replay --check` (batches of 2,000) finds no difference."""
    ids = _kept_log(client, "kept")
    middle = ids[len(ids) // 2]
    Projector(client, batch_size=7).catch_up("kept", until=middle)
    halfway = restore(client, "kept")
    _assert_same(halfway, _fresh(client, "kept", middle))
    assert halfway is not None
    halfway.feed((entry.id, entry.fields) for entry in EventStore(client, "kept").raw_range(f"({middle}"))
    _assert_same(halfway, _fresh(client, "kept"))  # as a page catches up with the log

    Projector(client, batch_size=7).catch_up("kept")
    kept = restore(client, "kept")
    _assert_same(kept, _fresh(client, "kept"))
    assert kept is not None and kept.attempt(TRIAL, 1).unknown == [[_position(ids[-10])[0], _position(ids[-9])[0]]]
    assert check(client, "kept") == []


def test_views_projected_before_the_timeline_was_kept_get_it_from_their_log(client: redis.Redis) -> None:
    """A projector that meets views without a timeline (an older version's) folds the log up to their position
    once and keeps it from there; until then a reader is told there is none (and folds the log itself)."""
    ids = _kept_log(client, "older")
    Projector(client, batch_size=50).catch_up("older", until=ids[len(ids) // 3])
    older = [str(name) for name in client.scan_iter(match="ts:view:older:timeline*")]
    assert older and client.delete(*older)
    assert restore(client, "older") is None
    Projector(client, batch_size=50).catch_up("older")
    _assert_same(restore(client, "older"), _fresh(client, "older"))
    assert check(client, "older") == []
