"""The manager's own API (/api/v1) end to end: a real `trialstream manager` over HTTP, a real worker, real trials.

Trials are gated: each waits for a file named after its trial id (or `all`) in the code directory's
`gates/`, so a test decides when each one ends and every assertion is tied to progress, not to time.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.connections import connect
from manager.replay import check
from simulators.waiting import wait_until
from tests.api.test_api_smoke import experiment_config
from tests.conftest import Processes
from tests.manager.test_config import CUSTOM_TUNER
from tests.support import web
from tests.support.configs import TOO_DEEP, deep_mapping, deep_space, nested, too_deep

GATED_TRIAL = """\
import json, os, sys, time
from pathlib import Path
import trialstream_sdk as nni

params = nni.get_next_parameter()
trial = nni.get_trial_id()
Path("params", trial + ".json").write_text(json.dumps(params))
nni.report_intermediate_result(0.5)
while not Path("gates", trial).exists() and not Path("gates", "all").exists():
    time.sleep(0.05)
nni.report_final_result(params.get("x", 0))
"""

IMPORTER = '''
import json
from nni.tuner import Tuner


class Importer(Tuner):
    """Proposes x = id / 10; writes a line when built and one for each import_data, with what it got."""

    def __init__(self, log_file):
        self.log_file = log_file
        self._write(["start"])

    def _write(self, line):
        with open(self.log_file, "a") as out:
            out.write(json.dumps(line) + "\\n")

    def update_search_space(self, search_space):
        pass

    def generate_parameters(self, parameter_id, **kwargs):
        return {"x": parameter_id / 10}

    def receive_trial_result(self, parameter_id, parameters, value, **kwargs):
        pass

    def import_data(self, data):
        self._write(["import", data])
'''

TERMINAL = {"SUCCEEDED", "FAILED", "USER_CANCELED", "SYS_CANCELED", "EARLY_STOPPED"}

pytestmark = pytest.mark.xdist_group("api")  # one manager and worker for the module, started once


def write_trial(code: Path) -> Path:
    """The gated trial in `code`, with its `gates/` and `params/` directories."""
    code.mkdir(exist_ok=True)
    (code / "trial.py").write_text(GATED_TRIAL)
    (code / "gates").mkdir(exist_ok=True)
    (code / "params").mkdir(exist_ok=True)
    return code


@dataclass
class Api:
    """A client of one manager's /api/v1, with the waits the tests need."""

    http: httpx.Client
    code: Path

    def create(self, config: dict[str, Any]) -> str:
        answer = self.http.post("/experiments", json={"config": config})
        assert answer.status_code == 201, answer.text
        return str(answer.json()["id"])

    def experiment(self, experiment_id: str) -> dict[str, Any]:
        answer = self.http.get(f"/experiments/{experiment_id}")
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    def trials(self, experiment_id: str, **params: Any) -> list[dict[str, Any]]:
        answer = self.http.get(f"/experiments/{experiment_id}/trials", params={"limit": 1000, **params})
        assert answer.status_code == 200, answer.text
        return list(answer.json()["items"])

    def events(self, experiment_id: str) -> list[dict[str, Any]]:
        """The whole log, a page at a time."""
        items: list[dict[str, Any]] = []
        after = "0-0"
        while page := self.http.get(f"/experiments/{experiment_id}/events", params={"after": after}).json()["items"]:
            items += page
            after = page[-1]["id"]
        return items

    def wait_status(self, experiment_id: str, status: str, timeout: float = 60) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            state = self.experiment(experiment_id)
            return state if state["status"] == status else None

        state = wait_until(reached, timeout, interval=0.1, what=f"experiment {experiment_id} to be {status}")
        assert state is not None
        return state

    def wait_running(self, experiment_id: str, count: int, timeout: float = 30) -> list[dict[str, Any]]:
        """Until exactly `count` trials are RUNNING (each has started: its gate is what holds it)."""

        def running() -> list[dict[str, Any]] | None:
            trials = self.trials(experiment_id, status="RUNNING")
            return trials if len(trials) == count else None

        trials = wait_until(running, timeout, interval=0.1, what=f"{count} trials of {experiment_id} running")
        assert trials is not None
        return trials

    def nni(self, experiment_id: str, path: str) -> httpx.URL:
        """The URL of `path` in NNI's API of this experiment (`/nni/<id>/api/v1/nni`), as its web UI asks."""
        return self.http.base_url.join(f"/nni/{experiment_id}/api/v1/nni{path}")

    def nni_status(self, experiment_id: str) -> str:
        answer = self.http.get(self.nni(experiment_id, "/check-status"))
        assert answer.status_code == 200, answer.text
        return str(answer.json()["status"])

    def release(self, *trial_ids: str) -> None:
        for trial_id in trial_ids:
            (self.code / "gates" / trial_id).touch()

    def release_all(self) -> None:
        (self.code / "gates" / "all").touch()


def start_api(processes: Processes) -> str:
    """A manager (with its own projector) and a worker running up to 4 trials at once: the manager's URL."""
    processes.worker(args=("--concurrency", "4"))
    return processes.manager()


@contextlib.contextmanager
def api_client(url: str, code: Path) -> Iterator[Api]:
    """A client of the manager at `url` whose trials run `code`; their gates open when it closes, so
    nothing of the test is left holding the worker."""
    with httpx.Client(base_url=f"{url}/api/v1", timeout=30) as http:
        api = Api(http, write_trial(code))
        try:
            yield api
        finally:
            api.release_all()


