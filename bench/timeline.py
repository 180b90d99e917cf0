"""The experiment timeline (issue 28) at scale: a 10,000-trial log of 100 metrics each (a synthetic log,
tests/support/experiment_log.py: 1,040,000 entries) served by a real `trialstream manager` and loaded in headless
Chromium, beside reading the same log out of Redis (the baseline: what folding the log on demand must at least do).

- projected: the manager's projector folding the whole log from nothing, views and the timeline it keeps;
- first answer: a manager's first answer for the experiment (the timeline the projector keeps, read back, and
  the entries past it);
- first look: navigation to `window.timeline.ready` (the window drawn as clusters, the views loaded) on a manager
  that never showed the experiment; again: the same page loaded again (its fold in memory);
- zoom: a window of 5 minutes (a few hundred attempts drawn one by one), asked by the page's own code path;
- the file `trialstream timeline -o` writes (with the log inside) and its load from disk to ready.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.harness import BenchStack, Figure, Section, free_port, median_of, repeat, wait_until
from core.event_store import EventStore
from manager.transfer import LogFile, import_log
from manager.views import ViewStore
from tests.support.experiment_log import synthetic_log

TRIALS, METRICS = 10_000, 100
EXPERIMENT = "timeline10k"
LOAD_TARGET_S = 3.0


def _chromium() -> object:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless", "--no-sandbox", "--disable-gpu", "--window-size=1600,1000"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def _load_s(driver: object, url: str) -> float:
    """Navigation to `window.timeline.ready`, in seconds."""
    started = time.perf_counter()
    driver.get(url)  # type: ignore[attr-defined]
    wait_until(
        lambda: driver.execute_script("return !!(window.timeline && window.timeline.ready)"),  # type: ignore[attr-defined]
        120,
        "the timeline to be ready",
        interval=0.02,
    )
    return time.perf_counter() - started


def run(root: Path, runs: int) -> Section:
    section = Section("The experiment timeline", "python -m bench --only timeline")
    with BenchStack(root / "timeline", workers=0, projector=False) as stack:
        started = time.perf_counter()
        entries = list(synthetic_log(EXPERIMENT, TRIALS, METRICS))
        import_log(stack.client, LogFile(EXPERIMENT, entries, {}))
        print(f"    wrote {len(entries):,} entries in {time.perf_counter() - started:.0f}s", flush=True)
        del entries

        def read_all(_: int) -> float:
            store, began, count, after = EventStore(stack.client, EXPERIMENT), time.perf_counter(), 0, "-"
            while batch := store.raw_range(after, "+", 10_000):
                count, after = count + len(batch), f"({batch[-1].id}"
            return time.perf_counter() - began

        baseline = median_of(repeat(runs, read_all))
        assert stack.services is not None
        url, api = _manager(stack, "manager")
        head = EventStore(stack.client, EXPERIMENT).head()
        with httpx.Client(timeout=600) as client:
            began = time.perf_counter()
            wait_until(lambda: _answers(client, f"{url}/api/v1/health"), 60, "the manager")
            # as on a manager that projected the log as it was written: its projector is done with it
            wait_until(lambda: ViewStore(stack.client, EXPERIMENT).position() == head, 1800, "the views")
            projected = time.perf_counter() - began
            began = time.perf_counter()
            whole = client.get(f"{api}/timeline", params={"px": 1400}).json()
            cold = time.perf_counter() - began
            views_bytes = len(client.get(f"{api}/timeline/views").content)
            # the middle of the trials' span (the import's own marker, at today's clock, ends the log much later)
            finished = next(m["time"] for m in whole["markers"] if m["kind"] == "ExperimentFinished")
            zoom_from = whole["start"] + (finished - whole["start"]) // 2
            began = time.perf_counter()
            zoomed = client.get(f"{api}/timeline", params={"from": zoom_from, "to": zoom_from + 300_000}).json()
            zoom_ms = (time.perf_counter() - began) * 1000
            other_url, _ = _manager(stack, "manager-2")  # one that never showed the experiment
            wait_until(lambda: _answers(client, f"{other_url}/api/v1/health"), 60, "the second manager")
        driver = _chromium()
        try:
            first_look = _load_s(driver, f"{other_url}/timeline/{EXPERIMENT}")
            page = median_of(repeat(runs, lambda _: _load_s(driver, f"{url}/timeline/{EXPERIMENT}")))
            html = root / "timeline" / "timeline10k.html"
            began = time.perf_counter()
            _write_file(stack.url, html)
            written = time.perf_counter() - began
            from_disk = median_of(repeat(runs, lambda _: _load_s(driver, html.as_uri())))
        finally:
            driver.quit()  # type: ignore[attr-defined]
    target = f"<= {LOAD_TARGET_S}"
    section.add(
        Figure("read the whole log out of Redis (baseline)", baseline, "s"),
        Figure("the projector: the whole log, views and timeline", projected, "s"),
        Figure("a manager's first answer (the kept timeline)", cold, "s", target),
        Figure("page load to drawn, first look", first_look, "s", target),
        Figure("page load to drawn, again", page, "s", target),
        Figure("a 5-minute window's answer", zoom_ms, "ms"),
        Figure("`trialstream timeline -o` (the file, log inside)", written, "s"),
        Figure("the file opened from disk to drawn", from_disk, "s", target),
    )
    section.notes.append(
        f"{TRIALS:,} trials of {METRICS} intermediate metrics and a final one, 8 local workers' lanes, every 50th "
        f"trial's first attempt lost and retried: {len(whole['clusters'])} clusters drawn for the whole span, "
        f"{len(zoomed['attempts'])} attempts in the 5-minute window; the views answer is {views_bytes / 1e6:.1f} MB; "
        f"the file is {html.stat().st_size / 1e6:.0f} MB. Headless Chromium, 1600x1000."
    )
    return section


def _manager(stack: BenchStack, name: str) -> tuple[str, str]:
    """A `trialstream manager` of the stack: its address and the experiment's API."""
    assert stack.services is not None
    port = free_port()
    stack.services.start("manager", "--port", str(port), "--no-token", log_name=name)
    url = f"http://127.0.0.1:{port}"
    return url, f"{url}/api/v1/experiments/{EXPERIMENT}"


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _write_file(redis_url: str, html: Path) -> None:
    """As a user would: `trialstream timeline EXP -o FILE`, against the stack's Redis."""
    subprocess.run(
        [sys.executable, "-m", "manager.cli", "--redis", redis_url, "timeline", EXPERIMENT, "-o", str(html)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
