"""Customized trials, the tuner's "no more" and imported data across a runner's SIGKILL and `trialstream resume`, with
real runner processes (`trialstream run` / `resume`) on a shared Redis. Kills are tied to what the log holds: a runner
SIGSTOPped before a request is appended has not read it; one killed once a Numbered event is in the log, with every
slot held by a gated trial, has numbered and not submitted."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from core import keys
from core.event_store import EventStore, StoredEvent
from core.settings import Settings
from manager import host as host_module
from manager.dispatcher import NewTrial
from manager.host import ExperimentNotRunning, ManagerHost
from manager.replay import check
from manager.views import ViewStore
from schemas.events import (
    CustomizedTrialNumbered,
    CustomizedTrialRefused,
    CustomizedTrialRequested,
    Event,
    ExperimentFinished,
    ExperimentResumed,
    ExperimentStopRequested,
    ImportedTrial,
    TrialStarted,
    TrialSubmitted,
    TunerDataImported,
    TunerNoMoreTrials,
    now_ms,
)
from schemas.nni_rest import experiment_status
from schemas.trial import HyperParameters, JobApplicationForm
from tests.api.test_api import IMPORTER, write_trial
from tests.api.test_api_smoke import experiment_config
from tests.conftest import Processes, wait_until
from tests.manager.test_resume import trialstream


class Run:
    """One experiment of the gated trial (tests/api/test_api.py), run by `trialstream run` on the test's Redis."""

    def __init__(self, tmp_path: Path, processes: Processes, client: redis.Redis, **config: Any) -> None:
        self.code = write_trial(tmp_path / "code")
        self.client = client
        self.redis_url = processes.redis_url
        config_file = tmp_path / "config.yml"
        config_file.write_text(json.dumps(experiment_config(self.code, **config)))
        self.process = trialstream(self.redis_url, "run", str(config_file), "--json")
        self.experiment_id = str(
            wait_until(lambda: cast(list[str], client.zrange(keys.EXPERIMENTS, 0, -1)), 30, what="the experiment")[0]
        )
        self.store = EventStore(client, self.experiment_id)
        self.views = ViewStore(client, self.experiment_id)
        self.host = ManagerHost(client, Settings(), project=False)  # the API's code path, without its server

    def events(self) -> list[Event]:
        return [entry.event for entry in self.store.read() if isinstance(entry, StoredEvent)]

    def of(self, kind: type[Any]) -> list[Any]:
        return [event for event in self.events() if isinstance(event, kind)]

    def wait_running(self, count: int) -> None:
        def running() -> bool:
            return sum(trial.status == "RUNNING" for trial in self.views.trials()) == count

        wait_until(running, 30, what=f"{count} trials running")

    def kill(self) -> None:
        """SIGKILL the runner, stopped or not: it leaves its claim to lapse."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def resume(self) -> subprocess.Popen[str]:
        self.process = trialstream(self.redis_url, "resume", self.experiment_id, "--json")
        return self.process

    def finish(self) -> list[dict[str, Any]]:
        """Open every gate and wait for the runner's end: its trials, as `--json` prints them."""
        (self.code / "gates" / "all").touch()
        output, errors = self.process.communicate(timeout=90)
        assert self.process.returncode == 0, errors
        assert check(self.client, self.experiment_id) == []  # the views equal a rebuild from the log
        return cast(list[dict[str, Any]], json.loads(output)["trials"])

    def close(self) -> None:
        (self.code / "gates" / "all").touch()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()


@pytest.fixture
def served_run(tmp_path: Path, processes: Processes, client: redis.Redis) -> Any:
    processes.projector()
    processes.worker(args=("--concurrency", "4"))
    runs: list[Run] = []

    def start(**config: Any) -> Run:
        runs.append(Run(tmp_path, processes, client, **config))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


def assert_numbers_kept(run: Run, budget: int) -> dict[str, int]:
    """Every customized request answered at most once; each numbered one submitted exactly once, under its number
    and with its parameters, none refused after; no sequence id submitted twice, none skipped or past the budget.
    The numbers given, by request."""
    events = run.events()
    numbered = {event.request_id: event.sequence_id for event in events if isinstance(event, CustomizedTrialNumbered)}
    answers = Counter(
        event.request_id for event in events if isinstance(event, CustomizedTrialNumbered | CustomizedTrialRefused)
    )
    assert all(count == 1 for count in answers.values()), answers
    submitted = [event for event in events if isinstance(event, TrialSubmitted)]
    sequences = Counter(event.form.sequence_id for event in submitted)
    assert all(count == 1 for count in sequences.values()), sequences
    assert sorted(sequences) == list(range(budget)), sequences  # none skipped, none past maxTrialNumber
    entries = {entry.id: entry.event for entry in run.store.read() if isinstance(entry, StoredEvent)}
    for request, sequence_id in numbered.items():
        (trial,) = [event for event in submitted if event.requested_by == request]
        assert trial.form.sequence_id == sequence_id
        asked = entries[request]
        assert isinstance(asked, CustomizedTrialRequested)
        assert json.loads(trial.form.hyper_parameters.value)["parameters"] == asked.parameters
    refused = {event.request_id for event in events if isinstance(event, CustomizedTrialRefused)}
    assert not refused & {event.requested_by for event in submitted}
    return numbered


