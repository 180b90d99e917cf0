"""NNI's own web UI, served by a real manager from the installed `nni` package, in a real headless chromium:
a finished experiment and a live one, as a user sees and drives them."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from core.variables import MANAGER_TOKEN_ENV
from simulators.waiting import wait_until
from tests.api.test_api_nni import TRIAL
from tests.api.test_api_smoke import experiment_config
from tests.conftest import Processes
from tests.support import web
from tests.support.browser import Browser, browser  # noqa: F401  (the fixture)

UI_DEADLINE_S = 40  # the UI polls every 10 s: a change shows within one poll, or at once after a page load


def _text(driver: WebDriver) -> str:
    return str(driver.find_element(By.TAG_NAME, "body").text)


def _shows(*texts: str) -> Callable[[WebDriver], bool]:
    return lambda driver: all(text in _text(driver) for text in texts)


def _api(url: str, experiment_id: str, path: str, headers: dict[str, str] | None = None) -> Any:
    return web.get(f"{url}/nni/{experiment_id}/api/v1/nni{path}", headers=headers, timeout=30).json()


def _submit(
    url: str, code: Path, trials: int, released: bool, headers: dict[str, str] | None = None, **extra: Any
) -> str:
    """An experiment of test_api_nni's trial, all its trials at once; they end once `code/release` exists
    (`extra`: more config keys)."""
    code.mkdir(exist_ok=True)
    (code / "trial.py").write_text(TRIAL.format(out=code / "files"))
    if released:
        (code / "release").touch()
    config = experiment_config(code, trials, trials, experimentName="webui", **extra)
    created = web.post(f"{url}/api/v1/experiments", json={"config": config}, headers=headers, timeout=30)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def _printed(job: dict[str, Any]) -> str:
    """The line test_api_nni's trial prints first, as trial.log holds it (`[time] PRINT ...`)."""
    parameters = json.loads(job["hyperParameters"][0])["parameters"]
    return f"PRINT parameters {parameters!r}"


def _format_time_style(seconds: int) -> str:
    """NNI's formatTimeStyle (ts/webui/src/static/function.ts), the HTML of the Overview's duration: `1d2h3m4s`,
    with no zero part (0 s is empty)."""
    parts = []
    for unit, size in (("d", 24 * 3600), ("h", 3600), ("m", 60), ("s", 1)):
        count, seconds = divmod(seconds, size)
        if count > 0:
            parts.append(f"<b>{count}</b><span>{unit}</span>")
    return "".join(parts)


def _duration_html(driver: WebDriver) -> str | None:
    """The Overview's duration as rendered (the HTML in its progress circle), once it is there."""
    found = driver.find_elements(By.CSS_SELECTOR, ".circle-progress .text")
    return str(found[0].get_attribute("innerHTML")) if found else None


def _click_in_row(wait: WebDriverWait[WebDriver], trial_id: str, selector: str) -> None:
    """Click `selector` in the trial's row of the Trials detail table, once the row is there (looked up again
    when a poll re-rendered it)."""

    def click(driver: WebDriver) -> bool:
        rows = [row for row in driver.find_elements(By.CSS_SELECTOR, ".ms-DetailsRow") if trial_id in row.text]
        if rows:
            rows[0].find_element(By.CSS_SELECTOR, selector).click()
        return bool(rows)

    wait.until(click)


def _click(wait: WebDriverWait[WebDriver], selector: str) -> None:
    """Click the element once it is there (looked up again when a re-render replaced it)."""

    def click(driver: WebDriver) -> bool:
        found = driver.find_elements(By.CSS_SELECTOR, selector)
        if found:
            found[0].click()
        return bool(found)

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


def _view_trial_log(chromium: Browser, wait: WebDriverWait[WebDriver]) -> tuple[str, str, str]:
    """In an expanded row of Trials detail, the Log tab's "View trial log": NNI's UI `window.open`s the log.
    What that new window shows, once loaded: its URL, its document's type and its text. Back to the UI after."""
    driver = chromium.driver
    ui = driver.current_window_handle
    before = set(driver.window_handles)
    _click_tab(wait, "Log")
    _click_button(wait, "View trial log")
    wait.until(lambda d: len(set(d.window_handles) - before) == 1)
    [opened] = set(driver.window_handles) - before
    driver.switch_to.window(opened)
    wait.until(
        lambda d: d.current_url != "about:blank" and d.execute_script("return document.readyState") == "complete"
    )
    shown = (str(driver.current_url), str(driver.execute_script("return document.contentType")), _text(driver))
    chromium.screenshot("trial-log")
    driver.close()
    driver.switch_to.window(ui)
    return shown


