"""Kubernetes (issue 14): 1,000 kubeflow trials on the simulated cluster (simulators/kubesim), supervised by 4 workers.

The simulated API server runs in this process (HTTPS on 127.0.0.1; its pods are local processes). A private
redis-server, a `trialstream projector` and 4 `trialstream worker --platform kubeflow --concurrency 256` processes
serve one experiment whose trials this process submits through TrainingService, keeping at most CONCURRENCY of
them in flight (submitted, not yet ended). Each trial is bench/trials/metrics.py with the dependency-free SDK: it
prints METRICS + 1 metric lines (`NNISDK_MEb'...'`, as the SDK does on every platform but local) INTERVAL_S apart,
each carrying the time.time() it printed it at.

Measured: the workers' peak RSS; the API requests the cluster served, per trial; submit -> RUNNING next to submit
-> pod running (the pod's `startedAt`, and the moment a watch in this process saw it running); metric printed ->
in the log. Then a baseline on a fresh simulated cluster: the same TFJobs (and code ConfigMaps), created by one
loop through the kubernetes client at the same concurrency and followed by one pod watch, with no trialstream:
what the simulator and the pods cost by themselves.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s
from kubernetes import config as kube_config
from kubernetes import watch as k8s_watch
from rq import Queue, Worker

from bench.harness import (
    REPO,
    SEARCH_SPACE,
    TRIALS_DIR,
    Figure,
    Section,
    cpu_seconds,
    peak_rss_mb,
    percentile,
    stream_ms,
    wait_until,
)
from bench.ingestion import sent_time
from bench.overhead import form
from core import keys
from core.connections import connect
from core.event_store import StoredEvent
from core.queueing import queue_name
from core.settings import Settings
from manager.config import load_experiment_config
from manager.runner import ExperimentRunner
from manager.stack import EmbeddedRedis, ServiceProcesses
from schemas.events import TrialEnded, TrialMetricReported, TrialStarted, TrialSubmitted
from workers.platforms.kubernetes.cluster import APP_LABEL, RESOURCE_LABEL

TRIALS = 1000
CONCURRENCY = 100  # trials submitted and not yet ended: the simulated node runs at most 110 pods at once
WORKERS = 4
WORKER_SLOTS = 256  # --concurrency of each worker: 4 x 256 slots, more than CONCURRENCY
METRICS = 4  # intermediate metrics per trial, INTERVAL_S apart, then the final one
INTERVAL_S = 2.0
DEADLINE_S = 900.0  # per phase: a guard against a hang, not a target
NAMESPACE = "default"
TFJOBS = ("kubeflow.org", "v1", NAMESPACE, "tfjobs")
SELECTOR = f"app={APP_LABEL}"


# --- the cluster and what it says ----------------------------------------------------------------------------


@contextlib.contextmanager
def simulated_cluster(directory: Path, trials: int) -> Iterator[Any]:
    """A started SimulatedCluster with room for every trial's pod at once (a pod asks for NNI's default 1 CPU and
    1 GiB): what is measured is following trials, not waiting for room."""
    from simulators.kubesim import Capacity, SimulatedCluster

    cluster = SimulatedCluster(directory, capacity=Capacity(cpu=2 * trials, memory_mib=2 * trials * 1024, gpu=0))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def rfc3339(text: str) -> float:
    """Epoch seconds of an RFC 3339 time (the API server writes metav1.Time in whole seconds)."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def _state(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return (statuses[0].get("state") or {}) if statuses else {}


def container_started_at(pod: dict[str, Any]) -> float | None:
    """When the pod's container started, as the simulator reports it (while running, and once terminated)."""
    state = _state(pod)
    started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
    return rfc3339(started) if started else None


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


