"""Archiving ended experiments (manager.archive): moved out of Redis into a directory or a real S3-compatible server
(moto's), read through from there by everything that reads an experiment, restored for good by `restore` or a
resume, and never half moved: each move's process is killed with SIGKILL after each of its steps."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from core import keys
from core.connections import same_server
from core.event_store import EventStore, ExperimentArchived
from core.keys import ViewKeys
from core.settings import Settings
from manager.archive import moves
from manager.archive.moves import ArchiveError, archive, archived, restore
from manager.archive.policy import archive_due
from manager.archive.stores import ArchiveStore, open_store
from manager.experiments import create_experiment, delete_experiment, list_experiments, resolve_experiment
from manager.projector import Projector
from manager.replay import check
from manager.training_service import TrainingService
from manager.transfer import LogFile, export_log, import_log
from schemas.events import ExperimentChanges, ExperimentUpdated
from tests.cli.test_cli import trialstream
from tests.support.experiment_log import CONFIG, synthetic_log
from tests.support.s3_setup import S3Server

REPO = Path(__file__).resolve().parents[2]
ARCHIVE_STEPS = ["segment", "manifest", "switched", "cleaned"]
RESTORE_STEPS = ["fetched", "staged", "switched", "cleaned"]


@pytest.fixture(params=["directory", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """(archive location, S3 endpoint) of each kind of store."""
    if request.param == "directory":
        return str(tmp_path / "archive"), None
    server: S3Server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_credentials")
    return server.bucket("archive"), server.endpoint_url


def ended(client: redis.Redis, experiment_id: str, trials: int = 12, metrics: int = 3) -> None:
    """An ended experiment (DONE), projected: trials with lost and retried attempts, metrics, a timeline."""
    log = list(synthetic_log(experiment_id, trials, metrics=metrics, lost_every=5))
    import_log(client, LogFile(experiment_id, log, {"created": log[0][0]}))
    Projector(client).catch_up(experiment_id)


def owned(client: redis.Redis, experiment_id: str) -> dict[str, Any]:
    """Each of the experiment's keys (its secrets aside) with its type and whole content, read as bytes."""
    raw: Any = same_server(client, decode=False)
    found = [*client.scan_iter(match=f"ts:exp:{experiment_id}:*"), *client.scan_iter(match=f"*:view:{experiment_id}:*")]
    names = {str(name) for name in found if not str(name).startswith("ts:staging:")} - {keys.thawed(experiment_id)}
    read = {
        "string": raw.get,
        "hash": raw.hgetall,
        "list": lambda name: raw.lrange(name, 0, -1),
        "set": lambda name: sorted(raw.smembers(name)),
        "zset": lambda name: raw.zrange(name, 0, -1, withscores=True),
        "stream": raw.xrange,
    }
    return {
        name: (kind, read[kind](name))
        for name in sorted(names)
        if ":secrets" not in name
        for kind in [str(client.type(name))]
    }


def seen(client: redis.Redis, experiment_id: str) -> dict[str, Any]:
    """What the readers of an experiment see: its trials, metrics, experiment, log, export and replay check."""
    resolve_experiment(client, experiment_id)
    service = TrainingService(client, same_server(client, decode=False), experiment_id)
    trials = service.list_trial_jobs()
    exported = io.StringIO()
    export_log(client, experiment_id, exported)
    return {
        "trials": [trial.model_dump() for trial in trials],
        "one": service.get_trial_job(trials[-1].id).model_dump(),
        "metrics": {trial.id: [m.model_dump() for m in service.views.metrics(trial.id)] for trial in trials},
        "experiment": service.experiment_view().model_dump(),
        "export": exported.getvalue(),
        "differences": check(client, experiment_id),
    }