def test_the_web_ui_shows_and_drives_experiments(tmp_path: Path, processes: Processes, browser: Browser) -> None:  # noqa: F811
    processes.worker(args=("--concurrency", "4"))
    url = processes.manager()
    finished = _submit(url, tmp_path / "finished", trials=3, released=True)
    wait_until(lambda: _api(url, finished, "/check-status")["status"] == "DONE", 60, what="the first experiment")
    submitted = time.time()  # the live experiment's execDuration can be no longer than it has existed
    live = _submit(url, tmp_path / "live", trials=2, released=False, maxExperimentDuration="2h")
    driver = browser.driver
    wait = WebDriverWait(driver, UI_DEADLINE_S, ignored_exceptions=(StaleElementReferenceException,))

    # Overview of the finished experiment: its status, trial counts and best metric
    jobs = _api(url, finished, "/trial-jobs")
    best = max(json.loads(json.loads(job["finalMetricData"][0]["data"])) for job in jobs)
    driver.get(f"{url}/nni/{finished}/oview")
    wait.until(_shows("DONE", "Best metric", f"{best:.6f}", "Succeeded"))
    assert "Succeeded 3" in _text(driver).replace("\n", " ")
    assert _duration_html(driver) == _format_time_style(_api(url, finished, "/experiment")["execDuration"])
    browser.screenshot("overview-finished")

    # Trials detail lists its trials, and a row opens on its parameters
    driver.get(f"{url}/nni/{finished}/detail")
    wait.until(_shows(*(job["trialJobId"] for job in jobs)))
    _click_in_row(wait, jobs[0]["trialJobId"], "[data-automation-key=_expand] i")
    x = json.loads(jobs[0]["hyperParameters"][0])["parameters"]["x"]
    wait.until(_shows(str(x)[:6]))
    browser.screenshot("detail-finished")

    # its Log tab's "View trial log" opens the trial's log from NNI's trial-file endpoint: text, as printed
    log_url, log_type, log_text = _view_trial_log(browser, wait)
    assert log_url == f"{url}/nni/{finished}/api/v1/nni/trial-file/{jobs[0]['trialJobId']}/trial.log"
    assert log_type == "text/plain"
    assert _printed(jobs[0]) in log_text

    # its charts: the default metric of every trial, and each trial's intermediate results (3 each)
    charts = len(driver.find_elements(By.TAG_NAME, "canvas"))
    assert charts >= 1  # the default metric chart
    _click_tab(wait, "Intermediate result")
    wait.until(lambda d: len(d.find_elements(By.TAG_NAME, "canvas")) >= 1 and "Intermediate result" in _text(d))
    browser.screenshot("detail-intermediate")
    _click_tab(wait, "Duration")
    browser.screenshot("detail-duration")

    # the live experiment's Overview: its duration as NNI formats execDuration (whichever second the page read),
    # and its maxExperimentDuration of 2h in the UI's default unit, minutes
    shortest = wait_until(
        lambda: _api(url, live, "/experiment")["execDuration"], UI_DEADLINE_S, what="the live experiment's 1st second"
    )
    driver.get(f"{url}/nni/{live}/oview")
    wait.until(_shows(live, "Max duration"))
    shown = wait.until(_duration_html)
    longest = _api(url, live, "/experiment")["execDuration"]
    assert longest <= time.time() - submitted + 1  # whole seconds (not ms), counted from its start
    assert shown in [_format_time_style(seconds) for seconds in range(shortest, longest + 1)], (shown, shortest)
    budget = driver.find_element(By.CSS_SELECTOR, ".maxExperimentDuration.show-params")
    assert [budget.find_element(By.CLASS_NAME, part).text for part in ("title", "number", "unit")] == [
        "Max duration",
        "120",
        "min",
    ]
    browser.screenshot("overview-live")

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


