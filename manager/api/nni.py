"""NNI 3.0's REST API (`/api/v1/nni`), as its web UI, nnictl and `nni.experiment` read it.

The router is mounted twice: at `/api/v1/nni` for the default experiment, and at
`/nni/{experiment_id}/api/v1/nni` for that one; `nni_experiment` is the one place that decides which.
The answers that list everything (`/trial-jobs`, `/metric-data*`, `/export-data`) are rendered once per
projection position for a small experiment (what the UI polls), and streamed a chunk of trials at a time
for a large one, so 100,000 trials are never in memory at once (manager/api/listings.py). Errors are
`{"error": ...}`: 404 for what does not exist, 400 for a malformed request, 409 for a write the experiment's
state refuses (NNI's UI shows the `error`; nnictl and NNI's client take any answer but 200 as a failure).
A write answers once every read shows it (ManagerHost's commands).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from core.event_store import InvalidExperimentId, StoredEvent, check_experiment_id
from core.platform import OutputStream, OutputUnavailable
from manager.api.listings import ListingCache
from manager.api.native import Experiment, Host, check_changes, get_host
from manager.experiments import ExperimentNotFound, resolve_experiment
from manager.host import ExperimentNotRunning, ManagerHost
from manager.nnictl import PINNED_EXPERIMENT
from manager.runner import RunnerError
from manager.search_space import NestedTooDeep
from manager.training_service import TrainingService, TrialNotFound
from manager.trial_files import OUTPUT_STREAMS, TrialFileRefused, file_chunks, output_chunks, trial_file
from manager.views import CHUNK, ViewStore
from schemas import nni_rest
from schemas.events import ExperimentChanges, ImportedTrial, TunerDataImported
from schemas.trial import ExperimentView, TrialJobDetail

JSON_TYPE = "application/json"
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

router = APIRouter(tags=["nni"])
trial_output_router = APIRouter(prefix="/api/v1", tags=["trials"])


def nni_experiment(request: Request) -> str:
    """The experiment a request is about: the one its path names (`/nni/<id>/...`), else the one its
    listener is pinned to, else the newest in Redis."""
    host = get_host(request)
    named = request.path_params.get("experiment_id")
    if named is not None:
        try:
            return resolve_experiment(host.client, check_experiment_id(named))
        except InvalidExperimentId as invalid:
            raise ExperimentNotFound(str(invalid)) from None
    pinned = request.scope.get(PINNED_EXPERIMENT)
    if pinned is not None:
        return str(pinned)
    return resolve_experiment(host.client, None)


NniExperiment = Annotated[str, Depends(nni_experiment)]


def _json(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body, separators=(",", ":"), ensure_ascii=False), status, media_type=JSON_TYPE)


def _error(message: str, status: int) -> Response:
    """NNI's error answer, `{"error": ...}`."""
    return _json({"error": message}, status)


def _empty() -> Response:
    """NNI's empty 200 (writes, an unknown trial), still typed JSON as every answer of this API."""
    return Response(b"", media_type=JSON_TYPE)


def _listing(request: Request, experiment_id: str, views: ViewStore, items: Callable[[], Iterable[str]]) -> Response:
    """A whole-list answer: kept per projection position for a small experiment, streamed for a large one."""
    key = (experiment_id, request.url.path.rsplit("/api/v1/nni", 1)[-1], str(request.url.query))
    cache: ListingCache = request.app.state.listings
    return cache.answer(views, key, items, request.headers.get("if-none-match"))


def _metrics_of(
    service: TrainingService, trials: Iterator[TrialJobDetail]
) -> Iterator[list[nni_rest.MetricDataRecord]]:
    """Each trial's served metrics, reading a chunk of trials' records in one round trip."""
    while chunk := list(islice(trials, CHUNK)):
        stored = service.views.metric_records([trial.id for trial in chunk])
        for trial in chunk:
            yield nni_rest.metric_records(trial, stored[trial.id])


