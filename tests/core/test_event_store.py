"""The event log on a real redis-server: order, idempotency, validation, unreadable entries."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis

from core import event_store, keys
from core.event_store import AppendFenced, EventStore, Fence, StoredEvent, UnreadableEvent, stream_position
from schemas.compact import compact_metrics
from schemas.events import (
    EVENT_ADAPTER,
    ClusterMetadataSet,
    ExperimentImported,
    TrialCancelRequested,
    TrialMetricReported,
)
from schemas.trial import TrialJobStatus
from tests.core.test_schemas import COMMON, EVENTS


def metadata(key: str, value: str = "v") -> ClusterMetadataSet:
    return ClusterMetadataSet(experiment_id="exp1", key=key, value=value)


def test_appends_are_read_back_in_order(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    ids = [store.append(metadata(f"k{i}")) for i in range(5)]
    entries = store.read()
    assert [entry.id for entry in entries] == ids
    stored = [entry.event for entry in entries if isinstance(entry, StoredEvent)]
    assert [event.key for event in stored if isinstance(event, ClusterMetadataSet)] == [f"k{i}" for i in range(5)]
    assert [stream_position(i) for i in ids] == sorted(stream_position(i) for i in ids)
    assert [entry.id for entry in store.read(after=ids[1], until=ids[3])] == ids[2:4]
    assert store.head() == ids[-1]


def test_a_retried_append_with_the_same_key_is_stored_once(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    first = store.append(metadata("a"), idempotency_key="once")
    again = store.append(metadata("a"), idempotency_key="once")
    batch = store.append_all([metadata("a"), metadata("b")], ["once", "other"])
    assert again == first == batch[0]
    assert store.length() == 2
    once = store.read_keyed("once")
    assert once is not None and once.id == first


def test_an_entry_is_read_by_its_idempotency_key_in_one_call(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    store.append(metadata("a"))
    event = metadata("b")
    keyed = store.append(event, idempotency_key="b")
    odd_id = client.xadd(keys.events("exp1"), {"type": "ClusterMetadataSet", "json": b"\xff not UTF-8"})
    client.hset(keys.idempotency("exp1"), "odd", odd_id)
    assert store.read_keyed("b") == StoredEvent(keyed, event)
    assert store.read_keyed("missing") is None
    odd = store.read_keyed("odd")  # read again as bytes: unreadable, not raised
    assert isinstance(odd, UnreadableEvent) and "not UTF-8" in odd.error
    with client.pipeline(transaction=False) as pipe:  # queued with other reads, decoded from its reply
        store.keyed_read("b", pipe)
        pipe.xlen(keys.events("exp1"))
        reply, length = pipe.execute()
    assert (store.keyed_entry(reply), length) == (StoredEvent(keyed, event), 3)


def test_appends_without_a_key_are_never_deduplicated(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    store.append(metadata("a"))
    store.append(metadata("a"))
    assert store.length() == 2


def test_an_event_of_another_experiment_is_refused_at_append(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    with pytest.raises(ValueError, match="appended to exp1"):
        store.append(ClusterMetadataSet(experiment_id="other", key="k", value="v"))
    assert store.length() == 0


def test_an_append_validates_nothing_twice(client: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic validated the event when it was built: the append only serializes it."""
    validations: list[object] = []

    class CountingAdapter:
        def validate_json(self, data: str) -> object:
            validations.append(data)
            return EVENT_ADAPTER.validate_json(data)

        def validate_python(self, data: object) -> object:
            validations.append(data)
            return EVENT_ADAPTER.validate_python(data)

    monkeypatch.setattr(event_store, "EVENT_ADAPTER", CountingAdapter())
    store = EventStore(client, "exp1")
    store.append(metadata("a"))
    store.append_all([metadata("b"), metadata("c")])
    assert validations == []


@pytest.mark.parametrize("event", [*EVENTS, ExperimentImported(**COMMON)], ids=lambda event: event.type)
def test_every_event_type_reads_back_as_appended(client: redis.Redis, event: Any) -> None:
    """What is stored must read back: checked here for each type, not re-validated at each append."""
    store = EventStore(client, event.experiment_id)
    entry_id = store.append(event)
    assert store.read_one(entry_id) == StoredEvent(entry_id, event)


