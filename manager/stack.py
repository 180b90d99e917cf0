"""The processes `trialstream run` starts for itself when no Redis URL is given, and their policy.

A private redis-server (AOF on, data under the experiment's directory, on a unix socket only its
owner can open), the projector, and local workers: the same programs a compose stack runs. Each is
in a session of its own, so a terminal's Ctrl-C reaches the runner alone, which then stops the
experiment cleanly through them before they are stopped; until then the projector and workers are
started again whenever they exit (`ServiceProcesses.supervise`). This module also says where an
embedded experiment's data lives and how an ended run's data is served again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from core.connections import RedisUnavailable, connect
from core.platform import Platform
from core.registry import platform_class
from core.settings import SettingError, Settings, trial_environment
from core.variables import EXPERIMENTS_DIR_ENV, REDIS_URL_ENV
from manager.experiments import ExperimentNotFound
from schemas.config import ConfigError

_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux
_START_DEADLINE_S = 15.0
_PR_SET_PDEATHSIG = 1
SPARE_WORKERS = 1  # see worker_slots
PROCESSES_PER_TRIAL_UP_TO = 16  # local trials: see worker_slots
DATA_DIR = "redis"
CREATED = "created"  # an empty file made with the experiment's directory: its time is the experiment's start
SUPERVISE_POLL_S = 0.2  # how soon a service that exited is noticed, reaped and started again
RESTART_BACKOFF_S = 0.5  # the wait before starting again a service that exited quickly; doubled for each in a row
SETTLED_S = 10.0  # a service that ran this long had started well: its exit is not counted as a quick one
QUICK_EXITS = 5  # quick exits in a row after which a service is given up on, and the run ends

log = logging.getLogger(__name__)


class StackError(RuntimeError):
    pass


# What redis-server logs at level `#` as it starts: not its errors.
_REDIS_START_NOTICES = ("oO0OoO0OoO0Oo", "Redis version=", "Configuration loaded", "Server initialized", "WARNING")


class EmbeddedRedis:
    """A redis-server owned by this process; its data outlives it in `data_dir`."""

    def __init__(self, data_dir: Path, appendfsync: str = "always") -> None:
        self.data_dir = data_dir
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None
        self.binary = ""
        self.url = ""

    def start(self) -> str:
        self.binary = shutil.which("redis-server") or ""
        if not self.binary:
            raise StackError(
                "redis-server is not installed: install it (apt-get install redis-server) "
                f"or point {REDIS_URL_ENV} at a Redis server"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        self.url = f"unix://{socket_path(self.data_dir, create=True)}"
        self.spawn()
        self._wait_ready()
        return self.url

    def spawn(self) -> subprocess.Popen[bytes]:
        """redis-server on the data and socket of `start`: also how the stack's supervisor starts it again after
        it died (the OOM killer), from its AOF, which holds every acknowledged write (`appendfsync always`)."""
        args = [self.binary, "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", self.appendfsync]
        args += ["--save", "", "--logfile", "redis.log", "--daemonize", "no"]
        args += ["--port", "0", "--unixsocket", self.url.removeprefix("unix://"), "--unixsocketperm", "700"]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C must not kill the log under the runner
            preexec_fn=_die_with_parent(signal.SIGTERM),
        )
        return self.process

    def _wait_ready(self) -> None:
        assert self.process is not None
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + _START_DEADLINE_S
        while True:
            if self.process.poll() is not None:
                log = self.data_dir / "redis.log"
                tail = log.read_text()[-500:] if log.exists() else ""
                raise StackError(f"redis-server exited with code {self.process.returncode}: {tail}")
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise StackError(f"redis-server did not answer within {_START_DEADLINE_S:g}s") from None
                time.sleep(0.02)

    def last_error(self) -> str:
        """The last error line of its log (`#`: a warning or worse) and the free space of its data's disk."""
        log_file = self.data_dir / "redis.log"
        lines = log_file.read_text(errors="replace").splitlines() if log_file.exists() else []
        notices = [line.split(" # ", 1)[1] for line in lines if " # " in line]
        errors = [notice for notice in notices if not notice.startswith(_REDIS_START_NOTICES)]
        free = shutil.disk_usage(self.data_dir).free
        said = f"it said: {errors[-1]}; " if errors else ""
        return f"{said}{free:,} bytes free on the disk of {self.data_dir}"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # redis fsyncs the AOF and exits
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class _Service:
    """A process of `ServiceProcesses`, with what starts it again."""

    name: str
    log: Path
    spawn: Callable[[], subprocess.Popen[bytes]]
    process: subprocess.Popen[bytes]
    started_at: float
    owned: bool = True  # False: started and stopped by its owner (the embedded Redis), only kept running here
    given_up: Callable[[], str] | None = None  # called once it is given up on: what to add to the error
    quick_exits: int = 0  # in a row, each within SETTLED_S of its start
    restart_at: float | None = None  # set once it has exited: when it is started again


