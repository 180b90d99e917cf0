"""Metric ingestion: how fast metrics from running trials reach the views, how long each one takes, and the
ceiling the same redis-server allows (a bare redis-py pipelined XADD loop, and `redis-benchmark`)."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis

from bench.harness import BenchStack, Figure, Section, median_of, percentile, repeat, stream_ms
from bench.overhead import form, idle_service
from core.event_store import StoredEvent, encode_event
from manager.training_service import TrainingService
from schemas.events import TrialMetricReported

BURST_TRIALS, BURST_METRICS = 4, 5000
PACED_TRIALS, PACED_METRICS, PACED_INTERVAL_S = 4, 250, 0.004
CEILING_EVENTS, PIPELINE = 100_000, 500


def metric_trial(stack: BenchStack, name: str, count: int, interval_s: float, trials: int) -> TrainingService:
    """An experiment whose trials each report `count` metrics, `interval_s` apart; all submitted at once."""
    service = idle_service(stack, name, trialCommand=f"{sys.executable} metrics.py {count} {interval_s}")
    for sequence_id in range(trials):
        service.submit_trial_job(form(sequence_id, {"x": 0.5, "y": 1}))
    return service


def follow_positions(client: redis.Redis, key: str, seen: list[tuple[float, str]], stop: threading.Event) -> None:
    """Add (time, projector position) to `seen` each time the position moves, polling every millisecond."""
    last = ""
    while not stop.is_set():
        position = str(client.hget(key, "position") or "0-0")
        if position != last:
            seen.append((time.time(), position))
            last = position
        stop.wait(0.001)


def projected_at(positions: list[tuple[float, str]], entry_id: str) -> float | None:
    """When the projector's position first reached `entry_id`."""
    target = tuple(map(int, entry_id.split("-")))
    for seen_at, position in positions:
        if tuple(map(int, position.split("-"))) >= target:
            return seen_at
    return None


def metric_entries(service: TrainingService) -> list[tuple[str, TrialMetricReported]]:
    return [
        (entry.id, entry.event)
        for entry in service.store.read(where=lambda fields: fields.get("type") == "TrialMetricReported")
        if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialMetricReported)
    ]


def sent_time(data: str) -> float:
    """The `sent` time inside a metric's data (NNI's data: the JSON of the JSON-encoded value)."""
    return float(json.loads(json.loads(data))["sent"])


def ingestion_rate(stack: BenchStack, name: str) -> float:
    """Metrics per second into the views: from the first metric appended to the moment the projector has
    applied the last, with trials reporting as fast as they can (nothing else reads meanwhile)."""
    service = metric_trial(stack, name, BURST_METRICS, 0, BURST_TRIALS)
    deadline = time.monotonic() + 120
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the metric trials did not end and get projected within 120 s")
        if service.views.position() == service.store.head():
            views = service.views.trials()
            if len(views) == BURST_TRIALS and all(view.status.is_terminal for view in views):
                done = time.time()
                break
        time.sleep(0.005)
    entries = metric_entries(service)
    expected = BURST_TRIALS * (BURST_METRICS + 1)
    if len(entries) != expected:
        raise RuntimeError(f"{len(entries)} metrics in the log, {expected} reported")
    return expected / (done - stream_ms(entries[0][0]) / 1000)


def latencies(stack: BenchStack, name: str) -> dict[str, list[float]]:
    """Per-metric latencies (ms) from the trial's report to the log, to a metric listener, and to the views."""
    received: list[tuple[float, str]] = []
    stop = threading.Event()
    positions: list[tuple[float, str]] = []
    service = metric_trial(stack, name, PACED_METRICS, PACED_INTERVAL_S, PACED_TRIALS)
    service.add_trial_job_metric_listener(lambda metric: received.append((time.time(), metric.data)))
    listener = threading.Thread(target=service.run, daemon=True)
    poller = threading.Thread(
        target=follow_positions, args=(stack.client, service.views.keys.position, positions, stop), daemon=True
    )
    listener.start()
    poller.start()
    expected = PACED_TRIALS * (PACED_METRICS + 1)
    deadline = time.monotonic() + 120
    while len(received) < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    entries = metric_entries(service)
    while entries and projected_at(positions, entries[-1][0]) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    service.clean_up()
    poller.join()
    listener.join()
    if len(received) < expected or len(entries) != expected:
        raise RuntimeError(f"{len(entries)} metrics in the log, {len(received)} delivered, {expected} reported")
    return {
        "to_log": [stream_ms(entry_id) - sent_time(event.data) * 1000 for entry_id, event in entries],
        "to_listener": [(at - sent_time(data)) * 1000 for at, data in received],
        "to_views": [
            ((projected_at(positions, entry_id) or float("nan")) - sent_time(event.data)) * 1000
            for entry_id, event in entries
        ],
    }


