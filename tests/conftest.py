"""Fixtures on real parts: a redis-server started by pytest-redis, real worker and projector processes."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
from rq import Queue, Worker

from core import keys
from core.connections import connect
from core.queueing import queue_name
from core.variables import MANAGER_TOKEN_ENV, REDIS_URL_ENV
from manager.experiments import create_experiment
from manager.training_service import TrainingService
from schemas.events import PLATFORM_CONFIG, TRIAL_CONFIG, TrialMetricReported
from schemas.trial import HyperParameters, JobApplicationForm, TrialConfig, TrialJobDetail
from simulators.waiting import wait_until
from tests.support import web
from tests.support.kube_setup import kube_cluster, kubeconfig  # noqa: F401  (simulated Kubernetes cluster fixtures)
from tests.support.ports import free_port
from tests.support.redis_process import killed, started, stopped
from tests.support.remote_setup import remote, remote_workers, shared_tmp_path  # noqa: F401  (remote platform fixtures)
from tests.support.s3_setup import s3_credentials, s3_server, s3_server_with_auth  # noqa: F401  (the S3-compatible server: moto)
from tests.support.sentinel import sentinel_set  # noqa: F401  (a master, replicas and sentinels)
from tests.support.sshd_setup import mute_host, ssh_environment, ssh_hosts, ssh_user  # noqa: F401  (sshd host fixtures)

REPO = Path(__file__).resolve().parent.parent


FAST_TIER = frozenset(
    {
        # no I/O
        *("test_projection", "test_schemas", "test_config", "test_upcasters", "test_settings", "test_compact"),
        *("test_event_store", "test_projector", "test_rebuild", "test_listings", "test_transfer"),  # the log
        "test_embedded_redis",
        *("test_training_service", "test_attempt_state", "test_tuners", "test_code_package", "test_compose"),
        *("test_metrics", "test_output_reader", "test_pod_keeper", "test_gpu", "test_gpu_nvml"),
        *("test_local_platform", "test_conformance_local", "test_nnictl_registry"),  # real local trials
    }
)
"""The modules of `-m "not slow"`, the tier to run while developing (under 3 minutes): the pure fold, schemas,
config, the event store and projector, and the local platform. Every other module starts heavy parts (sshd
hosts, simulated clusters, a browser, Docker, managers and whole experiments) and is marked `slow`."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow tier; and since the tests of an `xdist_group` run one after another on one pytest worker
    (`--dist loadgroup`), put them first, so that no group starts late and runs on alone at the end."""
    for item in items:
        if item.path.stem not in FAST_TIER:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)


@pytest.fixture
def redis_url(redis_proc: Any, redisdb: redis.Redis) -> str:
    """A real, empty redis-server (pytest-redis starts it once and flushes it after each test)."""
    return f"redis://{redis_proc.host}:{redis_proc.port}/0"


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return connect(redis_url)


@pytest.fixture
def rq_connection(redis_url: str) -> redis.Redis:
    return connect(redis_url, decode=False)


class Processes:
    """`python -m manager.cli ...` subprocesses against the test's Redis, stopped at teardown."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{args[0]}-{len(self.running)}.log").open("wb")
        process = subprocess.Popen(
            [sys.executable, "-m", "manager.cli", *args],
            env={**os.environ, REDIS_URL_ENV: self.redis_url, **(env or {})},
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.running.append(process)
        return process

    def worker(
        self, platform: str = "local", env: dict[str, str] | None = None, args: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        """A worker, returned once it has registered with RQ (so it is serving its queue)."""
        queue = Queue(queue_name(platform), connection=connect(self.redis_url, decode=False))
        before = len(Worker.all(queue=queue))
        process = self.start("worker", "--platform", platform, *args, env=env)
        wait_until(lambda: len(Worker.all(queue=queue)) > before, 20, what="the worker to register")
        return process

    def projector(self, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A projector, returned once its heartbeat is in Redis (one that starts while Redis is down exits)."""
        process = self.start("projector", env=env)
        wait_until(lambda: connect(self.redis_url).exists(keys.PROJECTOR_HEARTBEAT), 20, what="the projector")
        return process

    def manager(self, *args: str, env: dict[str, str] | None = None) -> str:
        """A `trialstream manager` on a free loopback port (it hosts its own projector), returned as its
        base URL (without any --url-prefix) once its health check answers. Given no token, it takes requests
        without one (--no-token), as the tests of a manager's routes ask them."""
        port = free_port()
        token = {**os.environ, **(env or {})}.get(MANAGER_TOKEN_ENV) or "--token-file" in args
        process = self.start("manager", "--port", str(port), *args, *([] if token else ["--no-token"]), env=env)
        url = f"http://127.0.0.1:{port}"
        prefix = args[args.index("--url-prefix") + 1].strip("/") + "/" if "--url-prefix" in args else ""

        def healthy() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the manager exited ({process.returncode}):\n{self.logs()}")
            try:
                return web.get(f"{url}/{prefix}api/v1/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 30, what="the manager to answer")
        return url

    def logs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture
def processes(redis_url: str, tmp_path: Path) -> Iterator[Processes]:
    log_dir = tmp_path / "process-logs"
    log_dir.mkdir()
    running = Processes(redis_url, log_dir)
    yield running
    running.stop()


@pytest.fixture
def served(processes: Processes) -> Processes:
    """A projector and a worker following up to 4 trials: enough to run a whole experiment."""
    processes.projector()
    processes.worker(args=("--concurrency", "4"))
    return processes


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    path = tmp_path / "code"
    path.mkdir()
    return path


ServiceFactory = Callable[..., TrainingService]


def new_service(
    client: redis.Redis,
    rq_connection: redis.Redis,
    root: Path,
    code_dir: Path,
    command: str = "true",
    platform_config: dict[str, Any] | None = None,
    gpu_number: int | None = None,
    max_trial_duration: float | None = None,
    max_retries: int = 0,
) -> TrainingService:
    """An experiment on `client`'s Redis whose trials run `command` in `code_dir` (local platform unless told)."""
    experiment_id = create_experiment(client, {"trialCommand": command}, root / "experiments")
    service = TrainingService(client, rq_connection, experiment_id)
    trial_config = TrialConfig(
        command=command,
        code_directory=str(code_dir),
        gpu_number=gpu_number,
        max_trial_duration=max_trial_duration,
        max_retries=max_retries,
    )
    service.set_cluster_metadata(TRIAL_CONFIG, trial_config.to_json())
    service.set_cluster_metadata(PLATFORM_CONFIG, json.dumps(platform_config or {"platform": "local"}))
    return service


@pytest.fixture
def make_service(client: redis.Redis, rq_connection: redis.Redis, tmp_path: Path, code_dir: Path) -> ServiceFactory:
    """An experiment whose trials run `command` in `code_dir` on the local platform."""
    return functools.partial(new_service, client, rq_connection, tmp_path, code_dir)


def form(sequence_id: int = 0, **parameters: Any) -> JobApplicationForm:
    value = json.dumps(
        {"parameter_id": sequence_id, "parameter_source": "algorithm", "parameters": parameters, "parameter_index": 0}
    )
    return JobApplicationForm(sequence_id=sequence_id, hyper_parameters=HyperParameters(value=value))


def wait_for_status(service: TrainingService, trial_id: str, *statuses: str, timeout: float = 30.0) -> TrialJobDetail:
    def probe() -> TrialJobDetail | None:
        trial = service.get_trial_job(trial_id)
        return trial if trial.status in statuses else None

    return wait_until(probe, timeout, what=f"trial {trial_id} to be {'/'.join(statuses)}")


def metric(experiment_id: str, trial_id: str, sequence: int, kind: str = "PERIODICAL") -> TrialMetricReported:
    """A metric as a worker reports it (value: sequence / 10)."""
    return TrialMetricReported(
        experiment_id=experiment_id,
        trial_id=trial_id,
        attempt=1,
        source="fake-worker",
        parameter_id="0",
        metric_type=kind,  # type: ignore[arg-type]
        sequence=sequence,
        data=f'"{sequence / 10}"',
    )


def stream_entries(client: redis.Redis, stream: str) -> list[tuple[str, dict[str, str]]]:
    """XRANGE of the whole stream through a decoding client, typed as it answers (redis-py's types allow a
    None reply, ids and fields, and bytes, whatever the client)."""
    return cast(list[tuple[str, dict[str, str]]], client.xrange(stream))


class RedisServer:
    """A redis-server this test owns: killed with SIGKILL and started again on the same port and data."""

    def __init__(self, data_dir: Path, *options: str, login: tuple[str, str] | None = None) -> None:
        """`options` go to redis-server's command line (`--aclfile F`); `login` (user, password) is how to ping it."""
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary = binary
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.options = options
        self.login = login
        data_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        args += ["--logfile", "redis.log", "--daemonize", "no", *self.options]
        username, password = self.login or (None, None)
        probe = redis.Redis(host="127.0.0.1", port=self.port, username=username, password=password)  # one try a ping
        self.process = started(args, probe, self.log_tail)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last fsync; whatever is not in the AOF file is gone."""
        killed(self.process)

    def stop(self) -> None:
        stopped(self.process)

    def log_tail(self) -> str:
        log = self.data_dir / "redis.log"
        return log.read_text(errors="replace")[-800:] if log.exists() else ""


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis-data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_processes(own_redis: RedisServer, tmp_path: Path) -> Iterator[Processes]:
    log_dir = tmp_path / "process-logs"
    log_dir.mkdir()
    running = Processes(own_redis.url, log_dir)
    yield running
    running.stop()


@contextmanager
def processes_on_own_redis(root: Path) -> Iterator[Processes]:
    """Processes on a redis-server of their own under `root`, which no test flushes: for processes that
    several tests share, each test isolating by the experiments it creates."""
    server = RedisServer(root / "redis")
    server.start()
    (root / "logs").mkdir()
    running = Processes(server.url, root / "logs")
    try:
        yield running
    finally:
        running.stop()
        server.stop()


@pytest.fixture(scope="module")
def module_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    """Processes that a module's tests share (a manager, a worker): the per-test Redis is flushed after every
    test. Mark such a module `xdist_group` so that one pytest worker starts them once."""
    with processes_on_own_redis(tmp_path_factory.mktemp("module")) as running:
        yield running
