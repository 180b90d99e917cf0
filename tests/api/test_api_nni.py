"""NNI's REST API on the manager: the conversions on their own, then a real manager, worker and trials read
through NNI's own Python client classes (`nni.experiment`), as NNI's web UI and nnictl read them. They are
imported by the tests that use them: `import nni` takes seconds, and every pytest worker collects this module."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from core import keys
from core.connections import connect
from core.variables import PREFIX
from manager.api.webui import url_prefix_problem
from manager.archive.moves import archive, archived
from manager.archive.stores import open_store
from schemas import nni_rest
from schemas.trial import (
    ExperimentView,
    HyperParameters,
    JobApplicationForm,
    MetricRecord,
    TrialJobDetail,
    TrialJobStatus,
)
from simulators.waiting import wait_until
from tests.api.test_api_smoke import experiment_config
from tests.conftest import Processes, ServiceFactory, form, free_port, metric
from tests.support import web

# unit: the conversions


def _trial(status: TrialJobStatus = TrialJobStatus.SUCCEEDED, attempt: int = 1, **changes: Any) -> TrialJobDetail:
    final = MetricRecord(
        timestamp=5, trial_job_id="abcde", parameter_id="0", type="FINAL", sequence=0, data='"0.5"', attempt=attempt
    )
    fields: dict[str, Any] = {
        "id": "abcde",
        "status": status,
        "submit_time": 1,
        "start_time": 2,
        "end_time": 9 if status.is_terminal else None,
        "working_directory": "/exp/trials/abcde",
        "form": form(0, x=0.5),
        "sequence_id": 0,
        "experiment_id": "exp",
        "platform": "local",
        "attempt": attempt,
        "final_metric_data": [final],
        **changes,
    }
    return TrialJobDetail(**fields)


def _stored(kind: str, sequence: int, attempt: int = 1, late: bool = False, parameter_id: str = "0") -> dict[str, Any]:
    """A record as the views give it (ViewStore.metric_records)."""
    record = MetricRecord(
        timestamp=7,
        trial_job_id="abcde",
        parameter_id=parameter_id,
        type=kind,  # type: ignore[arg-type]
        sequence=sequence,
        data=json.dumps(json.dumps({"default": sequence, "loss": 1.5})),
        attempt=attempt,
        late=late or None,
    )
    return dict(json.loads(record.to_json()))


def test_final_metric_data_only_for_a_succeeded_trial_with_one() -> None:
    from nni.experiment import TrialJob

    succeeded = nni_rest.trial_job_info(_trial()).wire()
    assert len(succeeded["finalMetricData"]) == 1
    job = TrialJob(**succeeded)
    assert job.finalMetricData[0].data == 0.5 and job.endTime == 9
    for status in (TrialJobStatus.FAILED, TrialJobStatus.USER_CANCELED, TrialJobStatus.RUNNING):
        info = nni_rest.trial_job_info(_trial(status)).wire()
        assert "finalMetricData" not in info
    assert "finalMetricData" not in nni_rest.trial_job_info(_trial(final_metric_data=[])).wire()
    with pytest.raises(ValidationError):  # the shape that crashes the UI cannot be built
        nni_rest.TrialJobInfo(**{**succeeded, "finalMetricData": []})


def test_running_trial_has_no_end_time_and_only_a_failed_one_a_stderr_path() -> None:
    running = nni_rest.trial_job_info(_trial(TrialJobStatus.RUNNING, url="/host/trial")).wire()
    assert "endTime" not in running and "stderrPath" not in running
    assert running["logPath"] == "/host/trial"
    failed = nni_rest.trial_job_info(_trial(TrialJobStatus.FAILED)).wire()
    assert failed["stderrPath"] == "/exp/trials/abcde/stderr"
    waiting = nni_rest.trial_job_info(_trial(TrialJobStatus.WAITING, start_time=None)).wire()
    assert waiting["startTime"] == 1  # NNI: the WAITING time until it runs


def test_hyper_parameters_always_hold_parameters_with_only_nni_keys() -> None:
    from nni.experiment import TrialHyperParameters

    odd = JobApplicationForm(
        sequence_id=3, hyper_parameters=HyperParameters(value='{"parameter_id": null, "extra": 1}')
    )
    [text] = nni_rest.trial_job_info(_trial(form=odd)).wire()["hyperParameters"]
    assert TrialHyperParameters(**json.loads(text)).parameters == {}
    customized = json.dumps({"parameter_id": None, "parameter_source": "customized", "parameters": {"x": 1}})
    info = nni_rest.trial_job_info(
        _trial(form=JobApplicationForm(sequence_id=0, hyper_parameters=HyperParameters(value=customized)))
    )
    parsed = TrialHyperParameters(**json.loads(info.hyper_parameters[0]))
    assert (parsed.parameter_id, parsed.parameter_source, parsed.parameters) == (None, "customized", {"x": 1})
    with pytest.raises(ValidationError):
        nni_rest.TrialJobInfo(**{**info.wire(), "hyperParameters": []})


def test_metrics_of_the_current_attempt_renumbered_without_late_ones() -> None:
    from nni.experiment import TrialMetricData

    stored = [
        _stored("PERIODICAL", 0, attempt=1),  # the lost attempt's curve
        _stored("PERIODICAL", 1, attempt=1),
        _stored("PERIODICAL", 0, attempt=2),
        _stored("PERIODICAL", 3, attempt=2),  # a gap
        _stored("FINAL", 0, attempt=2),
        _stored("PERIODICAL", 4, attempt=2, late=True),
    ]
    records = nni_rest.metric_records(_trial(attempt=2), stored)
    assert [(record.type, record.sequence) for record in records] == [
        ("PERIODICAL", 0),
        ("PERIODICAL", 1),
        ("FINAL", 0),
    ]
    for record in records:
        decoded = TrialMetricData(**record.wire())  # decodes `data` twice, takes exactly these keys
        assert decoded.data["loss"] == 1.5
    latest = nni_rest.latest_metric_records(records)
    assert [(record.type, record.sequence) for record in latest] == [("PERIODICAL", 1), ("FINAL", 0)]
    customized = nni_rest.metric_records(_trial(), [_stored("FINAL", 0, parameter_id="None")])
    assert customized[0].wire()["parameterId"] is None
    with pytest.raises(ValidationError):  # a single-encoded dict crashes the UI's parseMetrics
        nni_rest.MetricDataRecord(**{**records[0].wire(), "data": '{"default": 1}'})


def test_experiment_status_profile_and_registry_entry() -> None:
    config = {"maxTrialNumber": 2, "maxExperimentDuration": "bogus", "trainingService": {"platform": "local"}}
    view = ExperimentView(id="exp", config=config, working_directory="/home/u/exps/exp", start_time=1000)
    assert nni_rest.experiment_status(view, 1, now_ms=2000) == "RUNNING"
    assert nni_rest.experiment_status(view, 2, now_ms=2000) == "NO_MORE_TRIAL"
    timed = view.model_copy(update={"config": {**config, "maxExperimentDuration": "2s"}})
    assert nni_rest.experiment_status(timed, 1, now_ms=2999) == "RUNNING"
    assert nni_rest.experiment_status(timed, 1, now_ms=3000) == "NO_MORE_TRIAL"  # out of time: its trials end
    exhausted = view.model_copy(update={"tuner_no_more_trials": True})  # NNI: the tuner said NO_MORE_TRIAL_JOBS
    assert nni_rest.experiment_status(exhausted, 1, now_ms=2000) == "TUNER_NO_MORE_TRIAL"
    assert nni_rest.experiment_status(exhausted, 2, now_ms=2000) == "NO_MORE_TRIAL"  # as NNI: the budget first
    done = exhausted.model_copy(update={"status": "DONE"})
    assert nni_rest.experiment_status(done, 1, now_ms=2000) == "DONE"
    profile = nni_rest.experiment_profile(view, 2, 7, now_ms=4500).wire()
    assert profile["execDuration"] == 3 and "endTime" not in profile
    assert "maxExperimentDuration" not in profile["params"]
    unreadable = view.model_copy(update={"config": {**config, "searchSpace": {"x": [0, 1]}}})
    assert nni_rest.experiment_profile(unreadable, 2, 7, now_ms=0).wire()["params"]["searchSpace"] == {}
    done = view.model_copy(update={"status": "DONE", "end_time": 9000})
    assert nni_rest.experiment_profile(done, 2, 7, now_ms=99_000).wire()["endTime"] == 9000
    entry = nni_rest.experiment_metadata(done, 2, port=80, pid=5, prefix_url="nni/exp", now_ms=0).wire()
    assert entry["logDir"] == "/home/u/exps" and entry["status"] == "DONE" and entry["tag"] == []
    running = nni_rest.experiment_metadata(view, 0, port=80, pid=5, prefix_url="nni/exp", now_ms=0).wire()
    assert running["endTime"] == "N/A"


# end to end: a real manager, worker and trials

TRIAL = """\
import os, pathlib, sys, time
import trialstream_sdk as nni
params = nni.get_next_parameter()
print("parameters", params, flush=True)
print("to stderr", file=sys.stderr, flush=True)
os.write(1, b"straight to stdout\\n")
pathlib.Path("{out}", nni.get_trial_id()).mkdir(parents=True, exist_ok=True)
pathlib.Path("{out}", nni.get_trial_id(), "model.txt").write_text("weights")
for step in range(3):
    nni.report_intermediate_result({{"default": params["x"] + step, "loss": 1.5}})
