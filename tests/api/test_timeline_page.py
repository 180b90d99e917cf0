"""The experiment timeline (issue 28) as a person uses it: a real manager serving the page to headless Chromium, an
experiment whose worker is SIGKILLed mid-trial, the cursor moved before and after the kill, an attempt clicked
open, and the same experiment exported to one HTML file opened from disk with no server. Screenshots land in
tests-artifacts/webui/. The remote platform's partition is in tests/platforms/test_remote_timeline.py."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis
from selenium.webdriver.common.actions.action_builder import ActionBuilder
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from core.event_store import StoredEvent
from core.variables import REDIS_URL_ENV
from manager.replay import replayed
from manager.training_service import TrainingService
from manager.transfer import export_log
from manager.views import ViewStore
from schemas.events import TrialAttemptLost, TrialEnded, TrialStarted
from schemas.trial import TrialJobStatus
from simulators.waiting import wait_until
from tests.conftest import REPO, Processes, ServiceFactory, form, metric, wait_for_status
from tests.faults.test_fault_worker import DETECTION_BOUND_S, FAST_LEASE, TRIAL, running_trial
from tests.platforms.test_local_platform import script
from tests.support import web
from tests.support.browser import Browser, browser  # noqa: F401  (the fixture)

PAGE_DEADLINE_S = 30


def ready(driver: WebDriver) -> None:
    wait_until(
        lambda: driver.execute_script("return !!(window.timeline && window.timeline.ready)"),
        PAGE_DEADLINE_S,
        what="the timeline to be drawn",
    )


def drawn(driver: WebDriver) -> dict[str, dict[str, Any]]:
    return {attempt["key"]: attempt for attempt in driver.execute_script("return window.timeline.drawn()")}


def rows(driver: WebDriver) -> dict[str, tuple[str, str]]:
    """The trial table at the cursor: trial -> (status, attempt)."""
    found = driver.find_elements(By.CSS_SELECTOR, "#trials tr[data-trial]")
    cells = [[str(row.get_attribute(f"data-{name}")) for name in ("trial", "status", "attempt")] for row in found]
    return {trial: (status, attempt) for trial, status, attempt in cells}


def move_cursor(driver: WebDriver, position: str) -> None:
    """As a person types an event id into the cursor box and presses Enter."""
    box = driver.find_element(By.ID, "cursor-input")
    box.clear()
    box.send_keys(position, Keys.ENTER)
    wait_until(
        lambda: driver.execute_script("return window.timeline.cursor()") == position, 10, what=f"cursor {position}"
    )


def click_at(driver: WebDriver, x: float, y: float) -> None:
    actions = ActionBuilder(driver)
    actions.pointer_action.move_to_location(int(x), int(y)).click()
    actions.perform()


def click_attempt(driver: WebDriver, key: str) -> None:
    """A real click on the attempt's bar on the canvas; the detail panel opens with its history."""
    click_at(driver, *driver.execute_script("return window.timeline.pixelOf(arguments[0])", key))

    loaded = """
        const first = document.querySelector("#detail-history li");
        return !document.getElementById("detail").hidden && !!first && first.textContent !== "loading…";
    """  # the panel shows "loading…" until the attempt's answer is in
    wait_until(lambda: driver.execute_script(loaded), 15, what=f"the detail panel of {key}")


def drag_cursor(driver: WebDriver, to_ms: int, y: float) -> None:
    """Grab the cursor line where it is and drop it at the time `to_ms`."""
    cursor_ms = int(driver.execute_script("return window.timeline.cursor()").split("-")[0])
    start = driver.execute_script("return window.timeline.pixelOfTime(arguments[0])", cursor_ms)
    end = driver.execute_script("return window.timeline.pixelOfTime(arguments[0])", to_ms)
    actions = ActionBuilder(driver)
    pointer = actions.pointer_action
    pointer.move_to_location(int(start), int(y)).pointer_down()
    for step in range(1, 11):
        pointer.move_to_location(int(start + (end - start) * step / 10), int(y))
    pointer.pointer_up()
    actions.perform()


def replayed_status(client: redis.Redis, experiment_id: str, trial_id: str, position: str) -> tuple[str, str]:
    with replayed(client, experiment_id, position) as replay:
        trial = next(t for t in ViewStore(client, experiment_id, replay.namespace).trials() if t.id == trial_id)
    return str(trial.status), str(trial.attempt)


def history(service: TrainingService, trial_id: str) -> list[StoredEvent]:
    return [
        e for e in service.store.read() if isinstance(e, StoredEvent) and getattr(e.event, "trial_id", "") == trial_id
    ]


