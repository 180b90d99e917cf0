"""Old logs stay readable: a log stored by the v1 schemas projects to the views v1 produced.

tests/data/log-v1.jsonl was recorded with real trials before events moved to v2 (a success, a
failure, a multi-phase update, a cancel); tests/data/log-v1-views.json is what v1 projected from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from core import keys
from core.event_store import EventStore, StoredEvent, UnreadableEvent, decode_entry
from manager.projector import Projector
from manager.views import ViewStore
from schemas.events import TrialEnded, TrialMetricReported, TrialStarted
from schemas.upcasters import upcast

DATA = Path(__file__).parents[1] / "data"


def stored_v1_log(client: redis.Redis) -> str:
    """Write the stored log's entries, with their original ids, into this Redis."""
    lines = [json.loads(line) for line in (DATA / "log-v1.jsonl").read_text().splitlines()]
    experiment_id = lines[0]["experimentId"]
    for line in lines[1:-1]:
        client.xadd(keys.events(experiment_id), line["fields"], id=line["id"])
    return str(experiment_id)


def test_every_v1_entry_reads_as_a_current_event(client: redis.Redis) -> None:
    experiment_id = stored_v1_log(client)
    entries = EventStore(client, experiment_id).read()
    assert len(entries) == 29
    assert all(isinstance(entry, StoredEvent) for entry in entries)
    events = [entry.event for entry in entries if isinstance(entry, StoredEvent)]
    upgraded = [e for e in events if isinstance(e, TrialStarted | TrialMetricReported | TrialEnded)]
    assert len(upgraded) == 19  # 4 starts, 11 metrics, 4 ends
    assert {(e.v, e.attempt) for e in upgraded} == {(2, 1)}


def test_a_v1_log_projects_to_the_views_v1_produced(client: redis.Redis) -> None:
    experiment_id = stored_v1_log(client)
    Projector(client).rebuild(experiment_id)
    views = {trial.id: json.loads(trial.to_json()) for trial in ViewStore(client, experiment_id).trials()}

    expected: dict[str, Any] = json.loads((DATA / "log-v1-views.json").read_text())
    for view in expected.values():  # what v2 adds: every v1 run was attempt 1
        view["attempt"] = 1
        for record in view["finalMetricData"]:
            record["attempt"] = 1
    assert views == expected
    assert {view["status"] for view in views.values()} == {"SUCCEEDED", "FAILED", "USER_CANCELED"}


def test_upcasting_leaves_current_and_unknown_versions_alone() -> None:
    current = {"type": "TrialEnded", "v": 2, "attempt": 3}
    assert upcast(current) is current
    assert upcast({"type": "TrialStarted", "v": 1})["attempt"] == 1
    future = {"type": "TrialEnded", "v": 9}
    assert upcast(future) is future


def test_an_unknown_future_version_is_unreadable_not_guessed() -> None:
    stored = {"experimentId": "e", "trialId": "t", "type": "TrialEnded", "v": 9, "attempt": 1, "status": "SUCCEEDED"}
    entry = decode_entry("1-0", {"type": "TrialEnded", "trial": "t", "json": json.dumps(stored)}, "e")
    assert isinstance(entry, UnreadableEvent)
    assert "v" in entry.error