class PodObserver:
    """One list-then-watch of the trial pods from this process, raw JSON (no client models): when it first saw each
    pod's container running and terminated, keyed by `key(pod)`. `calls` counts its own requests, which the
    trialstream phase leaves out of the workers' tally."""

    def __init__(self, api: k8s.ApiClient, key: Callable[[dict[str, Any]], str]) -> None:
        self.core = k8s.CoreV1Api(api)
        self.key = key
        self.running: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.exit_codes: dict[str, int] = {}
        self.calls: Counter[str] = Counter()
        self.changed = threading.Condition()
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._watch: k8s_watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, name="pod-observer", daemon=True)

    def __enter__(self) -> PodObserver:
        self._thread.start()
        wait_until(self.synced.is_set, 30, "the bench's pod watch to list")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(10)

    def _see(self, pod: dict[str, Any], at: float) -> None:
        state = _state(pod)
        key = self.key(pod)
        if "running" in state or "terminated" in state:
            self.running.setdefault(key, at)
        if "terminated" in state and key not in self.ended:
            with self.changed:
                self.ended[key] = at
                self.exit_codes[key] = int(state["terminated"].get("exitCode", -1))
                self.changed.notify_all()

    def _run(self) -> None:
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    self.calls["list pods"] += 1
                    listed: Any = self.core.list_namespaced_pod(
                        NAMESPACE, label_selector=SELECTOR, _preload_content=False
                    )
                    body = json.loads(listed.data)
                    for pod in body.get("items") or []:
                        self._see(pod, time.time())
                    version = str(body["metadata"]["resourceVersion"])
                    self.synced.set()
                self._watch = k8s_watch.Watch()
                self.calls["watch pods"] += 1
                for event in self._watch.stream(
                    self.core.list_namespaced_pod,
                    NAMESPACE,
                    label_selector=SELECTOR,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=int(2 * DEADLINE_S),
                    deserialize=False,
                ):
                    at = time.time()
                    pod = event["object"]
                    version = str(pod["metadata"]["resourceVersion"])
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._see(pod, at)
            except Exception as error:
                if self._stop.is_set():
                    return
                if getattr(error, "status", None) == 410:
                    version = None
                print(f"    pod watch of the bench: {type(error).__name__}: {str(error)[:200]}", flush=True)
                self._stop.wait(0.5)


def request_groups(requests: Counter[str]) -> Counter[str]:
    """The API server's tally ("create tfjobs", "follow pods/log", ...) in the groups the section reports."""
    groups: Counter[str] = Counter()
    for key, count in requests.items():
        verb, _, what = key.partition(" ")
        if what == "pods/log":
            group = "log follows" if verb == "follow" else "log reads"
        elif verb in ("create", "watch", "delete", "deletecollection"):
            group = {"deletecollection": "delete"}.get(verb, verb)
        elif verb in ("get", "list"):
            group = "get/list"
        else:
            group = "other"
        groups[group] += count
    return groups


def tally(requests: Counter[str]) -> str:
    return ", ".join(f"{count:,} {key}" for key, count in requests.most_common())


def in_flight(intervals: Sequence[tuple[float, float]]) -> tuple[float, int]:
    """Time-weighted mean and peak of how many (start, end) intervals are open, from the first start to the last end."""
    if not intervals:
        return 0.0, 0
    changes = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_now = peak = 0
    area = 0.0
    last = changes[0][0]
    for at, step in changes:
        area += open_now * (at - last)
        last = at
        open_now += step
        peak = max(peak, open_now)
    span = changes[-1][0] - changes[0][0]
    return (area / span if span > 0 else float(peak)), peak


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- trialstream ---------------------------------------------------------------------------------------------


@dataclass
class TrialstreamRun:
    wall_s: float
    requests: Counter[str]  # the workers' (the bench's own pod watch taken out)
    check_requests: int  # the platform's pre-flight check, as `trialstream run` makes it once
    failed: list[str]
    in_flight: tuple[float, int]  # submitted, not ended: mean, peak
    running: tuple[float, int]  # TrialStarted, not ended
    submit_to_started_ms: list[float]
    submit_to_pod_started_ms: list[float]  # the pod's startedAt
    submit_to_pod_seen_ms: list[float]  # the bench's watch saw it running
    pod_seen_to_started_ms: list[float]
    metric_ms: list[float]
    metrics: int
    peak_rss_mb: list[float]
    cpu_s: dict[str, float]
    manifests: list[dict[str, Any]] = field(default_factory=list)  # the TFJobs, in submission order
    config_maps: list[dict[str, Any]] = field(default_factory=list)


