"""A real headless chromium driven by selenium, for NNI's web UI as the manager serves it.

The driver is Debian's chromedriver, named explicitly so Selenium Manager never runs (it would download one).
Screenshots land in `tests-artifacts/webui/`; the browser's console is checked for uncaught errors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "tests-artifacts" / "webui"
UNCAUGHT = re.compile(r"Uncaught|TypeError|ReferenceError|SyntaxError")
NETWORK_CHANGED = "net::ERR_NETWORK_CHANGED"  # Chromium cut a request off as the interfaces changed: no answer came


class Browser:
    def __init__(self, driver: WebDriver, name: str) -> None:
        self.driver = driver
        self.name = name

    def screenshot(self, step: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{self.name}-{step}.png"
        self.driver.save_screenshot(str(path))
        return path

    def console(self) -> list[dict[str, Any]]:
        """What the page logged since the last call (chromium hands each entry out once)."""
        entries: list[dict[str, Any]] = self.driver.get_log("browser")
        return entries

    def console_errors(self, base: str) -> list[str]:
        """The errors logged since the last call about what is under the URL `base`: uncaught ones (their
        script's) and failed requests (a 401, a 404). Others are left out: NNI's UI loads its icon fonts from
        Microsoft's CDN, which an offline machine cannot reach, and a browser asks for `/favicon.ico` at the
        root, outside any --url-prefix (a 404 from NNI's own server too). So is a request Chromium itself cut
        off because the machine's network interfaces changed (`ERR_NETWORK_CHANGED`: other tests make network
        namespaces and Docker bridges meanwhile), which no server answered."""
        return [
            entry["message"]
            for entry in self.console()
            if entry["level"] == "SEVERE"
            and entry["message"].startswith(base + "/")
            and NETWORK_CHANGED not in entry["message"]
        ]

    def uncaught_errors(self) -> list[str]:
        return [
            entry["message"]
            for entry in self.console()
            if entry["level"] == "SEVERE" and UNCAUGHT.search(entry["message"])
        ]


@pytest.fixture
def browser(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1600,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    opened = Browser(driver, request.node.name)
    try:
        yield opened
    finally:
        opened.screenshot("last")  # where it was when the test ended, passed or not
        driver.quit()