class ServiceProcesses:
    """`trialstream projector` and `trialstream worker` processes, logging to `log_dir`.

    They get the runner's settings through their environment (`Settings.as_environment`), with the
    stack's Redis URL: not argv, where a password would show in `ps`.
    """

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.environment = {**trial_environment(os.environ), **settings.as_environment()}
        self.log_dir = log_dir
        self.failure: str | None = None  # why supervision gave up: `check` raises it
        self._services: list[_Service] = []
        self._lock = threading.Lock()  # the supervisor's rounds against `stop`
        self._stopping = False
        self._stopped = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        """Each service's process now (a later one once it was started again), the watched ones left out."""
        return [service.process for service in self._services if service.owned]

    def start(self, *args: str, log_name: str, module: str = "manager.cli") -> None:
        """`python -m module args`; workers start as `python -m workers` (what `trialstream worker`
        execs), which spares them importing the control plane first: the first trial starts sooner."""
        spawn = functools.partial(self._spawn, args, log_name, module)
        self._services.append(_Service(log_name, self.log_dir / f"{log_name}.log", spawn, spawn(), time.monotonic()))

    def watch(
        self,
        name: str,
        process: subprocess.Popen[bytes],
        spawn: Callable[[], subprocess.Popen[bytes]],
        log: Path,
        given_up: Callable[[], str],
    ) -> None:
        """Keep running, as the services, a process started elsewhere (`spawn` starts it again), which `stop`
        leaves to its owner: the embedded Redis, which the services need until they have stopped. `given_up`
        is called if it is given up on, and says why in words to add to the error."""
        self._services.append(_Service(name, log, spawn, process, time.monotonic(), owned=False, given_up=given_up))

    def _spawn(self, args: tuple[str, ...], log_name: str, module: str) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{log_name}.log").open("ab") as log_file:
            return subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=self.environment,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C goes to the runner, which stops the trials through them
                preexec_fn=_die_with_parent(signal.SIGKILL),  # its trials' keepers end them too
            )

    def serve(self, platforms: list[str], concurrency: int) -> None:
        """The projector, and for each platform (several in a hybrid experiment: any may get every trial)
        the worker processes `concurrency` trials need (`worker_slots`), kept running (`supervise`)."""
        self.start("projector", log_name="projector")
        for platform in platforms:
            prefix = f"worker-{platform}-" if len(platforms) > 1 else "worker-"
            for index, slots in enumerate(worker_slots(platform_class(platform), concurrency)):
                self.start(
                    "--platform", platform, "--concurrency", str(slots), log_name=f"{prefix}{index}", module="workers"
                )
        self.supervise()

    def supervise(self) -> None:
        """Start again, until `stop`, every process that exits (the OOM killer took a worker): nothing else
        would serve the queue, and the run would wait for ever. Each exit is reaped and logged in one warning.
        One that exits within SETTLED_S of its start is started again after RESTART_BACKOFF_S, doubled for each
        such quick exit in a row; at the QUICK_EXITS-th it is given up on (it cannot start: a broken
        environment, no memory), supervision ends, and `check` raises a StackError that ends the run."""
        self._supervisor = threading.Thread(target=self._supervise, name="embedded-services", daemon=True)
        self._supervisor.start()

    def check(self) -> None:
        """Raise the StackError of a service given up on (`supervise`)."""
        if self.failure is not None:
            raise StackError(self.failure)

    def _supervise(self) -> None:
        """Rounds until `stop` has ended the processes: not sooner, since one started again here gets its
        PR_SET_PDEATHSIG when this *thread* ends (prctl(2)), which must not cut short its SIGTERM in `stop`."""
        while not self._stopped.wait(SUPERVISE_POLL_S):
            with self._lock:
                if self._stopping or self.failure is not None:
                    continue
                for service in self._services:
                    self._tend(service)
                    if self.failure is not None:
                        break

    def _tend(self, service: _Service) -> None:
        """Reap `service` if it exited, and start it again once its back-off is over."""
        now = time.monotonic()
        if service.restart_at is None:
            status = service.process.poll()
            if status is None:
                return
            quick = now - service.started_at < SETTLED_S
            service.quick_exits = service.quick_exits + 1 if quick else 0
            how = _exit_status(status)
            if service.quick_exits >= QUICK_EXITS:
                why = f" ({service.given_up()})" if service.given_up is not None else ""
                self.failure = (
                    f"embedded {service.name} {how}, the {QUICK_EXITS}th time in a row within {SETTLED_S:g} s "
                    f"of its start: see {service.log}{why}"
                )
                log.error("%s; ending the run", self.failure)
                return
            delay = RESTART_BACKOFF_S * 2 ** (service.quick_exits - 1) if quick else 0.0
            log.warning(
                "embedded %s (pid %d) %s; starting it again%s",
                service.name,
                service.process.pid,
                how,
                f" in {delay:g} s" if delay else "",
            )
            service.restart_at = now + delay
        if now < service.restart_at:
            return
        try:
            service.process = service.spawn()
        except OSError as error:
            self.failure = f"embedded {service.name} could not be started again: {error}"
            return
        service.started_at, service.restart_at = time.monotonic(), None

    def stop(self, grace_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True  # no process is started again from here on
        processes = self.processes
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._stopped.set()
        if self._supervisor is not None:
            self._supervisor.join()


def _exit_status(status: int) -> str:
    """A Popen returncode in words: `was killed by SIGKILL`, `exited with status 1`."""
    if status < 0:
        with suppress(ValueError):
            return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def worker_slots(adapter: type[Platform[Any]], concurrency: int) -> list[int]:
    """How many trials each worker process of a platform supervises, so that `concurrency` run at once plus a
    spare (the worker whose trial just ended is still doing RQ's bookkeeping when the next trial is queued,
    ~30 ms here, and the spare takes it at once), the trials spread evenly.

    Where trials run on their worker (local): a process per trial, so that a worker that dies takes one trial with
    it, up to `PROCESSES_PER_TRIAL_UP_TO` processes or one per core where there are more; past that the trials share
    them (a worker process is ~50 MB and an inotify instance, of the user's 128: docs/benchmarks.md, "Real trial
    processes"), each at most the platform's `trials_per_process`. Where they run elsewhere and a worker only
    follows them: as few processes as hold them all (one process starts sooner than several importing at once,
    and holds one SSH connection per host): one process follows about a core's worth."""
    needed = concurrency + SPARE_WORKERS
    fewest = -(-needed // adapter.trials_per_process)
    if adapter.trials_outlive_worker:
        processes = fewest
    else:
        processes = max(min(needed, max(PROCESSES_PER_TRIAL_UP_TO, len(os.sched_getaffinity(0)))), fewest)
    return [needed // processes + (index < needed % processes) for index in range(processes)]


class EmbeddedStack:
    """A private Redis with its data under the experiment's directory, and the services on it.

    Use it as a context manager: everything it started is stopped on the way out.
    """

    def __init__(self, experiment_dir: Path, settings: Settings) -> None:
        self.server = EmbeddedRedis(experiment_dir / DATA_DIR)
        url = self.server.start()
        self.redis_gone = threading.Event()  # set once the supervisor gives up on it: its clients stop retrying
        try:
            self.client = connect(url, gone=self.redis_gone)
            self.rq_connection = connect(url, decode=False, gone=self.redis_gone)
        except BaseException:
            self.server.stop()
            raise
        child_settings = settings.model_copy(update={"redis_url": url})
        self.services = ServiceProcesses(child_settings, experiment_dir / "logs")
        assert self.server.process is not None
        self.services.watch(
            "redis-server", self.server.process, self.server.spawn, self.server.data_dir / "redis.log", self._redis_lost
        )

    def _redis_lost(self) -> str:
        """Redis cannot start again (its disk is full): the stack's clients stop waiting for it, and the error
        says what Redis said last and how much room its disk has."""
        self.redis_gone.set()
        return self.server.last_error()

    def __enter__(self) -> EmbeddedStack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.services.stop()
        finally:
            self.server.stop()


def experiments_root(settings: Settings, configured: str | None = None) -> Path:
    """Where embedded experiments live: experimentWorkingDirectory if a config gives one, else the setting."""
    return Path(configured or settings.experiments_dir).expanduser().resolve()


def new_experiment_dir(settings: Settings, experiment_id: str, configured: str | None = None) -> Path:
    """A new embedded experiment's directory, made under `experiments_root`. A root where none can be made (a
    file, a path under /proc) is the user's to fix: the error names where they gave it, not an OSError's trace."""
    directory = experiments_root(settings, configured) / experiment_id
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CREATED).touch()
    except OSError as error:
        problem = f"cannot create {directory} ({error.strerror}); set it to a directory you can write to"
        if configured:
            raise ConfigError(f"experimentWorkingDirectory: {problem}") from None
        raise SettingError(f"{EXPERIMENTS_DIR_ENV}: {problem}") from None
    return directory


def experiment_dir(root: Path, experiment_id: str | None) -> Path:
    """The directory of an embedded experiment under `root` (the newest without an id)."""
    if experiment_id is not None:
        found = root / experiment_id
        if not (found / DATA_DIR).is_dir():
            raise ExperimentNotFound(
                f"experiment {experiment_id!r} not found under {root} (set {REDIS_URL_ENV} for a shared Redis)"
            )
        return found
    candidates = embedded_experiments(root)
    if not candidates:
        raise ExperimentNotFound(f"no experiment found under {root}; set {REDIS_URL_ENV} for a shared Redis")
    return candidates[-1]


def embedded_experiments(root: Path) -> list[Path]:
    """Every embedded experiment's directory under `root`, oldest first: by its `created` file, which nothing
    touches again (its data directory changes whenever a command opens it), else by its data."""
    return sorted((data.parent for data in root.glob(f"*/{DATA_DIR}")), key=_created)


def _created(directory: Path) -> float:
    marker = directory / CREATED
    return (marker if marker.exists() else directory / DATA_DIR).stat().st_mtime


def live_url(directory: Path) -> str | None:
    """The URL of the experiment's Redis if a run is serving it now, else None."""
    path = socket_path(directory / DATA_DIR)
    if not path.exists():
        return None
    url = f"unix://{path}"
    with suppress(RedisUnavailable):
        connect(url)
        return url
    return None


def socket_path(data_dir: Path, create: bool = False) -> Path:
    """Where the redis-server of `data_dir` listens: beside its data; or, where that path is too long for a
    unix socket (sun_path: 108 bytes), in a private directory of this user's under /tmp, named by the data
    directory, so that a run and every command reading it find the same one. (Never a TCP port: a second
    command would not find it, and would start a second server on the same files.) `create`: make that
    private directory if it is missing."""
    beside = data_dir / "redis.sock"
    if len(str(beside)) <= _MAX_SOCKET_PATH:
        return beside
    name = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:24] + ".sock"
    return _private_dir(create) / name


def _private_dir(create: bool) -> Path:
    """/tmp/trialstream-<uid>, 0700 and this user's (/tmp is everyone's: one another user made is refused)."""
    directory = Path(tempfile.gettempdir()) / f"trialstream-{os.getuid()}"
    if create:
        with suppress(FileExistsError):
            directory.mkdir(mode=0o700)
    try:
        status = directory.lstat()
    except FileNotFoundError:
        return directory
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or stat.S_IMODE(status.st_mode) != 0o700:
        raise StackError(f"{directory} is not a private directory of this user's (0700): remove it, or move it away")
    return directory


@contextmanager
def served_data(directory: Path) -> Iterator[str]:
    """A URL serving the experiment's data: its run's Redis while it runs, else a temporary server
    on the data the run left behind (stopped on the way out)."""
    url = live_url(directory)
    if url is not None:
        yield url
        return
    server = EmbeddedRedis(directory / DATA_DIR)
    try:
        yield server.start()
    finally:
        server.stop()


def _die_with_parent(signum: int) -> Callable[[], None] | None:
    """Have the kernel send `signum` to the child when this process dies, however it dies (Linux only).

    The embedded stack belongs to the `run` that started it: a SIGKILLed runner must not leave a
    redis-server (SIGTERM: it fsyncs the AOF and exits) or workers (SIGKILL) behind; `trialstream
    resume` starts them again from the data directory.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signum)

    return set_death_signal