def trial_code(directory: Path) -> Path:
    """The trial and the SDK it imports, as the trial's code directory (shipped to the pods in ConfigMaps)."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(TRIALS_DIR / "metrics.py", directory)
    shutil.copy(REPO / "trialstream_sdk.py", directory)
    return directory


def experiment_config(root: Path, kubeconfig: Path, trials: int, concurrency: int) -> Path:
    config: dict[str, Any] = {
        "experimentName": "kubernetes",
        "trialCommand": f"{sys.executable} -S metrics.py {METRICS} {INTERVAL_S}",  # -S: no site, a lighter start
        "trialCodeDirectory": str(trial_code(root / "code")),
        "trialConcurrency": concurrency,
        "maxTrialNumber": trials,
        "searchSpace": SEARCH_SPACE,
        "tuner": {"name": "Random", "classArgs": {"seed": 7}},
        "trainingService": {
            "platform": "kubeflow",
            "operator": "tf-operator",
            "kubeconfig": str(kubeconfig),
            "worker": {},
        },
        "experimentWorkingDirectory": str(root / "experiments"),
    }
    path = root / "kubernetes.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def drive(service: Any, trials: int, concurrency: int) -> list[str]:
    """Submit `trials` trials, at most `concurrency` not yet ended at any time; the ids of those that did not
    succeed. Reads only the TrialEnded entries of the log."""
    store = service.store
    cursor = store.head()
    submitted = ended = reported = 0
    failed: list[str] = []
    deadline = time.monotonic() + DEADLINE_S
    while ended < trials:
        while submitted < trials and submitted - ended < concurrency:
            service.submit_trial_job(form(submitted, {"x": submitted / trials, "y": 1}))
            submitted += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ended} of {trials} trials ended within {DEADLINE_S:.0f} s")
        for raw in store.raw_wait(cursor, block_ms=1000):
            cursor = raw.id
            if raw.fields.get("type") != "TrialEnded":
                continue
            entry = raw.decode()
            if isinstance(entry, StoredEvent) and isinstance(entry.event, TrialEnded):
                ended += 1
                if entry.event.status != "SUCCEEDED":
                    failed.append(f"{entry.event.trial_id}: {entry.event.status} {entry.event.message or ''}".strip())
        if ended // 100 > reported // 100:
            reported = ended
            print(f"    {ended} of {trials} ended", flush=True)
    return failed


def run_trialstream(root: Path, trials: int, concurrency: int) -> TrialstreamRun:
    root.mkdir(parents=True, exist_ok=True)
    with simulated_cluster(root / "cluster", trials) as cluster:
        kubeconfig = cluster.write_kubeconfig(root / "kubeconfig")
        server = EmbeddedRedis(root / "redis")
        url = server.start()
        services = ServiceProcesses(Settings(redis_url=url), root / "logs")
        api = kube_config.new_client_from_config(config_file=str(kubeconfig))
        try:
            client, rq_connection = connect(url), connect(url, decode=False)
            services.start("projector", log_name="projector")
            wait_until(lambda: client.exists(keys.PROJECTOR_HEARTBEAT), 30, "the projector")
            for index in range(WORKERS):  # what `trialstream worker --platform kubeflow --concurrency N` execs
                services.start(
                    "--platform", "kubeflow", "--concurrency", str(WORKER_SLOTS), log_name=f"w{index}", module="workers"
                )
            projector, *workers = (process.pid for process in services.processes)
            queue = Queue(queue_name("kubeflow"), connection=rq_connection)
            wait_until(lambda: len(Worker.all(queue=queue)) >= WORKERS, 60, "the workers to register")
            spec = load_experiment_config(experiment_config(root, kubeconfig, trials, concurrency))
            cluster.reset_requests()
            service = ExperimentRunner.create(spec, client, rq_connection).service  # checks the cluster first
            check_requests = sum(cluster.requests.values())
            cluster.reset_requests()
            with PodObserver(api, key=lambda pod: labels(pod).get("trialId", "")) as observer:
                assert server.process is not None
                pids = {"workers": workers, "projector": [projector], "redis-server": [server.process.pid]}
                cpu_before = {who: sum(map(cpu_seconds, group)) for who, group in pids.items()}
                own_before, children_before = _own_cpu_s(), _children_cpu_s()
                started = time.perf_counter()
                failed = drive(service, trials, concurrency)
                wall_s = time.perf_counter() - started
                cpu_s = {who: sum(map(cpu_seconds, group)) - cpu_before[who] for who, group in pids.items()}
                cpu_s["this process (simulator, submitting loop)"] = _own_cpu_s() - own_before
                cpu_s["pods (reaped)"] = _children_cpu_s() - children_before
                rss = [peak_rss_mb(pid) for pid in workers]
                requests = Counter(cluster.requests) - observer.calls
            pods = cluster.objects("pods", namespace=NAMESPACE)
            jobs = cluster.objects("tfjobs", namespace=NAMESPACE)
            config_maps = cluster.objects("configmaps", namespace=NAMESPACE)
            entries = [(entry.id, entry.event) for entry in service.store.read() if isinstance(entry, StoredEvent)]
        finally:
            services.stop()
            server.stop()
            api.close()

    submitted: dict[str, int] = {}
    started_ms: dict[str, int] = {}
    ended_ms: dict[str, int] = {}
    metric_ms: list[float] = []
    for entry_id, event in entries:
        at = stream_ms(entry_id)
        if isinstance(event, TrialSubmitted):
            submitted[event.trial_id] = at
        elif isinstance(event, TrialStarted):
            started_ms.setdefault(event.trial_id, at)
        elif isinstance(event, TrialEnded):
            ended_ms[event.trial_id] = at
        elif isinstance(event, TrialMetricReported):
            metric_ms.append(at - sent_time(event.data) * 1000)
    pod_started = {labels(pod).get("trialId", ""): container_started_at(pod) for pod in pods}
    order = {trial_id: index for index, trial_id in enumerate(submitted)}
    jobs.sort(key=lambda job: order.get(labels(job).get("trialId", ""), len(order)))
    return TrialstreamRun(
        wall_s=wall_s,
        requests=requests,
        check_requests=check_requests,
        failed=failed,
        in_flight=in_flight([(submitted[t] / 1000, ended_ms[t] / 1000) for t in submitted if t in ended_ms]),
        running=in_flight([(started_ms[t] / 1000, ended_ms[t] / 1000) for t in started_ms if t in ended_ms]),
        submit_to_started_ms=[float(started_ms[t] - submitted[t]) for t in started_ms],
        submit_to_pod_started_ms=[
            at * 1000 - submitted[t] for t, at in pod_started.items() if at is not None and t in submitted
        ],
        submit_to_pod_seen_ms=[observer.running[t] * 1000 - submitted[t] for t in observer.running if t in submitted],
        pod_seen_to_started_ms=[
            started_ms[t] - observer.running[t] * 1000 for t in started_ms if t in observer.running
        ],
        metric_ms=metric_ms,
        metrics=len(metric_ms),
        peak_rss_mb=rss,
        cpu_s=cpu_s,
        manifests=[
            {
                "apiVersion": job["apiVersion"],
                "kind": job["kind"],
                "metadata": {"name": job["metadata"]["name"], "labels": labels(job)},
                "spec": job["spec"],
            }
            for job in jobs
        ],
        config_maps=[
            {
                "metadata": {"name": config_map["metadata"]["name"], "labels": labels(config_map)},
                **{key: config_map[key] for key in ("data", "binaryData") if config_map.get(key)},
            }
            for config_map in config_maps
            if labels(config_map).get("app") == APP_LABEL
        ],
    )


# --- the baseline --------------------------------------------------------------------------------------------


@dataclass
class BaselineRun:
    wall_s: float
    requests: Counter[str]
    failed: int
    in_flight: tuple[float, int]
    running: tuple[float, int]
    create_to_pod_started_ms: list[float]
    create_to_pod_seen_ms: list[float]
    cpu_s: dict[str, float]


def run_baseline(
    root: Path, manifests: list[dict[str, Any]], config_maps: list[dict[str, Any]], concurrency: int
) -> BaselineRun:
    """The same TFJobs on a fresh simulated cluster: one loop creates them through the kubernetes client, at most
    `concurrency` whose pod has not ended, and one pod watch follows them; nothing reads a log."""
    root.mkdir(parents=True, exist_ok=True)
    with simulated_cluster(root / "cluster", len(manifests)) as cluster:
        kubeconfig = cluster.write_kubeconfig(root / "kubeconfig")
        api = kube_config.new_client_from_config(config_file=str(kubeconfig))
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        for config_map in config_maps:
            body = k8s.V1ConfigMap(
                metadata=k8s.V1ObjectMeta(name=config_map["metadata"]["name"], labels=labels(config_map)),
                data=config_map.get("data"),
                binary_data=config_map.get("binaryData"),
            )
            core.create_namespaced_config_map(NAMESPACE, body)
        with PodObserver(api, key=lambda pod: labels(pod).get(RESOURCE_LABEL, "")) as observer:
            cluster.reset_requests()
            own_before, children_before = _own_cpu_s(), _children_cpu_s()
            created: dict[str, float] = {}
            started = time.perf_counter()
            deadline = time.monotonic() + DEADLINE_S
            for manifest in manifests:
                with observer.changed:
                    while len(created) - len(observer.ended) >= concurrency:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{len(observer.ended)} of {len(manifests)} baseline pods ended")
                        observer.changed.wait(1.0)
                created[manifest["metadata"]["name"]] = time.time()
                custom.create_namespaced_custom_object(*TFJOBS, manifest, _request_timeout=(10, 30))
            with observer.changed:
                while len(observer.ended) < len(manifests):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{len(observer.ended)} of {len(manifests)} baseline pods ended")
                    observer.changed.wait(1.0)
            wall_s = time.perf_counter() - started
            cpu_s = {
                "this process (simulator, creating loop)": _own_cpu_s() - own_before,
                "pods (reaped)": _children_cpu_s() - children_before,
            }
            requests = Counter(cluster.requests)
        pods = cluster.objects("pods", namespace=NAMESPACE)
    api.close()
    pod_started = {labels(pod).get(RESOURCE_LABEL, ""): container_started_at(pod) for pod in pods}
    return BaselineRun(
        wall_s=wall_s,
        requests=requests,
        failed=sum(code != 0 for code in observer.exit_codes.values()),
        in_flight=in_flight([(created[name], observer.ended[name]) for name in created if name in observer.ended]),
        running=in_flight(
            [(observer.running[name], observer.ended[name]) for name in observer.running if name in observer.ended]
        ),
        create_to_pod_started_ms=[
            (at - created[name]) * 1000 for name, at in pod_started.items() if at is not None and name in created
        ],
        create_to_pod_seen_ms=[
            (observer.running[name] - created[name]) * 1000 for name in observer.running if name in created
        ],
        cpu_s=cpu_s,
    )


# --- the section ---------------------------------------------------------------------------------------------


def percentile_or_none(samples: Sequence[float], q: float) -> float | None:
    return percentile(samples, q) if samples else None


def _per_trial(count: int, trials: int) -> float:
    return count / trials if trials else 0.0


def _cpu(cpu_s: dict[str, float], trials: int) -> str:
    return "; ".join(
        f"{who} {seconds:.0f} s ({seconds / trials * 1000:.0f} ms/trial)" for who, seconds in cpu_s.items()
    )


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip()[-600:]}"


def run(root: Path, runs: int, trials: int | None = None, concurrency: int | None = None) -> Section:
    """One run of each phase whatever `runs` says (1,000 trials are their own sample: percentiles are over them).
    `trials` (default TRIALS, or $BENCH_KUBERNETES_TRIALS) and `concurrency` make a quick try cheap."""
    trials = trials or int(os.environ.get("BENCH_KUBERNETES_TRIALS", TRIALS))
    concurrency = min(concurrency or CONCURRENCY, trials)
    section = Section(
        f"Kubernetes: {trials:,} kubeflow trials on the simulated cluster", "python -m bench --only kubernetes"
    )
    ours: TrialstreamRun | None = None
    baseline: BaselineRun | None = None
    failures: dict[str, str] = {}
    try:
        print(f"  trialstream: {trials} trials, at most {concurrency} in flight, {WORKERS} workers", flush=True)
        ours = run_trialstream(root / "trialstream", trials, concurrency)
        print(f"    {ours.wall_s:.1f} s", flush=True)
    except (ImportError, RuntimeError, OSError, TimeoutError, ValueError, k8s.ApiException) as error:
        failures["trialstream"] = _why(error)
        print(f"    failed: {_why(error)}", flush=True)
    if ours is not None:
        try:
            print(f"  baseline: the same {len(ours.manifests)} TFJobs, one client loop and one watch", flush=True)
            baseline = run_baseline(root / "baseline", ours.manifests, ours.config_maps, concurrency)
            print(f"    {baseline.wall_s:.1f} s", flush=True)
        except (RuntimeError, OSError, TimeoutError, ValueError, k8s.ApiException) as error:
            failures["baseline"] = _why(error)
            print(f"    failed: {_why(error)}", flush=True)

    def not_measured(phase: str) -> str:
        return f"not measured: {failures.get(phase, 'the trialstream phase failed')}"

    if ours is None:
        section.add(Figure(f"trialstream: {trials:,} trials, wall time", None, "s", detail=not_measured("trialstream")))
    else:
        groups = request_groups(ours.requests)
        section.add(
            Figure(
                f"trialstream: {trials:,} trials, at most {concurrency} in flight, {WORKERS} workers: wall time",
                ours.wall_s,
                "s",
                detail=f"first submit -> last TrialEnded; in flight (submitted, not ended) {ours.in_flight[0]:.0f} on "
                f"average, {ours.in_flight[1]} at most; RUNNING {ours.running[0]:.0f} on average, "
                f"{ours.running[1]} at most; {len(ours.failed)} did not succeed",
            ),
            Figure(
                f"baseline: the same {trials:,} TFJobs, one client loop + one pod watch: wall time",
                baseline.wall_s if baseline else None,
                "s",
                detail=(
                    f"first create -> last pod seen terminated; in flight {baseline.in_flight[0]:.0f} on average, "
                    f"{baseline.in_flight[1]} at most; pods running {baseline.running[0]:.0f} on average; "
                    f"{baseline.failed} exited non-zero"
                    if baseline
                    else not_measured("baseline")
                ),
            ),
            Figure(
                f"worker peak RSS, largest of {WORKERS}",
                max(ours.peak_rss_mb),
                "MB",
                detail="VmHWM at the end, /proc/<pid>/status; each: "
                + ", ".join(f"{mb:.0f}" for mb in ours.peak_rss_mb)
                + " MB",
            ),
            Figure(f"worker peak RSS, sum of {WORKERS}", sum(ours.peak_rss_mb), "MB"),
            Figure(
                "API requests per trial, all",
                _per_trial(sum(ours.requests.values()), trials),
                "requests",
                detail=f"{sum(ours.requests.values()):,} served while the trials ran: {tally(ours.requests)}; the "
                f"pre-flight check made {ours.check_requests} more, once",
            ),
            Figure(
                "API requests per trial: creates",
                _per_trial(groups["create"], trials),
                "requests",
                detail="one TFJob per trial; the code's ConfigMaps once per worker (409 after the first)",
            ),
            Figure(
                "API requests per trial: pod log follows",
                _per_trial(groups["log follows"], trials),
                "requests",
                detail=f"and {groups['log reads']:,} plain log reads ({_per_trial(groups['log reads'], trials):.2f} "
                "per trial)",
            ),
            Figure(
                "API requests per trial: get / list (polling would show here)",
                _per_trial(groups["get/list"], trials),
                "requests",
                detail=f"{groups['get/list']:,} in all",
            ),
            Figure(
                "API watch requests, whole run",
                float(groups["watch"]),
                "requests",
                detail=f"{WORKERS} workers x (tfjobs, pods) = {2 * WORKERS} when none is re-opened",
            ),
            Figure(
                "baseline API requests per trial",
                _per_trial(sum(baseline.requests.values()), trials) if baseline else None,
                "requests",
                detail=tally(baseline.requests) if baseline else not_measured("baseline"),
            ),
            Figure(
                "submit -> RUNNING p50",
                percentile_or_none(ours.submit_to_started_ms, 50),
                "ms",
                detail="TrialSubmitted -> TrialStarted, log (stream id) times",
            ),
            Figure("submit -> RUNNING p95", percentile_or_none(ours.submit_to_started_ms, 95), "ms"),
            Figure(
                "submit -> pod running (startedAt) p50",
                percentile_or_none(ours.submit_to_pod_started_ms, 50),
                "ms",
                detail="TrialSubmitted -> the pod's containerStatuses[0] startedAt, which has whole seconds: "
                "up to 1 s early",
            ),
            Figure(
                "submit -> pod running (startedAt) p95", percentile_or_none(ours.submit_to_pod_started_ms, 95), "ms"
            ),
            Figure(
                "submit -> pod running seen on a watch p50",
                percentile_or_none(ours.submit_to_pod_seen_ms, 50),
                "ms",
                detail="TrialSubmitted -> a pod watch in the bench process receives the pod running",
            ),
            Figure(
                "submit -> pod running seen on a watch p95", percentile_or_none(ours.submit_to_pod_seen_ms, 95), "ms"
            ),
            Figure(
                "pod running seen on a watch -> RUNNING p50 (the platform's own delay)",
                percentile_or_none(ours.pod_seen_to_started_ms, 50),
                "ms",
                detail="the bench's watch receives the pod running -> TrialStarted's log time; "
                "negative where a worker was faster than the bench's watch",
            ),
            Figure(
                "pod running seen on a watch -> RUNNING p95", percentile_or_none(ours.pod_seen_to_started_ms, 95), "ms"
            ),
            Figure(
                "baseline: create -> pod running seen on the watch p50",
                percentile_or_none(baseline.create_to_pod_seen_ms, 50) if baseline else None,
                "ms",
                detail="the loop's create call -> its watch receives the pod running"
                if baseline
                else not_measured("baseline"),
            ),
            Figure(
                "baseline: create -> pod running seen on the watch p95",
                percentile_or_none(baseline.create_to_pod_seen_ms, 95) if baseline else None,
                "ms",
            ),
            Figure(
                "baseline: create -> pod running (startedAt) p50",
                percentile_or_none(baseline.create_to_pod_started_ms, 50) if baseline else None,
                "ms",
            ),
            Figure(
                "metric printed in the pod -> in the log p50",
                percentile_or_none(ours.metric_ms, 50),
                "ms",
                detail=f"{ours.metrics:,} metrics: `sent` (the trial's time.time() as it printed the line) -> "
                "TrialMetricReported's stream id",
            ),
            Figure("metric printed in the pod -> in the log p99", percentile_or_none(ours.metric_ms, 99), "ms"),
        )
        section.notes.append(
            "CPU while the trials ran (utime + stime): "
            + _cpu(ours.cpu_s, trials)
            + "."
            + (f" Baseline: {_cpu(baseline.cpu_s, trials)}." if baseline else "")
        )
        if ours.failed:
            section.notes.append(f"{len(ours.failed)} trials did not succeed, e.g. {ours.failed[0]}")
    for phase, why in failures.items():
        section.notes.append(f"{phase}: {why}")
    return section
