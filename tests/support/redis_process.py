"""Starting and stopping a redis-server subprocess a test owns: what `tests.conftest.RedisServer` and the
Sentinel set's nodes (tests/support/sentinel.py) share."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import redis

START_DEADLINE_S = 10.0


def started(command: list[str], probe: redis.Redis, log_tail: Callable[[], str]) -> subprocess.Popen[bytes]:
    """`command` running, returned once `probe` (a client with no retries) gets an answer to PING."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + START_DEADLINE_S
    try:
        while True:
            if process.poll() is not None:
                raise AssertionError(f"redis-server exited with {process.returncode}: {log_tail()}")
            try:
                if probe.ping():
                    return process
            except (redis.ConnectionError, redis.BusyLoadingError):
                pass  # BusyLoadingError (a ConnectionError) while it replays the AOF
            if time.monotonic() > deadline:
                raise AssertionError(f"redis-server did not answer within {START_DEADLINE_S}s: {log_tail()}")
            time.sleep(0.02)
    finally:
        probe.close()


def stopped(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (after SIGCONT: a paused server would not act on it), SIGKILL if it takes more than 10 s."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGCONT)
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def killed(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL, and reaped: no shutdown, no last fsync."""
    assert process is not None, "never started"
    process.kill()
    process.wait()
