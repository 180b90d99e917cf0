"""NNI's own web UI, served by a real manager from the installed `nni` package, in a real headless chromium:
a finished experiment and a live one, as a user sees and drives them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.browser import Browser, browser  # noqa: F401  (the fixture)
from tests.conftest import Processes
from tests.test_api_nni import _experiment
from tests.waiting import wait_until

UI_DEADLINE_S = 40  # the UI polls every 10 s: a change shows within one poll, or at once after a page load


def _text(driver: WebDriver) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def _shows(*texts: str) -> Callable[[WebDriver], bool]:
    return lambda driver: all(text in _text(driver) for text in texts)


def _api(url: str, experiment_id: str, path: str) -> Any:
    return httpx.get(f"{url}/nni/{experiment_id}/api/v1/nni{path}", timeout=30).json()


def _click_in_row(wait: WebDriverWait[WebDriver], trial_id: str, selector: str) -> None:
    """Click `selector` in the trial's row of the Trials detail table, once the row is there (looked up again
    when a poll re-rendered it)."""

    def click(driver: WebDriver) -> bool:
        rows = [row for row in driver.find_elements(By.CSS_SELECTOR, ".ms-DetailsRow") if trial_id in row.text]
        if rows:
            rows[0].find_element(By.CSS_SELECTOR, selector).click()
        return bool(rows)

    wait.until(click)


def _click_tab(wait: WebDriverWait[WebDriver], label: str) -> None:
    """A pivot tab of Trials detail (its label follows an icon glyph)."""

    def click(driver: WebDriver) -> bool:
        tabs = [tab for tab in driver.find_elements(By.CSS_SELECTOR, "[role=tab]") if label in tab.text]
        if tabs:
            tabs[0].click()
        return bool(tabs)

    wait.until(click)


def _click_button(wait: WebDriverWait[WebDriver], label: str) -> None:
    """Click the button once it is there; the UI re-renders as it polls, so a stale one is looked up again."""

    def click(driver: WebDriver) -> bool:
        found = [button for button in driver.find_elements(By.TAG_NAME, "button") if button.text.strip() == label]
        if found:
            found[0].click()
        return bool(found)

    wait.until(click)


def test_the_web_ui_shows_and_drives_experiments(tmp_path: Path, processes: Processes, browser: Browser) -> None:  # noqa: F811
    processes.worker(args=("--concurrency", "4"))
    url = processes.manager()
    finished = _experiment(url, tmp_path / "finished", trials=3, concurrency=3, released=True)
    wait_until(lambda: _api(url, finished, "/check-status")["status"] == "DONE", 60, what="the first experiment")
    live = _experiment(url, tmp_path / "live", trials=2, concurrency=2, released=False)
    driver = browser.driver
    wait = WebDriverWait(driver, UI_DEADLINE_S, ignored_exceptions=(StaleElementReferenceException,))

    # Overview of the finished experiment: its status, trial counts and best metric
    jobs = _api(url, finished, "/trial-jobs")
    best = max(json.loads(json.loads(job["finalMetricData"][0]["data"])) for job in jobs)
    driver.get(f"{url}/nni/{finished}/oview")
    wait.until(_shows("DONE", "Best metric", f"{best:.6f}", "Succeeded"))
    assert "Succeeded 3" in _text(driver).replace("\n", " ")
    browser.screenshot("overview-finished")

    # Trials detail lists its trials, and a row opens on its parameters
    driver.get(f"{url}/nni/{finished}/detail")
    wait.until(_shows(*(job["trialJobId"] for job in jobs)))
    _click_in_row(wait, jobs[0]["trialJobId"], "[data-automation-key=_expand] i")
    x = json.loads(jobs[0]["hyperParameters"][0])["parameters"]["x"]
    wait.until(_shows(str(x)[:6]))
    browser.screenshot("detail-finished")

    # its charts: the default metric of every trial, and each trial's intermediate results (3 each)
    charts = len(driver.find_elements(By.TAG_NAME, "canvas"))
    assert charts >= 1  # the default metric chart
    _click_tab(wait, "Intermediate result")
    wait.until(lambda d: len(d.find_elements(By.TAG_NAME, "canvas")) >= 1 and "Intermediate result" in _text(d))
    browser.screenshot("detail-intermediate")
    _click_tab(wait, "Duration")
    browser.screenshot("detail-duration")

    # a trial's log opens at the trial-file URL the UI links to; its output is text, not markup
    log = f"{url}/nni/{finished}/api/v1/nni/trial-file/{jobs[0]['trialJobId']}/trial.log"
    driver.get(log)
    wait.until(_shows("PRINT parameters"))
    browser.screenshot("trial-log")

    # the live experiment: its trials RUNNING; a kill from the UI ends one USER_CANCELED
    driver.get(f"{url}/nni/{live}/detail")
    wait.until(lambda d: _text(d).count("RUNNING") >= 2)
    browser.screenshot("detail-live")
    victim = _api(url, live, "/trial-jobs")[0]["trialJobId"]
    _click_in_row(wait, victim, "button[title=kill]")
    _click_button(wait, "Yes")
    wait_until(
        lambda: _api(url, live, f"/trial-jobs/{victim}")["status"] == "USER_CANCELED",
        UI_DEADLINE_S,
        what="the trial killed from the UI to end USER_CANCELED",
    )
    _click_button(wait, "Close")
    _click_button(wait, "Refresh")
    wait.until(_shows("USER_CANCELED"))
    browser.screenshot("detail-live-killed")

    # All experiments lists both
    driver.get(f"{url}/nni/{live}/experiment")
    wait.until(_shows("All experiments", finished, live))
    browser.screenshot("all-experiments")
    (tmp_path / "live" / "release").touch()

    assert browser.uncaught_errors() == []


def test_console_errors_are_checked_per_page(browser: Browser) -> None:  # noqa: F811
    """The check itself: an uncaught error in a page is caught by `uncaught_errors`."""
    browser.driver.get("data:text/html,<script>null.boom()</script>")
    assert any("TypeError" in message for message in browser.uncaught_errors())
