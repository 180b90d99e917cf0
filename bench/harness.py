"""What every benchmark shares: a private stack to measure, figures, percentiles, the machine's description."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import signal
import socket
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
from core.connections import RedisOptions, connect
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
NODE_CONFIG = REPO / "deploy" / "redis" / "ha-node.conf"  # a data node of the shipped Sentinel set


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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def replicas_online(client: redis.Redis) -> int:
    """How many replicas a master streams to (ROLE); -1 when it does not answer or is not a master."""
    try:
        role = client.execute_command("ROLE")
    except redis.ConnectionError:
        return -1
    return len(role[2]) if role[0] in ("master", b"master") else -1


class LoopbackRedis:
    """One redis-server on 127.0.0.1: a data node from its own copy of the shipped node config (NODE_CONFIG),
    the replica of the master on port `replica_of` when given; or, given `sentinel_config`, a sentinel."""

    def __init__(self, directory: Path, *, sentinel_config: str | None = None, replica_of: int | None = None) -> None:
        directory.mkdir(parents=True)
        self.port = free_port()
        binary = shutil.which("redis-server") or "redis-server"
        common = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory), "--logfile", "redis.log"]
        if sentinel_config is not None:
            config = directory / "sentinel.conf"
            config.write_text(sentinel_config)
            command = [binary, str(config), "--sentinel", *common]
        else:
            config = Path(shutil.copy(NODE_CONFIG, directory / "redis.conf"))  # a copy: sentinels rewrite it
            command = [binary, str(config), *common, "--save", ""]
            if replica_of is not None:
                command += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.client = redis.Redis("127.0.0.1", self.port, socket_timeout=2, decode_responses=True)
        wait_until(self._answers, 10, f"redis-server on {self.port}")

    def _answers(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def replicas_online(self) -> int:
        return replicas_online(self.client)

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class BenchStack:
    """A private redis-server set up as `trialstream run` sets up its own (AOF, `appendfsync always`
    unless told otherwise, unix socket), with a `trialstream projector` and `workers` local workers.

    With `replica`, that redis-server is also a master with one replica (a LoopbackRedis following it over
    loopback TCP, which replication needs) that is in sync before any client connects, and every append of
    this process's clients and of the stack's processes waits for it (`WAIT 1`: TRIALSTREAM_REDIS_REPLICAS=1).
    The clients stay on the unix socket, so the replica and its acknowledgement are all that differs."""

    def __init__(
        self,
        root: Path,
        workers: int = 4,
        projector: bool = True,
        appendfsync: str = "always",
        replica: bool = False,
    ) -> None:
        self.root = root
        self.redis = EmbeddedRedis(root / "redis", appendfsync=appendfsync)
        self.workers = workers
        self.with_projector = projector
        self.with_replica = replica
        self.replica: LoopbackRedis | None = None
        self.url = ""
        self.services: ServiceProcesses | None = None
        self.projector_pid: int | None = None

    def __enter__(self) -> BenchStack:
        try:
            return self._start()
        except BaseException:
            self.__exit__()
            raise

    def _start(self) -> BenchStack:
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.redis.start()
        if self.with_replica:
            self._attach_replica()
        replicas = 1 if self.with_replica else None  # None: today's default, a ROLE per connection and no WAIT
        self.client = connect(self.url, options=RedisOptions(replicas=replicas))
        self.rq_connection = connect(self.url, options=RedisOptions(replicas=replicas), decode=False)
        self.services = ServiceProcesses(Settings(redis_url=self.url, redis_replicas=replicas), self.root / "logs")
        if self.with_projector:
            self.start_projector()
        for index in range(self.workers):
            self.services.start("worker", "--platform", "local", log_name=f"worker-{index}")
        queue = Queue(queue_name("local"), connection=self.rq_connection)
        wait_until(lambda: len(Worker.all(queue=queue)) >= self.workers, 30, "the workers to register")
        return self

    def _attach_replica(self) -> None:
        """Open the master to loopback TCP with the shipped node config's replication settings (its AOF stays
        as set), start the replica and wait until it streams from the master."""
        with redis.Redis.from_url(self.url, decode_responses=True) as master:
            for line in NODE_CONFIG.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name and not name.startswith("#") and not name.startswith("append"):
                    master.config_set(name, value)
            port = free_port()
            master.config_set("bind", "127.0.0.1")
            master.config_set("port", port)
            self.replica = LoopbackRedis(self.root / "replica", replica_of=port)
            wait_until(lambda: replicas_online(master) == 1, 30, "the replica to sync")

    def start_projector(self) -> None:
        assert self.services is not None
        self.services.start("projector", log_name="projector")
        self.projector_pid = self.services.processes[-1].pid
        wait_until(lambda: self.client.exists(keys.PROJECTOR_HEARTBEAT), 30, "the projector")

    def __exit__(self, *exc: object) -> None:
        if self.services is not None:
            self.services.stop()
        self.redis.stop()
        if self.replica is not None:
            self.replica.stop()

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


def used_memory(client: redis.Redis) -> int:
    """Redis's used_memory once the keys UNLINK dropped are freed (in the background)."""
    while True:
        info: Any = client.info("memory")
        if int(info.get("lazyfree_pending_objects", 0)) == 0:
            return int(info["used_memory"])
        time.sleep(0.01)


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