def xadd_ceiling(client: redis.Redis, payload: dict[str, str]) -> float:
    """Events per second of a bare redis-py loop: XADD of the same fields, pipelined `PIPELINE` at a time."""
    stream = "bench:ceiling"
    client.delete(stream)
    started = time.perf_counter()
    with client.pipeline(transaction=False) as pipe:
        for start in range(0, CEILING_EVENTS, PIPELINE):
            for _ in range(min(PIPELINE, CEILING_EVENTS - start)):
                pipe.xadd(stream, payload)  # type: ignore[arg-type]
            pipe.execute()
    elapsed = time.perf_counter() - started
    client.delete(stream)
    return CEILING_EVENTS / elapsed


def redis_benchmark_xadd(socket: str, payload: dict[str, str]) -> float | None:
    """XADD requests per second by `redis-benchmark` (pipelining `PIPELINE`), or None if it is not installed."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    fields = [part for pair in payload.items() for part in pair]
    command = [binary, "-s", socket, "-n", str(CEILING_EVENTS * 2), "-P", str(PIPELINE), "--csv"]
    output = subprocess.run([*command, "XADD", "bench:rb", "*", *fields], capture_output=True, text=True, check=True)
    header, row = csv.reader(output.stdout.strip().splitlines()[-2:])
    # The test-name column holds the command with its JSON unescaped: count the columns from the end.
    return float(row[header.index("rps") - len(header)])


def run(root: Path, runs: int) -> Section:
    section = Section("Metric ingestion", "python -m bench --only ingestion")
    with BenchStack(root / "ingestion", workers=4) as stack:
        rates = repeat(runs, lambda index: ingestion_rate(stack, f"burst{index}"))
        paced = repeat(runs, lambda index: latencies(stack, f"paced{index}"))
        payload = encode_event(
            TrialMetricReported(
                experiment_id="benchexp",
                trial_id="Ab3dE",
                attempt=1,
                source="host:1234",
                parameter_id="0",
                metric_type="PERIODICAL",
                sequence=0,
                data=json.dumps(json.dumps({"default": 0.5, "sent": time.time()})),
            )
        )
        ceilings = [xadd_ceiling(stack.client, payload) for _ in range(runs)]
        socket = stack.url.removeprefix("unix://")
        benchmark = [rate for rate in (redis_benchmark_xadd(socket, payload) for _ in range(runs)) if rate]

    ours = median_of(rates)
    ceiling = median_of(ceilings)
    section.add(
        Figure(
            "metrics into the views",
            ours,
            "metrics/s",
            detail=f"{BURST_TRIALS} trials x {BURST_METRICS} metrics reported as fast as the SDK writes them",
        ),
        Figure("bare redis-py pipelined XADD (same server, same fields)", ceiling, "events/s"),
        Figure("`redis-benchmark` XADD (same server, -P 500)", median_of(benchmark) if benchmark else None, "events/s"),
        Figure("ours as a fraction of the redis-py XADD loop", ours / ceiling * 100, "%", ">= 50"),
    )
    for key, label, p50, p99 in (
        ("to_log", "metric reported -> in the log (get_trial_job reads it)", "<= 10", "<= 50"),
        ("to_listener", "metric reported -> delivered to a metric listener", "<= 10", "<= 50"),
        ("to_views", "metric reported -> in the projected views", "", ""),
    ):
        section.add(
            Figure(f"{label} p50", median_of([percentile(p[key], 50) for p in paced]), "ms", p50),
            Figure(f"{label} p99", median_of([percentile(p[key], 99) for p in paced]), "ms", p99),
        )
    section.notes.append(
        f"Latencies: {PACED_TRIALS} trials each report {PACED_METRICS} metrics {PACED_INTERVAL_S * 1000:g} ms apart; "
        "each metric carries the time the trial reported it. 'In the log' is the stream id's millisecond; the "
        "listener is `TrainingService.add_trial_job_metric_listener`; 'in the views' polls the projector's "
        "position every millisecond."
    )
    return section