def _records_json(
    batches: Iterator[list[nni_rest.MetricDataRecord]],
    keep: Callable[[list[nni_rest.MetricDataRecord]], list[nni_rest.MetricDataRecord]] = lambda records: records,
) -> Iterator[str]:
    for records in batches:
        yield from (record.wire_json() for record in keep(records))


def _view(service: TrainingService) -> ExperimentView:
    """The experiment as projected, as the trial lists are: the UI stops polling once it reads DONE, so DONE
    must not be served before the trials' last events are in the views it lists them from."""
    projected = service.views.experiment()
    if projected is not None:
        return projected
    # not projected yet (the projector has not reached it): its config, but not an end the trials do not show yet
    return service.experiment_view().model_copy(update={"status": "RUNNING", "end_time": None, "message": None})


def _submitted(service: TrainingService) -> int:
    return service.views.total()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _metadata(request: Request, host: ManagerHost, experiment_id: str) -> nni_rest.ExperimentMetadata:
    service = host.service(experiment_id)
    prefix = request.scope.get("root_path", "").strip("/")  # NNI's --url-prefix, as UrlPrefix passed it on
    server = request.scope.get("server")
    pinned = request.scope.get(PINNED_EXPERIMENT) is not None  # nnictl's port: the API at its root, no prefix
    return nni_rest.experiment_metadata(
        _view(service),
        _submitted(service),
        port=server[1] if server is not None else 0,
        pid=host.process_id(experiment_id),
        prefix_url=None if pinned else f"{prefix}/nni/{experiment_id}" if prefix else f"nni/{experiment_id}",
        now_ms=_now_ms(),
    )


# the experiment


@router.get("/check-status")
def check_status(experiment_id: NniExperiment, host: Host) -> Response:
    service = host.service(experiment_id)
    view = _view(service)
    status = nni_rest.experiment_status(view, _submitted(service), _now_ms())
    errors = [view.message] if view.status == "ERROR" and view.message else []
    return _json(nni_rest.CheckStatus(status=status, errors=errors).wire())


@router.get("/experiment")
def experiment(experiment_id: NniExperiment, host: Host) -> Response:
    service = host.service(experiment_id)
    applied = int(service.views.client.hget(service.views.keys.position, "applied") or 0)
    profile = nni_rest.experiment_profile(_view(service), _submitted(service), applied, _now_ms())
    return _json(profile.wire())


@router.get("/experiment-metadata")
def experiment_metadata(experiment_id: NniExperiment, host: Host, request: Request) -> Response:
    return _json(_metadata(request, host, experiment_id).wire())


@router.get("/experiments-info")
def experiments_info(host: Host, request: Request) -> Response:
    """Every experiment in Redis, each reachable at `<prefix>/nni/<id>` on this manager; on a port pinned to
    one experiment (nnictl's), that one alone: nothing else is reachable there."""
    pinned = request.scope.get(PINNED_EXPERIMENT)
    entries = []
    for experiment_id in [str(pinned)] if pinned is not None else host.experiment_ids():
        try:
            entries.append(_metadata(request, host, experiment_id).wire())
        except LookupError:  # deleted meanwhile, or no ExperimentCreated: nothing to show
            continue
    return _json(entries)


@router.get("/version")
def version() -> Response:
    """The bare text `3.0.0`, typed JSON as NNI sends it (the UI shows `v3.0`; the number `3.0` shows ERROR)."""
    return Response(nni_rest.NNI_VERSION, media_type=JSON_TYPE)


@router.put("/experiment")
def update_experiment(
    experiment_id: NniExperiment,
    host: Host,
    profile: dict[str, Any],
    update_type: Annotated[Literal["TRIAL_CONCURRENCY", "MAX_EXEC_DURATION", "SEARCH_SPACE", "MAX_TRIAL_NUM"], Query()],
) -> Response:
    """NNI's Overview edits: the body is the whole profile, `update_type` says which param changed."""
    params = profile.get("params")
    if not isinstance(params, dict):
        return _error("the body must be the experiment profile, with `params`", 400)
    try:
        changes = _changes(update_type, params)
        check_changes(host, experiment_id, changes)  # a search space is checked as a config's is
    except ValidationError as invalid:
        return _error(f"{_PARAMS[update_type]}: {invalid.errors()[0]['msg']}", 400)
    except ValueError as invalid:
        return _error(str(invalid), 400)
    try:
        host.update(experiment_id, changes)  # a DONE experiment goes on under them, as NNI's does
    except (ExperimentNotRunning, RunnerError) as refused:
        return _error(str(refused), 409)
    return _empty()


