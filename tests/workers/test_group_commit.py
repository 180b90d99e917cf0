"""The group commit a worker's trials write through (workers/runtime/group_commit.py), on a real redis-server:
writes made while a round trip is in flight go together in the next one, and each writer gets its own answer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.retry import Retry

from tests.conftest import wait_until
from tests.support.ports import free_port
from workers.runtime.group_commit import GroupCommit

WRITERS = 20


def _transactions(client: redis.Redis) -> int:
    stats: Any = client.info("commandstats")
    return int(stats.get("cmdstat_exec", {}).get("calls", 0))


def _together(client: redis.Redis, fills: list[Callable[[Pipeline], object]]) -> list[BaseException | None]:
    """Write each of `fills` from a thread of its own while a first write holds the only round trip, so that
    all of them queue behind it; then let it go. What each writer raised, in the order of `fills`."""
    commit = GroupCommit(client, flights=1)
    entered, gate = threading.Event(), threading.Event()

    def held(pipe: Pipeline) -> None:
        entered.set()
        gate.wait()
        pipe.set("first", "1")

    outcomes: list[BaseException | None] = [None] * len(fills)

    def writer(index: int, fill: Callable[[Pipeline], object]) -> None:
        try:
            commit.write(fill)
        except Exception as error:
            outcomes[index] = error

    def first_writer() -> None:
        with contextlib.suppress(redis.ConnectionError):  # the unreachable server's test: its writers are the point
            commit.write(held)

    first = threading.Thread(target=first_writer)
    first.start()
    assert entered.wait(timeout=30), "the first write did not take the round trip"
    threads = [threading.Thread(target=writer, args=pair) for pair in enumerate(fills)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(commit._queued) == len(fills), what="every writer to queue behind the first")
    gate.set()
    for thread in [first, *threads]:
        thread.join(timeout=30)
        assert not thread.is_alive()
    return outcomes


def _set(key: str) -> Callable[[Pipeline], object]:
    return lambda pipe: pipe.set(key, "written")


def test_writes_made_during_a_round_trip_go_together_in_the_next(client: redis.Redis) -> None:
    before = _transactions(client)
    outcomes = _together(client, [_set(f"key{index}") for index in range(WRITERS)])
    assert outcomes == [None] * WRITERS
    assert client.mget([f"key{index}" for index in range(WRITERS)]) == ["written"] * WRITERS
    assert _transactions(client) - before == 2  # the first write's, then all the others' in one


def test_a_command_that_fails_fails_its_own_write_only(client: redis.Redis) -> None:
    client.set("text", "not a number")

    def wrong_type(pipe: Pipeline) -> None:
        pipe.set("bad-writer-before", "kept")  # a transaction applies the rest of a write whose command failed
        pipe.incr("text")

    outcomes = _together(client, [_set("key0"), wrong_type, _set("key2")])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], redis.ResponseError) and "not an integer" in str(outcomes[1])
    assert client.mget(["key0", "key2"]) == ["written", "written"]


def test_a_write_refused_before_it_runs_does_not_take_the_others_with_it(client: redis.Redis) -> None:
    """A command refused as queued aborts the whole transaction (EXECABORT): the writes are then sent one by one,
    so the error reaches only the writer whose command it was."""

    def unknown(pipe: Pipeline) -> None:
        pipe.execute_command("NO-SUCH-COMMAND", "x")

    before = _transactions(client)
    outcomes = _together(client, [_set("key0"), unknown, _set("key2")])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], redis.ResponseError) and "no-such-command" in str(outcomes[1]).lower()
    assert client.mget(["key0", "key2"]) == ["written", "written"]
    assert _transactions(client) - before == 1 + 1 + 3  # the first write's; the batch's, aborted; each alone


def test_an_argument_that_cannot_be_sent_fails_its_own_write_only(client: redis.Redis) -> None:
    """redis-py checks a command's arguments as it sends the transaction, after every fill has queued: an argument
    it cannot send (None) fails the whole batch before anything is sent, and the writes then go one by one."""

    def unsendable(pipe: Pipeline) -> None:
        pipe.hset("unsendable", mapping={"field": None})  # type: ignore[dict-item]

    outcomes = _together(client, [_set("key0"), unsendable, _set("key2")])
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], redis.DataError)
    assert client.mget(["key0", "key2"]) == ["written", "written"]
    assert client.exists("unsendable") == 0


def test_a_fill_that_raises_sends_nothing_of_its_own(client: redis.Redis) -> None:
    def broken(pipe: Pipeline) -> None:
        pipe.set("half-written", "1")
        raise ValueError("event of another experiment")

    outcomes = _together(client, [_set("key0"), broken])
    assert outcomes[0] is None
    assert isinstance(outcomes[1], ValueError)
    assert client.get("key0") == "written"
    assert client.exists("half-written") == 0


def test_a_server_out_of_reach_fails_every_write_of_the_round_trip() -> None:
    """Each writer sees the error (and sends its write again: every trial write is safe to repeat)."""
    unreachable = redis.Redis(host="127.0.0.1", port=free_port(), retry=Retry(NoBackoff(), 0))
    outcomes = _together(unreachable, [_set(f"key{index}") for index in range(3)])
    assert all(isinstance(outcome, redis.ConnectionError) for outcome in outcomes), outcomes