def test_requests_a_killed_runner_never_read_or_numbered_and_never_submitted_run_once_under_their_numbers(
    served_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_module, "CUSTOMIZED_WAIT_S", 1.0)
    run = served_run(trials=5, concurrency=1)
    run.wait_running(1)  # sequence 0 holds the only slot
    numbered_first = run.host.add_customized_trial(run.experiment_id, {"x": 0.25})
    assert numbered_first.sequence_id == 1  # numbered, not submitted: no slot

    run.process.send_signal(signal.SIGSTOP)  # reads nothing more
    unread = run.host.add_customized_trial(run.experiment_id, {"x": 0.75})
    assert unread.sequence_id is None  # nobody read it within the wait: the answer names the request to look for
    assert len(run.of(CustomizedTrialRequested)) == 2 and len(run.of(CustomizedTrialNumbered)) == 1
    run.kill()
    run.resume()
    wait_until(lambda: len(run.of(CustomizedTrialNumbered)) == 2, 30, what="the unread request numbered")
    trials = run.finish()

    numbered = assert_numbers_kept(run, budget=5)
    assert sorted(numbered.values()) == [1, 2]
    assert numbered[unread.request_id] == 2  # the unread one took the next number, after the one kept
    assert {trial["status"] for trial in trials} == {"SUCCEEDED"} and len(trials) == 5
    starts = Counter(event.trial_id for event in run.of(TrialStarted))
    assert set(starts.values()) == {1}  # each ran once


def test_requests_racing_the_tuner_for_the_last_places_never_overspend_or_share_a_number(served_run: Any) -> None:
    run = served_run(trials=4, concurrency=2)
    run.wait_running(2)  # 0 and 1: two places left
    answers: list[int | str] = []

    def ask(x: float) -> None:
        try:
            answers.append(cast(int, run.host.add_customized_trial(run.experiment_id, {"x": x}).sequence_id))
        except ExperimentNotRunning as refused:
            answers.append(str(refused))

    asking = [threading.Thread(target=ask, args=(x / 10,)) for x in range(3)]
    (run.code / "gates" / "all").touch()  # the two end: the tuner is asked for their places as the requests come
    for thread in asking:
        thread.start()
    for thread in asking:
        thread.join(30)
    trials = run.finish()

    numbered = assert_numbers_kept(run, budget=4)
    assert sorted(answer for answer in answers if isinstance(answer, int)) == sorted(numbered.values())
    refusals = [answer for answer in answers if isinstance(answer, str)]
    assert all("maxTrialNumber" in refusal for refusal in refusals), refusals
    assert len(trials) == 4


def test_the_tuner_s_no_more_is_cleared_by_a_resume_and_set_again_by_the_new_tuner(served_run: Any) -> None:
    grid = {"x": {"_type": "choice", "_value": [0.25, 0.5]}}
    run = served_run(trials=10, concurrency=3, searchSpace=grid, tuner={"name": "GridSearch"})
    run.wait_running(2)
    wait_until(lambda: run.of(TunerNoMoreTrials), 30, what="the tuner's no more")
    wait_until(lambda: (view := run.views.experiment()) and view.tuner_no_more_trials, 30, what="shown")
    run.kill()
    run.resume()
    wait_until(lambda: run.of(ExperimentResumed), 30, what="the resume")
    wait_until(lambda: len(run.of(TunerNoMoreTrials)) == 2, 30, what="the new tuner's no more")
    trials = run.finish()
    said = [
        (type(event).__name__, getattr(event, "no_more", None))
        for event in run.events()
        if isinstance(event, TunerNoMoreTrials | ExperimentResumed)
    ]
    assert said == [("TunerNoMoreTrials", True), ("ExperimentResumed", None), ("TunerNoMoreTrials", True)], said
    assert len(trials) == 2


def importer(directory: Path) -> dict[str, Any]:
    """A tuner that writes a line when built and one for each import_data (tests/api/test_api.py's)."""
    (directory / "algorithms").mkdir(exist_ok=True)
    (directory / "algorithms" / "importer.py").write_text(IMPORTER)
    log = str(directory / "imports.jsonl")
    return {
        "codeDirectory": str(directory / "algorithms"),
        "className": "importer.Importer",
        "classArgs": {"log_file": log},
    }


def imports(directory: Path) -> list[Any]:
    return [json.loads(line) for line in (directory / "imports.jsonl").read_text().splitlines()]