@router.delete("/experiment")
def stop_experiment(experiment_id: NniExperiment, host: Host) -> Response:
    """NNI's `Experiment.stop()`: this experiment stops (trials SYS_CANCELED), and the process standing for it
    (the `pid` of `/experiments-info` and nnictl's registry, which the client then waits for) ends once it
    is STOPPED; one that has ended is closed. Never the manager, nor its other experiments."""
    host.end(experiment_id)
    return _empty()


_PARAMS = {
    "TRIAL_CONCURRENCY": "trialConcurrency",
    "MAX_TRIAL_NUM": "maxTrialNumber",
    "MAX_EXEC_DURATION": "maxExperimentDuration",
    "SEARCH_SPACE": "searchSpace",
}  # the profile's param each update_type changes


def _changes(update_type: str, params: dict[str, Any]) -> ExperimentChanges:
    match update_type:
        case "TRIAL_CONCURRENCY":
            return ExperimentChanges(trial_concurrency=params.get("trialConcurrency"))
        case "MAX_TRIAL_NUM":
            return ExperimentChanges(max_trial_number=params.get("maxTrialNumber"))
        case "MAX_EXEC_DURATION":
            return ExperimentChanges(max_experiment_duration=_seconds(params.get("maxExperimentDuration")))
        case _:
            if not isinstance(params.get("searchSpace"), dict):
                raise ValueError("searchSpace: expected a mapping of parameter names to {_type, _value}")
            return ExperimentChanges(search_space=params["searchSpace"])


def _seconds(duration: Any) -> float:
    if isinstance(duration, int | float) and not isinstance(duration, bool):
        return float(duration)
    match = _DURATION.match(str(duration))
    if match is None:
        raise ValueError(f"maxExperimentDuration {duration!r}: expected seconds or <n>s|m|h|d")
    return float(match[1]) * _SECONDS[match[2]]


@router.post("/experiment/import-data")
def import_data(experiment_id: NniExperiment, host: Host, data: list[ImportedTrial]) -> Response:
    """`nnictl experiment import`: results of trials run elsewhere (`[{"parameter": {...}, "value": ...}]`, as
    export-data writes them) for the tuner's `import_data`; an empty 200 once logged, as NNI answers once it has
    sent them to its dispatcher. A malformed entry is a 400 naming it (`body.<i>.value`)."""
    try:
        host.import_data(experiment_id, data)
    except ValueError as invalid:  # NestedTooDeep too
        return _error(f"body{invalid}", 400)
    except (ExperimentNotRunning, RunnerError) as refused:
        return _error(str(refused), 409)
    return _empty()


@router.get("/experiment/imported-data")
def imported_data(experiment_id: NniExperiment, host: Host) -> Response:
    """What was imported, as NNI lists it: the JSON text of each import, in log order. Read off the log (its
    entries' `type` field, nothing decoded but these): nothing NNI ships reads it, so no view keeps it."""
    store = host.service(experiment_id).store
    imports = store.read(where=lambda fields: fields.get("type") == "TunerDataImported")
    return _json(
        [
            json.dumps([record.model_dump(mode="json") for record in entry.event.data], separators=(",", ":"))
            for entry in imports
            if isinstance(entry, StoredEvent) and isinstance(entry.event, TunerDataImported)
        ]
    )


@router.get("/job-statistics")
def job_statistics(experiment_id: NniExperiment, host: Host) -> Response:
    counts = host.service(experiment_id).views.counts()
    return _json([statistic.wire() for statistic in nni_rest.job_statistics(counts)])


@router.get("/tensorboard-tasks")
def tensorboard_tasks() -> Response:
    return _json(nni_rest.TENSORBOARD_TASKS)


