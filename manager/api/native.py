"""trialstream's own API under /api/v1: experiments, trials, metrics, events, code uploads, health.

Handlers are plain functions (FastAPI runs them on its thread pool): each is a call into the
ManagerHost or a read of the views, so one slow request never holds up the others.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import weakref
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from core import code_archive, keys
from core.event_store import check_experiment_id, is_stream_id, stream_position
from manager.algorithms import AlgorithmError, optimize_mode_of, resolve
from manager.config import experiment_spec
from manager.experiments import resolve_experiment
from manager.host import ManagerHost
from manager.projector import Projector
from manager.replay import describe
from manager.search_space import NestedTooDeep, SearchSpaceError, check_depth, check_json_text, validate_search_space
from manager.views import TrialOrder
from schemas.api import (
    CancelRequest,
    ClusterMetadataValue,
    CodeUploaded,
    CustomizedTrial,
    CustomizedTrialAnswer,
    EventPage,
    ExperimentChangeRequest,
    ExperimentCreatedAnswer,
    ExperimentRequest,
    ExperimentState,
    Health,
    MetricList,
    TrialPage,
)
from schemas.config import ConfigError, ExperimentConfig
from schemas.events import PLATFORM_CONFIG, TRIAL_CONFIG, ExperimentChanges
from schemas.trial import JobApplicationForm, TrialJobDetail, TrialJobStatus

router = APIRouter(prefix="/api/v1")
SSE_BLOCK_MS = 1000
SSE_BATCH = 1000  # entries a follower reads at once: `after=0-0` on a long log is read a batch at a time
SSE_THREADS = 256  # followers reading at once (more wait for a free thread), apart from the handlers' pool
MAX_OFFSET = 2**53  # a page offset Redis takes as an index, with room for the limit (and exact in JSON)
CATCH_UP_S = 2.0  # how long a page waits for the projector to reach what was logged before the request


def get_host(request: Request) -> ManagerHost:
    host: ManagerHost = request.app.state.host
    return host


Host = Annotated[ManagerHost, Depends(get_host)]


def experiment_id_of(experiment_id: str, host: Host) -> str:
    return resolve_experiment(host.client, check_experiment_id(experiment_id))


Experiment = Annotated[str, Depends(experiment_id_of)]


# health


@router.get("/health", response_model=Health)
def health() -> Health:
    """The process answers (for container health checks; needs no token)."""
    return Health(status="ok")


@router.get("/ready", response_model=Health, responses={503: {"model": Health}})
def ready(host: Host) -> Any:
    """Redis answers and a projector is alive: the API can read and write."""
    checks = {"redis": "ok", "projector": "ok"}
    try:
        projector_alive = bool(host.client.exists(keys.PROJECTOR_HEARTBEAT))
    except Exception as error:
        checks["redis"] = f"unreachable: {type(error).__name__}"
        projector_alive = False
    if not projector_alive:
        checks["projector"] = "no heartbeat"
    if all(value == "ok" for value in checks.values()):
        return Health(status="ok", checks=checks)
    from fastapi.responses import JSONResponse

    return JSONResponse(Health(status="not ready", checks=checks).model_dump(), status_code=503)


# code


@router.put("/code", response_model=CodeUploaded, status_code=201, responses={413: {}, 422: {}})
async def upload_code(request: Request, host: Host) -> Any:
    """A tar.gz of the trial code directory (the CLI packs it with `.nniignore`). Stored by content
    hash, so uploading the same code again costs nothing. Unpacked within NNI's limits for code
    (core/code_archive: files, bytes), or refused with a 413 naming the limit; members that would
    leave the directory, or write through a link, are refused (422). Symlinks are kept as they are,
    absolute ones included (`data -> /nfs/datasets`), as the CLI archives them."""
    body = await request.body()
    try:
        # hashing (up to the upload limit) and unpacking are blocking work: not on the event loop
        return await anyio.to_thread.run_sync(_store_code, body, code_directory(host, "."))
    except code_archive.ArchiveTooLarge as error:
        return JSONResponse({"error": str(error)}, status_code=413)


def code_directory(host: ManagerHost, code_id: str) -> Path:
    return Path(host.settings.experiments_dir).expanduser().resolve() / "code" / code_id


def _store_code(body: bytes, code_root: Path) -> CodeUploaded:
    code_id = hashlib.sha256(body).hexdigest()
    target = code_root / code_id
    if not target.is_dir():
        code_archive.unpack(body, target)
    return CodeUploaded(code_id=code_id, size=len(body))


# experiments


@router.get("/experiments", response_model=list[ExperimentState])
def list_experiments(host: Host) -> list[ExperimentState]:
    return [_state(host, experiment_id) for experiment_id in host.experiment_ids()]


@router.post("/experiments", response_model=ExperimentCreatedAnswer, status_code=201)
def create_experiment(request: ExperimentRequest, host: Host) -> ExperimentCreatedAnswer:
    """Accepted even while no worker serves its platform: its trials wait in their queue until one
    does (workers may be scaled up later; /metrics shows queue depth and workers)."""
    config = dict(request.config)
    if request.code_id is not None:
        directory = code_directory(host, request.code_id)
        if not directory.is_dir():
            raise ConfigError(f"codeId {request.code_id}: no such upload; PUT the archive to /api/v1/code first")
        config["trialCodeDirectory"] = str(directory)
    spec = experiment_spec(config, "config")
    return ExperimentCreatedAnswer(id=host.create(spec))


@router.get("/experiments/{experiment_id}", response_model=ExperimentState)
def get_experiment(experiment_id: Experiment, host: Host) -> ExperimentState:
    return _state(host, experiment_id)


@router.patch("/experiments/{experiment_id}", response_model=ExperimentState)
def update_experiment(experiment_id: Experiment, changes: ExperimentChangeRequest, host: Host) -> ExperimentState:
    """Change trialConcurrency, maxTrialNumber, maxExperimentDuration (seconds) or the search space; an unknown
    key is refused (422), and a body with nothing to change changes nothing (an empty PATCH is a no-op)."""
    changes.check_keys()
    check_changes(host, experiment_id, changes)
    host.update(experiment_id, changes)
    return _state(host, experiment_id)


def check_changes(host: ManagerHost, experiment_id: str, changes: ExperimentChanges) -> None:
    """A new search space is checked as a config's is, its depth first, then by the experiment's tuner (a
    ConfigError naming the offending key): the tuner would fail on it, and NNI's web UI cannot show it."""
    space = changes.search_space
    if space is None:
        return
    tuner, custom = None, False
    try:
        section = ExperimentConfig.model_validate(host.service(experiment_id).experiment_view().config).tuner_section
        custom = section.class_name is not None
        if not custom:  # a custom tuner reads its space alone: its code is not imported here
            tuner = resolve(section, "tuner")
    except (ValidationError, AlgorithmError):
        pass  # a tuner that cannot be loaded here: the structure is checked all the same
    try:
        check_depth(space)  # whatever the tuner: the event that holds it must read back
        if tuner is not None:
            tuner.check_search_space(space)
        elif not custom:
            validate_search_space(space, allow_empty=True)
    except (NestedTooDeep, SearchSpaceError) as error:
        raise ConfigError(str(error)) from None