def test_the_web_ui_under_a_url_prefix_behind_a_token(
    tmp_path: Path,
    processes: Processes,
    browser: Browser,  # noqa: F811
) -> None:
    """NNI's `--url-prefix` on a manager open to the network, so with a token: the browser gets in through
    `/login` (a cookie), and the UI's links, API calls and log windows all stay under the prefix."""
    token = secrets.token_urlsafe(24)
    (tmp_path / "token").write_text(token)
    processes.worker()
    url = processes.manager("--host", "0.0.0.0", "--url-prefix", "some/prefix", "--token-file", str(tmp_path / "token"))
    base = f"{url}/some/prefix"
    bearer = {"Authorization": f"Bearer {token}"}
    experiment = _submit(base, tmp_path / "code", trials=1, released=True, headers=bearer)
    wait_until(lambda: _api(base, experiment, "/check-status", bearer)["status"] == "DONE", 60, what="the experiment")
    [job] = _api(base, experiment, "/trial-jobs", bearer)
    driver = browser.driver
    wait = WebDriverWait(driver, UI_DEADLINE_S, ignored_exceptions=(StaleElementReferenceException,))

    # without the token (no header, no cookie) neither the API nor the UI's page answers
    refused = web.get(f"{base}/api/v1/nni/check-status", timeout=30)
    assert refused.status_code == 401 and refused.json() == {"error": "a bearer token is required"}
    driver.get(f"{base}/oview")
    wait.until(_shows("a bearer token is required"))
    refused_page = f"{base}/oview - Failed to load resource: the server responded with a status of 401"
    logged: list[str] = []  # that 401 in the console is expected: only what follows the login is checked

    def refused_page_logged(_: object) -> bool:
        logged.extend(browser.console_errors(base))
        return any(refused_page in m for m in logged)

    wait.until(refused_page_logged)

    # /login sets the cookie and leads to the Overview under the prefix
    driver.get(f"{base}/login?token={token}")
    wait.until(lambda d: d.current_url == f"{base}/oview")
    wait.until(_shows(experiment, "DONE", "Succeeded"))
    browser.screenshot("overview")

    # the side bar's Trials detail link stays under the prefix
    _click(wait, "img[alt='Details icon']")
    wait.until(lambda d: d.current_url == f"{base}/detail")
    wait.until(_shows(job["trialJobId"], "SUCCEEDED"))
    _click_in_row(wait, job["trialJobId"], "[data-automation-key=_expand] i")
    browser.screenshot("detail")

    # and so does the trial's log the Log tab opens
    log_url, log_type, log_text = _view_trial_log(browser, wait)
    assert log_url == f"{base}/api/v1/nni/trial-file/{job['trialJobId']}/trial.log"
    assert log_type == "text/plain"
    assert _printed(job) in log_text

    # no error at all: the web app manifest, which chromium fetches without the cookie, is served to it too
    errors = browser.console_errors(base)
    assert errors == [], "\n".join(errors)


def test_the_web_ui_at_an_experiments_own_port(tmp_path: Path, processes: Processes, browser: Browser) -> None:  # noqa: F811
    """NNI's users open the port `nnictl create` printed (here: nnictl's registry lists it): the web UI is there,
    for that experiment although another is newer, behind the manager's token as on the main port."""
    token = secrets.token_urlsafe(24)
    home = tmp_path / "home"
    home.mkdir()
    processes.worker(args=("--concurrency", "3"))
    url = processes.manager("--nnictl-registry", env={"HOME": str(home), MANAGER_TOKEN_ENV: token})
    bearer = {"Authorization": f"Bearer {token}"}
    experiment = _submit(url, tmp_path / "code", trials=2, released=True, headers=bearer)
    newer = _submit(url, tmp_path / "newer", trials=1, released=True, headers=bearer)
    registry = home / "nni-experiments" / ".experiment"
    wait_until(lambda: registry.exists() and experiment in json.loads(registry.read_text()), 30, what="the entry")
    own = f"http://127.0.0.1:{json.loads(registry.read_text())[experiment]['port']}"
    wait_until(lambda: _api(url, experiment, "/check-status", bearer)["status"] == "DONE", 60, what="the experiment")
    jobs = _api(url, experiment, "/trial-jobs", bearer)
    driver = browser.driver
    wait = WebDriverWait(driver, UI_DEADLINE_S, ignored_exceptions=(StaleElementReferenceException,))

    driver.get(f"{own}/login?token={token}")
    wait.until(lambda d: d.current_url == f"{own}/oview")
    wait.until(_shows(experiment, "DONE", "Succeeded"))
    assert "Succeeded 2" in _text(driver).replace("\n", " ") and newer not in _text(driver)
    browser.screenshot("own-port-overview")

    _click(wait, "img[alt='Details icon']")
    wait.until(lambda d: d.current_url == f"{own}/detail")
    wait.until(_shows(*(job["trialJobId"] for job in jobs)))
    browser.screenshot("own-port-detail")

    driver.get(f"{own}/experiment")  # All experiments: this one alone, the port's only experiment
    wait.until(_shows("All experiments", experiment))
    assert newer not in _text(driver)
    errors = browser.console_errors(own)
    assert errors == [], "\n".join(errors)
    assert browser.uncaught_errors() == []


def test_console_errors_are_checked_per_page(browser: Browser) -> None:  # noqa: F811
    """The check itself: an uncaught error in a page is caught by `uncaught_errors`."""
    browser.driver.get("data:text/html,<script>null.boom()</script>")
    assert any("TypeError" in message for message in browser.uncaught_errors())