@pytest.fixture(scope="module")
def manager_url(module_processes: Processes) -> str:
    return start_api(module_processes)


@pytest.fixture
def api(manager_url: str, tmp_path: Path) -> Iterator[Api]:
    """The module's manager and worker; a test isolates by the experiments it creates and its own trial code."""
    with api_client(manager_url, tmp_path / "code") as client:
        yield client


def in_flight_at_submissions(events: list[dict[str, Any]], after_index: int) -> list[int]:
    """For each TrialSubmitted after `after_index` in the log, how many trials were in flight (submitted,
    not ended) just before it, in log order: what the runner saw when it submitted."""
    flying: set[str] = set()
    seen: list[int] = []
    for index, item in enumerate(events):
        event = item["event"]
        if event["type"] == "TrialSubmitted":
            if index > after_index:
                seen.append(len(flying))
            flying.add(event["trialId"])
        elif event["type"] == "TrialEnded":
            flying.discard(event["trialId"])
    return seen


def parameters_of(trial: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(trial["hyperParameters"]["value"])) if "hyperParameters" in trial else {}


# experiments: create, list, get, and what is refused


def test_create_list_get_and_refusals_name_what_is_wrong(api: Api, tmp_path: Path) -> None:
    def listed() -> set[str]:
        return {state["id"] for state in api.http.get("/experiments").json()}

    before = listed()
    good = experiment_config(api.code, trials=1)
    experiment_id = api.create(good)
    api.release_all()
    assert listed() == before | {experiment_id}
    state = api.wait_status(experiment_id, "DONE")
    assert state["trialCounts"] == {"SUCCEEDED": 1} and state["config"]["maxTrialNumber"] == 1

    invalid = api.http.post("/experiments", json={"config": {**good, "trialConcurrency": 0}})
    assert invalid.status_code == 422 and "trialConcurrency" in invalid.json()["error"], invalid.text
    unknown_key = api.http.post("/experiments", json={"config": {**good, "maxTrialNumbr": 3}})
    assert unknown_key.status_code == 422 and "maxTrialNumbr" in unknown_key.json()["error"], unknown_key.text
    platform = api.http.post("/experiments", json={"config": {**good, "trainingService": {"platform": "nowhere"}}})
    assert platform.status_code == 422 and "nowhere" in platform.json()["error"], platform.text
    missing = tmp_path / "no-such-code"
    no_code = api.http.post("/experiments", json={"config": {**good, "trialCodeDirectory": str(missing)}})
    assert no_code.status_code == 422 and str(missing) in no_code.json()["error"], no_code.text
    no_upload = api.http.post("/experiments", json={"config": good, "codeId": "0" * 64})
    assert no_upload.status_code == 422 and "codeId" in no_upload.json()["error"], no_upload.text
    assert listed() == before | {experiment_id}  # nothing was created by any refused request

    assert api.http.get("/experiments/nope").status_code == 404
    assert api.http.get("/experiments/-bad").status_code == 422
    assert api.http.get(f"/experiments/{experiment_id}/trials/nope").status_code == 404


def test_stop_cancels_running_trials_resume_runs_to_the_budget_and_delete_waits_for_the_end(api: Api) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=4, concurrency=2))
    first = api.wait_running(experiment_id, 2)

    refused = api.http.delete(f"/experiments/{experiment_id}")
    assert refused.status_code == 409, refused.text

    assert api.http.post(f"/experiments/{experiment_id}/stop").status_code == 202
    api.wait_status(experiment_id, "STOPPED")
    # the runner records STOPPED, then lets go of the experiment
    wait_until(lambda: not api.experiment(experiment_id)["hosted"], what="the manager to let go of the experiment")
    trials = api.trials(experiment_id)
    assert {trial["id"]: trial["status"] for trial in trials} == {trial["id"]: "SYS_CANCELED" for trial in first}
    assert api.http.post(f"/experiments/{experiment_id}/stop").status_code == 409  # not running any more
    changed = api.http.patch(f"/experiments/{experiment_id}", json={"maxTrialNumber": 5})
    assert changed.status_code == 409 and "STOPPED" in changed.json()["error"]  # resuming it is the user's call

    assert api.http.post(f"/experiments/{experiment_id}/resume").status_code == 202
    api.release_all()
    api.wait_status(experiment_id, "DONE")
    trials = api.trials(experiment_id)
    assert [trial["sequenceId"] for trial in trials] == [0, 1, 2, 3]  # the budget counts the canceled two
    assert [trial["status"] for trial in trials] == ["SYS_CANCELED"] * 2 + ["SUCCEEDED"] * 2

    deleted = api.http.delete(f"/experiments/{experiment_id}")
    assert deleted.status_code == 200 and deleted.json()["deletedKeys"] > 0, deleted.text
    assert api.http.get(f"/experiments/{experiment_id}").status_code == 404
    assert api.http.get(f"/experiments/{experiment_id}/trials").status_code == 404
    assert experiment_id not in {state["id"] for state in api.http.get("/experiments").json()}
    assert api.http.delete(f"/experiments/{experiment_id}").status_code == 404