@router.post("/experiments/{experiment_id}/stop", status_code=202)
def stop_experiment(experiment_id: Experiment, host: Host) -> dict[str, str]:
    host.stop(experiment_id)
    return {"status": "stopping"}


@router.post("/experiments/{experiment_id}/resume", status_code=202)
def resume_experiment(experiment_id: Experiment, host: Host) -> dict[str, str]:
    host.resume(experiment_id)
    return {"status": "resumed"}


@router.delete("/experiments/{experiment_id}")
def remove_experiment(experiment_id: Experiment, host: Host) -> dict[str, int]:
    return {"deletedKeys": host.delete(experiment_id)}


def _caught_up(host: ManagerHost, experiment_id: str) -> None:
    """Make the projected views include every event logged before this request.

    Pages and counts come from the projected indexes, while an experiment's status folds the log's
    tail: without this, an experiment read as DONE could list trials still RUNNING, or none at all.
    The projector gets CATCH_UP_S to get there; one that is not alive, or still slow (reconnecting after
    a Redis restart), is helped: the request projects up to there itself, as concurrent projectors may."""
    service = host.service(experiment_id)
    target = service.store.last_id()
    if target is None:
        return
    give_up = time.monotonic() + CATCH_UP_S
    while True:
        position: Any = host.client.hget(service.views.keys.position, "position")
        if position is not None and stream_position(str(position)) >= stream_position(target):
            return
        if time.monotonic() >= give_up or not host.client.exists(keys.PROJECTOR_HEARTBEAT):
            Projector(host.client).catch_up(experiment_id, until=target)
            return
        time.sleep(0.01)


