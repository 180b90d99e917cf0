"""The experiment timeline (issue 28): its page, its assets and the data the page asks for.

`/timeline/` lists the experiments, `/timeline/<experiment>` is one's page (under the same token, Host and
Origin rules and `--url-prefix` as NNI's web UI). The page asks `/api/v1/experiments/<id>/timeline` for the
window it shows (clusters when zoomed out over more attempts than it should draw one by one), `.../views` for
the trial table at its cursor, `.../attempts/<trial>/<n>` for what a click opens, and follows the log's SSE
stream while the experiment runs.

Each experiment's fold (manager.timeline) starts from the one its projector keeps (manager.timeline_views), is
kept in memory while it is asked for, and is caught up with the log on each request: a first look costs the
kept fold and the entries past it, a live page the entries appended since its last question.
"""

from __future__ import annotations

import html
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import FileResponse, HTMLResponse

from core import keys
from core.event_store import EventStore
from core.platform import OutputUnavailable
from manager.api.native import Experiment, Host
from manager.host import ManagerHost
from manager.timeline import Timeline
from manager.timeline_page import ASSETS, SERVED_CSP, attempt_detail, served_page
from manager.timeline_views import restore
from manager.trial_files import output_chunks, output_tail, started_attempt

router = APIRouter(tags=["timeline"])
FOLDS_KEPT = 8  # experiments whose fold stays in memory (the least recently asked for goes first)
READ_BATCH = 10_000
_PAGE_HEADERS = {
    "content-security-policy": SERVED_CSP,
    "x-content-type-options": "nosniff",
    "cache-control": "no-store",
}


@dataclass
class _Fold:
    lock: threading.Lock = field(default_factory=threading.Lock)
    timeline: Timeline | None = None  # made by the first request that holds the lock


class Timelines:
    """Folds kept per experiment; each made and caught up under its own lock (two pages never fold the same
    entries, nor read the kept fold twice)."""

    def __init__(self) -> None:
        self._folds: OrderedDict[str, _Fold] = OrderedDict()
        self._lock = threading.Lock()

    def caught_up(self, store: EventStore) -> Timeline:
        experiment_id = store.experiment_id
        with self._lock:
            fold = self._folds.setdefault(experiment_id, _Fold())
            self._folds.move_to_end(experiment_id)
            while len(self._folds) > FOLDS_KEPT:
                self._folds.popitem(last=False)
        with fold.lock:
            if fold.timeline is None:  # the projector's fold where it keeps one, then only the entries past it
                fold.timeline = restore(store.client, experiment_id) or Timeline(experiment_id)
            timeline = fold.timeline
            while True:
                batch = store.raw_range(f"({timeline.head}", "+", READ_BATCH)
                timeline.feed((entry.id, entry.fields) for entry in batch)
                if len(batch) < READ_BATCH:
                    return timeline


def timelines(request: Request) -> Timelines:
    found: Timelines = request.app.state.timelines
    return found


Folds = Annotated[Timelines, Depends(timelines)]


def _timeline(host: ManagerHost, folds: Timelines, experiment_id: str) -> Timeline:
    return folds.caught_up(host.service(experiment_id).store)


@router.get("/api/v1/experiments/{experiment_id}/timeline")
def timeline_window(
    experiment_id: Experiment,
    host: Host,
    folds: Folds,
    start: Annotated[int | None, Query(alias="from", ge=0)] = None,
    end: Annotated[int | None, Query(alias="to", ge=0)] = None,
    px: Annotated[int, Query(ge=1, le=20_000)] = 1200,
) -> Any:
    """The attempts and markers between `from` and `to` (ms; the whole experiment by default), drawn `px` wide."""
    if start is not None and end is not None and end < start:
        raise HTTPException(422, f"to ({end}) is before from ({start})")
    return _timeline(host, folds, experiment_id).window(start, end, px)


