"""Many concurrent trials on one stack (issue 29): one Redis, one `trialstream manager` (its runner, tuner and
projector), and worker processes whose trials are threads (bench/load_platform.py), each reporting one intermediate
metric a second. The load steps up until something breaks: a step breaks when its trials do not all succeed within
a deadline, or fewer metrics are stored per second than the trials report, or the views fall more than 10 s behind.

Per step: the metrics' lag into the log (each metric's value is the time it was reported; its entry id the time it was
stored), the views' lag behind the log (sampled each second), the manager's answer times for a page of 100 trials and
for NNI's whole trial list, Redis's CPU (cores) and memory, the connections the trials added per worker process,
the worker processes' CPU per metric reported, and the rate the log took.

BENCH_LOAD_STEPS=1000,2500 runs those steps, each whatever broke before it (to compare builds on a machine where an
early step breaks); BENCH_LOAD_PROCESSES=1 runs every step's trials in one worker process. BENCH_LOAD_PLATFORM=local
runs real trial processes instead (bench/trials/metrics.py, the dependency-free SDK, under the local platform's
keepers, 64 to a worker process as `trialstream worker --concurrency 64` runs them).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.harness import (
    TRIALS_DIR,
    BenchStack,
    Figure,
    Section,
    free_port,
    median_of,
    percentile,
    stream_ms,
    wait_until,
)
from core.event_store import EventStore, stored_payload
from core.queueing import queue_name
from core.settings import Settings
from manager.stack import ServiceProcesses
from manager.views import ViewStore

STEPS = (1_000, 2_500, 5_000, 10_000)
METRICS, INTERVAL_S = 30, 1.0


@dataclass(frozen=True)
class LoadPlatform:
    """Where a step's trials run: the platform, the trial command, and how many trials a worker process follows."""

    name: str
    command: str
    code_directory: str
    slots: int
    platforms: dict[str, str]  # the `platforms` setting that loads it (none for a built-in one)


PLATFORMS = {
    "threads": LoadPlatform(
        "threads",
        f"metrics={METRICS} interval={INTERVAL_S}",
        "/",
        2_500,
        {"threads": "bench.load_platform:ThreadPlatform"},
    ),
    "local": LoadPlatform("local", f"{sys.executable} metrics.py {METRICS} {INTERVAL_S}", str(TRIALS_DIR), 64, {}),
}
PLATFORM = PLATFORMS[os.environ.get("BENCH_LOAD_PLATFORM", "threads")]
MAX_VIEWS_LAG_S = 10.0
PER_ENTRY_B = 213  # a metric event in Redis, log and views (bench/memory.py)


@dataclass
class Step:
    trials: int
    wall_s: float = 0.0
    succeeded: int = 0
    views_lag_s: list[float] = field(default_factory=list)
    page_ms: list[float] = field(default_factory=list)
    nni_list_ms: list[float] = field(default_factory=list)
    redis_cores: float = 0.0
    redis_mb: float = 0.0
    metric_lag_ms: list[float] = field(default_factory=list)
    stored_per_s: float = 0.0
    workers: int = 0  # worker processes
    memory_before: int = 0  # used_memory before the experiment
    worker_cpu_s: float = 0.0  # the worker processes' CPU over the step
    machine_cores: float = 0.0  # the whole machine's CPU over the step, in cores (the trials' own included)
    clients_before: int = 0  # connected clients before the experiment: the manager's, the idle workers', the bench's
    peak_running: int = 0  # the most trials seen RUNNING at once, and at that sample:
    memory_at_peak: int = 0  # used_memory
    entries_at_peak: int = 0  # the log's length
    clients_at_peak: int = 0  # connected clients
    client_memory_at_peak: int = 0  # mem_clients_normal: their buffers
    queued_at_peak: int = 0  # trials still WAITING for a worker: their jobs sit in the queue
    queued_job_b: float = 0.0  # what one of those jobs holds in Redis (MEMORY USAGE of a sample of them)
    statuses: dict[str, int] = field(default_factory=dict)  # the trials' at the end
    why: str = ""  # what broke

    @property
    def per_running_trial_b(self) -> float | None:
        """Redis memory per running trial, less what the log entries written so far hold (PER_ENTRY_B each) and
        the jobs of the trials still queued (at the biggest steps, thousands wait for a worker at the peak)."""
        if not self.peak_running:
            return None
        held = self.memory_at_peak - self.memory_before - self.entries_at_peak * PER_ENTRY_B
        return (held - self.queued_at_peak * self.queued_job_b) / self.peak_running

    @property
    def clients_per_worker(self) -> float | None:
        """Connections the running trials added, per worker process (the manager's grow little with them)."""
        return _per(self.clients_at_peak - self.clients_before, self.workers) if self.peak_running else None

    @property
    def worker_cpu_ms_per_metric(self) -> float | None:
        """The workers' CPU per metric stored: what a running trial costs its worker, whatever the machine's load."""
        return self.worker_cpu_s * 1000 / len(self.metric_lag_ms) if self.metric_lag_ms else None

    @property
    def offered_per_s(self) -> float:
        return self.trials / INTERVAL_S


