"""Asking a manager that does not answer again, for a while: the commands that follow an experiment through a
manager (`run`, `resume`, `events --follow`, `trials logs --follow`) ride out its pause or restart instead of
ending on it, since the experiment goes on there meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from manager.api_client import ManagerError, ManagerUnreachable
from manager.cli import render

RETRY_S = (0.5, 1.0, 2.0, 5.0)  # the pauses between asks of a manager that does not answer, the last repeated
T = TypeVar("T")


class Patience:
    """One outage at a time: said once on stderr when it starts (with `going_on`: what goes on meanwhile) and once
    when the manager answers again; after `wait_s` seconds without an answer, a ManagerError that says what `lost`
    says when asked then (what may still be going on there, and the command that takes it up again)."""

    def __init__(self, url: str, wait_s: float, going_on: str, lost: Callable[[], str]) -> None:
        self.url = url
        self.wait_s = wait_s
        self._going_on = going_on
        self._lost = lost
        self._give_up: float | None = None  # set while the manager does not answer
        self._pauses: Iterator[float] = iter(RETRY_S)

    def __call__(self, request: Callable[[], T]) -> T:
        """`request` (one safe to repeat), asked until the manager answers it or the wait is over."""
        while True:
            try:
                answer = request()
            except ManagerUnreachable as error:
                self.failed(error)
                continue
            self.answered()
            return answer

    def failed(self, error: ManagerUnreachable) -> None:
        """The manager did not answer: say so the first time, give up once the wait is over, else pause before
        the next ask."""
        now = time.monotonic()
        if self._give_up is None:
            self._give_up = now + self.wait_s
            self._pauses = iter(RETRY_S)
            render.note(
                f"the manager at {self.url} does not answer ({error}); {self._going_on}: asking again for up to"
                f" {self.wait_s:g} s"
            )
        if now >= self._give_up:
            raise ManagerError(
                f"the manager at {self.url} has not answered for {self.wait_s:g} s ({error}); {self._lost()}"
                " (TRIALSTREAM_MANAGER_WAIT_S sets how long this command waits)"
            ) from None
        time.sleep(min(next(self._pauses, RETRY_S[-1]), self._give_up - now))

    def answered(self) -> None:
        """The manager answered: the outage, if there was one, is over."""
        if self._give_up is not None:
            self._give_up = None
            render.note(f"the manager at {self.url} answers again")