def test_an_ended_experiment_leaves_redis_reads_the_same_and_comes_back(
    client: redis.Redis, location: tuple[str, str | None]
) -> None:
    store = open_store(*location)
    ended(client, "arch")
    before, read_before = owned(client, "arch"), seen(client, "arch")
    assert read_before["differences"] == [] and len(read_before["trials"]) == 12

    record = archive(client, "arch", store, thaw_s=60)
    assert archived(client, "arch") == record and record.keys == len(before)
    assert set(owned(client, "arch")) == ViewKeys("arch").kept_when_archived  # all but what listings read
    assert not client.exists(keys.events("arch")) and client.zscore(keys.ACTIVITY, "arch") is None
    names = store.names("arch/")
    assert f"arch/{record.archive_id}/manifest.json" in names and len(names) >= 2
    summary = {s.id: s for s in list_experiments(client)}["arch"]  # a listing does not bring it back
    assert summary.status == "DONE" and sum(summary.trial_counts.values()) == 12 and summary.archived
    assert not client.exists(keys.thawed("arch"))

    assert seen(client, "arch") == read_before  # read through: the keys come back for a while, as they were
    assert owned(client, "arch") == before
    assert 0 < client.pttl(keys.events("arch")) <= 60_000 and 0 < client.pttl(keys.thawed("arch")) <= 60_000
    assert client.pttl(ViewKeys("arch").position) == -1  # what stays in Redis stays
    with pytest.raises(ExperimentArchived, match="arch is archived: restore it"):
        EventStore(client, "arch").append(
            ExperimentUpdated(experiment_id="arch", changes=ExperimentChanges(max_trial_number=20))
        )
    assert owned(client, "arch") == before  # the log refused it

    assert restore(client, "arch") == len(before)
    assert archived(client, "arch") is None and store.names("arch/") == []
    assert owned(client, "arch") == before and seen(client, "arch") == read_before
    assert all(client.pttl(name) == -1 for name in before) and not client.exists(keys.thawed("arch"))
    EventStore(client, "arch").append(
        ExperimentUpdated(experiment_id="arch", changes=ExperimentChanges(max_trial_number=20))
    )
    assert restore(client, "arch") == 0  # not archived: nothing to do


def test_a_read_copy_goes_by_itself_and_comes_back_when_read_again(client: redis.Redis, tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "archive"))
    ended(client, "brief", trials=3)
    read_before = seen(client, "brief")
    archive(client, "brief", store, thaw_s=0.3)
    assert seen(client, "brief") == read_before
    thawed = set(client.smembers(keys.thawed("brief")))
    assert keys.events("brief") in thawed and not thawed & ViewKeys("brief").kept_when_archived

    def gone() -> bool:
        return not client.exists(keys.events("brief"), keys.thawed("brief"), *thawed)

    from simulators.waiting import wait_until

    wait_until(gone, 10, what="the read copy to expire")
    assert seen(client, "brief") == read_before  # thawed again from the archive


def test_only_an_ended_experiment_without_a_runner_is_archived_and_the_policy_archives_those_due(
    client: redis.Redis, tmp_path: Path
) -> None:
    settings = Settings(archive_location=str(tmp_path / "archive"), archive_after_h=0)
    running = create_experiment(client, CONFIG, tmp_path, experiment_id="running")
    Projector(client).catch_up(running)
    ended(client, "held", trials=2)
    ended(client, "due", trials=2)
    client.set(keys.runner("held"), "runner-1")
    with pytest.raises(ArchiveError, match="running has not finished"):
        archive(client, running, open_store(str(tmp_path / "archive")))
    with pytest.raises(ArchiveError, match=r"held is running \(runner-1\): stop it first"):
        archive(client, "held", open_store(str(tmp_path / "archive")))

    a_year = Settings(archive_location=str(tmp_path / "archive"), archive_after_h=24 * 365)
    assert archive_due(client, a_year) == []  # they ended (their logs say) two months ago
    assert archive_due(client, settings) == ["due"]
    assert set(client.hkeys(keys.ARCHIVED)) == {"due"}
    with pytest.raises(ArchiveError, match="due is archived already"):
        archive(client, "due", open_store(str(tmp_path / "archive")))
    client.delete(keys.runner("held"))
    assert archive_due(client, settings) == ["held"]

    deleted = delete_experiment(client, "due")  # an archived one is deleted with its archive
    assert deleted > 0 and archived(client, "due") is None and open_store(str(tmp_path / "archive")).names("due/") == []
    assert not list(client.scan_iter(match="*due*"))


