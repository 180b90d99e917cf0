"""The processes `trialstream run` starts for itself when no Redis URL is given.

A private redis-server (AOF on, data under the experiment's directory, on a unix socket only its
owner can open), the projector, and local workers: the same programs a compose stack runs.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis

from core.connections import REDIS_URL_ENV

_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux
_START_DEADLINE_S = 15.0
_PR_SET_PDEATHSIG = 1


class StackError(RuntimeError):
    pass


class EmbeddedRedis:
    """A redis-server owned by this process; its data outlives it in `data_dir`."""

    def __init__(self, data_dir: Path, appendfsync: str = "always") -> None:
        self.data_dir = data_dir
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError(
                "redis-server is not installed: install it (apt-get install redis-server) "
                f"or point {REDIS_URL_ENV} at a Redis server"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        args = [binary, "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", self.appendfsync]
        args += ["--save", "", "--logfile", "redis.log", "--daemonize", "no"]
        sock = self.data_dir / "redis.sock"
        if len(str(sock)) <= _MAX_SOCKET_PATH:
            args += ["--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700"]
            self.url = f"unix://{sock}"
        else:  # a long path: loopback only, and never without a password
            password = secrets.token_urlsafe(24)
            port = _free_port()
            args += ["--port", str(port), "--bind", "127.0.0.1"]
            self.url = f"redis://:{password}@127.0.0.1:{port}/0"
            args += ["--requirepass", password]
        self.process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent(signal.SIGTERM)
        )
        self._wait_ready()
        return self.url

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

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # redis fsyncs the AOF and exits
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ServiceProcesses:
    """`trialstream projector` and `trialstream worker` processes, logging to `log_dir`."""

    def __init__(self, redis_url: str, log_dir: Path) -> None:
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, log_name: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, REDIS_URL_ENV: self.redis_url}  # not argv: a password must not show in `ps`
        with (self.log_dir / f"{log_name}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "manager.cli", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(signal.SIGKILL),  # its trials' keepers end them too
            )
        self.processes.append(process)

    def stop(self, grace_s: float = 10.0) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
