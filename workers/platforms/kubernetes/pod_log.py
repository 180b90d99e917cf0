"""Following a pod's log through the API, with timestamps: the offset (the last line's timestamp) is committed
with the metrics read, so a re-opened stream or a restarted worker resumes after it."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from core.platform import (
    TrialControl,
)
from workers.platforms.kubernetes.cluster import REQUEST_TIMEOUT, describe
from workers.platforms.shared.trial_contract import (
    MetricBatch,
    StdoutMetricPump,
)

log = logging.getLogger(__name__)


LOG_READ_TIMEOUT_S = 300.0  # a silent log stream is re-opened (from its offset) after this


def _timestamp_ns(text: str) -> int:
    """RFC 3339 with up to nanoseconds, as the kubelet prefixes log lines."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])


class LogFollower:
    """Reads one pod's log to its end, through the API, parsing metric lines. What it has committed is
    (`log_ns`, `log_skip`): the timestamp of the last metric line and how many lines of that very
    timestamp were read, so a re-opened stream skips exactly what was read."""

    def __init__(
        self, core: k8s.CoreV1Api, namespace: str, pod: str, control: TrialControl, pod_ended: Callable[[], bool]
    ) -> None:
        self.core, self.namespace, self.pod, self.control = core, namespace, pod, control
        self._pod_ended = pod_ended
        self.batch = MetricBatch(control)
        self.pump = StdoutMetricPump(self.batch)
        offsets = control.offsets()
        self.read_ns, self.read_same = offsets.get("log_ns", 0), offsets.get("log_skip", 0)
        self.done = threading.Event()
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"log-{pod}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self.done.is_set()

    def stop(self) -> None:
        self._stop.set()
        _interrupt(self._response)

    def _run(self) -> None:
        pause = 0.2
        try:
            while not self._stop.is_set():
                try:
                    self._read_once()
                    pause = 0.2
                except ApiException as error:
                    if error.status == 404:  # the pod is gone, and its log with it
                        return
                    log.info("log of pod %s: %s", self.pod, describe(error))
                except Exception as error:  # a broken stream: re-opened from the offset
                    log.info("log of pod %s interrupted: %s", self.pod, describe(error))
                if self._pod_ended() and not self._stop.is_set():
                    self._read_once()  # what was written after the stream broke, to the end
                    return
                self._stop.wait(pause)
                pause = min(pause * 2, 5.0)
        except Exception as error:
            log.warning("log of pod %s: %s", self.pod, describe(error))
        finally:
            self.done.set()
            self.control.wake()

    def _read_once(self) -> None:
        """One stream, from the start of the log (the client offers no sinceTime, and a sinceSeconds from
        this machine's clock could miss lines on a cluster whose clock is ahead): what was read is skipped."""
        response: Any = self.core.read_namespaced_pod_log(
            self.pod,
            self.namespace,
            follow=not self._pod_ended(),
            timestamps=True,
            _preload_content=False,
            _request_timeout=(REQUEST_TIMEOUT[0], LOG_READ_TIMEOUT_S),
        )
        self._response = response
        try:
            same = 0  # lines of the current timestamp seen in this stream
            last = 0
            for line in _lines(response):
                stamp, _, text = line.partition(b" ")
                at = _timestamp_ns(stamp.decode())
                same = same + 1 if at == last else 1
                last = at
                if at < self.read_ns or (at == self.read_ns and same <= self.read_same):
                    continue  # read before this stream was opened
                self.pump.feed(text)
                found = self.batch.take()
                if found:
                    self.read_ns, self.read_same = at, same
                    self.control.metrics(found, offsets={"log_ns": at, "log_skip": same})
        finally:
            self._response = None
            response.release_conn()


def _interrupt(response: Any) -> None:
    """Closes a stream another thread is blocked reading, if there is one: the reader wakes at once."""
    if response is not None:
        with contextlib.suppress(Exception):
            response.close()


def _lines(response: urllib3.HTTPResponse) -> Iterator[bytes]:
    """Whole lines as they arrive (a chunk may hold several, or part of one)."""
    rest = b""
    for chunk in response.stream(64 * 1024, decode_content=False):
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest
