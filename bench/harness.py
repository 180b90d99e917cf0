"""What every benchmark shares: a private stack to measure, figures, percentiles, the machine's description."""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
import yaml
from rq import Queue, Worker

from core import keys
from core.connections import connect
from core.queueing import queue_name
from core.settings import Settings
from manager.config import load_experiment_config
from manager.runner import ExperimentResult, ExperimentRunner
from manager.stack import EmbeddedRedis, ServiceProcesses

T = TypeVar("T")
BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
TRIALS_DIR = BENCH_DIR / "trials"
SDK_TRIAL = f"{sys.executable} trial.py trialstream_sdk"
NNI_TRIAL = f"{sys.executable} trial.py nni"
SEARCH_SPACE = {"x": {"_type": "uniform", "_value": [0, 1]}, "y": {"_type": "choice", "_value": [1, 2, 3, 4]}}


@dataclass(frozen=True)
class Figure:
    """One measured figure, with its target when the issue sets one."""

    name: str
    value: float | None
    unit: str
    target: str = ""  # "<= 20" or ">= 600", in `unit`
    detail: str = ""

    @property
    def met(self) -> bool | None:
        if not self.target or self.value is None:
            return None
        comparison, bound = self.target.split()
        return self.value <= float(bound) if comparison == "<=" else self.value >= float(bound)