@router.post("/tensorboard")
def start_tensorboard() -> Response:
    """The UI's TensorBoard button: refused as NNI refuses a start it cannot make (400, shown by the UI)."""
    return _error("TensorBoard is not run by trialstream: point your own tensorboard at the trials' output", 400)


@router.api_route("/tensorboard/{task_id}", methods=["GET", "PUT", "DELETE"])
def tensorboard_task(task_id: str) -> Response:
    """Reading, restarting or stopping a TensorBoard task: there is none."""
    return _error(f"TensorBoard task {task_id!r} not found", 404)


@router.delete("/tensorboard-tasks")
def stop_tensorboard_tasks() -> Response:
    """Stopping every TensorBoard task: there is none to stop."""
    return _empty()


# trials


@router.get("/trial-jobs")
def trial_jobs(experiment_id: NniExperiment, host: Host, request: Request, status: str | None = None) -> Response:
    views = host.service(experiment_id).views
    return _listing(
        request,
        experiment_id,
        views,
        lambda: (nni_rest.trial_job_info(trial).wire_json() for trial in views.iter_trials(status=status)),
    )


@router.get("/trial-jobs/{trial_job_id}")
def trial_job(experiment_id: NniExperiment, trial_job_id: str, host: Host) -> Response:
    """One trial; an unknown id is NNI's 200 with an empty body."""
    try:
        trial = host.service(experiment_id).get_trial_job(trial_job_id)
    except TrialNotFound:
        return _empty()
    return _json(nni_rest.trial_job_info(trial).wire())


@router.post("/trial-jobs")
def add_trial_job(experiment_id: NniExperiment, host: Host, parameters: dict[str, Any]) -> Response:
    """A customized trial with these parameters; its sequence id at once, as NNI answers, free slot or not."""
    try:
        sequence_id = host.add_customized_trial(experiment_id, parameters).sequence_id
    except NestedTooDeep as invalid:
        return _error(str(invalid), 400)
    except (ExperimentNotRunning, RunnerError) as refused:
        return _error(str(refused), 409)
    return _json(nni_rest.SequenceId(sequenceId=sequence_id).wire())


@router.delete("/trial-jobs/{trial_job_id}")
def cancel_trial_job(experiment_id: NniExperiment, trial_job_id: str, host: Host) -> Response:
    """The UI's kill and `nnictl trial kill`: the trial ends USER_CANCELED (one that has ended stays as it is)."""
    try:
        host.cancel_trial(experiment_id, trial_job_id)
    except TrialNotFound as missing:
        return _error(str(missing), 404)
    return _empty()


# metrics


@router.get("/metric-data")
def metric_data(
    experiment_id: NniExperiment, host: Host, request: Request, type: nni_rest.NniMetricType | None = None
) -> Response:
    service = host.service(experiment_id)
    keep = _of_type(type)
    return _listing(
        request,
        experiment_id,
        service.views,
        lambda: _records_json(_metrics_of(service, service.views.iter_trials()), keep),
    )


@router.get("/metric-data/{trial_job_id}")
def trial_metric_data(
    experiment_id: NniExperiment,
    trial_job_id: str,
    host: Host,
    type: nni_rest.NniMetricType | None = None,
) -> Response:
    service = host.service(experiment_id)
    try:
        trial = service.get_trial_job(trial_job_id)
    except TrialNotFound:
        return _json([])
    records = nni_rest.metric_records(trial, service.views.metric_records([trial.id])[trial.id])
    return _json([record.wire() for record in _of_type(type)(records)])


def _of_type(
    metric_type: str | None,
) -> Callable[[list[nni_rest.MetricDataRecord]], list[nni_rest.MetricDataRecord]]:
    if metric_type is None:
        return lambda records: records
    return lambda records: [record for record in records if record.type == metric_type]


@router.get("/metric-data-latest")
@router.get("/metric-data-latest/")
def metric_data_latest(experiment_id: NniExperiment, host: Host, request: Request) -> Response:
    service = host.service(experiment_id)
    return _listing(
        request,
        experiment_id,
        service.views,
        lambda: _records_json(_metrics_of(service, service.views.iter_trials()), nni_rest.latest_metric_records),
    )


