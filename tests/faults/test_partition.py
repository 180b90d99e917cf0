"""A silent partition between one worker and Redis (Redis stays up for everyone else).

A TCP proxy in the test sits between that worker and Redis; on command it becomes a black hole:
it keeps accepting and keeps every connection open, but forwards no byte either way (no RST, no
FIN), as a cut network cable or a dropped route would. The worker must notice on its own (its
local deadline) and stop its trial before the retry that another worker starts, so that two
copies of the attempt never run at the same time.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from core.event_store import StoredEvent
from core.variables import REDIS_URL_ENV
from schemas.events import TrialAttemptLost, TrialStarted
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, ServiceFactory, form, wait_for_status, wait_until
from tests.platforms.test_local_platform import script
from workers.runtime.control import LOCAL_DEADLINE_LEASES, STOP_MARGIN_S

LEASE_S = 1.0
LEASE = {"TRIALSTREAM_TRIAL_LEASE_S": str(LEASE_S)}
# The cut-off worker stops its trial at its local deadline; slack for a loaded machine on top.
STOPPED_WITHIN_S = LOCAL_DEADLINE_LEASES * LEASE_S + STOP_MARGIN_S

# The first copy outlives any bound of this test unless it is stopped; a later copy ends soon.
TRIAL = """
import os, sys, time
marks = sys.argv[1]
first = not os.path.exists(marks)
with open(marks, "a") as f:
    f.write(f"start {os.getpid()} {time.time()!r}\\n")
time.sleep(120 if first else 1)
with open(marks, "a") as f:
    f.write(f"end {os.getpid()}\\n")
"""


class BlackHoleProxy:
    """A TCP proxy on 127.0.0.1 to `upstream` that, once `black_hole()` is called, forwards nothing:
    bytes from either side are read and dropped, connections stay open, new ones are still accepted."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._silent = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def black_hole(self) -> None:
        self._silent.set()

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _keep(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
        return sock

    def _accept(self) -> None:
        while True:
            try:
                downstream = self._keep(self._listener.accept()[0])
            except OSError:
                return  # closed at teardown
            if self._silent.is_set():  # accepted, and never answered
                self._start(downstream, None)
                continue
            upstream = self._keep(socket.create_connection(self._upstream))
            self._start(downstream, upstream)
            self._start(upstream, downstream)

    def _start(self, source: socket.socket, target: socket.socket | None) -> None:
        threading.Thread(target=self._pump, args=(source, target), name="proxy-pump", daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket | None) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if self._silent.is_set() or target is None:
                if not data:
                    return  # a close is not forwarded either
                continue
            try:
                if not data:
                    target.shutdown(socket.SHUT_WR)
                    return
                target.sendall(data)
            except OSError:
                return


@pytest.fixture
def proxy(redis_url: str) -> Iterator[BlackHoleProxy]:
    parsed = urlparse(redis_url)
    assert parsed.hostname is not None and parsed.port is not None
    running = BlackHoleProxy((parsed.hostname, parsed.port))
    yield running
    running.close()


def _alive(pid: int) -> bool:
    """Running (a zombie has stopped running: only its exit status is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class GoneWatch:
    """Polls /proc/<pid> from a thread of the test, recording (wall-clock time) when the pid stopped running."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.gone_at: float | None = None
        self._thread = threading.Thread(target=self._watch, name=f"watch-{pid}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while _alive(self.pid):
            time.sleep(0.005)
        self.gone_at = time.time()


def _starts(marks: Path) -> list[tuple[int, float]]:
    if not marks.exists():
        return []
    lines = [line.split() for line in marks.read_text().splitlines()]
    return [(int(line[1]), float(line[2])) for line in lines if len(line) == 3 and line[0] == "start"]


@pytest.mark.timeout(180)
def test_a_silently_partitioned_worker_stops_its_trial_before_the_retry_starts(
    make_service: ServiceFactory, processes: Processes, proxy: BlackHoleProxy, code_dir: Path, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    service = make_service(f"{script(code_dir, 'trial.py', TRIAL)} {marks}", max_retries=1)
    processes.projector()
    cut_off = processes.worker(env={**LEASE, REDIS_URL_ENV: f"redis://127.0.0.1:{proxy.port}/0"})
    trial_id = service.submit_trial_job(form(0)).id
    running = wait_for_status(service, trial_id, "RUNNING", timeout=60)
    assert running.worker is not None and running.worker.endswith(f":{cut_off.pid}"), running.worker
    first_pid, _ = wait_until(lambda: _starts(marks), 30, what="the first copy's start mark")[0]
    first = GoneWatch(first_pid)
    processes.worker(env=LEASE)  # connects directly: it reaps the lost attempt and runs the retry

    proxy.black_hole()
    cut_at = time.time()
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=90)

    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 2, trial.message
    events = [e.event for e in service.store.read() if isinstance(e, StoredEvent)]
    lost = [e for e in events if isinstance(e, TrialAttemptLost) and e.trial_id == trial_id]
    assert [(e.attempt, e.status) for e in lost] == [(1, TrialJobStatus.WAITING)]
    started = [e for e in events if isinstance(e, TrialStarted) and e.trial_id == trial_id]
    assert [e.attempt for e in started] == [1, 2] and started[1].source != running.worker
    starts = _starts(marks)
    assert len(starts) == 2 and starts[0][0] == first_pid, starts
    retry_started_at = starts[1][1]
    assert first.gone_at is not None and first.gone_at < retry_started_at, (
        f"the retry started beside the cut-off copy (pid {first_pid}, still running: {first.gone_at is None})"
    )
    assert first.gone_at - cut_at < STOPPED_WITHIN_S + 10, f"the cut-off copy ran {first.gone_at - cut_at:.1f}s on"
    assert f"end {first_pid}" not in marks.read_text()  # stopped, not finished
    assert cut_off.poll() is None  # it lost a trial, not its life