@dataclass
class Section:
    title: str
    command: str
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *figures: Figure) -> None:
        self.figures.extend(figures)
        for figure in figures:
            value = "n/a" if figure.value is None else f"{figure.value:,.4g}"
            verdict = {None: "", True: " (target met)", False: f" (target {figure.target}: MISSED)"}[figure.met]
            print(f"  {figure.name}: {value} {figure.unit}{verdict}", flush=True)


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): always one of the samples."""
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median_of(runs: Sequence[float]) -> float:
    return float(statistics.median(runs))


def repeat(runs: int, measure: Callable[[int], T]) -> list[T]:
    """`measure(run_index)` `runs` times, printing progress."""
    results = []
    for index in range(runs):
        started = time.perf_counter()
        results.append(measure(index))
        print(f"    run {index + 1}/{runs}: {time.perf_counter() - started:.1f}s", flush=True)
    return results


def wait_until(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
    return value


class BenchStack:
    """A private redis-server set up as `trialstream run` sets up its own (AOF, `appendfsync always`
    unless told otherwise, unix socket), with a `trialstream projector` and `workers` local workers."""

    def __init__(self, root: Path, workers: int = 4, projector: bool = True, appendfsync: str = "always") -> None:
        self.root = root
        self.redis = EmbeddedRedis(root / "redis", appendfsync=appendfsync)
        self.workers = workers
        self.with_projector = projector
        self.url = ""
        self.services: ServiceProcesses | None = None
        self.projector_pid: int | None = None

    def __enter__(self) -> BenchStack:
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.redis.start()
        self.client = connect(self.url)
        self.rq_connection = connect(self.url, decode=False)
        self.services = ServiceProcesses(Settings(redis_url=self.url), self.root / "logs")
        if self.with_projector:
            self.start_projector()
        for index in range(self.workers):
            self.services.start("worker", "--platform", "local", log_name=f"worker-{index}")
        queue = Queue(queue_name("local"), connection=self.rq_connection)
        wait_until(lambda: len(Worker.all(queue=queue)) >= self.workers, 30, "the workers to register")
        return self

    def start_projector(self) -> None:
        assert self.services is not None
        self.services.start("projector", log_name="projector")
        self.projector_pid = self.services.processes[-1].pid
        wait_until(lambda: self.client.exists(keys.PROJECTOR_HEARTBEAT), 30, "the projector")

    def __exit__(self, *exc: object) -> None:
        if self.services is not None:
            self.services.stop()
        self.redis.stop()

    def experiment_config(self, name: str, **overrides: Any) -> Path:
        """An NNI v2 config for the benchmark trial; `overrides` are NNI keys (camelCase)."""
        config: dict[str, Any] = {
            "experimentName": name,
            "trialCommand": SDK_TRIAL,
            "trialCodeDirectory": str(TRIALS_DIR),
            "trialConcurrency": 1,
            "maxTrialNumber": 40,
            "searchSpace": SEARCH_SPACE,
            "tuner": {"name": "Random", "classArgs": {"seed": 7}},
            "trainingService": {"platform": "local"},
            "experimentWorkingDirectory": str(self.root / "experiments"),
        }
        config.update(overrides)
        path = self.root / f"{name}.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    def run_experiment(self, config: Path) -> tuple[ExperimentResult, float]:
        """Run the experiment in this process, as `trialstream run` does; returns it and its wall time."""
        started = time.perf_counter()
        runner = ExperimentRunner.create(load_experiment_config(config), self.client, self.rq_connection)
        result = runner.run()
        return result, time.perf_counter() - started


def stream_ms(entry_id: str) -> int:
    """The millisecond timestamp Redis put in a stream id."""
    return int(entry_id.partition("-")[0])


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no {field} for process {pid}")


def peak_rss_mb(pid: int) -> float:
    """The most memory a process has held resident so far (VmHWM), from /proc."""
    return _status_mb(pid, "VmHWM")


def rss_mb(pid: int) -> float:
    """The memory a process holds resident now (VmRSS), from /proc."""
    return _status_mb(pid, "VmRSS")


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat past the command name (which may hold spaces): state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used so far (utime + stime), from /proc."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every process below `pid` in the process tree, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError, IndexError):
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def processes_in(option: str, group: int) -> list[int]:
    """Processes in a process group (`-g`) or session (`-s`), from pgrep."""
    found = subprocess.run(["pgrep", option, str(group)], capture_output=True, text=True, check=False)
    return [int(pid) for pid in found.stdout.split()]


def reap(option: str, group: int, what: str, grace_s: float = 10.0) -> list[str]:
    """Wait for a system's processes to be gone after it says it stopped; kill and report any straggler."""
    deadline = time.monotonic() + grace_s
    while (left := processes_in(option, group)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [f"{len(left)} {what} processes were still running {grace_s:.0f}s after it stopped; killed"] if left else []


def trialstream_run(
    config: Path, stderr_path: Path, env: dict[str, str], deadline_s: float
) -> tuple[dict[str, Any], float, float, list[str]]:
    """`trialstream run CONFIG --json` in embedded mode (`env` without a Redis URL), launch -> exit, in a session
    of its own so that everything it started can be checked to be gone; (its result, wall s, launch epoch s,
    remarks on stragglers)."""
    launched = time.time()
    started = time.perf_counter()
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", "run", str(config), "--json"],
            cwd=REPO,  # the code under test, as the `trialstream` console script of this checkout runs it
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, _ = process.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    wall_s = time.perf_counter() - started
    remarks = reap("-s", process.pid, "trialstream")
    if process.returncode != 0:
        tail = stderr_path.read_text()[-1500:]
        raise RuntimeError(f"trialstream run exited with {process.returncode} (see {stderr_path}): {tail}")
    return json.loads(stdout), wall_s, launched, remarks


@contextmanager
def scratch_redis(root: Path, appendfsync: str = "always") -> Iterator[tuple[redis.Redis, str]]:
    """A bare private redis-server, set up as the embedded one."""
    server = EmbeddedRedis(root / "redis", appendfsync=appendfsync)
    url = server.start()
    try:
        yield connect(url), url
    finally:
        server.stop()


def machine_description() -> list[str]:
    def first(path: str, prefix: str) -> str:
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip() if ":" in line else line.split("=", 1)[1].strip('"')
        except OSError:
            pass
        return "unknown"

    def version(*command: str) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "not installed"

    memory_kb = first("/proc/meminfo", "MemTotal").split()[0]
    try:
        from importlib.metadata import version as package_version

        nni_version = package_version("nni")
    except Exception:
        nni_version = "not installed"
    commit = version("git", "-C", str(REPO), "rev-parse", "--short", "HEAD")
    dirty = version("git", "-C", str(REPO), "status", "--porcelain")
    return [
        f"CPU: {first('/proc/cpuinfo', 'model name')}, {os.cpu_count()} cores",
        f"memory: {int(memory_kb) / 1024 / 1024:.1f} GiB" if memory_kb.isdigit() else "memory: unknown",
        f"OS: {first('/etc/os-release', 'PRETTY_NAME=')}, Linux {platform.release()}",
        f"Python {platform.python_version()}; {version('redis-server', '--version')}",
        f"redis-py {redis.__version__} (hiredis {'on' if _hiredis() else 'off'}); nni {nni_version}",
        f"trialstream commit {commit}{' (with uncommitted changes)' if dirty != 'not installed' and dirty else ''}",
    ]


def _hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True