def test_an_unreadable_entry_is_returned_as_such_not_raised(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    good = store.append(metadata("a"))
    client.xadd(keys.events("exp1"), {"type": "TrialEnded", "trial": "t", "json": "{not json"})
    client.xadd(keys.events("exp1"), {"type": "Future", "json": '{"type": "FromTheFuture", "v": 9}'})
    entries = store.read()
    assert isinstance(entries[0], StoredEvent) and entries[0].id == good
    assert [type(entry) for entry in entries[1:]] == [UnreadableEvent, UnreadableEvent]


def cancel(trial_id: str) -> TrialCancelRequested:
    return TrialCancelRequested(experiment_id="exp1", trial_id=trial_id, status=TrialJobStatus.USER_CANCELED)


def test_a_batch_is_appended_whole_in_one_call_and_in_order(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    events = [metadata(f"k{i}") for i in range(2500)]  # more than one script call's batch
    ids = store.append_all(events)
    assert len(ids) == len(set(ids)) == 2500
    assert [entry.id for entry in store.read()] == ids
    with pytest.raises(ValueError, match="2 events but 1 idempotency keys"):
        store.append_all([metadata("a"), metadata("b")], ["only-one"])


def test_metrics_queued_in_compact_form_are_stored_as_their_events_would_be(client: redis.Redis) -> None:
    # a worker appends the metrics it reads without building their events (append_metrics): the same entries
    store = EventStore(client, "exp1")
    events = [
        TrialMetricReported(
            experiment_id="exp1",
            trial_id="t1",
            attempt=2,
            source="w",
            parameter_id="0",
            metric_type="FINAL" if i == 1500 else "PERIODICAL",
            sequence=i,
            data=json.dumps(json.dumps(i / 3)),
            time=1_790_000_000_000,
        )
        for i in range(1501)  # more than one script call's batch
    ]
    store.append_all(events)
    values = [(event.parameter_id, event.metric_type, event.sequence, event.data) for event in events]
    payloads = compact_metrics(1_790_000_000_000, "w", 2, values)
    with client.pipeline(transaction=True) as pipe:
        entries = [(f"key{i}", payload) for i, payload in enumerate(payloads)]
        store.append_metrics("t1", entries, pipe)
        store.append_metrics("t1", entries[:2], pipe)  # sent again (its answer lost): stored once
        assert pipe.execute() == [1000, 501, 0]  # how many were new, in script calls of 1000 at most
    stored: Any = client.xrange(keys.events("exp1"))
    assert [fields for _, fields in stored] == [event_store.encode_event(event) for event in events] * 2
    assert [entry.event for entry in store.read() if isinstance(entry, StoredEvent)] == events * 2
    client.hset(keys.ARCHIVED, "exp1", "archive")  # refused as any append is, with nothing written
    with client.pipeline(transaction=True) as pipe:
        store.append_metrics("t1", [("another", payloads[0])], pipe)
        [refused] = pipe.execute(raise_on_error=False)
    assert isinstance(refused, redis.ResponseError) and str(refused).startswith("ARCHIVED")
    assert store.length() == 2 * len(events) and not client.hexists(keys.idempotency("exp1"), "another")


def test_a_read_pages_through_the_log_a_bounded_number_of_entries_a_call(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(event_store, "READ_PAGE", 3)
    store = EventStore(client, "exp1")
    ids = store.append_all([metadata(f"k{i}") for i in range(10)])
    client.config_resetstat()
    assert [entry.id for entry in store.read()] == ids
    calls: Any = client.info("commandstats")
    assert calls["cmdstat_xrange"]["calls"] == 4  # 3 + 3 + 3 + 1, never the whole log at once
    assert [entry.id for entry in store.read(count=7)] == ids[:7]
    assert [entry.id for entry in store.read(after=ids[1], until=ids[8])] == ids[2:9]
    odd = store.read(where=lambda fields: int(json.loads(fields["json"])["key"][1:]) % 2 == 1)
    assert [entry.id for entry in odd] == ids[1::2]


def test_a_pipelined_append_sends_its_script_whole_in_one_round_trip(client: redis.Redis) -> None:
    """No SCRIPT EXISTS before each pipeline (redis-py's way: a round trip more per metric a worker stores), and
    nothing half-applied where the script cache is empty (a restarted or promoted server): EVAL needs none."""
    store = EventStore(client, "exp1")
    client.script_flush()
    client.config_resetstat()
    with client.pipeline(transaction=True) as pipe:
        pipe.set("beside", "1")
        store.append(metadata("piped"), pipeline=pipe)
        pipe.execute()
    calls: Any = client.info("commandstats")
    assert "cmdstat_script|exists" not in calls and "cmdstat_evalsha" not in calls
    assert calls["cmdstat_eval"]["calls"] == 1
    assert [entry.event.key for entry in store.read() if isinstance(entry, StoredEvent)] == ["piped"]  # type: ignore[union-attr]


def test_commands_to_a_trial_are_indexed_for_its_worker_and_nothing_else_is(client: redis.Redis) -> None:
    store = EventStore(client, "exp1")
    metric = TrialMetricReported(
        experiment_id="exp1", trial_id="t1", attempt=1, parameter_id="0", metric_type="FINAL", sequence=0, data="1"
    )
    store.append(metric)
    first = store.append(cancel("t1"), idempotency_key="stop-once")
    store.append(cancel("t1"), idempotency_key="stop-once")  # a retried command is indexed once, like it is stored
    store.append(cancel("t2"))
    cursor, commands = store.trial_commands("t1")
    assert [entry.id for entry in commands] == [first]
    assert isinstance(commands[0], StoredEvent) and isinstance(commands[0].event, TrialCancelRequested)
    assert store.trial_commands("t1", after=cursor) == (cursor, [])
    later = store.append(cancel("t1"))
    assert [entry.id for entry in store.trial_commands("t1", after=cursor, block_ms=1000)[1]] == [later]


def test_an_append_past_its_fence_is_refused_whole_and_writes_nothing(client: redis.Redis) -> None:
    """A writer superseded since it was given its epoch (a runner whose claim another took): each of its appends,
    alone, in a batch of several script calls or in a transaction, is refused before anything of it is written."""
    epoch = keys.runner_epoch("exp1")
    client.set(epoch, 2)
    store = EventStore(client, "exp1", Fence(epoch, "2"))
    kept = store.append(metadata("while-it-held"))
    activity = client.zscore(keys.ACTIVITY, "exp1")
    client.incr(epoch)  # another runner took the claim

    with pytest.raises(AppendFenced, match=f"{epoch} is 3, not 2"):
        store.append(cancel("t1"), idempotency_key="stale")
    with pytest.raises(AppendFenced):
        store.append_all([metadata(f"k{i}") for i in range(1500)], [f"batch{i}" for i in range(1500)])
    with client.pipeline(transaction=True) as pipe:
        store.append(cancel("t1"), pipeline=pipe)
        [refused] = pipe.execute(raise_on_error=False)
    assert isinstance(refused, redis.ResponseError) and str(refused).startswith("FENCED")
    client.delete(epoch)
    with pytest.raises(AppendFenced, match=f"{epoch} is unset, not 2"):
        store.append(metadata("after-a-delete"))

    assert [entry.id for entry in store.read()] == [kept]
    assert client.hlen(keys.idempotency("exp1")) == 0
    assert not client.exists(keys.trial_commands("exp1", "t1"))  # no command indexed for a trial's worker
    assert client.zscore(keys.ACTIVITY, "exp1") == activity
    client.set(epoch, 3)
    EventStore(client, "exp1", Fence(epoch, "3")).append(metadata("by-the-new-holder"))
    EventStore(client, "exp1").append(metadata("unfenced"))  # a worker's appends have no fence
    stored = [entry.event for entry in store.read() if isinstance(entry, StoredEvent)]
    logged = [event.key for event in stored if isinstance(event, ClusterMetadataSet)]
    assert logged == ["while-it-held", "by-the-new-holder", "unfenced"]