def page_data(path: Path) -> Any:
    found = re.search(r'<script id="timeline-data" type="application/json">(.*?)</script>', path.read_text(), re.S)
    assert found is not None
    return json.loads(found.group(1))


def test_a_lost_attempt_and_its_retry_in_their_workers_lanes_before_and_after_the_cursor_and_from_disk(
    make_service: ServiceFactory,
    processes: Processes,
    code_dir: Path,
    client: redis.Redis,
    browser: Browser,  # noqa: F811
    tmp_path: Path,
) -> None:
    service = make_service(script(code_dir, "trial.py", TRIAL), max_retries=1)
    url = processes.manager()
    trial_id, _, victim = running_trial(service, processes, code_dir)
    victim_name = service.get_trial_job(trial_id).worker
    processes.worker(env=FAST_LEASE)
    victim.send_signal(signal.SIGKILL)
    done = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=DETECTION_BOUND_S + 10)
    assert done.status.value == "SUCCEEDED" and done.attempt == 2
    survivor_name = done.worker
    events = history(service, trial_id)
    first_start, second_start = (e.id for e in events if isinstance(e.event, TrialStarted))
    [loss] = [e.id for e in events if isinstance(e.event, TrialAttemptLost)]

    driver = browser.driver
    driver.get(f"{url}/timeline/{service.experiment_id}")
    ready(driver)
    attempts = drawn(driver)
    lost, retry = attempts[f"{trial_id}/1"], attempts[f"{trial_id}/2"]
    assert lost["outcome"] == "LOST" and retry["outcome"] == "SUCCEEDED"
    assert retry["retryOf"] == f"{trial_id}/1"
    assert [f"worker {victim_name}" in lane for lane in lost["lanes"]] == [True]
    assert [f"worker {survivor_name}" in lane for lane in retry["lanes"]] == [True]
    browser.screenshot("lanes")

    # the cursor before the kill: attempt 1 RUNNING; after the loss: attempt 2 waiting, then running elsewhere
    for position, expected in (
        (first_start, ("RUNNING", "1")),
        (loss, ("WAITING", "2")),
        (second_start, ("RUNNING", "2")),
    ):
        move_cursor(driver, position)
        wait_until(lambda: rows(driver).get(trial_id) == expected, 10, what=f"the table at {position}")  # noqa: B023
        assert replayed_status(client, service.experiment_id, trial_id, position) == expected
        browser.screenshot(f"cursor-{expected[0].lower()}-{expected[1]}")

    # the cursor line dragged back before the trial's submission: no trial yet
    submitted_ms = int(events[0].id.split("-")[0])
    drag_cursor(
        driver,
        submitted_ms - 500,
        driver.execute_script("return window.timeline.pixelOf(arguments[0])", f"{trial_id}/1")[1],
    )
    wait_until(lambda: rows(driver) == {}, 10, what="an empty table before the submission")
    browser.screenshot("cursor-before-submission")

    # played forward from there, the trial appears as the cursor passes its submission
    Select(driver.find_element(By.ID, "speed")).select_by_visible_text("10x")
    driver.find_element(By.ID, "play").click()
    wait_until(lambda: trial_id in rows(driver), 30, what="the trial to appear as the cursor plays")
    driver.find_element(By.ID, "play").click()

    click_attempt(driver, f"{trial_id}/1")
    kinds = [li.get_attribute("data-type") for li in driver.find_elements(By.CSS_SELECTOR, "#detail-history li")]
    assert "TrialAttemptLost" in kinds and kinds.count("TrialStarted") == 2
    assert driver.find_element(By.ID, "detail-metrics").get_attribute("data-points") == "1"
    browser.screenshot("attempt-lost")
    assert browser.uncaught_errors() == []
    served = drawn(driver)

    # one file, the log inside; opened from disk with no manager at all, it shows the same
    html = tmp_path / "timeline.html"
    env = {**os.environ, REDIS_URL_ENV: processes.redis_url}
    cli = [sys.executable, "-m", "manager.cli"]
    subprocess.run([*cli, "timeline", service.experiment_id, "-o", str(html)], env=env, cwd=REPO, check=True)
    log = tmp_path / "exported.jsonl"
    with log.open("w") as out:
        export_log(client, service.experiment_id, out)  # what `trialstream export` writes
    offline = tmp_path / "from-log.html"
    no_redis = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV}
    subprocess.run([*cli, "timeline", "--log", str(log), "-o", str(offline)], env=no_redis, cwd=REPO, check=True)
    from_redis, from_log = page_data(html), page_data(offline)
    assert from_log["timeline"] == from_redis["timeline"] and from_log["views"] == from_redis["views"]
    processes.stop()
    for path in (html, offline):
        driver.get(path.as_uri())
        ready(driver)
        assert drawn(driver) == served
    move_cursor(driver, first_start)
    wait_until(lambda: rows(driver).get(trial_id) == ("RUNNING", "1"), 10, what="the file's table before the kill")
    click_attempt(driver, f"{trial_id}/1")
    assert "TrialAttemptLost" in [
        li.get_attribute("data-type") for li in driver.find_elements(By.CSS_SELECTOR, "#detail-history li")
    ]
    browser.screenshot("file")
    assert browser.uncaught_errors() == []


