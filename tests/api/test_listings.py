"""NNI's whole-list answers are rendered once per projection position, and never kept for a large experiment."""

from __future__ import annotations

import json

import redis
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from core import keys
from core.settings import Settings
from core.variables import PREFIX
from manager.api import listings
from manager.api.app import ApiOptions, build_api
from manager.api.listings import ListingCache
from manager.host import ManagerHost
from manager.projector import Projector
from simulators.waiting import wait_until
from tests.conftest import Processes, ServiceFactory, form, metric
from tests.support import web

TOKEN = "tok-revalidated"


def test_an_answer_is_rendered_again_only_when_the_projection_moves(
    make_service: ServiceFactory, client: redis.Redis
) -> None:
    service = make_service()
    service.submit_trial_job(form(0))
    Projector(client).catch_up(service.experiment_id)
    cache, renders = ListingCache(), []

    def items() -> list[str]:
        renders.append(1)
        return [json.dumps(trial.id) for trial in service.views.iter_trials()]

    first = cache.answer(service.views, ("e", "/trial-jobs", ""), items, None)
    again = cache.answer(service.views, ("e", "/trial-jobs", ""), items, None)
    assert first.body == again.body and len(renders) == 1
    assert len(json.loads(bytes(first.body))) == 1

    service.submit_trial_job(form(1))
    Projector(client).catch_up(service.experiment_id)
    moved = cache.answer(service.views, ("e", "/trial-jobs", ""), items, None)
    assert len(renders) == 2 and len(json.loads(bytes(moved.body))) == 2
    other_query = cache.answer(service.views, ("e", "/trial-jobs", "status=RUNNING"), items, None)
    assert len(renders) == 3 and other_query.body == moved.body
    revalidated = cache.answer(service.views, ("e", "/trial-jobs", ""), items, moved.headers["etag"])
    assert revalidated.status_code == 304 and not revalidated.body and len(renders) == 3  # as a browser asks


def test_a_large_experiment_is_streamed_and_kept_answers_stay_within_their_bytes(
    make_service: ServiceFactory, client: redis.Redis, monkeypatch: object
) -> None:
    service = make_service()
    for index in range(3):
        service.submit_trial_job(form(index))
    Projector(client).catch_up(service.experiment_id)
    monkeypatch.setattr(listings, "CACHED_TRIALS", 2)  # type: ignore[attr-defined]
    streamed = ListingCache().answer(service.views, ("e", "/trial-jobs", ""), lambda: ['"a"', '"b"', '"c"'], None)
    assert isinstance(streamed, StreamingResponse)

    monkeypatch.setattr(listings, "CACHED_TRIALS", 100)  # type: ignore[attr-defined]
    small = ListingCache(max_bytes=10)
    for key in ("one", "two", "three"):
        small.answer(service.views, ("e", key, ""), lambda: ['"xyz"'], None)  # 7 bytes each: one fits
    assert small._bytes <= 10 and len(small._answers) == 1


def test_a_listing_projects_what_no_projector_has_yet(make_service: ServiceFactory, client: redis.Redis) -> None:
    """The manager's own API, in process, with no projector at all (after a Redis restart the projector's
    heartbeat may be gone, or it may still be reconnecting): what was logged before the request is listed,
    projected by the request itself, never an ended experiment with trials missing or still RUNNING."""
    service = make_service("true")
    submitted = [service.submit_trial_job(form(index)).id for index in range(3)]
    assert not client.exists(keys.PROJECTOR_HEARTBEAT)
    api = TestClient(build_api(ManagerHost(client, Settings(), project=False), ApiOptions()))
    page = api.get(f"/api/v1/experiments/{service.experiment_id}/trials").json()
    assert [trial["id"] for trial in page["items"]] == submitted and page["total"] == 3


def test_a_revalidation_is_a_304_until_a_trial_or_a_metric_changes_and_never_without_the_token(
    processes: Processes, make_service: ServiceFactory
) -> None:
    """The web UI's revalidations, answered in front of the routes (manager.api.app.Revalidations), on a real
    manager with a token: a bodiless 304 while the views are where the ETag says; a 200 with a new ETag on
    the first revalidation after a trial or a metric is projected; every guard first, 304s included."""
    service = make_service()
    trial_id = service.submit_trial_job(form(0)).id
    url = processes.manager(env={f"{PREFIX}MANAGER_TOKEN": TOKEN})
    api = f"{url}/nni/{service.experiment_id}/api/v1/nni"
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def projected() -> bool:
        return service.views.position() == service.store.last_id()

    wait_until(projected, 30, what="the manager's projector to fold the log")
    etags = {}
    for path in ("/trial-jobs", "/metric-data", "/metric-data-latest", "/export-data"):
        first = web.get(api + path, headers=auth)
        assert first.status_code == 200, (path, first.text)
        etags[path] = first.headers["etag"]
        again = web.get(api + path, headers={**auth, "If-None-Match": etags[path]})
        assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", etags[path]), path
        assert again.headers["cache-control"] == "no-cache"
        for refused, status in (
            ({}, 401),
            ({"Authorization": "Bearer wrong"}, 401),
            ({**auth, "Origin": "http://evil.example"}, 403),
        ):
            answer = web.get(api + path, headers={**refused, "If-None-Match": etags[path]})
            assert answer.status_code == status and b"error" in answer.content, (path, refused)
    matching = {**auth, "If-None-Match": etags["/trial-jobs"]}
    unknown = web.get(f"{url}/nni/nosuch/api/v1/nni/trial-jobs", headers=matching)
    assert unknown.status_code == 404  # the route's answer, not a 304 of an experiment that does not exist

    service.store.append(metric(service.experiment_id, trial_id, 0))
    wait_until(projected, 30, what="the metric to be projected")
    changed = web.get(api + "/metric-data", headers={**auth, "If-None-Match": etags["/metric-data"]})
    assert changed.status_code == 200 and changed.headers["etag"] != etags["/metric-data"]
    assert [record["trialJobId"] for record in changed.json()] == [trial_id]
    unchanged = web.get(api + "/metric-data", headers={**auth, "If-None-Match": changed.headers["etag"]})
    assert unchanged.status_code == 304

    service.cancel_trial_job(trial_id)
    wait_until(projected, 30, what="the cancel to be projected")
    trials = web.get(api + "/trial-jobs", headers={**auth, "If-None-Match": changed.headers["etag"]})
    assert trials.status_code == 200 and trials.headers["etag"] not in (etags["/trial-jobs"], changed.headers["etag"])
    assert [job["status"] for job in trials.json()] == ["USER_CANCELED"]
