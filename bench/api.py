"""The manager's API at scale: reads of a 100,000-trial experiment, the streamed NNI trial list, the SSE
follow latency, and what 50 web-UI-like pollers cost the experiment that runs meanwhile.

Everything goes through a real `trialstream manager` process over HTTP on loopback; the logs are
written straight into Redis (bench/scale.py) and projected by the manager's own projector.
"""

from __future__ import annotations

import functools
import json
import operator
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, NamedTuple

import httpx
import yaml

from bench.harness import (
    BenchStack,
    Figure,
    Section,
    cpu_seconds,
    median_of,
    peak_rss_mb,
    percentile,
    rss_mb,
    wait_until,
)
from bench.nnictl import free_port
from bench.overhead import slot_refills_ms
from bench.scale import write_log
from core.event_store import EventStore
from manager.experiments import create_experiment
from manager.training_service import TrainingService
from manager.views import ViewStore
from schemas.events import TrialMetricReported

BIG, POLLED = 100_000, 1_000
GETS, PAGES, SSE_SAMPLES = 500, 100, 200
POLLERS = 50
WEB_UI_PERIOD_S = 1.0  # NNI's UI refreshes every 10 s at most (nav menu: off/10/20/30/60 s)
REFILL_TRIALS, REFILL_CONCURRENCY, WORKERS = 60, 4, 4
_CONFIG: dict[str, Any] = {
    "experimentName": "bench",
    "trialCommand": "python3 trial.py",
    "trialCodeDirectory": "/bench",
    "trialConcurrency": 4,
    "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
    "tuner": {"name": "Random"},
    "trainingService": {"platform": "local"},
}