def test_changes_to_a_running_experiment_are_obeyed(api: Api) -> None:
    """More trials and more at once when raised; never more in flight than a lowered concurrency."""
    experiment_id = api.create(experiment_config(api.code, trials=2, concurrency=1))
    api.wait_running(experiment_id, 1)

    raised = api.http.patch(f"/experiments/{experiment_id}", json={"trialConcurrency": 3, "maxTrialNumber": 6})
    assert raised.status_code == 200, raised.text
    assert raised.json()["config"]["trialConcurrency"] == 3 and raised.json()["config"]["maxTrialNumber"] == 6
    running = api.wait_running(experiment_id, 3)  # three at once, held by their gates

    lowered = api.http.patch(f"/experiments/{experiment_id}", json={"trialConcurrency": 1})
    assert lowered.status_code == 200 and lowered.json()["config"]["trialConcurrency"] == 1
    events = api.events(experiment_id)
    lowered_at = max(i for i, item in enumerate(events) if item["event"]["type"] == "ExperimentUpdated")
    api.release(*(trial["id"] for trial in running))
    api.release_all()
    api.wait_status(experiment_id, "DONE")

    trials = api.trials(experiment_id)
    assert [trial["sequenceId"] for trial in trials] == list(range(6))
    assert {trial["status"] for trial in trials} == {"SUCCEEDED"}
    submitted_with = in_flight_at_submissions(api.events(experiment_id), lowered_at)
    assert submitted_with == [0, 0, 0], submitted_with  # the last three, each once nothing else was in flight

    bad = api.http.patch(f"/experiments/{experiment_id}", json={"trialConcurrency": 0})
    assert bad.status_code == 422
    more = api.http.patch(f"/experiments/{experiment_id}", json={"maxTrialNumber": 7})
    assert more.status_code == 200, more.text
    # taken up again, as NNI does: running, or (its gates open) already done with the seventh trial
    taken_up = more.json()["status"] == "RUNNING" or sum(more.json()["trialCounts"].values()) == 7
    assert taken_up, more.text
    api.wait_status(experiment_id, "DONE")
    assert [trial["status"] for trial in api.trials(experiment_id)] == ["SUCCEEDED"] * 7


def test_a_change_with_an_unknown_key_or_nothing_to_change_leaves_a_done_experiment_as_it_was(api: Api) -> None:
    """A misspelt key was dropped, leaving an empty change that took a DONE experiment up again (its log
    written, its endTime moved). An unknown key is refused by name; an empty change set is no change."""
    experiment_id = api.create(experiment_config(api.code, trials=1))
    api.release_all()
    done = api.wait_status(experiment_id, "DONE")
    log = api.events(experiment_id)

    for body, unknown in (({"bogus": 1}, "bogus"), ({"maxTrialNumbr": 5, "trialConcurrency": 2}, "maxTrialNumbr")):
        refused = api.http.patch(f"/experiments/{experiment_id}", json=body)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error.startswith(f"{unknown}: "), error
        assert error.endswith("trialConcurrency, maxTrialNumber, maxExperimentDuration, searchSpace"), error
    for nothing in ({}, {"maxTrialNumber": None}):
        unchanged = api.http.patch(f"/experiments/{experiment_id}", json=nothing)
        assert unchanged.status_code == 200, unchanged.text
        assert unchanged.json() == done
    assert api.events(experiment_id) == log


def test_a_customized_trial_runs_with_exactly_its_parameters_within_the_budget(api: Api) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=2, concurrency=1))
    (tuner_trial,) = api.wait_running(experiment_id, 1)
    mine = {"x": 0.125, "note": "mine", "nested": {"depth": [1, 2]}}

    answer = api.http.post(f"/experiments/{experiment_id}/trials", json={"parameters": mine})
    assert answer.status_code == 201, answer.text
    # the budget (2) is now spoken for, by the running trial and the one waiting for its slot
    over = api.http.post(f"/experiments/{experiment_id}/trials", json={"parameters": {"x": 0.5}})
    assert over.status_code == 409 and "maxTrialNumber" in over.json()["error"], over.text

    api.release(tuner_trial["id"])
    api.release_all()
    api.wait_status(experiment_id, "DONE")
    trials = api.trials(experiment_id)
    assert len(trials) == 2
    customized = [trial for trial in trials if parameters_of(trial["form"])["parameter_source"] == "customized"]
    assert len(customized) == 1 and customized[0]["status"] == "SUCCEEDED"
    ran_with = json.loads((api.code / "params" / f"{customized[0]['id']}.json").read_text())
    assert ran_with == mine
    assert customized[0]["finalMetricData"][0]["data"] == json.dumps(0.125) or customized[0]["finalMetricData"]

    after = api.http.post(f"/experiments/{experiment_id}/trials", json={"parameters": {"x": 0.5}})
    assert after.status_code == 409


