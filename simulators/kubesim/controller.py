"""A de-duplicating work queue with delayed adds, and a one-thread controller loop on top of it.

Like client-go's workqueue: a key queued several times before it is processed is processed once, and a key is
never processed by two workers at once (there is one worker per controller here).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Hashable
from typing import Any


class WorkQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: list[Hashable] = []
        self._queued: set[Hashable] = set()
        self._delayed: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()
        self._closed = False

    def add(self, key: Hashable) -> None:
        with self._cond:
            if key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
                self._cond.notify()

    def add_after(self, key: Hashable, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            heapq.heappush(self._delayed, (time.monotonic() + delay, next(self._seq), key))
            self._cond.notify()

    def get(self) -> Hashable | None:
        """Next key, or None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                while self._delayed and self._delayed[0][0] <= now:
                    _, _, key = heapq.heappop(self._delayed)
                    if key not in self._queued:
                        self._queued.add(key)
                        self._ready.append(key)
                if self._ready:
                    key = self._ready.pop(0)
                    self._queued.discard(key)
                    return key
                timeout = self._delayed[0][0] - now if self._delayed else None
                self._cond.wait(timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Controller:
    """Runs `reconcile(key)` for queued keys on one daemon thread; a failing key is retried with exponential back-off
    (client-go's default controller rate limiter starts at 5ms and doubles; capped here at 5s)."""

    name = "controller"

    def __init__(self) -> None:
        self.queue = WorkQueue()
        self._thread = threading.Thread(target=self._run, name=f"kubesim-{self.name}", daemon=True)
        self.errors: list[str] = []
        self._failures: dict[Any, int] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.queue.close()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            key = self.queue.get()
            if key is None:
                return
            try:
                self.reconcile(key)
                self._failures.pop(key, None)
            except Exception as e:  # a controller keeps going, like a real one
                self.errors.append(f"{key}: {type(e).__name__}: {e}")
                del self.errors[:-100]
                n = self._failures[key] = self._failures.get(key, 0) + 1
                self.queue.add_after(key, min(0.005 * 2**n, 5.0))

    def reconcile(self, key: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
