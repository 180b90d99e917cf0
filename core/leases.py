"""Leases on running trial attempts: how a lost worker is noticed in seconds, not in RQ's minutes.

A delivery of an attempt's job claims the attempt (so a duplicate delivery does nothing, even one that
the same worker process runs in another slot) and holds a lease on it, renewed while the trial runs.
Leases expire by Redis server time, so workers' clocks never matter. A lease that expired means the
worker stopped: `core.reaper` declares the attempt lost.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from core import keys
from core.replication import acknowledge_after

CLAIM_TTL_S = 7 * 24 * 3600
ENDED = "ended"
LOST = "lost"
ORPHANED = "orphaned"  # its worker was lost, its trial runs on: another worker may take the attempt up

# KEYS: claim, leases. ARGV: holder, claim ttl (s), lease member, lease length (ms), take over ('' or a claim)
# Acquiring again as the same holder (one delivery) succeeds: a client that resends the script after a lost
# reply must not lock itself out of its own attempt. A claim equal to ARGV[5] (an orphaned attempt) is taken over.
_ACQUIRE = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] and (ARGV[5] == '' or held ~= ARGV[5]) then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
local now = redis.call('TIME')
redis.call('ZADD', KEYS[2], now[1] * 1000 + math.floor(now[2] / 1000) + tonumber(ARGV[4]), ARGV[3])
return 1
"""
# With replicas, a claim returns once they have it: a claim lost in a failover would let a second
# delivery of the attempt claim it too and run the trial again (tests/faults/test_failover.py saw it).
acknowledge_after(_ACQUIRE)

# Touching the claim makes a reaper that WATCHes it back off: a renewed lease is never reaped. Its
# TTL starts again too, so a trial may run for longer than the claim's TTL. Many attempts' renewals in one call
# (a worker's): KEYS: leases, then each attempt's claim. ARGV: claim ttl (s), then per attempt: holder, lease
# member, lease length (ms). Returns 1 or 0 for each.
_RENEW_ALL = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
local renewed = {}
for i = 2, #KEYS do
  local at = 3 * i - 4
  if redis.call('GET', KEYS[i]) == ARGV[at] then
    redis.call('SET', KEYS[i], ARGV[at], 'EX', ARGV[1])
    redis.call('ZADD', KEYS[1], 'XX', ms + tonumber(ARGV[at + 2]), ARGV[at + 1])
    renewed[#renewed + 1] = 1
  else
    renewed[#renewed + 1] = 0
  end
end
return renewed
"""
RENEW_BATCH = 500  # renewals per script call: Redis serves nobody else while a script runs


@dataclass(frozen=True)
class AttemptRef:
    experiment_id: str
    trial_id: str
    attempt: int

    @property
    def member(self) -> str:
        return f"{self.experiment_id}/{self.trial_id}/{self.attempt}"

    @classmethod
    def parse(cls, member: str) -> AttemptRef:
        experiment_id, trial_id, attempt = member.rsplit("/", 2)
        return cls(experiment_id, trial_id, int(attempt))

    @property
    def claim_key(self) -> str:
        return keys.trial_claim(self.experiment_id, self.trial_id, self.attempt)

    @property
    def ended_key(self) -> str:
        """Idempotency key of the event that ends the attempt: TrialEnded or TrialAttemptLost, only one."""
        return f"ended:{self.trial_id}:{self.attempt}"

    def release(self, pipeline: Pipeline, claim: str) -> None:
        """Queue on `pipeline` the end of the attempt's lease, leaving its claim as `claim` (ENDED, LOST,
        ORPHANED), to commit with the event that says why."""
        pipeline.set(self.claim_key, claim, keepttl=True)
        pipeline.zrem(keys.LEASES, self.member)


def worker_of(claim: str | None) -> str | None:
    """The worker named by an attempt's claim (`Lease.holder`), None when no worker holds it."""
    return None if claim is None or claim in (ENDED, LOST, ORPHANED) else claim.split(" ", 1)[0]


class Lease:
    """One delivery's hold on one attempt, for the worker that runs it."""

    def __init__(
        self, client: redis.Redis, ref: AttemptRef, worker: str, seconds: float, delivery: str | None = None
    ) -> None:
        self.client = client
        self.ref = ref
        self.worker = worker
        self.seconds = seconds
        self.delivery = delivery or secrets.token_hex(4)
        self._acquire = client.register_script(_ACQUIRE)

    @property
    def holder(self) -> str:
        """The claim's value: the worker and this delivery. Two deliveries of one attempt in one worker
        process (a requeued job in its other slot) are two holders: only one runs the trial."""
        return f"{self.worker} {self.delivery}"

    def on(self, client: redis.Redis) -> Lease:
        """The same hold, used through another client."""
        return Lease(client, self.ref, self.worker, self.seconds, self.delivery)

    @property
    def _args(self) -> list[str | int]:
        return [self.holder, CLAIM_TTL_S, self.ref.member, int(self.seconds * 1000)]

    def acquire(self, take_over: bool = False) -> bool:
        """Claim the attempt and start the lease; False if another delivery already claimed it. With
        `take_over`, an orphaned attempt (its worker lost, its trial running on) is claimed too."""
        return bool(self.acquire_on(self.client, take_over))

    def acquire_on(self, client: redis.Redis | Pipeline, take_over: bool = False) -> Any:
        """`acquire`'s claim, sent through `client` (of the same server) or queued on a pipeline with other commands:
        its reply is 1 if claimed, else 0."""
        args = [*self._args, ORPHANED if take_over else ""]
        return self._acquire(keys=[self.ref.claim_key, keys.LEASES], args=args, client=client)

    def renew(self) -> bool:
        """Extend the lease; False once the attempt has been declared lost (or has ended)."""
        return renew_all(self.client, [self])[0]

    def end(self, pipeline: Pipeline) -> None:
        """Queue the end of the attempt on `pipeline`, to commit with the event that ends it."""
        self.ref.release(pipeline, ENDED)

    def give_up(self, then: Callable[[Pipeline], None]) -> bool:
        """Let the attempt be claimed again (it was deferred before starting), and queue `then` in the
        same transaction; False, doing nothing, if the attempt is no longer this worker's (declared lost)."""
        with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.ref.claim_key)
                    if pipe.get(self.ref.claim_key) != self.holder:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.delete(self.ref.claim_key)
                    pipe.zrem(keys.LEASES, self.ref.member)
                    then(pipe)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue


def renew_all(client: redis.Redis, leases: Sequence[Lease]) -> list[bool]:
    """Extend many leases (one worker's), through `client`, in one round trip per RENEW_BATCH of them: for
    each, False once its attempt has been declared lost (or has ended), as `Lease.renew` says."""
    script = client.register_script(_RENEW_ALL)
    renewed: list[bool] = []
    for start in range(0, len(leases), RENEW_BATCH):
        batch = leases[start : start + RENEW_BATCH]
        args: list[str | int] = [CLAIM_TTL_S]
        for lease in batch:
            args += [lease.holder, lease.ref.member, int(lease.seconds * 1000)]
        answers = script(keys=[keys.LEASES, *(lease.ref.claim_key for lease in batch)], args=args)
        renewed += [bool(answer) for answer in answers]
    return renewed