_CRASHING = """
import os, signal, sys
from core.connections import connect
from manager.archive import moves
from manager.archive.stores import open_store

url, experiment_id, location, endpoint, move, step = sys.argv[1:]
endpoint = endpoint or None


def checkpoint(name: str) -> None:
    if name == step:
        os.kill(os.getpid(), signal.SIGKILL)


client = connect(url)
if move == "archive":
    store = open_store(location, endpoint)
    moves.archive(client, experiment_id, store, checkpoint=checkpoint, segment_bytes=4096)
else:
    moves.restore(client, experiment_id, checkpoint=checkpoint)
sys.exit(3)  # the step never came
"""


def _killed_at(redis_url: str, experiment_id: str, location: tuple[str, str | None], move: str, step: str) -> None:
    arguments = [redis_url, experiment_id, location[0], location[1] or "", move, step]
    done = subprocess.run([sys.executable, "-c", _CRASHING, *arguments], cwd=REPO, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()


def test_a_move_killed_after_any_step_leaves_the_experiment_whole_in_redis_or_in_its_archive(
    client: redis.Redis, redis_url: str, location: tuple[str, str | None]
) -> None:
    store = open_store(*location)
    for step in ARCHIVE_STEPS:
        experiment_id = f"a-{step}"
        ended(client, experiment_id, trials=4)
        before, read_before = owned(client, experiment_id), seen(client, experiment_id)
        _killed_at(redis_url, experiment_id, location, "archive", step)
        if step in ("segment", "manifest"):  # the archive was written (in part): Redis was not touched
            assert archived(client, experiment_id) is None and owned(client, experiment_id) == before
            assert store.names(f"{experiment_id}/")  # what the dead move left, unnamed by any record
            record = archive(client, experiment_id, store)  # the next move deletes it
        else:
            record = _archived(client, experiment_id)
        assert {name.split("/")[1] for name in store.names(f"{experiment_id}/")} == {record.archive_id}, step
        assert seen(client, experiment_id) == read_before, step
        assert restore(client, experiment_id) and owned(client, experiment_id) == before, step

    for step in RESTORE_STEPS:
        experiment_id = f"r-{step}"
        ended(client, experiment_id, trials=4)
        before, read_before = owned(client, experiment_id), seen(client, experiment_id)
        archive(client, experiment_id, store)
        _killed_at(redis_url, experiment_id, location, "restore", step)
        staging = list(client.scan_iter(match=f"{keys.staging(experiment_id, '*')}*"))
        assert all(client.pttl(name) > 0 for name in staging), step  # staged keys a dead restore left expire
        if step in ("fetched", "staged"):
            assert archived(client, experiment_id) is not None, step  # still archived, read the same
            assert bool(staging) == (step == "staged")
            assert seen(client, experiment_id) == read_before, step
            assert restore(client, experiment_id) == len(before)
        else:
            assert archived(client, experiment_id) is None and owned(client, experiment_id) == before, step
            assert bool(store.names(f"{experiment_id}/")) == (step == "switched")  # its archive, deleted next
            record = archive(client, experiment_id, store)
            assert {name.split("/")[1] for name in store.names(f"{experiment_id}/")} == {record.archive_id}
            assert restore(client, experiment_id)
        assert owned(client, experiment_id) == before and store.names(f"{experiment_id}/") == [], step
        assert all(client.pttl(name) == -1 for name in before), step
        assert seen(client, experiment_id) == read_before, step


def _archived(client: redis.Redis, experiment_id: str) -> moves.ArchiveRecord:
    record = archived(client, experiment_id)
    assert record is not None
    return record


def test_a_damaged_archive_is_refused_by_name(client: redis.Redis, tmp_path: Path) -> None:
    store: ArchiveStore = open_store(str(tmp_path / "archive"))
    ended(client, "damaged", trials=2)
    record = archive(client, "damaged", store)
    segment = tmp_path / "archive" / "damaged" / record.archive_id / "segment-00000.zz"
    segment.write_bytes(segment.read_bytes()[:-1] + b"x")
    with pytest.raises(Exception, match=r"segment-00000\.zz: its SHA-256 is not the manifest's"):
        resolve_experiment(client, "damaged")
    assert archived(client, "damaged") == record  # nothing moved


def test_the_command_line_archives_restores_and_reads_through_a_bucket(
    client: redis.Redis, redis_url: str, s3_server: S3Server, s3_credentials: dict[str, str]
) -> None:
    ended(client, "cli", trials=5)
    env = {
        "TRIALSTREAM_REDIS_URL": redis_url,
        "TRIALSTREAM_ARCHIVE_LOCATION": s3_server.bucket("cli"),
        "TRIALSTREAM_ARCHIVE_ENDPOINT_URL": s3_server.endpoint_url,
        **s3_credentials,
    }
    reads = [
        ("trials", "list", "-e", "cli", "--json"),
        ("trials", "show", "t00003", "-e", "cli", "--json", "--history"),
        ("events", "cli", "--json"),
        ("export", "cli"),
        ("replay", "cli", "--check"),
    ]
    before = [trialstream(*command, env=env) for command in reads]
    assert all(done.returncode == 0 for done in before), [done.stderr for done in before]
    listed_before = list_experiments(client)

    archived_ = trialstream("experiments", "archive", "cli", env=env)
    assert archived_.returncode == 0 and "archived experiment cli to s3://cli-" in archived_.stdout, archived_.stderr
    again = trialstream("experiments", "archive", "cli", env=env)
    assert again.returncode != 0 and "cli is archived already" in again.stderr
    listed = trialstream("experiments", "list", "--json", env=env)
    assert json.loads(listed.stdout) == [
        summary.model_dump(by_alias=True) | {"archived": True} for summary in listed_before
    ]
    assert not client.exists(keys.thawed("cli"))
    after = [trialstream(*command, env=env) for command in reads]
    assert [(done.returncode, done.stdout) for done in after] == [(done.returncode, done.stdout) for done in before]
    rebuilt = trialstream("replay", "cli", "--rebuild", env=env)  # views read through are not the archive's
    assert rebuilt.returncode != 0 and "`trialstream experiments restore cli` brings it back" in rebuilt.stderr

    restored = trialstream("experiments", "restore", "cli", env=env)
    assert restored.returncode == 0 and "restored experiment cli" in restored.stdout, restored.stderr
    assert archived(client, "cli") is None and client.pttl(keys.events("cli")) == -1


def test_a_listing_counts_what_no_projector_has_reached_and_marks_what_is_archived(
    client: redis.Redis, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing counts trials by the views where they have folded the whole log, not by parsing each trial's view
    (2 s for 100k trials); where no projector has, by the log. An archived experiment says so."""
    log = list(synthetic_log("unread", 6, metrics=2, lost_every=5))
    import_log(client, LogFile("unread", log, {"created": log[0][0]}))  # no projector has read it
    ended(client, "stored", trials=3)
    archive(client, "stored", open_store(str(tmp_path / "archive")))
    expected = Counter(str(trial.status) for trial in TrainingService(client, client, "unread").list_trial_jobs())

    summaries = {summary.id: summary for summary in list_experiments(client)}
    assert summaries["unread"].trial_counts == dict(expected) and sum(expected.values()) == 6
    Projector(client).catch_up("unread")
    with monkeypatch.context() as patched:  # folded whole, its views' counts answer: no trial's view is parsed
        patched.setattr(TrainingService, "list_trial_jobs", lambda self: pytest.fail("every view parsed"))
        assert {summary.id: summary for summary in list_experiments(client)}["unread"] == summaries["unread"]
    assert not summaries["unread"].archived and summaries["stored"].archived
    assert sum(summaries["stored"].trial_counts.values()) == 3
    table = trialstream("experiments", "list", env={"TRIALSTREAM_REDIS_URL": redis_url, "COLUMNS": "300"})
    assert "DONE, archived" in table.stdout and "Traceback" not in table.stderr
