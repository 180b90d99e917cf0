"""NNI's whole-list answers are rendered once per projection position, and never kept for a large experiment."""

from __future__ import annotations

import json

import redis
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from core import keys
from core.settings import Settings
from manager.api import listings
from manager.api.app import ApiOptions, build_api
from manager.api.listings import ListingCache
from manager.host import ManagerHost
from manager.projector import Projector
from tests.conftest import ServiceFactory, form


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