def test_the_timeline_under_a_url_prefix_behind_a_token_says_what_is_missing(
    make_service: ServiceFactory, processes: Processes, tmp_path: Path
) -> None:
    """The page and its data under `--url-prefix` and a token, as NNI's web UI is; unknown experiments,
    trials and attempts are a clear 404, a window ending before it starts a 422, and only the page's own
    files are served as its assets."""
    service = make_service("true")
    experiment = service.experiment_id
    token = secrets.token_urlsafe(24)
    (tmp_path / "token").write_text(token)
    url = processes.manager("--url-prefix", "some/prefix", "--token-file", str(tmp_path / "token"))
    base = f"{url}/some/prefix"
    bearer = {"authorization": f"Bearer {token}"}

    def get(path: str, **params: Any) -> httpx.Response:
        return web.get(f"{base}{path}", headers=bearer, params=params)

    assert web.get(f"{base}/timeline/{experiment}").status_code == 401
    assert web.get(f"{base}/api/v1/experiments/{experiment}/timeline").status_code == 401
    page = get(f"/timeline/{experiment}")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    found = re.search(r'id="timeline-config" type="application/json">(.*?)</script>', page.text, re.S)
    assert found is not None
    assert json.loads(found.group(1))["api"] == f"/some/prefix/api/v1/experiments/{experiment}"
    assert "/some/prefix/timeline/assets/timeline.js" in page.text
    assert get("/timeline/assets/echarts.min.js").status_code == 200
    assert get("/timeline/assets/nope.js").status_code == 404
    assert "[project]" not in get("/timeline/assets/..%2Fpyproject.toml").text  # only its own files
    assert f'href="/some/prefix/timeline/{experiment}"' in get("/timeline/").text
    assert get(f"/api/v1/experiments/{experiment}/timeline").json()["experimentId"] == experiment
    assert get("/timeline/nope").status_code == 404
    assert get("/api/v1/experiments/nope/timeline").status_code == 404
    missing = get(f"/api/v1/experiments/{experiment}/timeline/attempts/t1/1")
    assert missing.status_code == 404 and "no trial 't1'" in missing.text
    assert get(f"/api/v1/experiments/{experiment}/timeline", **{"from": 10, "to": 5}).status_code == 422


def test_a_live_page_follows_a_log_that_grows_faster_than_it_refreshes(
    make_service: ServiceFactory,
    processes: Processes,
    browser: Browser,  # noqa: F811
) -> None:
    """A trial reporting metrics more often than the page's refresh delay (500 ms) must not keep the page from
    refreshing: it draws the trial's end while the metrics of another trial go on arriving."""
    service = make_service("true")
    store, experiment = service.store, service.experiment_id
    busy, ending = (service.submit_trial_job(form(index)).id for index in (0, 1))
    for trial_id in (busy, ending):
        store.append(
            TrialStarted(
                experiment_id=experiment, trial_id=trial_id, attempt=1, source="fake-worker", working_directory="/w"
            )
        )
    driver = browser.driver
    driver.get(f"{processes.manager()}/timeline/{experiment}")
    ready(driver)
    assert drawn(driver)[f"{ending}/1"]["outcome"] == "RUNNING"
    store.append(
        TrialEnded(
            experiment_id=experiment,
            trial_id=ending,
            attempt=1,
            source="fake-worker",
            status=TrialJobStatus.SUCCEEDED,
            exit_code=0,
        )
    )
    sequence = 0

    def ended_while_reporting() -> bool:
        nonlocal sequence
        sequence += 1
        store.append(metric(experiment, busy, sequence))
        time.sleep(0.1)  # a metric every ~100 ms: faster than the page refreshes
        return bool(drawn(driver)[f"{ending}/1"]["outcome"] == "SUCCEEDED")

    wait_until(ended_while_reporting, PAGE_DEADLINE_S, interval=0, what="the page to draw the trial's end")
    assert drawn(driver)[f"{busy}/1"]["outcome"] == "RUNNING"
    assert browser.uncaught_errors() == []
