"""Export and import of an experiment's log: all or nothing, safe ids, and marked as imported."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
import redis

from core import keys
from core.event_store import EventStore, InvalidExperimentId, StoredEvent, check_experiment_id, encode_event
from manager.projector import Projector
from manager.runner import ExperimentRunner, RunnerError
from manager.training_service import TrainingService
from manager.transfer import (
    IMPORTED_RUN_GONE,
    ExperimentExists,
    InvalidLogFile,
    LogFile,
    export_log,
    import_log,
    read_log_file,
    renamed,
)
from manager.views import ViewStore
from schemas.events import (
    Event,
    ExperimentCreated,
    ExperimentImported,
    TrialCancelRequested,
    TrialEnded,
    TrialLaunchSpec,
    TrialStarted,
    TrialSubmitted,
)
from schemas.trial import TrialJobStatus
from tests.conftest import form

EXPERIMENT = "source1"


def submitted(trial_id: str, sequence_id: int) -> TrialSubmitted:
    return TrialSubmitted(
        experiment_id=EXPERIMENT,
        trial_id=trial_id,
        platform="local",
        form=form(sequence_id),
        working_directory=f"/tmp/{trial_id}",
        launch=TrialLaunchSpec(command="true", code_directory="/tmp", platform_config={"platform": "local"}),
    )


def source_events() -> list[Event]:
    """A run cut short: t1 ended, t2 running with a cancel sent to it, t3 waiting."""
    config = {
        "trialCommand": "true",
        "trialCodeDirectory": "/tmp",
        "trialConcurrency": 1,
        "maxTrialNumber": 3,
        "searchSpace": {"x": {"_type": "choice", "_value": [1]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 5}},
        "trainingService": {"platform": "local"},
    }
    return [
        ExperimentCreated(experiment_id=EXPERIMENT, config=config, working_directory="/tmp/source1"),
        submitted("t1", 0),
        TrialStarted(experiment_id=EXPERIMENT, trial_id="t1", attempt=1, working_directory="/tmp/t1"),
        TrialEnded(experiment_id=EXPERIMENT, trial_id="t1", attempt=1, status=TrialJobStatus.SUCCEEDED),
        submitted("t2", 1),
        TrialStarted(experiment_id=EXPERIMENT, trial_id="t2", attempt=1, working_directory="/tmp/t2"),
        TrialCancelRequested(experiment_id=EXPERIMENT, trial_id="t2", status=TrialJobStatus.USER_CANCELED),
        submitted("t3", 2),
    ]


def log_lines(events: list[Event], ids: list[str] | None = None, experiment_id: str = EXPERIMENT) -> list[str]:
    ids = ids or [f"{1000 + n}-0" for n in range(len(events))]
    lines = [json.dumps({"format": "trialstream-log", "version": 1, "experimentId": experiment_id})]
    lines += [json.dumps({"id": i, "fields": encode_event(e)}) for i, e in zip(ids, events, strict=True)]
    lines.append(json.dumps({"idempotency": {"created": ids[0]}, "entries": len(events)}))
    return lines


def source_log() -> LogFile:
    return read_log_file(log_lines(source_events()))


def nothing_stored(client: redis.Redis, experiment_id: str) -> bool:
    return not client.keys(f"*{experiment_id}*") and client.zscore(keys.EXPERIMENTS, experiment_id) is None


# A10: all or nothing


@pytest.mark.parametrize("bad_id", ["18446744073709551616-0", "1-18446744073709551616", "0-0"])
def test_an_id_redis_would_refuse_is_refused_before_anything_is_written(bad_id: str) -> None:
    ids = [f"{1000 + n}-0" for n in range(len(source_events()))]
    ids[0 if bad_id == "0-0" else 2] = bad_id
    with pytest.raises(InvalidLogFile, match="stream id"):
        read_log_file(log_lines(source_events(), ids))


def test_an_import_that_fails_in_redis_leaves_nothing_and_can_be_retried(client: redis.Redis) -> None:
    good = source_log()
    broken = replace(good, entries=[*good.entries[:3], ("18446744073709551616-0", good.entries[3][1])])
    with pytest.raises(redis.ResponseError):
        import_log(client, broken)  # past the file checks (a LogFile built by hand): Redis refuses the id
    assert nothing_stored(client, EXPERIMENT)

    import_log(client, good)
    assert EventStore(client, EXPERIMENT).length() == len(good.entries) + 1  # and the ExperimentImported mark


def test_an_import_over_an_existing_experiment_is_refused(client: redis.Redis) -> None:
    import_log(client, source_log())
    with pytest.raises(ExperimentExists, match="--experiment-id"):
        import_log(client, source_log())


def test_export_then_import_under_a_new_id_keeps_ids_and_idempotency(client: redis.Redis) -> None:
    import_log(client, source_log())
    out = io.StringIO()
    assert export_log(client, EXPERIMENT, out) == len(source_events()) + 1  # and the ExperimentImported mark
    moved = renamed(read_log_file(out.getvalue().splitlines()), "copy_1")
    import_log(client, moved)
    source, copy = EventStore(client, EXPERIMENT), EventStore(client, "copy_1")
    assert [entry.id for entry in copy.read()][: len(source.read())] == [entry.id for entry in source.read()]
    created = copy.read_keyed("created")
    assert created is not None and created.id == "1000-0"


# A11: experiment ids


@pytest.mark.parametrize("bad", ["..", ".", "a/b", "../x", ".hidden", "-flag", "", "a.b", "x" * 65, "a b"])
def test_an_experiment_id_that_is_not_a_plain_name_is_refused_everywhere(bad: str, client: redis.Redis) -> None:
    with pytest.raises(InvalidExperimentId, match="invalid experiment id"):
        check_experiment_id(bad)
    with pytest.raises(InvalidLogFile, match="invalid experiment"):
        read_log_file(log_lines(source_events(), experiment_id=bad))
    with pytest.raises(InvalidLogFile, match="invalid experiment id"):
        renamed(source_log(), bad)
    with pytest.raises(InvalidExperimentId):
        EventStore(client, bad)


@pytest.mark.parametrize("good", ["a", "AbC123", "exp_1-2", "_x", "x" * 64])
def test_plain_names_are_experiment_ids(good: str) -> None:
    assert check_experiment_id(good) == good


# A9: imported logs go through the append path and are marked


def test_an_imported_cancel_reaches_its_trials_commands_stream(client: redis.Redis) -> None:
    import_log(client, source_log())
    store = EventStore(client, EXPERIMENT)
    _, commands = store.trial_commands("t2")
    assert [entry.event.type for entry in commands if isinstance(entry, StoredEvent)] == ["TrialCancelRequested"]
    assert store.trial_commands("t1") == ("0-0", [])


def test_an_imported_experiment_is_marked_as_such_at_the_end_of_its_log(client: redis.Redis) -> None:
    import_log(client, source_log())
    last = EventStore(client, EXPERIMENT).read()[-1]
    assert isinstance(last, StoredEvent) and isinstance(last.event, ExperimentImported)
    Projector(client).catch_up(EXPERIMENT)
    view = ViewStore(client, EXPERIMENT).experiment()
    assert view is not None and view.imported


def test_resuming_an_imported_experiment_needs_the_flag(client: redis.Redis, rq_connection: redis.Redis) -> None:
    import_log(client, source_log())
    with pytest.raises(RunnerError, match="--imported") as refused:
        ExperimentRunner.resume(client, rq_connection, EXPERIMENT)
    assert "\n" not in str(refused.value)
    statuses = {t.id: t.status for t in TrainingService(client, rq_connection, EXPERIMENT).list_trial_jobs()}
    assert statuses == {"t1": "SUCCEEDED", "t2": "RUNNING", "t3": "WAITING"}  # nothing changed


def test_resuming_with_the_flag_first_ends_what_the_imported_run_left_unfinished(
    client: redis.Redis, rq_connection: redis.Redis
) -> None:
    import_log(client, source_log())
    ExperimentRunner.resume(client, rq_connection, EXPERIMENT, allow_imported=True)
    service = TrainingService(client, rq_connection, EXPERIMENT)
    trials = {trial.id: trial for trial in service.list_trial_jobs()}
    assert {t.id: t.status for t in trials.values()} == {"t1": "SUCCEEDED", "t2": "SYS_CANCELED", "t3": "SYS_CANCELED"}
    assert trials["t2"].message == trials["t3"].message == IMPORTED_RUN_GONE
    assert not service.experiment_view().imported  # taken up here: a later resume is an ordinary one
    assert client.llen("rq:queue:trialstream.local") == 0  # no job queued: nothing imported runs again