def _state(host: ManagerHost, experiment_id: str) -> ExperimentState:
    service = host.service(experiment_id)
    # The status first, then the counts projected up to the log's end read after it: an experiment read as DONE
    # counts every trial that ended before it finished (read the other way round, a trial ending meanwhile was
    # still RUNNING in the counts of an experiment already DONE).
    view = service.experiment_view()
    _caught_up(host, experiment_id)
    counts = {name: count for name, count in service.views.counts().items() if name in TrialJobStatus.__members__}
    return ExperimentState(
        id=view.id,
        status=view.status,
        start_time=view.start_time,
        end_time=view.end_time,
        message=view.message,
        trial_counts=counts,
        hosted=view.id in host.hosted(),
        archived=bool(host.client.hexists(keys.ARCHIVED, view.id)),
        working_directory=view.working_directory,
        config=view.config,
    )


# trials


@router.get("/experiments/{experiment_id}/trials", response_model=TrialPage)
def list_trials(
    experiment_id: Experiment,
    host: Host,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    status: TrialJobStatus | None = None,
    sort: TrialOrder = "sequence",
) -> TrialPage:
    """A page of trials, by sequence id or by final metric (best first in the tuner's optimize_mode)."""
    service = host.service(experiment_id)
    _caught_up(host, experiment_id)
    maximize = True
    if sort == "metric":
        config = ExperimentConfig.model_validate(service.experiment_view().config)
        maximize = optimize_mode_of(config.tuner_section) != "minimize"
    items = service.views.page(offset, limit, sort, maximize, None if status is None else str(status))
    return TrialPage(total=service.views.total(), offset=offset, items=items)


@router.post("/experiments/{experiment_id}/trials", response_model=CustomizedTrialAnswer, status_code=201)
def add_trial(experiment_id: Experiment, trial: CustomizedTrial, host: Host) -> CustomizedTrialAnswer:
    """A customized trial: these parameters, numbered at once, run by the experiment's runner in the next free slot."""
    return host.add_customized_trial(experiment_id, trial.parameters)


@router.get("/experiments/{experiment_id}/trials/{trial_id}", response_model=TrialJobDetail)
def get_trial(experiment_id: Experiment, trial_id: str, host: Host) -> TrialJobDetail:
    return host.service(experiment_id).get_trial_job(trial_id)


@router.put("/experiments/{experiment_id}/trials/{trial_id}", response_model=TrialJobDetail)
def update_trial(experiment_id: Experiment, trial_id: str, form: JobApplicationForm, host: Host) -> TrialJobDetail:
    """NNI's updateTrialJob: a new parameter set for a running trial (multi-phase). Its value is refused unless it
    is JSON the trial (its parameter.cfg) and the views can parse."""
    check_json_text(form.hyper_parameters.value, "hyperParameters.value", "a trial's parameter set")
    return host.service(experiment_id).update_trial_job(trial_id, form)


@router.post("/experiments/{experiment_id}/trials/{trial_id}/cancel", response_model=TrialJobDetail)
def cancel_trial(
    experiment_id: Experiment, trial_id: str, host: Host, request: CancelRequest | None = None
) -> TrialJobDetail:
    """USER_CANCELED, or EARLY_STOPPED with `{"earlyStopped": true}`. The body is optional (NNI's cancelTrialJob
    defaults isEarlyStopped to false): a plain POST reaches the trial, an unknown one a 404, not a 422 for the body."""
    early_stopped = request is not None and request.early_stopped
    host.cancel_trial(experiment_id, trial_id, early_stopped=early_stopped)
    return host.service(experiment_id).get_trial_job(trial_id)


@router.get("/experiments/{experiment_id}/trials/{trial_id}/metrics", response_model=MetricList)
def trial_metrics(experiment_id: Experiment, trial_id: str, host: Host) -> MetricList:
    service = host.service(experiment_id)
    service.get_trial_job(trial_id)  # an unknown trial is a 404, not an empty list
    return MetricList(items=service.views.metrics(trial_id))


# cluster metadata


@router.get("/experiments/{experiment_id}/cluster-metadata/{key}", response_model=ClusterMetadataValue)
def get_cluster_metadata(experiment_id: Experiment, key: str, host: Host) -> ClusterMetadataValue:
    return ClusterMetadataValue(value=host.service(experiment_id).get_cluster_metadata(key))


