"""Wakes each running trial's watch loop when the trial writes in its `.nni` directory and when its keeper is done:
one thread and one inotify instance per worker process, whatever the number of trials it follows.

An inotify instance per trial, as before, ran out at 128 trials a user (fs.inotify.max_user_instances, Debian's
default), and every trial past them polled its metrics file every 5 ms: at 250 local trials on one machine, ~6x the
worker's CPU per metric (docs/benchmarks.md, "Many concurrent trials on one stack"). Watches are cheap
(max_user_watches is ~200,000 here); instances are not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inotify_simple import INotify, flags

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often a trial is woken where inotify is not available
_WRITES = flags.MODIFY | flags.CREATE | flags.MOVED_TO


@dataclass(eq=False)
class _Watch:
    wake: Callable[[], None]
    exited: int  # readable once the trial's keeper is done
    wd: int | None  # its directory's inotify watch; None: polled


class TrialWakeups:
    """Call a trial's `wake` at each write in its directory, and once more when its keeper is done; a thread of its
    own, started at the first trial."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoll: select.epoll | None = None
        self._inotify: INotify | None = None
        self._nudge_r, self._nudge_w = -1, -1  # the thread's own wake-up: b"s" to stop, b"p" to poll a new trial
        self._thread: threading.Thread | None = None
        self._by_fd: dict[int, _Watch] = {}
        self._by_wd: dict[int, list[_Watch]] = {}
        self._polled: set[_Watch] = set()
        self._inotify_refused = False  # warned once: each new trial tries for an instance again

    def watch(self, directory: Path, exited: int, wake: Callable[[], None]) -> None:
        """Wake at each write in `directory` until `exited` (a descriptor, closed here then) is readable."""
        with self._lock:
            epoll = self._epoll or self._start()
            watch = _Watch(wake, exited, self._add_watch(directory))
            self._by_fd[exited] = watch
            if watch.wd is None:
                self._polled.add(watch)
            else:
                self._by_wd.setdefault(watch.wd, []).append(watch)
            epoll.register(exited, select.EPOLLIN)
        if watch.wd is None:  # the thread's wait must now time out to poll it
            os.write(self._nudge_w, b"p")

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            os.write(self._nudge_w, b"s")
            thread.join()

    def _start(self) -> select.epoll:
        self._epoll = select.epoll()
        self._nudge_r, self._nudge_w = os.pipe()
        self._epoll.register(self._nudge_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="trial-wakeups", daemon=True)
        self._thread.start()
        return self._epoll

    def _add_watch(self, directory: Path) -> int | None:
        inotify = self._inotify or self._open_inotify()
        if inotify is None:
            return None
        try:
            return int(inotify.add_watch(directory, _WRITES))
        except OSError as error:  # ENOSPC: out of watches (fs.inotify.max_user_watches)
            log.warning("no inotify watch for %s (%s): polling it every %g s", directory, error, POLL_S)
            return None

    def _open_inotify(self) -> INotify | None:
        """The process's inotify instance; while the user has none left (fs.inotify.max_user_instances), each new
        trial asks again, since other processes may have freed one."""
        assert self._epoll is not None
        try:
            inotify = INotify()
        except OSError as error:
            if not self._inotify_refused:
                log.warning("no inotify (%s): polling running trials' metrics every %g s", error, POLL_S)
                self._inotify_refused = True
            return None
        self._epoll.register(inotify.fileno(), select.EPOLLIN)
        self._inotify = inotify
        return inotify

    def _run(self) -> None:
        assert self._epoll is not None
        try:
            while True:
                with self._lock:
                    timeout = POLL_S if self._polled else -1
                woken = {fd for fd, _ in self._epoll.poll(timeout)}
                if self._nudge_r in woken and b"s" in os.read(self._nudge_r, 1024):
                    return
                self._wake_written(woken)
                for fd in woken.intersection(self._by_fd):
                    self._done(fd)
                with self._lock:
                    polled = list(self._polled)
                for watch in polled:
                    watch.wake()
        finally:
            self._close_all()

    def _wake_written(self, woken: set[int]) -> None:
        if self._inotify is None or self._inotify.fileno() not in woken:
            return
        events = self._inotify.read(timeout=0)
        with self._lock:
            if any(event.mask & flags.Q_OVERFLOW for event in events):  # some were lost: wake every trial
                written = list(self._by_fd.values())
            else:
                written = [watch for event in events for watch in self._by_wd.get(event.wd, ())]
        for watch in dict.fromkeys(written):
            watch.wake()

    def _done(self, fd: int) -> None:
        """The keeper is done: wake its trial a last time, then forget it, so that a forgotten trial is never woken
        again (a wake after the forgetting reached a trial seen gone: ci95)."""
        assert self._epoll is not None
        with self._lock:
            watch = self._by_fd[fd]
        watch.wake()
        with self._lock:
            del self._by_fd[fd]
            self._epoll.unregister(fd)
            self._polled.discard(watch)
            if watch.wd is not None:
                sharing = self._by_wd[watch.wd]
                sharing.remove(watch)
                if not sharing:  # another attempt of the same trial may watch the same directory
                    del self._by_wd[watch.wd]
                    assert self._inotify is not None
                    with contextlib.suppress(OSError):  # the directory is gone, and its watch with it
                        self._inotify.rm_watch(watch.wd)
        os.close(fd)

    def _close_all(self) -> None:
        with self._lock:
            watches, self._by_fd, self._by_wd, self._polled = list(self._by_fd.values()), {}, {}, set()
            for watch in watches:
                os.close(watch.exited)
            if self._inotify is not None:
                self._inotify.close()
                self._inotify = None
            if self._epoll is not None:
                self._epoll.close()
                self._epoll = None
            os.close(self._nudge_r)
            os.close(self._nudge_w)
