"""Group commit: the writes a worker process's trials make while every round trip is busy share the next one.

A trial's write is a function that queues its commands on a transaction (its appends, its read offsets, the
idempotency keys it no longer needs). A write that finds a round trip free carries itself at once, so a lone
write waits for nothing. Writes that come while `flights` round trips are in flight queue up, and the next
writer to get one carries all of them in one MULTI/EXEC; each writer returns once its own write has its
answer, and raises its own error. A trial's writes are never reordered: it waits for each before the next.

Why: the trials' writes were bounded by a semaphore of as many slots, each write its own round trip. With 2,500
trials reporting a metric a second in one process, hundreds of writers queued there, 16 round trips at a time,
and a metric's p99 into the log was 1.5-2.7 s; the writes queued now leave together in the next free round trip
(p99 50 ms, with the same CPU and throughput: docs/benchmarks.md, Many concurrent trials). The bound on round trips in
flight also bounds the connections the trials' writes hold.

Every writer takes a round trip in turn, even one whose write another took along, and carries what is queued
then: a thread already running takes a free round trip at once. Handing the queue to one waiting writer instead
(tried) waits for that thread to wake and get the interpreter lock: p99 81-118 ms against 50-54, three runs each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from redis.client import Pipeline

FLIGHTS = 16  # round trips in flight at once, per worker process and lease length; more writes go together

Fill = Callable[[Pipeline], object]


@dataclass(eq=False)
class _Write:
    fill: Fill
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class GroupCommit:
    """The trials' writes on one client, at most `flights` round trips at once."""

    def __init__(self, client: redis.Redis, flights: int = FLIGHTS) -> None:
        self._client = client
        self._flights = threading.BoundedSemaphore(flights)
        self._queued: list[_Write] = []
        self._lock = threading.Lock()

    def write(self, fill: Fill) -> None:
        """Run the commands `fill` queues in a transaction; raise what failed of them (a connection's error
        fails every write of its round trip: each is safe to send again)."""
        write = _Write(fill)
        with self._lock:
            self._queued.append(write)
        with self._flights:
            with self._lock:
                batch, self._queued = self._queued, []
            try:
                if batch:  # empty when a writer before us took ours along
                    self._carry(batch)
            finally:  # whatever stopped this writer, no other waits for good
                for each in batch:
                    each.finish(redis.ConnectionError("not sent: the thread carrying it stopped"))
        write.done.wait()
        if write.error is not None:
            raise write.error

    def _carry(self, batch: list[_Write]) -> None:
        """One round trip for `batch`; every write of it is finished when this returns."""
        try:
            self._round_trip(batch)
        except (redis.ConnectionError, redis.TimeoutError) as error:  # the round trip's: each writer sends again
            for write in batch:
                write.finish(error)
        except Exception as error:  # refused as a whole (EXECABORT, an argument redis-py cannot send): each alone
            if len(batch) == 1:  # tells whose it was
                batch[0].finish(error)
            else:
                for write in batch:
                    if not write.done.is_set():
                        self._carry([write])

    def _round_trip(self, batch: list[_Write]) -> None:
        spans = []  # (write, where its commands start and end in the transaction)
        with self._client.pipeline(transaction=True) as pipe:
            for write in batch:
                start = len(pipe.command_stack)
                try:
                    write.fill(pipe)
                except Exception as error:  # its own mistake: nothing of it goes
                    del pipe.command_stack[start:]
                    write.finish(error)
                else:
                    spans.append((write, start, len(pipe.command_stack)))
            results = pipe.execute(raise_on_error=False) if spans else []
        for write, start, end in spans:
            write.finish(next((result for result in results[start:end] if isinstance(result, Exception)), None))