while not pathlib.Path("release").exists():
    time.sleep(0.05)
nni.report_final_result(params["x"])
"""


def _experiment(url: str, code: Path, trials: int, concurrency: int, released: bool) -> str:
    code.mkdir(exist_ok=True)
    (code / "trial.py").write_text(TRIAL.format(out=code / "files"))
    if released:
        (code / "release").touch()
    created = web.post(
        f"{url}/api/v1/experiments",
        json={"config": experiment_config(code, trials, concurrency, experimentName="nni-api")},
    )
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def _nni(url: str, path: str, **params: Any) -> Any:
    answer = web.get(f"{url}/api/v1/nni{path}", params=params, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    return answer.json()


def _status_is(url: str, status: str) -> bool:
    return bool(_nni(url, "/check-status")["status"] == status)


def test_a_finished_experiment_reads_as_nni_serves_it(tmp_path: Path, processes: Processes) -> None:
    from nni.experiment import TrialJob, TrialMetricData
    from nni.experiment.data import TrialResult

    processes.worker(args=("--concurrency", "3"))
    url = processes.manager()
    experiment_id = _experiment(url, tmp_path / "code", trials=3, concurrency=3, released=True)
    wait_until(lambda: _status_is(url, "DONE"), 60, what="the experiment to finish")

    assert _nni(url, "/check-status") == {"status": "DONE", "errors": []}
    profile = _nni(url, "/experiment")
    assert profile["id"] == experiment_id and profile["params"]["maxTrialNumber"] == 3
    assert isinstance(profile["execDuration"], int) and profile["endTime"] >= profile["startTime"]
    assert profile["nextSequenceId"] == 3
    metadata = _nni(url, "/experiment-metadata")
    assert metadata["prefixUrl"] == f"nni/{experiment_id}" and metadata["port"] == int(url.rsplit(":", 1)[1])
    assert metadata["status"] == "DONE" and metadata["tag"] == [] and isinstance(metadata["pid"], int)
    assert _nni(url, "/experiments-info") == [metadata]
    assert web.get(f"{url}/api/v1/nni/version").text == "3.0.0"
    assert web.get(f"{url}/api/v1/nni/version").headers["content-type"] == "application/json"
    assert _nni(url, "/tensorboard-tasks") == []
    started = web.post(f"{url}/api/v1/nni/tensorboard", json={"trials": "abc"})
    assert started.status_code == 400 and "TensorBoard is not run by trialstream" in started.json()["error"]
    for method in ("GET", "PUT", "DELETE"):
        task = web.request(method, f"{url}/api/v1/nni/tensorboard/t1")
        assert task.status_code == 404 and "not found" in task.json()["error"]
    assert web.delete(f"{url}/api/v1/nni/tensorboard-tasks").status_code == 200
    malformed = web.put(f"{url}/api/v1/nni/experiment", params={"update_type": "EVERYTHING"}, json=profile)
    assert malformed.status_code == 400 and malformed.json()["error"].startswith("query.update_type: ")
    wrong_method = web.delete(f"{url}/api/v1/nni/trial-jobs")
    assert wrong_method.status_code == 405 and wrong_method.json() == {"error": "Method Not Allowed"}
    assert "GET" in wrong_method.headers["allow"]
    assert _nni(url, "/experiment/imported-data") == []
    assert _nni(url, "/job-statistics") == [{"trialJobStatus": "SUCCEEDED", "trialJobNumber": 3}]

    records = _nni(url, "/trial-jobs")
    jobs = [TrialJob(**record) for record in records]
    assert [job.sequenceId for job in jobs] == [0, 1, 2]
    for job in jobs:
        assert job.status == "SUCCEEDED" and job.endTime >= job.startTime
        assert job.finalMetricData[0].data == job.hyperParameters[0].parameters["x"]
        assert Path(job.logPath).is_dir()
    assert _nni(url, "/trial-jobs", status="FAILED") == []
    assert len(_nni(url, "/trial-jobs", status="SUCCEEDED")) == 3
    assert _nni(url, f"/trial-jobs/{jobs[1].trialJobId}") == records[1]
    unknown = web.get(f"{url}/api/v1/nni/trial-jobs/nope0")
    assert (unknown.status_code, unknown.content, unknown.headers["content-type"]) == (200, b"", "application/json")

    metrics = [TrialMetricData(**record) for record in _nni(url, "/metric-data")]
    for job in jobs:
        mine = [metric for metric in metrics if metric.trialJobId == job.trialJobId]
        assert [metric.sequence for metric in mine if metric.type == "PERIODICAL"] == [0, 1, 2]
        assert [metric.data for metric in mine if metric.type == "FINAL"] == [job.hyperParameters[0].parameters["x"]]
        assert mine[0].data["loss"] == 1.5 and all(metric.parameterId.isdigit() for metric in mine)
    assert len(_nni(url, "/metric-data", type="FINAL")) == 3
    assert len(_nni(url, f"/metric-data/{jobs[0].trialJobId}")) == 4
    latest = _nni(url, "/metric-data-latest")
    assert (
        sorted((record["type"], record["sequence"]) for record in latest)
        == [("FINAL", 0)] * 3 + [("PERIODICAL", 2)] * 3
    )
    in_range = _nni(url, "/metric-data-range/1/2")
    assert {record["trialJobId"] for record in in_range} == {jobs[1].trialJobId, jobs[2].trialJobId}
    exported = [TrialResult(**entry) for entry in _nni(url, "/export-data")]
    assert sorted(result.value for result in exported) == sorted(job.finalMetricData[0].data for job in jobs)

    prefixed = f"{url}/nni/{experiment_id}/api/v1/nni"
    assert web.get(f"{prefixed}/experiment").json()["id"] == experiment_id
    missing = web.get(f"{url}/nni/nosuchexp/api/v1/nni/check-status")
    assert missing.status_code == 404 and "error" in missing.json()

    # archived (manager.archive), it reads the same; the listings read what stays in Redis, the rest thaws it
    paths = ["/experiment", "/check-status", "/job-statistics", "/trial-jobs", f"/trial-jobs/{jobs[1].trialJobId}"]
    paths += ["/metric-data", f"/metric-data/{jobs[0].trialJobId}", "/metric-data-latest", "/export-data"]
    answers = {path: _nni(url, path) for path in paths}
    listed = web.get(f"{url}/api/v1/experiments").json()
    timeline = web.get(f"{url}/api/v1/experiments/{experiment_id}/timeline").json()
    client = connect(processes.redis_url)
    wait_until(lambda: not client.exists(keys.runner(experiment_id)), 30, what="the runner to let go")
    archive(client, experiment_id, open_store(str(tmp_path / "archive")))
    assert not client.exists(keys.events(experiment_id), keys.ViewKeys(experiment_id).trials)
    assert _nni(url, "/experiments-info") == [metadata]
    assert web.get(f"{url}/api/v1/experiments").json() == [state | {"archived": True} for state in listed]
    assert not client.exists(keys.thawed(experiment_id))
    assert {path: _nni(url, path) for path in paths} == answers
    assert web.get(f"{url}/api/v1/experiments/{experiment_id}/timeline").json() == timeline
    assert client.exists(keys.thawed(experiment_id), keys.events(experiment_id)) == 2

    # NNI's import-data into it (DONE, as NNI's manager takes it): brought back from the archive first, then logged
    data = [{"parameter": {"x": 0.5}, "value": 0.1}]
    imported = web.post(f"{url}/api/v1/nni/experiment/import-data", json=data)
    assert (imported.status_code, imported.content) == (200, b""), imported.text
    assert archived(client, experiment_id) is None and client.pttl(keys.events(experiment_id)) == -1
    assert [json.loads(text) for text in _nni(url, "/experiment/imported-data")] == [data]


def test_trial_files_serve_output_and_stay_in_the_trial_directory(tmp_path: Path, processes: Processes) -> None:
    processes.worker()
    url = processes.manager()
    experiment_id = _experiment(url, tmp_path / "code", trials=1, concurrency=1, released=True)
    wait_until(lambda: _status_is(url, "DONE"), 60, what="the experiment to finish")
    [job] = _nni(url, "/trial-jobs")
    trial_id, trial_dir = job["trialJobId"], Path(job["logPath"])
    files = f"{url}/api/v1/nni/trial-file/{trial_id}"

    stdout = web.get(f"{files}/trial.log")
    assert stdout.status_code == 200 and stdout.headers["content-type"].startswith("text/plain")
    assert "parameters {'x':" in stdout.text and stdout.headers["x-content-type-options"] == "nosniff"
    assert web.get(f"{files}/stdout").text == "straight to stdout\n"
    assert web.get(f"{files}/stderr").text == "to stderr\n"
    (trial_dir / "notes.txt").write_text("")
    (trial_dir / "weights.bin").write_bytes(b"\x00\x01\xff")
    assert web.get(f"{files}/notes.txt").text == "notes.txt is empty."
    binary = web.get(f"{files}/weights.bin")
    assert binary.headers["content-type"] == "application/octet-stream" and binary.content == b"\x00\x01\xff"
    (trial_dir / "out").symlink_to("/etc/hostname")
    for escape in ("..%2f..%2f..%2fcode%2ftrial.py", "%2e%2e%2f%2e%2e%2ftrial.py", "%2fetc%2fhostname", "out", "nope"):
        refused = web.get(httpx.URL(f"{files}/{escape}"))  # sent as written: the client does not normalize it
        assert refused.status_code == 404, escape
        assert "error" in refused.json()

    output = f"{url}/api/v1/experiments/{experiment_id}/trials/{trial_id}/output"
    assert web.get(output).content == b"straight to stdout\n"
    assert web.get(output, params={"offset": 9}).content == b"to stdout\n"
    assert web.get(output, params={"stream": "stderr"}).content == b"to stderr\n"

    ui = f"{url}/nni/{experiment_id}"
    assert '<div id="root">' in web.get(f"{ui}/oview").text
    assert web.get(f"{ui}/logs/dispatcher.log").status_code == 200
    assert web.get(httpx.URL(f"{ui}/logs/..%2f..%2fcode%2ftrial.py")).status_code == 404
    assert web.get(f"{url}/api/v1/no-such-endpoint").status_code == 404


def test_writes_change_the_running_experiment(tmp_path: Path, processes: Processes) -> None:
    from nni.experiment import TrialJob

    processes.worker(args=("--concurrency", "4"))
    url = processes.manager()
    experiment_id = _experiment(url, tmp_path / "code", trials=1, concurrency=1, released=False)
    code = tmp_path / "code"

    def running() -> list[dict[str, Any]]:
        return [job for job in _nni(url, "/trial-jobs") if job["status"] == "RUNNING"]

    [first] = wait_until(running, 30, what="the first trial to run")
    assert "endTime" not in _nni(url, "/experiment")
    assert _status_is(url, "NO_MORE_TRIAL")
    profile = _nni(url, "/experiment")

    def update(update_type: str, **params: Any) -> None:
        body = {**profile, "params": {**profile["params"], **params}}
        answer = web.put(f"{url}/api/v1/nni/experiment", params={"update_type": update_type}, json=body)
        assert (answer.status_code, answer.content) == (200, b""), answer.text

    for space in ({"x": [0, 1]}, {"x": {"_type": "nonsense", "_value": [0, 1]}}, "wide"):
        body = {**profile, "params": {**profile["params"], "searchSpace": space}}
        refused = web.put(f"{url}/api/v1/nni/experiment", params={"update_type": "SEARCH_SPACE"}, json=body)
        assert refused.status_code == 400 and refused.json()["error"].startswith("searchSpace"), refused.text
    assert _nni(url, "/experiment")["params"]["searchSpace"] == profile["params"]["searchSpace"]  # unchanged
    update("SEARCH_SPACE", searchSpace={"x": {"_type": "choice", "_value": [0.5, 0.75]}})
    wait_until(
        lambda: _nni(url, "/experiment")["params"]["searchSpace"]["x"]["_type"] == "choice",
        30,
        what="the new search space in the profile",
    )
    vague = {**profile, "params": {**profile["params"], "maxExperimentDuration": "soon"}}
    refused = web.put(f"{url}/api/v1/nni/experiment", params={"update_type": "MAX_EXEC_DURATION"}, json=vague)
    assert refused.status_code == 400 and refused.json()["error"].startswith("maxExperimentDuration"), refused.text
    update("MAX_EXEC_DURATION", maxExperimentDuration="2h")
    wait_until(
        lambda: _nni(url, "/experiment")["params"].get("maxExperimentDuration") == "2h",
        30,
        what="the new maxExperimentDuration in the profile, in the form NNI keeps",
    )
    update("TRIAL_CONCURRENCY", trialConcurrency=2)
    update("MAX_TRIAL_NUM", maxTrialNumber=3)
    assert _nni(url, "/experiment")["params"]["trialConcurrency"] == 2
    assert _status_is(url, "RUNNING")
    wait_until(lambda: len(running()) == 2, 30, what="the runner to run a second trial under the new limits")

    # a customized trial, asked for while both slots are busy: it takes the slot the kill frees
    events = f"{url}/api/v1/experiments/{experiment_id}/events"
    with ThreadPoolExecutor(1) as pool:
        added = pool.submit(httpx.post, f"{url}/api/v1/nni/trial-jobs", json={"x": 0.25}, timeout=30)
        wait_until(
            lambda: "CustomizedTrialRequested" in web.get(events, params={"limit": 10_000}).text,
            30,
            what="the customized trial to be requested",
        )
        killed = web.delete(f"{url}/api/v1/nni/trial-jobs/{first['trialJobId']}")
        assert (killed.status_code, killed.content) == (200, b"")
        answer = added.result()
    assert answer.status_code == 200 and answer.json() == {"sequenceId": 2}
    wait_until(
        lambda: _nni(url, f"/trial-jobs/{first['trialJobId']}")["status"] == "USER_CANCELED",
        30,
        what="the killed trial to end USER_CANCELED",
    )
    (code / "release").touch()
    wait_until(lambda: _status_is(url, "DONE"), 60, what="the experiment to finish")
    customized = TrialJob(**_nni(url, "/trial-jobs")[2])
    parameters = customized.hyperParameters[0]
    assert (parameters.parameter_source, parameters.parameter_id, parameters.parameters) == (
        "customized",
        None,
        {"x": 0.25},
    )
    assert customized.status == "SUCCEEDED" and customized.finalMetricData[0].data == 0.25
    assert customized.finalMetricData[0].parameterId is None
    gone = web.delete(f"{url}/api/v1/nni/trial-jobs/nope0")
    assert gone.status_code == 404 and "error" in gone.json()
    refused = web.post(f"{url}/api/v1/nni/trial-jobs", json={"x": 0.5})
    assert refused.status_code == 409 and "not running" in refused.json()["error"]


def test_a_url_prefix_is_refused_only_where_the_web_ui_would_misread_it() -> None:
    """NNI's UI takes its prefix to be the page's path with the first `/oview` or `/detail` cut out, and any
    path holding `experiment` for its All experiments page: those prefixes, and characters a browser would
    rewrite in the path, are refused at start (the start itself: tests/api/test_api_security.py)."""
    for usable in ("nni", "api", "api/v1", "oview", "detail", "x/oview", "some/prefix", "a-b_c.d~e!$&'()*+,;=:@"):
        assert url_prefix_problem(usable) is None, usable
    for unusable, reason in (
        ("oview/ui", "first '/oview'"),
        ("oviewer", "first '/oview'"),
        ("detail/x", "first '/detail'"),
        ("myexperiments", "'experiment'"),
        ("my ui", "ASCII letters"),
        ("a//b", "none empty"),
        ("a/../b", "'..'"),
        ("%2e%2e", "ASCII letters"),
        ("prefixé", "ASCII letters"),
    ):
        assert reason in (url_prefix_problem(unusable) or ""), unusable


def test_any_url_prefix_routes_the_apis_the_ui_and_the_login(
    processes: Processes, make_service: ServiceFactory
) -> None:
    """Issue 24, A6: a prefix that is also a path of the manager (`nni`, `api`, `api/v1`, `oview`) is taken off
    once, so the REST calls under it answer JSON, not the UI's index.html; the UI, its manifest and the login's
    redirect stay under it. Behind a token, as a prefixed manager usually is (a proxy in front)."""
    experiment_id = make_service().experiment_id
    token = "tok-prefix-0b1e"
    bearer = {"Authorization": f"Bearer {token}"}
    prefixes = ("nni", "api", "api/v1", "oview", "some/prefix")
    urls = {prefix: f"http://127.0.0.1:{free_port()}" for prefix in prefixes}
    for prefix, url in urls.items():  # started together, waited for together
        port = url.rsplit(":", 1)[1]
        processes.start("manager", "--port", port, "--url-prefix", prefix, env={f"{PREFIX}MANAGER_TOKEN": token})

    def serving(url: str) -> bool:
        """It answers, whatever the answer (what each prefix answers is checked next)."""
        try:
            web.get(url, timeout=2)
        except httpx.HTTPError:
            return False
        return True

    wait_until(lambda: all(serving(f"{url}/{prefix}/") for prefix, url in urls.items()), 60, what="the managers")
    for prefix, url in urls.items():
        base = f"{url}/{prefix}"
        health = web.get(f"{base}/api/v1/health")  # open: no token
        assert health.headers["content-type"] == "application/json" and health.json()["status"] == "ok", prefix
        native = web.get(f"{base}/api/v1/experiments/{experiment_id}", headers=bearer)
        assert native.status_code == 200 and native.json()["id"] == experiment_id, (prefix, native.text[:80])
        assert web.get(f"{base}/api/v1/nni/version", headers=bearer).text == "3.0.0", prefix
        for nni_api in (f"{base}/api/v1/nni", f"{base}/nni/{experiment_id}/api/v1/nni"):
            entry = web.get(f"{nni_api}/experiment-metadata", headers=bearer).json()
            assert entry["id"] == experiment_id and entry["prefixUrl"] == f"{prefix}/nni/{experiment_id}", prefix
            assert web.get(f"{nni_api}/trial-jobs", headers=bearer).json() == [], prefix
        unknown = web.get(f"{base}/api/v1/nosuch", headers=bearer)
        assert unknown.status_code == 404 and unknown.json() == {"error": "no such endpoint: /api/v1/nosuch"}, prefix
        for page in (f"{base}/oview", f"{base}/nni/{experiment_id}/detail"):
            assert '<div id="root">' in web.get(page, headers=bearer).text, page
        assert "start_url" in web.get(f"{base}/manifest.json").json(), prefix  # open, as without a prefix
        assert web.get(f"{base}/api/v1/experiments").status_code == 401, prefix
        login = web.get(f"{base}/login", params={"token": token})
        assert login.status_code == 303 and login.headers["location"] == f"/{prefix}/oview", prefix
        assert web.get(f"{base}/api/v1/experiments", cookies=login.cookies).status_code == 200, prefix
        outside = web.get(f"{url}/elsewhere/oview")
        assert (outside.status_code, outside.text) == (404, f'Outside prefix "/{prefix}"'), prefix


def test_hundreds_of_trials_listed_under_a_url_prefix(processes: Processes, make_service: ServiceFactory) -> None:
    """(Streaming of large experiments: tests/api/test_listings.py; at 100,000 trials, bench/api.py.)"""
    from nni.experiment import TrialJob, TrialMetricData

    service = make_service()
    for sequence_id in range(400):
        service.submit_trial_job(form(sequence_id, x=sequence_id))
    trial_id = service.list_trial_jobs()[7].id
    for sequence in (0, 2, 5):  # as a trial that skipped steps reported them
        service.store.append(metric(service.experiment_id, trial_id, sequence))
    url = processes.manager("--url-prefix", "ts")
    api = f"{url}/ts/api/v1/nni"

    def projected() -> bool:
        return service.views.total() == 400 and len(service.views.metrics(trial_id)) == 3

    wait_until(projected, 30, what="the manager's projector to project the trials")
    listed = web.get(f"{api}/trial-jobs")
    jobs = [TrialJob(**record) for record in listed.json()]
    assert [job.sequenceId for job in jobs] == list(range(400))
    assert {job.status for job in jobs} == {"WAITING"}
    assert len(web.get(f"{api}/trial-jobs", params={"status": "WAITING"}).json()) == 400
    metrics = [TrialMetricData(**record) for record in web.get(f"{api}/metric-data").json()]
    assert [(metric.trialJobId, metric.sequence) for metric in metrics] == [(trial_id, 0), (trial_id, 1), (trial_id, 2)]
    assert web.get(f"{api}/metric-data-range/7/7").json() == web.get(f"{api}/metric-data").json()
    assert web.get(f"{api}/metric-data-range/8/400").json() == []
    assert web.get(f"{api}/export-data").json() == []
    entry = web.get(f"{api}/experiment-metadata").json()
    assert entry["prefixUrl"] == f"ts/nni/{service.experiment_id}" and entry["status"] == "RUNNING"
    assert web.get(f"{url}/ts/nni/{service.experiment_id}/api/v1/nni/version").text == "3.0.0"
    assert '<div id="root">' in web.get(f"{url}/ts/oview").text

    outside = web.get(f"{url}/api/v1/nni/version")
    assert (outside.status_code, outside.text) == (404, 'Outside prefix "/ts"')
    assert web.get(f"{url}/tsx/oview").status_code == 404
    assert web.get(f"{url}/ts/api/v1/health").status_code == 200
    assert os.getpid() != entry["pid"]