def _timed_ms(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def _ok(response: httpx.Response) -> httpx.Response:
    response.raise_for_status()
    return response


_POLLERS_PROCESS = """
import os, random, sys, threading, time, httpx
url, clients, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def poll():
    etags = {}  # as a browser's cache revalidates: If-None-Match with the ETag it was given
    time.sleep(random.uniform(0, period))  # web UIs opened at different moments
    with httpx.Client(base_url=url, timeout=120) as client:
        while True:
            time.sleep(period)  # NNI's UI restarts its timer after each refresh
            for path in ("/trial-jobs", "/metric-data"):
                answer = client.get(path, headers={"if-none-match": etags.get(path, "")})
                if answer.status_code not in (200, 304):  # 304: unchanged since the ETag it was given
                    print(path, answer.status_code, file=sys.stderr, flush=True)
                    os._exit(1)  # a dead poller must fail the figure, not quietly lighten the load
                etags[path] = answer.headers.get("etag", etags.get(path, ""))
            print("poll", flush=True)
for _ in range(clients):
    threading.Thread(target=poll, daemon=True).start()
threading.Event().wait()
"""


def _pollers(url: str, period_s: float) -> subprocess.Popen[str]:
    """Web UIs, each a thread asking what NNI's UI asks on its timer, every `period_s` (0: back to back),
    revalidating with the ETag it got as a browser's HTTP cache does, in a process of their own (so they
    share this machine's cores, where browsers on other machines would cost it none)."""
    return subprocess.Popen(
        [sys.executable, "-c", _POLLERS_PROCESS, url, str(POLLERS), str(period_s)], stdout=subprocess.PIPE, text=True
    )


class _Polled(NamedTuple):
    refill_ms: float
    manager_cores: float
    pollers_cores: float
    rounds_per_s: float


def _polled(stack: BenchStack, client: httpx.Client, url: str, name: str, period_s: float, manager: int) -> _Polled:
    """An experiment's refill p50 while the pollers poll `url`, with the manager's and the pollers' CPU."""
    pollers = _pollers(url, period_s)
    assert pollers.stdout is not None
    pollers.stdout.readline()  # they are polling
    rounds = _counted(pollers.stdout)
    cpu_before, pollers_before, started = cpu_seconds(manager), cpu_seconds(pollers.pid), time.perf_counter()
    refill = median_of(_refills(stack, client, name))
    elapsed = time.perf_counter() - started
    polled = _Polled(
        refill,
        (cpu_seconds(manager) - cpu_before) / elapsed,
        (cpu_seconds(pollers.pid) - pollers_before) / elapsed,
        rounds() / elapsed,
    )
    if pollers.poll() is not None:
        raise RuntimeError("the pollers stopped during the run: the figure would be of a lighter load")
    pollers.kill()
    pollers.wait()
    return polled


def _counted(lines: IO[str]) -> Callable[[], int]:
    """Count the lines the pollers print (one per round of both requests) on a thread of its own."""
    count = [0]

    def drain() -> None:
        for _ in lines:
            count[0] += 1

    threading.Thread(target=drain, daemon=True).start()
    return lambda: count[0]


def _refills(stack: BenchStack, client: httpx.Client, name: str) -> list[float]:
    """Run a short experiment through the manager; its slot refills (trial ends -> next RUNNING), from its log."""
    config = stack.experiment_config(name, trialConcurrency=REFILL_CONCURRENCY, maxTrialNumber=REFILL_TRIALS)
    created = _ok(client.post("/api/v1/experiments", json={"config": yaml.safe_load(config.read_text())}))
    experiment_id = created.json()["id"]
    wait_until(
        lambda: client.get(f"/api/v1/experiments/{experiment_id}").json()["status"] != "RUNNING",
        600,
        f"experiment {name} to finish",
    )
    service = TrainingService(stack.client, stack.rq_connection, experiment_id)
    return slot_refills_ms(service, REFILL_CONCURRENCY)


def _getter(client: httpx.Client, path: str) -> Callable[[], object]:
    return lambda: _ok(client.get(path))


def _sse_latencies(stack: BenchStack, url: str, experiment_id: str) -> list[float]:
    """Append metric events as a worker does; time until each arrives on an SSE follower."""
    arrived: dict[str, float] = {}
    ready = threading.Event()

    def follow() -> None:
        with (
            httpx.Client(base_url=url, timeout=None) as client,
            client.stream("GET", f"/api/v1/experiments/{experiment_id}/events/stream") as stream,
        ):
            for line in stream.iter_lines():
                ready.set()
                if line.startswith("data: "):
                    event = json.loads(line[6:]).get("event", {})
                    if event.get("type") == "TrialMetricReported":
                        arrived[str(event["sequence"])] = time.perf_counter()
                        if len(arrived) == SSE_SAMPLES:
                            return

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    ready.wait(30)
    store = EventStore(stack.client, experiment_id)
    sent = {}
    for sequence in range(SSE_SAMPLES):
        sent[str(sequence)] = time.perf_counter()
        store.append(
            TrialMetricReported(
                experiment_id=experiment_id,
                trial_id="t000000",
                attempt=1,
                parameter_id="0",
                metric_type="PERIODICAL",
                sequence=10_000 + sequence,
                data=json.dumps(json.dumps(sequence)),
            )
        )
        wait_until(functools.partial(operator.contains, arrived, str(10_000 + sequence)), 10, "the SSE event")
    follower.join(10)
    return [(arrived[str(10_000 + s)] - sent[str(s)]) * 1000 for s in range(SSE_SAMPLES)]


def run(root: Path, runs: int) -> Section:
    section = Section("The manager's API", "python -m bench --only api")
    with BenchStack(root / "api", workers=WORKERS, projector=False) as stack:
        socket_path = stack.url.removeprefix("unix://")
        big = create_experiment(stack.client, _CONFIG, stack.root, "big")
        polled = create_experiment(stack.client, _CONFIG, stack.root, "polled")
        write_log(socket_path, big, BIG)
        write_log(socket_path, polled, POLLED)
        port = free_port()
        assert stack.services is not None
        stack.services.start("manager", "--port", str(port), "--no-token", log_name="manager")
        manager_pid = stack.services.processes[-1].pid
        url = f"http://127.0.0.1:{port}"
        heads = {experiment: EventStore(stack.client, experiment).head() for experiment in (big, polled)}
        wait_until(
            lambda: all(ViewStore(stack.client, exp).position() == head for exp, head in heads.items()),
            900,
            "the manager's projector to catch up",
        )
        with httpx.Client(base_url=url, timeout=120) as client:
            gets = [
                _timed_ms(_getter(client, f"/api/v1/experiments/{big}/trials/t{random.randrange(BIG):06d}"))
                for _ in range(GETS)
            ]
            pages = [
                _timed_ms(
                    _getter(client, f"/api/v1/experiments/{big}/trials?offset={random.randrange(BIG - 100)}&limit=100")
                )
                for _ in range(PAGES)
            ]
            section.add(
                Figure("GET one trial of 100,000: p50", percentile(gets, 50), "ms", "<= 2"),
                Figure("GET one trial of 100,000: p99", percentile(gets, 99), "ms"),
                Figure("GET a page of 100 trials of 100,000: p50", percentile(pages, 50), "ms", "<= 10"),
                Figure("GET a page of 100 trials of 100,000: p99", percentile(pages, 99), "ms"),
            )
            rss_before = rss_mb(manager_pid)
            started = time.perf_counter()
            received = 0
            with client.stream("GET", f"/nni/{big}/api/v1/nni/trial-jobs") as stream:
                for chunk in stream.iter_bytes():
                    received += len(chunk)
            streamed_s = time.perf_counter() - started
            growth = peak_rss_mb(manager_pid) - rss_before
            section.add(
                Figure(
                    "NNI GET /trial-jobs of 100,000 trials, streamed: manager RSS growth",
                    max(0.0, growth),
                    "MB",
                    "<= 100",
                    detail=f"{received / 1e6:.0f} MB of JSON in {streamed_s:.1f} s; peak RSS over RSS before",
                ),
                Figure("NNI GET /trial-jobs of 100,000 trials: time to the last byte", streamed_s, "s"),
            )
            latencies = _sse_latencies(stack, url, polled)
            section.add(
                Figure("metric appended -> delivered on SSE: p50", percentile(latencies, 50), "ms"),
                Figure("metric appended -> delivered on SSE: p99", percentile(latencies, 99), "ms", "<= 50"),
            )
            nni_base = f"{url}/nni/{polled}/api/v1/nni"
            quiet, quiet_cores, web_uis, flat_out, burned = [], [], [], [], []
            for index in range(runs):  # interleaved, so a machine that slows down meanwhile weighs on each alike
                cpu_before, started = cpu_seconds(manager_pid), time.perf_counter()
                quiet.append(median_of(_refills(stack, client, f"quiet{index}")))
                quiet_cores.append((cpu_seconds(manager_pid) - cpu_before) / (time.perf_counter() - started))
                web_uis.append(_polled(stack, client, nni_base, f"webui{index}", WEB_UI_PERIOD_S, manager_pid))
                flat_out.append(_polled(stack, client, nni_base, f"flat{index}", 0, manager_pid))
                burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                burned.append(median_of(_refills(stack, client, f"burned{index}")))
                burner.kill()
                burner.wait()
            section.add(Figure("slot refill p50, no pollers", median_of(quiet), "ms"))
            for label, samples, target in (
                (f"{POLLERS} web UIs refreshing every {WEB_UI_PERIOD_S:g} s", web_uis, "<= 10"),
                (f"{POLLERS} pollers asking back to back", flat_out, ""),
            ):
                rate = median_of([run.rounds_per_s for run in samples])
                # what the pollers cost the manager: its CPU beyond the quiet runs', per request answered (2 a round)
                manager_cores = median_of([run.manager_cores for run in samples]) - median_of(quiet_cores)
                per_request_ms = manager_cores / (2 * rate) * 1000
                section.add(
                    Figure(
                        f"slot refill slowed by {label}",
                        (median_of([run.refill_ms for run in samples]) / median_of(quiet) - 1) * 100,
                        "%",
                        target,
                        detail=f"{median_of([run.refill_ms for run in samples]):.0f} ms p50; the pollers' own process "
                        f"used {median_of([run.pollers_cores for run in samples]):.2f} cores",
                    ),
                    Figure(
                        f"manager CPU per request answered, {label}",
                        per_request_ms,
                        "ms",
                        detail=f"{rate * 2:.1f} requests/s (/trial-jobs + /metric-data)",
                    ),
                )
            section.add(
                Figure(
                    "slot refill slowed by a process that burns a core and asks nothing",
                    (median_of(burned) / median_of(quiet) - 1) * 100,
                    "%",
                    detail=f"{median_of(burned):.0f} ms p50; `while True: pass` in a process of its own",
                ),
            )
    section.notes.append(
        f"A real `trialstream manager` on loopback over HTTP/1.1 keep-alive; the experiments' logs written into "
        f"Redis and projected by the manager. Pollers: {POLLERS} threads in one process of their own, each asking "
        f"NNI's `/trial-jobs` and `/metric-data` of a {POLLED:,}-trial experiment (revalidating with the ETag it "
        f"was given, as a browser does) while a {REFILL_TRIALS}-trial experiment runs at concurrency "
        f"{REFILL_CONCURRENCY} on {WORKERS} workers. Web UIs refresh every {WEB_UI_PERIOD_S:g} s, ten times as "
        "often as NNI's UI at its shortest interval (10 s, its default: docs of its REST use in "
        "shared/reference/nni-rest.md); the pollers asking back to back are a stress figure, without a target: "
        "a faster answer is asked again sooner, and on this 2-core machine their own process takes the cores the "
        "experiment needs (compare the process that burns a core and asks nothing). The quiet, polled and burned "
        "runs are interleaved. The manager's CPU per request is its utime + stime beyond the quiet runs', over "
        "the requests answered (2 a round)."
    )
    return section