@router.get("/metric-data-range/{min_sequence_id}/{max_sequence_id}")
def metric_data_range(
    experiment_id: NniExperiment, min_sequence_id: int, max_sequence_id: int, host: Host, request: Request
) -> Response:
    """All metrics of the trials whose sequence id is in [min, max], found through the order index."""
    service = host.service(experiment_id)
    return _listing(
        request,
        experiment_id,
        service.views,
        lambda: _records_json(_metrics_of(service, _trials_in_range(service, min_sequence_id, max_sequence_id))),
    )


def _trials_in_range(service: TrainingService, low: int, high: int) -> Iterator[TrialJobDetail]:
    views = service.views
    start = 0
    while True:
        ids = [str(i) for i in views.client.zrangebyscore(views.keys.order, low, high, start=start, num=CHUNK)]
        if ids:
            for raw in views.client.hmget(views.keys.trials, ids):
                if raw:
                    yield TrialJobDetail.model_validate_json(raw)
        if len(ids) < CHUNK:
            return
        start += CHUNK


@router.get("/export-data")
def export_data(experiment_id: NniExperiment, host: Host, request: Request) -> Response:
    views = host.service(experiment_id).views
    return _listing(
        request,
        experiment_id,
        views,
        lambda: (
            entry.wire_json()
            for trial in views.iter_trials(status="SUCCEEDED")
            for entry in nni_rest.export_entries(trial)
        ),
    )


# files


@router.get("/trial-file/{trial_job_id}/{filename:path}")
def trial_file_of(experiment_id: NniExperiment, trial_job_id: str, filename: str, host: Host) -> Response:
    """`trial.log`/`stdout`/`stderr`: the trial's output, read through its platform; another name: that file
    under the trial's working directory, never outside it. Text as it is, never rendered; empty:
    `<filename> is empty.`"""
    try:
        trial = host.service(experiment_id).get_trial_job(trial_job_id)
    except TrialNotFound as missing:
        return _error(str(missing), 404)
    stream = OUTPUT_STREAMS.get(filename)
    if filename == "trial.log" and (Path(trial.working_directory) / filename).is_file():
        stream = None
    try:
        if stream is not None:
            chunks = output_chunks(host.settings, host.client, trial, stream)
        else:
            chunks = file_chunks(trial_file(trial, filename))
        first = next(chunks, b"")
    except (OutputUnavailable, TrialFileRefused) as missing:
        return _error(str(missing), 404)
    if not first:
        return Response(f"{filename} is empty.", media_type="text/plain")
    media_type = "text/plain; charset=utf-8" if _is_text(first) else "application/octet-stream"
    return StreamingResponse(_prepend(first, chunks), media_type=media_type, headers=_NOT_SNIFFED)


_NOT_SNIFFED = {"x-content-type-options": "nosniff"}  # trial output is data: never let a browser render it as markup


def _is_text(sample: bytes) -> bool:
    if b"\0" in sample:
        return False
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start >= len(sample) - 3  # a character cut at the chunk's end is still text
    return True


def _prepend(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


@trial_output_router.get("/experiments/{experiment_id}/trials/{trial_id}/output", response_class=Response)
def trial_output(
    experiment_id: Experiment,
    trial_id: str,
    host: Host,
    stream: OutputStream = "stdout",
    offset: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    """The trial's raw stdout or stderr from byte `offset` on (`trialstream trials logs` through the manager;
    a follower asks again from `offset` + what it got). 404 when it cannot be read."""
    trial = host.service(experiment_id).get_trial_job(trial_id)
    chunks = output_chunks(host.settings, host.client, trial, stream, offset)
    try:
        first = next(chunks, b"")
    except OutputUnavailable as missing:
        return JSONResponse({"error": str(missing)}, status_code=404)
    return StreamingResponse(_prepend(first, chunks), media_type="application/octet-stream", headers=_NOT_SNIFFED)


__all__ = ["nni_experiment", "router", "trial_output_router"]