class ClusterMetadataOfTheConfig(ValueError):
    """A PUT of the cluster metadata the experiment's config sets at creation (409)."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"cluster metadata {key!r} is set from the experiment's config when it is created (its trainingService "
            "checked by the platform, its secrets kept out of the log) and cannot be set on its own: to run trials "
            "another way, create an experiment with that config (POST /api/v1/experiments, or `trialstream run`)"
        )


@router.put(
    "/experiments/{experiment_id}/cluster-metadata/{key}", response_model=ClusterMetadataValue, responses={409: {}}
)
def set_cluster_metadata(
    experiment_id: Experiment, key: str, value: ClusterMetadataValue, host: Host
) -> ClusterMetadataValue:
    """Any key but `trial_config` and `platform_config`, which are the experiment's config. Stored as sent, a
    section would pass no platform check and land in the log unmasked; checked and masked as at creation, it
    would still not be safe: the secrets are kept beside the log by path for the trainingService the
    experiment was created with, which the trials submitted so far (their retries, re-attachments) and a
    resume (its spec, its platform check) go on using, and another section's secrets would reach them."""
    if key in (TRIAL_CONFIG, PLATFORM_CONFIG):
        raise ClusterMetadataOfTheConfig(key)
    host.service(experiment_id).set_cluster_metadata(key, value.value)
    return value


# events


@router.get("/experiments/{experiment_id}/events", response_model=EventPage)
def list_events(
    experiment_id: Experiment,
    host: Host,
    after: Annotated[str, Query(pattern=r"^[0-9]+-[0-9]+$")] = "0-0",
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> EventPage:
    """The log, a page at a time, in order: each entry's id and its event as stored."""
    _check_stream_id(after, "after")
    store = host.service(experiment_id).store
    head = store.last_id() or "0-0"
    entries = store.read(after=after, count=limit)
    items = [describe(entry).json for entry in entries]
    return EventPage(items=items, next=entries[-1].id if entries else after, head=head)


@router.get("/experiments/{experiment_id}/events/stream", response_class=StreamingResponse)
async def follow_events(experiment_id: Experiment, host: Host, request: Request, after: str = "$") -> StreamingResponse:
    """Server-Sent Events: each new entry of the log as it is appended (`after=0-0` for all of it
    first, SSE_BATCH entries at a time). A client reconnecting with Last-Event-ID resumes after the
    last entry it got.

    Its blocking reads run on threads of their own (SSE_THREADS), not on the pool every plain handler
    runs on: a follower waits in a read nearly all the time, and 40 of them would hold that whole pool."""
    last_event_id = request.headers.get("last-event-id")
    cursor = last_event_id or after
    store = (await anyio.to_thread.run_sync(host.service, experiment_id)).store
    if cursor == "$" and last_event_id is None:
        newest: str | None = await anyio.to_thread.run_sync(store.last_id)
        cursor = newest or "0-0"
    _check_stream_id(cursor, "Last-Event-ID" if last_event_id else "after")
    limiter = _sse_threads()

    async def stream() -> Any:
        nonlocal cursor
        yield ": following the log\n\n"
        while not await request.is_disconnected():
            entries = await anyio.to_thread.run_sync(store.wait, cursor, SSE_BLOCK_MS, SSE_BATCH, limiter=limiter)
            for entry in entries:
                cursor = entry.id
                yield f"id: {entry.id}\nevent: log\ndata: {json.dumps(describe(entry).json)}\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"cache-control": "no-store"})


_SSE_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = weakref.WeakKeyDictionary()


def _sse_threads() -> anyio.CapacityLimiter:
    """The event loop's limiter for followers' reads (one per loop: nnictl's listeners run loops of their own)."""
    loop = asyncio.get_running_loop()
    limiter = _SSE_LIMITERS.get(loop)
    if limiter is None:
        limiter = _SSE_LIMITERS[loop] = anyio.CapacityLimiter(SSE_THREADS)
    return limiter


def _check_stream_id(value: str, name: str) -> None:
    """A log position from outside, checked before Redis sees it: an id Redis refuses (a part over 64
    bits, not `ms-seq`) is the client's mistake, a 422, not a server error (and, in a stream, not a
    broken response)."""
    if not is_stream_id(value):
        raise HTTPException(422, f"{name}: {value[:80]!r} is not a log position (ms-seq, each part < 2**64)")