@router.get("/api/v1/experiments/{experiment_id}/timeline/views")
def timeline_views(experiment_id: Experiment, host: Host, folds: Folds) -> Any:
    """Every trial's view changes, by log position: the trial table at any point of the log."""
    return _timeline(host, folds, experiment_id).views()


@router.get("/api/v1/experiments/{experiment_id}/timeline/attempts/{trial_id}/{attempt}")
def timeline_attempt(
    experiment_id: Experiment, trial_id: str, attempt: Annotated[int, Path(ge=1)], host: Host, folds: Folds
) -> Any:
    """One attempt: the trial's history, the attempt's metrics, and the end of its output where it can be read."""
    timeline = _timeline(host, folds, experiment_id)
    try:
        entry_ids = timeline.entry_ids(trial_id)
        timeline.attempt(trial_id, attempt)
    except LookupError as error:
        raise HTTPException(404, str(error)) from None
    store = host.service(experiment_id).store
    output = _output(host, experiment_id, trial_id, attempt)
    return attempt_detail(timeline, trial_id, attempt, _entries(store, entry_ids), output)


def _entries(store: EventStore, entry_ids: list[str]) -> list[tuple[str, dict[str, str]]]:
    """The entries of `entry_ids`, read in one round trip."""
    with store.client.pipeline(transaction=False) as pipe:
        for entry_id in entry_ids:
            pipe.xrange(keys.events(store.experiment_id), entry_id, entry_id, count=1)
        found = pipe.execute()
    return [(entry_id, dict(rows[0][1])) for entry_id, rows in zip(entry_ids, found, strict=True) if rows]


def _output(host: ManagerHost, experiment_id: str, trial_id: str, attempt: int) -> dict[str, Any]:
    trial = host.service(experiment_id).get_trial_job(trial_id)
    if started_attempt(trial) != attempt:
        return {"error": f"only the output of the trial's latest started attempt ({started_attempt(trial)}) is kept"}
    try:
        return output_tail(output_chunks(host.settings, host.client, trial, "stdout"))
    except OutputUnavailable as error:
        return {"error": str(error)}


# the pages


@router.get("/timeline/assets/{name}", include_in_schema=False)
def timeline_asset(name: str) -> FileResponse:
    path = ASSETS.get(name)
    if path is None:
        raise HTTPException(404, f"no asset {name!r}")
    return FileResponse(path, headers={"x-content-type-options": "nosniff"})


@router.get("/timeline/{experiment_id}", include_in_schema=False)
def timeline_page(experiment_id: Experiment, request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    config = {
        "mode": "server",
        "experimentId": experiment_id,
        "api": f"{root}/api/v1/experiments/{experiment_id}",
        "webui": f"{root}/nni/{experiment_id}/oview",
        "index": f"{root}/timeline/",
    }
    return HTMLResponse(served_page(config, f"{root}/timeline/assets/"), headers=_PAGE_HEADERS)


@router.get("/timeline", include_in_schema=False)
@router.get("/timeline/", include_in_schema=False)
def timeline_index(host: Host, request: Request) -> HTMLResponse:
    """The experiments, newest first, each with its timeline and NNI's web UI."""
    root = html.escape(request.scope.get("root_path", ""))
    rows = []
    for experiment_id in reversed(host.experiment_ids()):
        name = html.escape(experiment_id)
        rows.append(
            f'<li><a href="{root}/timeline/{name}">{name}</a> '
            f'<a class="webui" href="{root}/nni/{name}/oview">NNI web UI</a></li>'
        )
    body = "\n".join(rows) or "<li>no experiments yet</li>"
    page = (
        '<!doctype html><html lang="en"><head><meta charset="utf-8"><title>trialstream: timelines</title>'
        f'<link rel="stylesheet" href="{root}/timeline/assets/timeline.css"></head>'
        f'<body class="index"><h1>Experiments</h1><ul id="experiments">{body}</ul></body></html>'
    )
    return HTMLResponse(page, headers=_PAGE_HEADERS)