def test_trial_pages_filters_and_metric_order(api: Api) -> None:
    """Pages by sequence, by status, and best-first by final metric for a maximizing and a minimizing tuner."""
    experiment_id = api.create(experiment_config(api.code, trials=5, concurrency=4))
    minimizing = api.create(
        experiment_config(
            api.code, trials=5, concurrency=4, tuner={"name": "Random", "classArgs": {"optimize_mode": "minimize"}}
        )
    )
    api.release_all()
    api.wait_status(experiment_id, "DONE")
    api.wait_status(minimizing, "DONE")

    everything = api.trials(experiment_id)
    assert [trial["sequenceId"] for trial in everything] == [0, 1, 2, 3, 4]
    page = api.http.get(f"/experiments/{experiment_id}/trials", params={"offset": 1, "limit": 2}).json()
    assert page["total"] == 5 and page["offset"] == 1
    assert [trial["sequenceId"] for trial in page["items"]] == [1, 2]
    assert api.trials(experiment_id, offset=5) == []
    assert len(api.trials(experiment_id, status="SUCCEEDED")) == 5
    assert api.trials(experiment_id, status="FAILED") == []
    assert api.http.get(f"/experiments/{experiment_id}/trials", params={"status": "BOGUS"}).status_code == 422
    assert api.http.get(f"/experiments/{experiment_id}/trials", params={"limit": 0}).status_code == 422

    for exp, best_first_high in ((experiment_id, True), (minimizing, False)):
        values = [trial["finalMetricData"][-1]["data"] for trial in api.trials(exp, sort="metric")]
        scores = [float(json.loads(value)) for value in values]
        assert scores == sorted(scores, reverse=best_first_high), (exp, scores)
        paged = [
            float(json.loads(trial["finalMetricData"][-1]["data"]))
            for offset in range(0, 5, 2)
            for trial in api.trials(exp, sort="metric", offset=offset, limit=2)
        ]
        assert paged == scores


def test_cancel_early_stop_metrics_and_the_trial_form(api: Api) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=3, concurrency=2))
    first, second = api.wait_running(experiment_id, 2)
    base = f"/experiments/{experiment_id}/trials"

    def reached(trial_id: str, status: str) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            trial = api.http.get(f"{base}/{trial_id}").json()
            return trial if trial["status"] == status else None

        trial = wait_until(probe, 30, interval=0.1, what=f"trial {trial_id} {status}")
        assert trial is not None
        return trial

    # metrics: the intermediate result every trial reports before it waits at its gate
    metrics = wait_until(lambda: api.http.get(f"{base}/{first['id']}/metrics").json()["items"], 30, what="a metric")
    assert [(m["type"], float(json.loads(m["data"]))) for m in metrics] == [("PERIODICAL", 0.5)]
    assert api.http.get(f"{base}/nope/metrics").status_code == 404

    # PUT: a new form for a running trial (NNI's updateTrialJob)
    form = {"sequenceId": first["sequenceId"], "hyperParameters": {"value": json.dumps({"parameters": {"x": 1}})}}
    updated = api.http.put(f"{base}/{first['id']}", json=form)
    assert updated.status_code == 200 and updated.json()["id"] == first["id"], updated.text
    assert api.http.put(f"{base}/nope", json=form).status_code == 404
    assert api.http.put(f"{base}/{first['id']}", json={"sequenceId": "x"}).status_code == 422
    # a value the trial (its parameter.cfg) and the views could not parse: refused, the form left as it was
    for value, why in (
        ("not json", "hyperParameters.value: not JSON"),
        ("[" * 5000 + "]" * 5000, "hyperParameters.value: nested too deep to read"),
        (json.dumps(nested(65)), f"hyperParameters.value{'[0]' * 64}: nested more than 64 levels deep"),
    ):
        bad = {"sequenceId": first["sequenceId"], "hyperParameters": {"value": value}}
        refused = api.http.put(f"{base}/{first['id']}", json=bad)
        assert refused.status_code == 422 and refused.json()["error"].startswith(why), refused.text
    assert api.http.get(f"{base}/{first['id']}").json()["form"] == updated.json()["form"]

    canceled = api.http.post(f"{base}/{first['id']}/cancel")  # no body: earlyStopped false
    assert canceled.status_code == 200, canceled.text
    assert reached(first["id"], "USER_CANCELED")["id"] == first["id"]
    stopped = api.http.post(f"{base}/{second['id']}/cancel", json={"earlyStopped": True})
    assert stopped.status_code == 200, stopped.text
    assert reached(second["id"], "EARLY_STOPPED")["id"] == second["id"]
    assert api.http.post(f"{base}/nope/cancel", json={}).status_code == 404
    unknown = api.http.post(f"{base}/nope/cancel")  # the missing trial, not the missing (optional) body
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"], unknown.text

    api.release_all()
    api.wait_status(experiment_id, "DONE")
    statuses = sorted(trial["status"] for trial in api.trials(experiment_id))
    assert statuses == ["EARLY_STOPPED", "SUCCEEDED", "USER_CANCELED"]
    # a cancel of an ended trial changes nothing
    again = api.http.post(f"{base}/{first['id']}/cancel", json={"earlyStopped": True})
    assert again.status_code == 200 and again.json()["status"] == "USER_CANCELED"


def test_cluster_metadata_and_health(api: Api) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=1))
    api.release_all()
    base = f"/experiments/{experiment_id}/cluster-metadata"
    trial_config = api.http.get(f"{base}/trial_config")
    assert trial_config.status_code == 200 and "trial.py" in json.loads(trial_config.json()["value"])["command"]
    assert api.http.get(f"{base}/no_such_key").status_code == 409
    put = api.http.put(f"{base}/my_key", json={"value": "my value"})
    assert put.status_code == 200 and put.json() == {"value": "my value"}
    assert api.http.get(f"{base}/my_key").json() == {"value": "my value"}

    assert api.http.get("/health").json()["status"] == "ok"
    ready = api.http.get("/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ok", "checks": {"redis": "ok", "projector": "ok"}}
    api.wait_status(experiment_id, "DONE")