def test_imported_data_reaches_each_tuner_once_across_a_kill(served_run: Any, tmp_path: Path) -> None:
    run = served_run(trials=3, concurrency=1, tuner=importer(tmp_path))
    run.wait_running(1)
    first = [ImportedTrial(parameter={"x": 0.1}, value=0.3)]
    run.host.import_data(run.experiment_id, first)
    given = [record.model_dump() for record in first]
    wait_until(lambda: imports(tmp_path) == [["start"], ["import", given]], 30, what="the first import")
    run.process.send_signal(signal.SIGSTOP)
    second = [ImportedTrial(parameter={"x": 0.2}, value=0.4)]
    run.host.import_data(run.experiment_id, second)  # logged while the runner's claim stands; it never reads it
    run.kill()
    run.resume()
    run.finish()
    again = [record.model_dump() for record in second]
    assert imports(tmp_path) == [["start"], ["import", given], ["start"], ["import", given], ["import", again]]


def test_a_log_from_before_customized_trials_were_numbered_resumes_and_replays(served_run: Any) -> None:
    """The runner of a log written before CustomizedTrialNumbered existed answered a request only by submitting it
    (TrialSubmitted.requested_by), and kept the ones waiting for a slot in memory: appended here as it wrote them."""
    run = served_run(trials=4, concurrency=1)
    run.wait_running(1)  # sequence 0
    run.process.send_signal(signal.SIGSTOP)  # from here the log is the old runner's
    service = run.host.service(run.experiment_id)
    ran = run.store.append(CustomizedTrialRequested(experiment_id=run.experiment_id, parameters={"x": 0.25}))
    old = NewTrial(None, {"x": 0.25}, source="customized")
    form = JobApplicationForm(sequence_id=1, hyper_parameters=HyperParameters(value=old.hyper_parameters))
    service.submit(service.submission(form, requested_by=ran))
    waiting = run.store.append(CustomizedTrialRequested(experiment_id=run.experiment_id, parameters={"x": 0.75}))
    run.kill()
    run.resume()
    trials = run.finish()

    numbered = assert_numbers_kept(run, budget=4)
    assert numbered == {waiting: 2}  # the one still waiting, numbered now; the one submitted then, not again
    assert [event.form.sequence_id for event in run.of(TrialSubmitted) if event.requested_by == ran] == [1]
    assert {trial["status"] for trial in trials} == {"SUCCEEDED"} and len(trials) == 4


def test_a_customized_trial_numbered_before_the_deadline_runs_and_one_asked_after_is_refused(
    served_run: Any,
) -> None:
    """maxExperimentDuration: no more tuner trials, as NNI; but a number given is a trial promised."""
    run = served_run(trials=5, concurrency=1, maxExperimentDuration="3s")
    run.wait_running(1)
    before_deadline = run.host.add_customized_trial(run.experiment_id, {"x": 0.25})
    assert before_deadline.sequence_id == 1  # numbered, waits for the slot

    def out_of_time() -> bool:
        view = run.views.experiment()
        return view is not None and experiment_status(view, 1, now_ms()) == "NO_MORE_TRIAL"

    wait_until(out_of_time, 30, what="the experiment's duration to pass")
    with pytest.raises(ExperimentNotRunning, match="maxExperimentDuration"):
        run.host.add_customized_trial(run.experiment_id, {"x": 0.75})
    trials = run.finish()
    assert sorted(trial["sequenceId"] for trial in trials) == [0, 1]
    (refused,) = run.of(CustomizedTrialRefused)
    assert "maxExperimentDuration" in refused.reason


def test_data_imported_as_the_runner_stops_reaches_the_resumed_tuner_once(served_run: Any, tmp_path: Path) -> None:
    """The host checked the experiment RUNNING and its claim held, then the runner recorded STOPPED before the import
    was appended: no tuner has it yet, and the next one gets it once, after what was imported before."""
    run = served_run(trials=3, concurrency=1, tuner=importer(tmp_path))
    run.wait_running(1)
    before = [ImportedTrial(parameter={"x": 0.1}, value=0.3)]
    run.host.import_data(run.experiment_id, before)
    run.store.append(ExperimentStopRequested(experiment_id=run.experiment_id, reason="enough"))
    wait_until(lambda: run.of(ExperimentFinished), 30, what="the runner to record the stop")
    late = [ImportedTrial(parameter={"x": 0.2}, value=0.4)]
    run.store.append(TunerDataImported(experiment_id=run.experiment_id, data=late))  # as the host appends it
    run.process.communicate(timeout=30)
    run.resume()
    run.finish()
    given, again = ([record.model_dump() for record in data] for data in (before, late))
    assert imports(tmp_path) == [["start"], ["import", given], ["start"], ["import", given], ["import", again]]
