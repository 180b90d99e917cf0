"""The dispatcher on a thread of its own, so the runner never waits on a tuner.

A GP or Metis tuner may think for seconds; meanwhile the runner keeps following the log, renewing
its claim and submitting parameter sets that are ready. Calls run one at a time, in the order
given, so the tuner sees its inputs exactly in log order. A tuner's exception is kept with its
traceback and every later call is dropped: the runner records it and stops the experiment.
"""

from __future__ import annotations

import threading
import traceback
from collections import deque
from typing import Any

from manager.dispatcher import Dispatcher, Output


class TunerThread:
    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.error: str | None = None
        self._calls: deque[tuple[str, tuple[Any, ...]]] = deque()
        self._outputs: list[Output] = []
        self._busy = 0
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="tuner", daemon=True)
        self._thread.start()

    def call(self, method: str, *args: Any) -> None:
        """Queue `dispatcher.method(*args)`; its outputs come back through `outputs()`."""
        with self._changed:
            self._calls.append((method, args))
            self._busy += 1
            self._changed.notify_all()

    def outputs(self) -> list[Output]:
        with self._changed:
            taken, self._outputs = self._outputs, []
            return taken

    @property
    def idle(self) -> bool:
        """No call is queued or running: what the tuner will say has been said."""
        with self._changed:
            return self._busy == 0

    def wait(self, timeout_s: float | None) -> bool:
        """Until every queued call is done (or the timeout): True when idle."""
        with self._changed:
            return self._changed.wait_for(lambda: self._busy == 0, timeout_s)

    def close(self) -> None:
        """Stop; calls still queued are dropped (wait() first to have them run)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._calls or self._closed)
                if self._closed:
                    return
                method, args = self._calls.popleft()
            outputs: list[Output] = []
            try:
                if self.error is None:
                    outputs = getattr(self.dispatcher, method)(*args) or []
            except BaseException:  # SystemExit from a tuner too: it must not leave the runner waiting
                self.error = traceback.format_exc()
            finally:
                with self._changed:
                    self._outputs.extend(outputs)
                    self._busy -= 1
                    self._changed.notify_all()