def test_events_pages_chain_through_the_whole_log(api: Api) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=3, concurrency=2))
    api.release_all()
    api.wait_status(experiment_id, "DONE")
    whole = api.http.get(f"/experiments/{experiment_id}/events", params={"limit": 10_000}).json()
    ids = [item["id"] for item in whole["items"]]
    assert len(ids) > 10 and whole["next"] == ids[-1]
    assert whole["items"][0]["event"]["type"] == "ExperimentCreated"
    assert whole["items"][-1]["event"]["type"] == "ExperimentFinished"

    chained: list[str] = []
    after = "0-0"
    while True:
        page = api.http.get(f"/experiments/{experiment_id}/events", params={"after": after, "limit": 3}).json()
        assert len(page["items"]) <= 3
        if not page["items"]:
            assert page["next"] == after  # the end: asking again gives nothing new
            break
        chained += [item["id"] for item in page["items"]]
        after = page["next"]
    assert chained == ids  # no gap, no repeat
    assert api.http.get(f"/experiments/{experiment_id}/events", params={"after": "zz"}).status_code == 422


class SseReader:
    """A Server-Sent Events client on its own thread, keeping every event it receives."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, params: dict[str, str] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.connected = threading.Event()
        self._close = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, headers or {}, params or {}), daemon=True)
        self._thread.start()
        assert self.connected.wait(20), "the event stream did not open"

    def _read(self, url: str, headers: dict[str, str], params: dict[str, str]) -> None:
        try:
            self._follow(url, headers, params)
        except httpx.HTTPError:
            if not self._close.is_set():  # a closed reader's connection ends with the manager
                raise

    def _follow(self, url: str, headers: dict[str, str], params: dict[str, str]) -> None:
        with web.stream("GET", url, headers=headers, params=params, timeout=httpx.Timeout(30, read=None)) as answer:
            assert answer.status_code == 200
            fields: dict[str, str] = {}
            for line in answer.iter_lines():
                if line.startswith(": "):
                    self.connected.set()  # the stream's first comment: the server has taken its cursor
                elif line == "":
                    if "data" in fields:
                        self.events.append({"id": fields.get("id"), **json.loads(fields["data"])})
                    fields = {}
                else:
                    name, _, value = line.partition(": ")
                    fields[name] = value
                if self._close.is_set():
                    return

    def close(self) -> None:
        self._close.set()


def test_event_stream_follows_new_entries_and_resumes_after_the_last_event_id(api: Api) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=2, concurrency=1))
    (first,) = api.wait_running(experiment_id, 1)
    url = f"{str(api.http.base_url).rstrip('/')}/experiments/{experiment_id}/events/stream"
    live = SseReader(url)
    api.release(first["id"])  # from here on, the first trial ends and the second is submitted

    def submitted_after_connecting() -> str | None:
        for event in live.events:
            if event["event"]["type"] == "TrialSubmitted" and event["event"]["trialId"] != first["id"]:
                return str(event["event"]["trialId"])
        return None

    second = wait_until(submitted_after_connecting, 30, what="the stream to show the second trial submitted")
    wait_until(
        lambda: any(e["event"]["type"] == "TrialStarted" and e["event"]["trialId"] == second for e in live.events),
        30,
        what="the second trial's start on the stream",
    )
    live.close()
    seen = list(live.events)
    last_id = seen[-1]["id"]
    api.release_all()
    api.wait_status(experiment_id, "DONE")

    resumed = SseReader(url, headers={"Last-Event-ID": last_id})
    log = api.events(experiment_id)
    wait_until(lambda: resumed.events and resumed.events[-1]["id"] == log[-1]["id"], 30, what="the resumed stream")
    resumed.close()
    ids = [event["id"] for event in seen + resumed.events]
    log_ids = [item["id"] for item in log]
    start = log_ids.index(ids[0])
    assert ids == log_ids[start:]  # contiguous with the log: no gap, no repeat across the reconnect
    assert all(event == item for event, item in zip(seen + resumed.events, log[start:], strict=True))

    everything = SseReader(url, params={"after": "0-0"})
    wait_until(lambda: len(everything.events) == len(log), 30, what="the whole log on the stream")
    everything.close()
    assert [event["id"] for event in everything.events] == log_ids


def test_a_search_space_change_is_checked_as_a_configs_is(api: Api) -> None:
    experiment_id = api.create(experiment_config(api.code, trials=1, concurrency=1))
    api.wait_running(experiment_id, 1)
    for space, key in (
        ({"lr": [0.1, 0.2]}, "searchSpace.lr"),
        ({"lr": {"_type": "nonsense", "_value": [1, 2]}}, "searchSpace.lr._type"),
        ({"lr": {"_type": "uniform", "_value": "wide"}}, "searchSpace.lr._value"),
    ):
        refused = api.http.patch(f"/experiments/{experiment_id}", json={"searchSpace": space})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"].startswith(key), refused.text
    good = {"lr": {"_type": "loguniform", "_value": [0.001, 0.1]}}
    changed = api.http.patch(f"/experiments/{experiment_id}", json={"searchSpace": good})
    assert changed.status_code == 200, changed.text
    assert changed.json()["config"]["searchSpace"] == good
    api.release_all()


@pytest.mark.parametrize("tuner", [{"name": "Random"}, {"codeDirectory": "tuners", "className": "mine.Mine"}])
def test_a_search_space_nested_too_deep_is_refused_not_lost(api: Api, tuner: dict[str, Any]) -> None:
    """Past ~200 levels its event could not be read back: a new experiment's config was lost, a change answered
    200 and was lost; at 600 a change answered 500. Past 64 it is refused (422; NNI's API: 400) with where,
    whatever the tuner (a custom one reads its space alone), and nothing is written."""
    (api.code / "tuners").mkdir()
    (api.code / "tuners" / "mine.py").write_text(CUSTOM_TUNER)
    tuner = {**tuner, "codeDirectory": str(api.code / "tuners")} if "className" in tuner else tuner
    config = experiment_config(api.code, trials=1, concurrency=1, tuner=tuner)
    for levels in (65, 600):
        refused = api.http.post("/experiments", json={"config": {**config, "searchSpace": deep_space(levels)}})
        assert refused.status_code == 422 and TOO_DEEP in refused.json()["error"], refused.text[-300:]
    experiment_id = api.create(config)
    api.wait_running(experiment_id, 1)

    root = str(api.http.base_url).rstrip("/").removesuffix("/api/v1")
    for levels in (65, 200, 600):
        refused = api.http.patch(f"/experiments/{experiment_id}", json={"searchSpace": deep_space(levels)})
        assert refused.status_code == 422 and refused.json()["error"].startswith(TOO_DEEP), refused.text[-300:]
        nni = api.http.put(
            f"{root}/nni/{experiment_id}/api/v1/nni/experiment",
            params={"update_type": "SEARCH_SPACE"},
            json={"params": {"searchSpace": deep_space(levels)}},
        )
        assert nni.status_code == 400 and nni.json()["error"].startswith(TOO_DEEP), nni.text[-300:]
    assert api.experiment(experiment_id)["config"]["searchSpace"] == config["searchSpace"]
    assert not any(item["event"]["type"] == "ExperimentUpdated" for item in api.events(experiment_id))

    deepest = api.http.patch(f"/experiments/{experiment_id}", json={"searchSpace": deep_space(64)})
    assert deepest.status_code == 200 and deepest.json()["config"]["searchSpace"] == deep_space(64), deepest.text
    api.release_all()


def test_class_args_nested_too_deep_are_refused_not_lost(api: Api) -> None:
    """Past ~200 levels the event holding the config could not be read back: a new experiment's config was lost.
    Past 64 they are refused (422) with where; 64 levels are kept as they were sent."""
    (api.code / "tuners").mkdir()
    (api.code / "tuners" / "mine.py").write_text(CUSTOM_TUNER)

    def config(levels: int) -> dict[str, Any]:
        tuner = {
            "codeDirectory": str(api.code / "tuners"),
            "className": "mine.Mine",
            "classArgs": deep_mapping(levels, "width"),
        }
        return experiment_config(api.code, trials=1, concurrency=1, tuner=tuner)

    for levels in (65, 200, 600):
        refused = api.http.post("/experiments", json={"config": config(levels)})
        assert refused.status_code == 422, refused.text[-300:]
        assert too_deep("tuner.classArgs.width") in refused.json()["error"], refused.text[-300:]
    experiment_id = api.create(config(64))
    assert api.experiment(experiment_id)["config"]["tuner"]["classArgs"] == deep_mapping(64, "width")
    api.release_all()


def test_customized_trial_parameters_nested_too_deep_are_refused_not_lost(api: Api) -> None:
    """Past ~200 levels the event holding them could not be read back: the experiment's log was broken. Past 64
    they are refused (422; NNI's API: 400) with where, and nothing is written; 64 levels run as they were sent."""
    experiment_id = api.create(experiment_config(api.code, trials=2, concurrency=1))
    api.wait_running(experiment_id, 1)
    nni = f"{str(api.http.base_url).rstrip('/').removesuffix('/api/v1')}/nni/{experiment_id}/api/v1/nni/trial-jobs"

    for levels in (65, 200, 600):
        refused = api.http.post(f"/experiments/{experiment_id}/trials", json={"parameters": deep_mapping(levels)})
        assert refused.status_code == 422, refused.text[-300:]
        assert refused.json()["error"].startswith(too_deep("parameters.x")), refused.text[-300:]
        refused = api.http.post(nni, json=deep_mapping(levels))
        assert refused.status_code == 400, refused.text[-300:]
        assert refused.json()["error"].startswith(too_deep("parameters.x")), refused.text[-300:]
    assert not any(
        item.get("event", {}).get("type") == "CustomizedTrialRequested" for item in api.events(experiment_id)
    )

    added = api.http.post(f"/experiments/{experiment_id}/trials", json={"parameters": deep_mapping(64)})
    assert added.status_code == 201, added.text
    api.release_all()
    api.wait_status(experiment_id, "DONE")
    assert all("event" in item for item in api.events(experiment_id))  # every event reads back
    trials = api.trials(experiment_id)
    (customized,) = [trial for trial in trials if parameters_of(trial["form"])["parameter_source"] == "customized"]
    assert json.loads((api.code / "params" / f"{customized['id']}.json").read_text()) == deep_mapping(64)


def test_no_depth_of_a_search_space_is_a_server_error(api: Api) -> None:
    """Just short of the depth JSON's parser refuses (a 400), the recursive check of a request's text for lone
    surrogates ran out of Python's stack: a 500. Every depth is a 4xx: too deep a space, or too deep to parse."""
    experiment_id = api.create(experiment_config(api.code, trials=1, concurrency=1))
    api.wait_running(experiment_id, 1)
    root = str(api.http.base_url).rstrip("/").removesuffix("/api/v1")
    config = json.dumps({"config": {**experiment_config(api.code), "searchSpace": "SPACE"}})
    for levels in range(900, 1001):  # bodies as text: the client's json.dumps would recurse as deep
        space = '{"a": {"_type": "choice", "_value": ' + "[" * levels + "1" + "]" * levels + "}}"
        for method, url, body in (
            ("POST", "/experiments", config.replace('"SPACE"', space)),
            ("PATCH", f"/experiments/{experiment_id}", f'{{"searchSpace": {space}}}'),
            ("PUT", f"{root}/nni/{experiment_id}/api/v1/nni/experiment", f'{{"params": {{"searchSpace": {space}}}}}'),
        ):
            answer = api.http.request(
                method,
                url,
                content=body,
                params={"update_type": "SEARCH_SPACE"} if method == "PUT" else None,
                headers={"content-type": "application/json"},
            )
            assert 400 <= answer.status_code < 500, (levels, method, answer.status_code, answer.text[-300:])
    api.release_all()


def test_event_stream_followers_leave_the_thread_pool_to_ordinary_requests(api: Api) -> None:
    """Followers wait on the log in blocking reads, on threads of their own: more of them than the
    handlers' pool has threads (40) still leave ordinary requests answered."""
    experiment_id = api.create(experiment_config(api.code, trials=1, concurrency=1))
    api.wait_running(experiment_id, 1)
    url = f"{str(api.http.base_url).rstrip('/')}/experiments/{experiment_id}/events/stream"
    followers = [SseReader(url) for _ in range(45)]
    try:
        with httpx.Client(base_url=str(api.http.base_url), timeout=10) as http:
            for _ in range(3):
                assert http.get(f"/experiments/{experiment_id}").status_code == 200
                assert http.get(f"/experiments/{experiment_id}/trials").status_code == 200
    finally:
        for follower in followers:
            follower.close()
        api.release_all()


# NNI's API: what the tuner says, customized trials, imported data


def test_an_exhausted_tuner_shows_as_nni_s_tuner_no_more_trial_until_it_gives_trials_again(
    api: Api, module_processes: Processes
) -> None:
    """NNI's manager: TUNER_NO_MORE_TRIAL on the tuner's NO_MORE_TRIAL_JOBS while trials run, RUNNING again on its
    next trial, DONE once nothing runs; logged when it changes, not at every request the tuner refuses."""
    grid = {"x": {"_type": "choice", "_value": [0.25, 0.5]}}
    config = experiment_config(api.code, trials=10, concurrency=3, searchSpace=grid, tuner={"name": "GridSearch"})
    experiment_id = api.create(config)
    api.wait_running(experiment_id, 2)  # the whole grid, a slot still free: the tuner said it has no more
    wait_until(lambda: api.nni_status(experiment_id) == "TUNER_NO_MORE_TRIAL", 30, what="TUNER_NO_MORE_TRIAL")
    metadata = api.http.get(api.nni(experiment_id, "/experiment-metadata")).json()
    assert metadata["status"] == "TUNER_NO_MORE_TRIAL"

    profile = api.http.get(api.nni(experiment_id, "/experiment")).json()
    wider = {"x": {"_type": "choice", "_value": [0.25, 0.5, 0.75]}}
    body = {**profile, "params": {**profile["params"], "searchSpace": wider}}
    updated = api.http.put(api.nni(experiment_id, "/experiment"), params={"update_type": "SEARCH_SPACE"}, json=body)
    assert updated.status_code == 200, updated.text
    api.wait_running(experiment_id, 3)  # the tuner gave a trial of the new space
    wait_until(lambda: api.nni_status(experiment_id) == "RUNNING", 30, what="RUNNING again")

    api.release_all()
    api.wait_status(experiment_id, "DONE")
    assert api.nni_status(experiment_id) == "DONE"
    said = [
        item["event"]["noMore"] for item in api.events(experiment_id) if item["event"]["type"] == "TunerNoMoreTrials"
    ]
    assert said == [True, False, True], said
    assert check(connect(module_processes.redis_url), experiment_id) == []  # the views fold again the same


def test_a_customized_trial_is_numbered_at_once_and_keeps_its_number_when_it_runs(api: Api) -> None:
    """NNI's addCustomizedTrialJob answers `nextSequenceId++` at once (its web UI shows "Trial No.<n>"), free slot
    or not, and refuses one past maxTrialNumber; the trial runs under that number when a slot frees."""
    experiment_id = api.create(experiment_config(api.code, trials=4, concurrency=1))
    (first,) = api.wait_running(experiment_id, 1)  # number 0, in the only slot
    nni = api.http.post(api.nni(experiment_id, "/trial-jobs"), json={"x": 0.25})
    assert (nni.status_code, nni.json()) == (200, {"sequenceId": 1}), nni.text
    native = api.http.post(f"/experiments/{experiment_id}/trials", json={"parameters": {"x": 0.5}})
    assert (native.status_code, native.json()["sequenceId"]) == (201, 2), native.text
    request = native.json()["requestId"]  # the request's place in the log, its answer after it
    answered = [item["event"] for item in api.events(experiment_id) if item["event"].get("requestId") == request]
    assert answered == [{**answered[0], "type": "CustomizedTrialNumbered", "sequenceId": 2}], answered
    last = api.http.post(api.nni(experiment_id, "/trial-jobs"), json={"x": 0.75})
    assert (last.status_code, last.json()) == (200, {"sequenceId": 3}), last.text
    over = api.http.post(api.nni(experiment_id, "/trial-jobs"), json={"x": 1.0})
    assert over.status_code == 409 and "maxTrialNumber" in over.json()["error"], over.text
    assert [trial["id"] for trial in api.trials(experiment_id)] == [first["id"]]  # none of them submitted yet

    api.release_all()
    api.wait_status(experiment_id, "DONE")
    jobs = api.http.get(api.nni(experiment_id, "/trial-jobs")).json()
    ran = {job["sequenceId"]: json.loads(job["hyperParameters"][0])["parameters"] for job in jobs}
    assert {sequence: ran[sequence] for sequence in (1, 2, 3)} == {1: {"x": 0.25}, 2: {"x": 0.5}, 3: {"x": 0.75}}
    assert sorted(ran) == [0, 1, 2, 3]


def test_imported_data_reaches_the_tuner_once_and_a_resumed_one_once_more(api: Api) -> None:
    """NNI's import-data (`nnictl experiment import`): checked, logged, given to the tuner's import_data as NNI's
    dispatcher gives it (JSON text decoded); a resume's new tuner gets it in its replay, once. A DONE experiment
    takes it too, for the tuner of an update's run."""
    (api.code / "algorithms").mkdir()
    (api.code / "algorithms" / "importer.py").write_text(IMPORTER)
    log = api.code / "imports.jsonl"
    tuner = {
        "codeDirectory": str(api.code / "algorithms"),
        "className": "importer.Importer",
        "classArgs": {"log_file": str(log)},
    }
    experiment_id = api.create(experiment_config(api.code, trials=2, concurrency=1, tuner=tuner))
    api.wait_running(experiment_id, 1)
    url = api.nni(experiment_id, "/experiment/import-data")
    for body, error in (
        ({"parameter": {"x": 0.1}, "value": 0.3}, "body: "),
        ([{"parameter": {"x": 0.1}, "value": 0.3}, {"parameter": {"x": 0.2}, "value": "loss"}], "body.1.value: "),
        ([{"parameter": {"x": 0.1}}], "body.0.value: "),
        ([{"parameter": {"x": 0.1}, "value": {"loss": 0.3}}], "body.0.value: "),
        ([{"parameter": {"y": 0.1}, "value": 0.3}], "body[0].parameter: missing x"),
        ([{"parameter": {"x": 0.1, "y": 2}, "value": 0.3}], "body[0].parameter.y: not in the search space"),
    ):
        refused = api.http.post(url, json=body)
        assert refused.status_code == 400 and refused.json()["error"].startswith(error), refused.text
    data = [
        {"parameter": {"x": 0.1}, "value": 0.3},
        {"parameter": {"x": 0.2}, "value": '{"default": 0.4}', "trialJobId": "elsewhere"},  # as export-data writes
    ]
    imported = api.http.post(url, json=data)
    assert (imported.status_code, imported.content) == (200, b""), imported.text
    given = [{"parameter": {"x": 0.1}, "value": 0.3}, {"parameter": {"x": 0.2}, "value": {"default": 0.4}}]

    def lines() -> list[Any]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    wait_until(lambda: lines() == [["start"], ["import", given]], 30, what="the tuner to get the data")
    listed = api.http.get(api.nni(experiment_id, "/experiment/imported-data"))
    assert [json.loads(text) for text in listed.json()] == [given]

    assert api.http.post(f"/experiments/{experiment_id}/stop").status_code == 202
    api.wait_status(experiment_id, "STOPPED")
    wait_until(lambda: not api.experiment(experiment_id)["hosted"], what="the manager to let go of the experiment")
    refused = api.http.post(url, json=data)
    assert refused.status_code == 409 and "not running" in refused.json()["error"], refused.text
    assert api.http.post(f"/experiments/{experiment_id}/resume").status_code == 202
    api.release_all()
    api.wait_status(experiment_id, "DONE")
    assert lines() == [["start"], ["import", given], ["start"], ["import", given]]  # replayed, not given twice

    later = [{"parameter": {"x": 0.3}, "value": 0.5}]
    taken = api.http.post(url, json=later)  # DONE: taken, as NNI's manager takes it, for the next run's tuner
    assert (taken.status_code, taken.content) == (200, b""), taken.text
    assert api.http.patch(f"/experiments/{experiment_id}", json={"maxTrialNumber": 3}).status_code == 200
    wait_until(lambda: lines()[4:] == [["start"], ["import", given], ["import", later]], 30, what="the next tuner")
    api.release_all()
    wait_until(lambda: len(api.http.get(api.nni(experiment_id, "/trial-jobs")).json()) == 3, 30, what="the trial")
    api.wait_status(experiment_id, "DONE")
