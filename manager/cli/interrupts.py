"""SIGINT and SIGTERM: both unwind like Ctrl-C, so every `finally` runs, and the exit status says which.

A runner that is interrupted stops its experiment cleanly on the way out (running trials
SYS_CANCELED, the experiment STOPPED); a second signal during that stop ends it at once.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The process was told to stop by `signum`; its exit status is 128 + signum (130, 143)."""

    def __init__(self, signum: int, message: str = "interrupted") -> None:
        super().__init__(message)
        self.signum = signum
        self.message = message

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def explained(interrupt: KeyboardInterrupt, message: str) -> Interrupted:
    """The same interrupt, with a message saying what became of the command's work."""
    return Interrupted(interrupt.signum if isinstance(interrupt, Interrupted) else signal.SIGINT, message)


def install() -> None:
    for signum in SIGNALS:
        signal.signal(signum, _interrupt)


@contextmanager
def announced(message: str) -> Iterator[None]:
    """While the block runs, the first signal also prints `message` (what happens now); a second one
    interrupts whatever that stop is doing."""

    def first(signum: int, frame: FrameType | None) -> None:
        install()
        sys.stderr.write(f"{message}\n")
        sys.stderr.flush()
        raise Interrupted(signum)

    for signum in SIGNALS:
        signal.signal(signum, first)
    try:
        yield
    finally:
        install()


def ending_a_follow(follow: bool) -> AbstractContextManager[None]:
    """^C or SIGTERM is the way to stop a follow (`events --follow`, `trials logs --follow`), not a failure: at any
    step, waiting for a manager as much as printing, it ends the command quietly with status 0. A command that
    does not follow is interrupted (130 or 143, and a line saying so)."""
    return suppress(KeyboardInterrupt) if follow else nullcontext()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)