def _config(trials: int) -> dict[str, Any]:
    return {
        "experimentName": f"load{trials}",
        "trialCommand": PLATFORM.command,
        "trialCodeDirectory": PLATFORM.code_directory,
        "trialConcurrency": trials,
        "maxTrialNumber": trials,
        "searchSpace": {"x": {"_type": "uniform", "_value": [0, 1]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 7}},
        "trainingService": {"platform": PLATFORM.name},
    }


def _redis_cpu(stack: BenchStack) -> float:
    info: Any = stack.client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes used so far (/proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def _machine_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat: user, nice, system, irq, softirq, steal)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def _queued_job_b(stack: BenchStack, sample: int = 20) -> float:
    """Redis memory of one queued job (its hash and its place in the queue), the mean over the queue's first few."""
    queue = f"rq:queue:{queue_name(PLATFORM.name)}"
    found: Any = stack.rq_connection.lrange(queue, 0, sample - 1)  # bytes: the RQ connection does not decode
    job_ids = [job_id.decode() for job_id in found]
    if not job_ids:
        return 0.0
    held = [int(stack.rq_connection.memory_usage(f"rq:job:{job_id}") or 0) for job_id in job_ids]
    entry_b = int(stack.rq_connection.memory_usage(queue) or 0) / max(1, int(stack.rq_connection.llen(queue)))
    return sum(held) / len(held) + entry_b


def _sample(stack: BenchStack, client: httpx.Client, experiment_id: str, step: Step, done: threading.Event) -> None:
    """Each second until `done`: the views' lag, a page of trials; every fifth, NNI's whole trial list."""
    store, views = EventStore(stack.client, experiment_id), ViewStore(stack.client, experiment_id)
    tick = 0
    while not done.wait(1.0):
        head, position = store.head(), views.position()
        if head and position != "0-0":
            step.views_lag_s.append((stream_ms(head) - stream_ms(position)) / 1000)
        running = views.counts().get("RUNNING", 0)
        if running > step.peak_running:
            memory: Any = stack.client.info("memory")
            clients: Any = stack.client.info("clients")
            step.peak_running, step.memory_at_peak = running, int(memory["used_memory"])
            step.client_memory_at_peak = int(memory["mem_clients_normal"])
            step.clients_at_peak = int(clients["connected_clients"])
            step.entries_at_peak = store.length()
            step.queued_at_peak = views.counts().get("WAITING", 0)
            step.queued_job_b = _queued_job_b(stack)
        began = time.perf_counter()
        client.get(f"/api/v1/experiments/{experiment_id}/trials", params={"offset": 0, "limit": 100})
        step.page_ms.append((time.perf_counter() - began) * 1000)
        if tick % 5 == 0:
            began = time.perf_counter()
            client.get(f"/nni/{experiment_id}/api/v1/nni/trial-jobs")
            step.nni_list_ms.append((time.perf_counter() - began) * 1000)
        tick += 1


