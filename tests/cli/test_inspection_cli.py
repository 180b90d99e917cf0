"""`trialstream events / replay / export / import / trials show --history` as a user runs them."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import redis
from redis.typing import EncodableT, FieldT

from core import keys
from core.connections import connect
from core.event_store import EventStore, StoredEvent
from manager.replay import (
    SCRATCH_PREFIX,
    InvalidPosition,
    diff_views,
    event_types,
    parse_position,
    replayed,
    snapshot_views,
)
from manager.views import ViewStore
from tests.conftest import REPO, Processes, ServiceFactory, free_port, stream_entries, wait_until
from tests.manager.test_replay import Mixed, run_mixed_experiment

V1_LOG = REPO / "tests" / "data" / "log-v1.jsonl"
WORKER_SOURCE = re.compile(r".+:\d+")


@pytest.fixture
def mixed(make_service: ServiceFactory, processes: Processes, code_dir: Path, rq_connection: redis.Redis) -> Mixed:
    return run_mixed_experiment(make_service, processes, code_dir, rq_connection)


@pytest.fixture
def env(redis_url: str) -> dict[str, str]:
    return {"TRIALSTREAM_REDIS_URL": redis_url}


@pytest.fixture
def other_db(redis_url: str) -> tuple[str, redis.Redis]:
    """Database 1 of the same server: a second, empty Redis (pytest-redis flushes all databases after the test)."""
    url = redis_url.rsplit("/", 1)[0] + "/1"
    other = connect(url)
    other.flushdb()
    return url, other


def trialstream(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    """The command as a user runs it; only `env` says which Redis (none: the embedded data directories)."""
    inherited = {name: value for name, value in os.environ.items() if name != "TRIALSTREAM_REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "manager.cli", *args],
        cwd=REPO,
        env={**inherited, **env},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def fails(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_events_lists_every_entry_with_filters_and_survives_unreadable_ones(
    mixed: Mixed, client: redis.Redis, env: dict[str, str]
) -> None:
    exp = mixed.experiment_id
    future = {"type": "TrialTeleported", "trial": mixed.trials[1], "json": '{"type":"TrialTeleported","v":9}'}
    unreadable_id = cast(str, client.xadd(keys.events(exp), cast(dict[FieldT, EncodableT], future)))
    stream = stream_entries(client, keys.events(exp))

    listed = json_lines(ok(trialstream("events", exp, "--json", env=env)))
    assert [line["id"] for line in listed] == [entry_id for entry_id, _ in stream]
    assert listed[-1] == {"id": unreadable_id, "unreadable": listed[-1]["unreadable"], "fields": future}
    assert all(line["event"]["experimentId"] == exp for line in listed[:-1])

    table = ok(trialstream("events", exp, env=env))
    rows = [line for line in table.splitlines() if line.startswith(tuple("0123456789"))]
    assert len(rows) == len(stream)
    started = next(row for row in rows if " TrialStarted " in row)
    assert WORKER_SOURCE.search(started.split(" TrialStarted ")[1].split()[1])  # trial, then the worker host:pid
    assert "exitCode=3" in next(row for row in rows if " TrialEnded " in row and mixed.trials[2] in row)
    assert "unreadable:" in next(row for row in rows if row.startswith(unreadable_id))

    one_trial = json_lines(ok(trialstream("events", exp, "--trial", mixed.trials[2], "--json", env=env)))
    assert [line["event"]["type"] for line in one_trial] == ["TrialSubmitted", "TrialStarted", "TrialEnded"]

    typed = json_lines(ok(trialstream("events", exp, "--type", "TrialEnded,TrialStarted", "--json", env=env)))
    repeated = ["--type", "TrialEnded", "--type", "TrialStarted"]
    assert json_lines(ok(trialstream("events", exp, *repeated, "--json", env=env))) == typed
    assert {line["event"]["type"] for line in typed} == {"TrialEnded", "TrialStarted"}
    started_trials = {line["event"]["trialId"] for line in typed if line["event"]["type"] == "TrialStarted"}
    assert started_trials == {mixed.trials[x] for x in (1, 2, 3)}  # x=4 was canceled before it started

    ids = [entry_id for entry_id, _ in stream]
    window = json_lines(ok(trialstream("events", exp, "--since", ids[3], "--until", ids[6], "--json", env=env)))
    assert [line["id"] for line in window] == ids[3:7]
    first_ms = int(ids[0].split("-")[0])
    by_ms = json_lines(ok(trialstream("events", exp, "--until", str(first_ms), "--json", env=env)))
    assert by_ms and all(int(line["id"].split("-")[0]) == first_ms for line in by_ms)

    fails(
        trialstream("events", exp, "--type", "TrialExploded", env=env),
        "unknown event type TrialExploded; known types: ",
    )
    unknown = trialstream("events", exp, "--type", "Nope", env=env)
    assert all(name in unknown.stderr for name in event_types())
    fails(trialstream("events", exp, "--since", "last tuesday", env=env), "'last tuesday' is not an event id")
    fails(trialstream("events", exp, "--trial", "zzzzz", env=env), "trial 'zzzzz' not found")
    fails(trialstream("events", "nosuchexp", env=env), "experiment 'nosuchexp' not found")


def test_events_follow_streams_new_events_until_sigterm(
    make_service: ServiceFactory, redis_url: str, env: dict[str, str]
) -> None:
    service = make_service()
    follower = subprocess.Popen(
        [sys.executable, "-m", "manager.cli", "events", service.experiment_id, "--follow", "--json"],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def forward() -> None:
        for line in follower.stdout or []:
            lines.put(line)

    threading.Thread(target=forward, daemon=True).start()
    seen: list[dict] = []

    def received(count: int) -> bool:
        while not lines.empty():
            seen.append(json.loads(lines.get()))
        return len(seen) >= count

    try:
        wait_until(lambda: received(3), what="the history: created and two metadata events")
        service.set_cluster_metadata("note", "appended while following")
        wait_until(lambda: received(4), what="the new event")
        assert seen[3]["event"]["type"] == "ClusterMetadataSet" and seen[3]["event"]["key"] == "note"
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(20) == 0, follower.stderr.read() if follower.stderr else ""
    finally:
        follower.kill()
    assert [line["id"] for line in seen] == [
        entry_id for entry_id, _ in stream_entries(service.store.client, service.store.stream)
    ]


def test_replay_until_and_check(mixed: Mixed, client: redis.Redis, env: dict[str, str]) -> None:
    exp = mixed.experiment_id
    started = next(
        entry
        for entry in EventStore(client, exp).read()
        if isinstance(entry, StoredEvent)
        and entry.event.type == "TrialStarted"
        and entry.event.trial_id == mixed.trials[3]
    )
    past = json.loads(ok(trialstream("replay", exp, "--until", started.id, "--json", env=env)))
    assert past["position"] == started.id and past["experiment"]["status"] == "RUNNING"
    assert {t["id"]: t["status"] for t in past["trials"]} == {
        mixed.trials[1]: "SUCCEEDED",
        mixed.trials[2]: "FAILED",
        mixed.trials[3]: "RUNNING",
    }
    at_time = json.loads(
        ok(trialstream("replay", exp, "--until", str(started.event.time - 100_000), "--json", env=env))
    )
    assert at_time == {"position": "0-0", "experiment": None, "trials": []}
    table = ok(trialstream("replay", exp, "--until", started.id, env=env))
    assert f"at event {started.id}, RUNNING" in table and mixed.trials[3] in table and mixed.trials[4] not in table

    checked = trialstream("replay", exp, "--check", env=env)
    assert checked.stdout.strip() == f"views match the log ({EventStore(client, exp).length()} events)"
    assert checked.returncode == 0, checked.stderr

    view_keys = ViewStore(client, exp).keys
    client.hdel(view_keys.trials, mixed.trials[4])  # the projector is idle: nothing is appended any more
    broken = trialstream("replay", exp, "--check", env=env)
    assert broken.returncode == 1
    missing = f"trials[{mixed.trials[4]}]: live (missing) vs replayed {{"
    assert broken.stdout.startswith(missing) and len(broken.stdout.splitlines()) == 1, broken.stdout
    assert f"the views of {exp} differ from a replay" in broken.stderr
    assert f"`trialstream replay {exp} --rebuild` replaces them" in broken.stderr
    report = json.loads(trialstream("replay", exp, "--check", "--json", env=env).stdout)
    assert report["differences"] == broken.stdout.splitlines()

    head = EventStore(client, exp).head()
    assert (
        ok(trialstream("replay", exp, "--rebuild", env=env)).strip()
        == f"views of {exp} rebuilt from its log, up to {head}"
    )
    assert client.hexists(view_keys.trials, mixed.trials[4])
    assert trialstream("replay", exp, "--check", env=env).returncode == 0
    assert list(client.scan_iter(match=f"{SCRATCH_PREFIX}*")) == []


def test_export_then_import_into_another_redis_gives_the_same_views(
    mixed: Mixed, client: redis.Redis, env: dict[str, str], other_db: tuple[str, redis.Redis], tmp_path: Path
) -> None:
    exp = mixed.experiment_id
    exported = trialstream("export", exp, env=env)
    assert exported.returncode == 0, exported.stderr
    log_file = tmp_path / "log.jsonl"
    log_file.write_text(exported.stdout)
    lines = json_lines(exported.stdout)
    assert lines[0] == {"format": "trialstream-log", "version": 1, "experimentId": exp}
    assert lines[-1] == {"idempotency": client.hgetall(keys.idempotency(exp)), "entries": len(lines) - 2}

    other_url, other = other_db
    imported = trialstream("import", str(log_file), env={"TRIALSTREAM_REDIS_URL": other_url})
    assert ok(imported).strip() == f"imported experiment {exp}: {len(lines) - 2} entries"
    *copied_entries, marker = stream_entries(other, keys.events(exp))
    assert copied_entries == client.xrange(keys.events(exp)) and marker[1]["type"] == "ExperimentImported"
    assert other.hgetall(keys.idempotency(exp)) == client.hgetall(keys.idempotency(exp))
    assert other.zscore(keys.EXPERIMENTS, exp) == client.zscore(keys.EXPERIMENTS, exp)
    imported_at = marker[0].split("-")[0]
    assert diff_views(client, exp, other_client=other, labels=("original", "imported")) == [
        "experiment[view].imported: original false vs imported true",  # every trial's view the same
        f"position[applied]: original {len(lines) - 2} vs imported {len(lines) - 1}",
        f'position[position]: original "{copied_entries[-1][0]}" vs imported "{marker[0]}"',
        # the timeline: the same but for the import's own mark
        f"timeline[header].end: original {copied_entries[-1][0].split('-')[0]} vs imported {imported_at}",
        f'timeline[header].head: original "{copied_entries[-1][0]}" vs imported "{marker[0]}"',
        f"timeline:markers[2]: original (missing) vs imported "
        f'{{"id":"{marker[0]}","time":{imported_at},"kind":"ExperimentImported","text":"imported"}}',
    ]
    with replayed(other, exp) as replay:  # and a fresh fold of the imported log says the same
        assert diff_views(other, exp, keys.LOG_PREFIX, replay.namespace) == []
    assert snapshot_views(other, exp).applied == len(lines) - 1  # and the import's own mark

    again = trialstream("import", "-", env={"TRIALSTREAM_REDIS_URL": other_url}, stdin=exported.stdout)
    fails(again, f"experiment '{exp}' already exists in this Redis; import it under another id with --experiment-id")
    other_env = {"TRIALSTREAM_REDIS_URL": other_url}
    copy = trialstream("import", "-", "--experiment-id", "copy1", env=other_env, stdin=exported.stdout)
    assert ok(copy).strip() == f"imported experiment copy1: {len(lines) - 2} entries"
    copied = json_lines(ok(trialstream("events", "copy1", "--json", env=other_env)))
    assert {line["event"]["experimentId"] for line in copied} == {"copy1"}
    *copied, mark = copied
    assert [line["id"] for line in copied] == [line["id"] for line in lines[1:-1]]
    assert mark["event"]["type"] == "ExperimentImported"
    copied_trials = json.loads(ok(trialstream("trials", "list", "-e", "copy1", "--json", env=other_env)))
    assert {t["id"]: t["status"] for t in copied_trials} == {t.id: t.status for t in mixed.service.list_trial_jobs()}


def test_the_stored_v1_log_imports_and_lists_all_entries(redis_url: str, client: redis.Redis, tmp_path: Path) -> None:
    file_ids = [json.loads(line)["id"] for line in V1_LOG.read_text().splitlines()[1:-1]]
    assert len(file_ids) == 29
    shared = {"TRIALSTREAM_REDIS_URL": redis_url}
    ok(trialstream("import", str(V1_LOG), env=shared))
    *listed, mark = json_lines(ok(trialstream("events", "v1sample", "--json", env=shared)))
    assert [line["id"] for line in listed] == file_ids and mark["event"]["type"] == "ExperimentImported"

    embedded = {"TRIALSTREAM_EXPERIMENTS_DIR": str(tmp_path / "experiments")}  # no Redis: a data dir of its own
    ok(trialstream("import", str(V1_LOG), env=embedded))
    assert (tmp_path / "experiments" / "v1sample" / "redis").is_dir()
    *listed, mark = json_lines(ok(trialstream("events", "v1sample", "--json", env=embedded)))
    assert [line["id"] for line in listed] == file_ids and mark["event"]["type"] == "ExperimentImported"
    fails(trialstream("import", str(V1_LOG), env=embedded), "experiment 'v1sample' already exists under")


def test_trials_show_history(mixed: Mixed, client: redis.Redis, env: dict[str, str]) -> None:
    exp, trial_id = mixed.experiment_id, mixed.trials[1]
    shown = json.loads(ok(trialstream("trials", "show", trial_id, "-e", exp, "--history", "--json", env=env)))
    assert shown["status"] == "SUCCEEDED" and [m["type"] for m in shown["metrics"]] == ["PERIODICAL", "FINAL"]
    history = shown["history"]
    expected = [
        entry_id for entry_id, fields in stream_entries(client, keys.events(exp)) if fields["trial"] == trial_id
    ]
    assert [line["id"] for line in history] == expected
    types = [line["event"]["type"] for line in history]
    assert types[0] == "TrialSubmitted" and types[-1] == "TrialEnded" and "TrialMetricReported" in types
    assert history[0]["event"]["source"] == "manager"
    assert all(WORKER_SOURCE.fullmatch(line["event"]["source"]) for line in history[1:])
    assert "history" not in json.loads(ok(trialstream("trials", "show", trial_id, "--json", env=env)))

    text = ok(trialstream("trials", "show", trial_id, "-e", exp, "--history", env=env))
    rows = text.split(f"history of trial {trial_id}")[1].splitlines()[2:]
    assert [row.split()[2] for row in rows if row.strip()] == types
    ended = next(row for row in rows if " TrialEnded " in row)
    assert "status=SUCCEEDED" in ended and "exitCode=0" in ended
    fails(trialstream("trials", "show", "zzzzz", "--history", env=env), "trial 'zzzzz' not found")


def _swap(lines: list[str], one: int, other: int) -> list[str]:
    lines[one], lines[other] = lines[other], lines[one]
    return lines


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda ls: ['{"format": "other", "version": 1}', *ls[1:]], "{path}, line 1: not a trialstream log"),
        (lambda ls: [ls[0].replace('"version": 1', '"version": 2'), *ls[1:]], "{path}, line 1: log format version 2"),
        (lambda ls: [*ls[:4], "{not json", *ls[5:]], "{path}, line 5: not JSON"),
        (lambda ls: _swap(ls, 5, 6), "{path}, line 7: stream id 1795319624204-0 does not come after the one before"),
        (
            lambda ls: [*ls[:2], ls[2].replace("v1sample", "other", 1), *ls[3:]],
            "{path}, line 3: an event of experiment 'other' in the log of 'v1sample'",
        ),
        (lambda ls: [*ls[:2], *ls[3:]], "{path}: the trailer says 29 entries, the file holds 28"),
        (
            lambda ls: [*ls[:10], *ls[11:]],
            "{path}, line 30: idempotency key 'ended:PRNKq:1' points at '1795319624334-0'",
        ),
        (lambda ls: ls[:-1], "{path}: truncated: no trailer line after 29 entries"),
        (lambda ls: [*ls, ls[1]], "{path}, line 32: a line after the trailer"),
        (lambda ls: [], "{path}: empty, not a trialstream log"),
    ],
)
def test_a_bad_log_file_is_refused_naming_the_line_and_nothing_is_written(
    corrupt: Callable[[list[str]], list[str]], message: str, client: redis.Redis, env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in corrupt(V1_LOG.read_text().splitlines())))
    fails(trialstream("import", str(path), env=env), message.format(path=path))
    assert client.dbsize() == 0


def test_a_log_file_that_cannot_be_read_is_named(client: redis.Redis, env: dict[str, str], tmp_path: Path) -> None:
    fails(trialstream("import", str(tmp_path / "absent.jsonl"), env=env), f"cannot read {tmp_path / 'absent.jsonl'}")
    assert client.dbsize() == 0


def test_an_experiments_dir_that_cannot_hold_the_import_is_named(tmp_path: Path) -> None:
    """With no Redis, the import makes a data directory under TRIALSTREAM_EXPERIMENTS_DIR: a file there is the
    user's to fix, said in one line (it was a NotADirectoryError's traceback)."""
    a_file = tmp_path / "a-file"
    a_file.touch()
    imported = trialstream("import", str(V1_LOG), env={"TRIALSTREAM_EXPERIMENTS_DIR": str(a_file)})
    fails(imported, f"TRIALSTREAM_EXPERIMENTS_DIR: cannot create {a_file}/v1sample (Not a directory); set it to a")


def test_a_time_out_of_range_is_said_plainly(make_service: ServiceFactory, env: dict[str, str]) -> None:
    """A naive time is local: one that Python cannot move by the local offset (year 1, or 9999 east of UTC) was
    a `year 0 is out of range` traceback."""
    exp = make_service().experiment_id
    east = {**env, "TZ": "Asia/Tokyo"}
    fails(trialstream("events", exp, "--since", "0001-01-01", env=east), "'0001-01-01' is before 1970")
    fails(trialstream("replay", exp, "--until", "0001-01-01", env=east), "'0001-01-01' is before 1970")
    fails(trialstream("events", exp, "--until", "9999-12-31T23:59", env=east), "too late: give a time before 9999")


def test_a_position_redis_would_refuse_is_not_an_event_id(make_service: ServiceFactory, env: dict[str, str]) -> None:
    """Each part of an event id is below 2**64, in ASCII digits (\\d takes full-width ones): anything else was
    Redis's `Invalid stream ID` error, and through a manager an --until past 2**64 listed every entry. It is
    refused before anything is read, whichever way the log is read (the manager here answers nothing)."""
    for position in (
        "99999999999999999999999",
        "18446744073709551616",
        "1795893112577-18446744073709551616",
        "\uff10\uff11\uff12",
    ):
        with pytest.raises(InvalidPosition, match=f"^{re.escape(repr(position))} is not an event id"):
            parse_position(position)
    exp = make_service().experiment_id
    via_manager = {"TRIALSTREAM_MANAGER_URL": f"http://127.0.0.1:{free_port()}"}
    for command, option, position in (
        ("events", "--until", "99999999999999999999999"),
        ("replay", "--until", "1-18446744073709551616"),
    ):
        for way in (env, via_manager):
            fails(trialstream(command, exp, option, position, env=way), f"{position!r} is not an event id")