def _metrics(stack: BenchStack, experiment_id: str, step: Step) -> None:
    """From the log: each intermediate metric's lag (stored minus reported), and the busiest second's rate."""
    per_second: dict[int, int] = {}
    after = "-"
    store = EventStore(stack.client, experiment_id)
    while batch := store.raw_range(after, "+", 10_000):
        after = f"({batch[-1].id}"
        for entry in batch:
            payload = stored_payload(entry.fields) if entry.fields.get("type") == "TrialMetricReported" else {}
            if payload.get("metricType") != "PERIODICAL":
                continue
            stored = stream_ms(entry.id)
            value = json.loads(json.loads(payload["data"]))  # a real trial's carries the time as `sent`
            reported = float(value["sent"] if isinstance(value, dict) else value)
            step.metric_lag_ms.append(stored - reported * 1000)
            per_second[stored // 1000] = per_second.get(stored // 1000, 0) + 1
    step.stored_per_s = max(per_second.values(), default=0)


def _run_step(root: Path, trials: int) -> Step:
    step = Step(trials)
    with BenchStack(root / f"step{trials}", workers=0, projector=False) as stack:
        services = ServiceProcesses(Settings(redis_url=stack.url, platforms=PLATFORM.platforms), stack.root / "logs")
        try:
            port = free_port()
            services.start("manager", "--port", str(port), "--no-token", log_name="manager")
            workers = step.workers = worker_processes(trials)
            for index in range(workers):
                slots = str(-(-trials // workers))
                services.start(
                    "--platform", PLATFORM.name, "--concurrency", slots, log_name=f"worker-{index}", module="workers"
                )
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
                wait_until(lambda: _answers(client), 60, "the manager")
                wait_until(lambda: stack.client.scard("rq:workers") >= workers, 60, "the workers")
                worker_pids = [process.pid for process in services.processes[1:]]
                worker_cpu_before = _cpu_s(worker_pids)
                cpu_before, machine_before, began = _redis_cpu(stack), _machine_cpu_s(), time.perf_counter()
                before: Any = stack.client.info("memory")
                step.memory_before = int(before["used_memory"])
                clients_before: Any = stack.client.info("clients")
                step.clients_before = int(clients_before["connected_clients"])
                created = client.post("/api/v1/experiments", json={"config": _config(trials)})
                created.raise_for_status()
                experiment_id = created.json()["id"]
                done = threading.Event()
                sampler = threading.Thread(target=_sample, args=(stack, client, experiment_id, step, done))
                sampler.start()
                deadline = time.monotonic() + 3 * METRICS * INTERVAL_S + trials / 50
                try:
                    while time.monotonic() < deadline:
                        if client.get(f"/api/v1/experiments/{experiment_id}").json()["status"] != "RUNNING":
                            break
                        time.sleep(1)
                    else:
                        step.why = "the experiment did not end within its deadline"
                finally:
                    done.set()
                    sampler.join()
                step.wall_s = time.perf_counter() - began
                step.worker_cpu_s = _cpu_s(worker_pids) - worker_cpu_before
                step.redis_cores = (_redis_cpu(stack) - cpu_before) / step.wall_s
                step.machine_cores = (_machine_cpu_s() - machine_before) / step.wall_s
                memory: Any = stack.client.info("memory")
                step.redis_mb = float(memory["used_memory_peak"]) / 1e6
                step.statuses = ViewStore(stack.client, experiment_id).counts()
                step.succeeded = int(step.statuses.get("SUCCEEDED", 0))
        finally:
            services.stop()
        _metrics(stack, experiment_id, step)
    if not step.why and step.succeeded < trials:
        step.why = (
            f"{trials - step.succeeded} of {trials} trials did not succeed (the trials' statuses: {step.statuses})"
        )
    if not step.why and step.views_lag_s and max(step.views_lag_s) > MAX_VIEWS_LAG_S:
        step.why = f"the views fell {max(step.views_lag_s):.0f} s behind the log"
    if not step.why and step.stored_per_s < 0.9 * step.offered_per_s:
        step.why = f"the log took {step.stored_per_s:.0f} metrics/s of the {step.offered_per_s:.0f}/s reported"
    return step


def worker_processes(trials: int) -> int:
    """A worker process per core (one Python process follows about a core's worth of trials: its interpreter
    lock), more where a step needs more than the platform's slots a process; BENCH_LOAD_PROCESSES sets it."""
    chosen = os.environ.get("BENCH_LOAD_PROCESSES")
    return int(chosen) if chosen else max(os.cpu_count() or 1, -(-trials // PLATFORM.slots))


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/api/v1/health").status_code == 200
    except httpx.HTTPError:
        return False


def run(root: Path, runs: int) -> Section:
    section = Section("Many concurrent trials on one stack (issue 29)", "python -m bench --only load")
    chosen = os.environ.get("BENCH_LOAD_STEPS")
    steps = tuple(int(trials) for trials in chosen.split(",")) if chosen else STEPS
    for trials in steps:
        step = _run_step(root, trials)
        label = f"{trials:,} trials"
        section.add(
            Figure(f"{label}: wall time (submit all, {METRICS} metrics each at 1/s, end)", step.wall_s, "s"),
            Figure(f"{label}: succeeded", step.succeeded, "trials"),
            Figure(f"{label}: metrics stored, busiest second", step.stored_per_s, "/s"),
            Figure(f"{label}: metric -> in the log p50", _p(step.metric_lag_ms, 50), "ms"),
            Figure(f"{label}: metric -> in the log p99", _p(step.metric_lag_ms, 99), "ms"),
            Figure(f"{label}: views behind the log, median of samples", _median(step.views_lag_s), "s"),
            Figure(f"{label}: views behind the log, worst sample", max(step.views_lag_s, default=None), "s"),
            Figure(f"{label}: a page of 100 trials, p50", _p(step.page_ms, 50), "ms"),
            Figure(f"{label}: NNI's whole trial list, p50", _p(step.nni_list_ms, 50), "ms"),
            Figure(f"{label}: Redis CPU", step.redis_cores, "cores"),
            Figure(f"{label}: the machine's CPU, all of it", step.machine_cores, f"cores of {os.cpu_count()}"),
            Figure(f"{label}: Redis memory, peak", step.redis_mb, "MB"),
            Figure(f"{label}: Redis memory per running trial", step.per_running_trial_b, "B"),
            Figure(f"{label}: of which clients' buffers", _per(step.client_memory_at_peak, step.peak_running), "B"),
            Figure(f"{label}: clients connected, at the most trials running", step.clients_at_peak, ""),
            Figure(f"{label}: of which the trials added, per worker process", step.clients_per_worker, ""),
            Figure(f"{label}: the most trials running at once", step.peak_running, "trials"),
            Figure(
                f"{label}: worker processes' CPU per intermediate metric stored", step.worker_cpu_ms_per_metric, "ms"
            ),
        )
        if step.why:
            section.notes.append(f"At {label} the first thing that broke: {step.why}.")
            if not chosen:
                break
    what = (
        "threads of `trialstream worker --platform threads` processes"
        if PLATFORM.name == "threads"
        else f"processes (`{PLATFORM.command}`, bench/trials) under `trialstream worker --platform local` processes"
    )
    section.notes.append(
        f"Trials are {what} (one per core, at most {PLATFORM.slots:,} trials each, the trials spread evenly; "
        f"BENCH_LOAD_PROCESSES sets how many), each reporting {METRICS} intermediate metrics 1 s apart and a final "
        "one; one `trialstream manager` (its runner, Random tuner and projector) and one redis-server as "
        "`trialstream run` starts it (AOF, appendfsync always, unix socket)."
    )
    return section


def _per(total: int, count: int) -> float | None:
    return total / count if count else None


def _p(samples: list[float], q: float) -> float | None:
    return percentile(samples, q) if samples else None


def _median(samples: list[float]) -> float | None:
    return median_of(samples) if samples else None
