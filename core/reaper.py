"""Declaring lost attempts: a lease that expired means its worker stopped (killed, crashed, cut off).

Every worker runs the reaper in the background, and so does the experiment runner, so a lost trial
is noticed within its lease plus a second even when no worker is left. The verdict is one
MULTI/EXEC under a WATCH of the attempt's claim: the TrialAttemptLost event, the retry's job when
maxTrialRetries allows one, and the release of the lease. A renewal or a normal end touches the
claim, so an attempt that is alive after all is never declared lost, and two reapers never both act.

A pause of Redis (frozen, restarted, failed over) is not a worker's death: every reap round records
its Redis server time and server process, and a round that finds the previous one longer ago than
`quiet_gap_s`, or recorded by another server process (a replica promoted by Sentinel), holds reaping
back for `pause_grace_s`, so workers that renew as soon as Redis answers again keep their attempts.
A failover needs the second test: reapers may reach the new master before the workers' renewals,
still waiting on the old one, do.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from redis.client import Pipeline
from rq.job import Job

from core import keys
from core.connections import RETRY_CAP_S
from core.event_store import AppendRefused, EventStore, StoredEvent
from core.leases import LOST, ORPHANED, AttemptRef, worker_of
from core.placement import attempt_platform, listed_platforms, place
from core.queueing import (
    RELEASE_ATTEMPT,
    TrialJob,
    attempt_job_prefix,
    enqueue,
    execute_enqueued,
    load_submission,
    parked_attempts,
    queued_attempts,
)
from core.registry import platform_class
from schemas.events import TrialAttemptLost, TrialCancelRequested, TrialRequeued, TrialSubmitted
from schemas.trial import TrialJobDetail, TrialJobStatus

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 1.0
_BATCH = 100

# KEYS: round, hold. ARGV: the longest quiet gap between rounds (ms), the hold after a longer one (ms).
# The round is "<server time ms> <server run_id>". Returns {now, hold}: reaping is allowed when now >= hold.
_ROUND = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local server = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local last, last_server = string.match(redis.call('GET', KEYS[1]) or '', '^(%d+) ?(%x*)$')
last = tonumber(last)
redis.call('SET', KEYS[1], now .. ' ' .. server)
local hold = tonumber(redis.call('GET', KEYS[2])) or 0
local silent = last and (now - last > tonumber(ARGV[1]) or last_server ~= server)
if silent and now + tonumber(ARGV[2]) > hold then
  hold = now + tonumber(ARGV[2])
  redis.call('SET', KEYS[2], hold)
end
return {now, hold}
"""


def quiet_gap_s(lease_s: float) -> float:
    """Reapers run every REAP_INTERVAL_S; a longer silence between two rounds means Redis (or every
    reaper) could not act: frozen (SIGSTOP, a VM pause, a slow fsync), restarted, or unreachable."""
    return max(lease_s / 2, 2 * REAP_INTERVAL_S)


def pause_grace_s(lease_s: float) -> float:
    """After such a silence, how long nothing is reaped: no worker could renew meanwhile, so each
    gets two lease lengths, plus the client's longest back-off, to renew once Redis answers."""
    return 2 * lease_s + RETRY_CAP_S


def reaping_allowed(client: redis.Redis | Pipeline, lease_s: float) -> bool:
    """Record this reap round (in Redis server time) and say whether reaping is allowed now: not
    within `pause_grace_s` of a silence longer than `quiet_gap_s`, of a failover, nor of a restart."""
    arguments = [int(quiet_gap_s(lease_s) * 1000), int(pause_grace_s(lease_s) * 1000)]
    now, hold = client.eval(_ROUND, 2, keys.REAP_ROUND, keys.REAP_HOLD, *arguments)
    return int(now) >= int(hold)


def reap_lost_attempts(
    client: redis.Redis, rq_connection: redis.Redis, reaper: str, lease_s: float
) -> list[TrialAttemptLost | TrialRequeued]:
    """Declare every attempt whose lease has expired lost (or, where trials outlive their worker, hand
    it to another worker); returns the verdicts this call appended. Every call is a reap round."""
    if not reaping_allowed(client, lease_s):
        return []
    seconds, microseconds = client.time()
    now_ms = seconds * 1000 + microseconds // 1000
    members: Any = client.zrangebyscore(keys.LEASES, "-inf", now_ms, start=0, num=_BATCH)
    if not members or int(client.info("server")["uptime_in_seconds"]) < pause_grace_s(lease_s):
        return []  # Redis restarted without its last round (no persistence): the grace from its start
    verdicts = []
    for member in members:
        try:
            verdict = _declare_lost(client, rq_connection, AttemptRef.parse(member), reaper, lease_s)
        except redis.RedisError:
            raise
        except AppendRefused as refused:  # archived meanwhile: its MULTI ended the lease, its jobs are withdrawn
            log.info("reaper: lease %r ended unjudged: %s", member, refused)
            continue
        except Exception:  # poison: one bad lease must not stop every reaper; the log keeps it
            log.exception("reaper: cannot judge lease %r; dropping it", member)
            client.zrem(keys.LEASES, member)
            continue
        if verdict is not None:
            log.warning(
                "trial %s attempt %d: %s",
                verdict.trial_id,
                verdict.attempt,
                verdict.reason,
                extra={"experiment": verdict.experiment_id, "trial": verdict.trial_id},
            )
            verdicts.append(verdict)
    return verdicts


def unclaimed_attempts(client: redis.Redis, trials: list[TrialJobDetail]) -> list[TrialJobDetail]:
    """WAITING trials whose current attempt is neither claimed by a worker nor in its queue.

    RQ pops a job before the worker can claim it: a worker killed in between takes the job with
    it. Seen twice, some time apart, such a trial's job was lost and must be queued again; a
    needless re-queue is harmless, since only one delivery can claim the attempt.

    The queues are read through `client`, which the runner queues jobs through: its RQ connection, a pool of its
    own, could still read a master a failover deposed, where every job queued since looks lost.
    """
    waiting = [trial for trial in trials if trial.status is TrialJobStatus.WAITING]
    if not waiting:
        return []
    platforms = {trial.platform for trial in waiting}
    present = queued_attempts(client, platforms) | parked_attempts(client, platforms)
    claims: Any = client.mget([keys.trial_claim(t.experiment_id, t.id, t.attempt) for t in waiting])
    return [
        trial
        for trial, claim in zip(waiting, claims, strict=True)
        if claim is None and attempt_job_prefix(trial.experiment_id, trial.id, trial.attempt) not in present
    ]


def _declare_lost(
    client: redis.Redis, rq_connection: redis.Redis, ref: AttemptRef, reaper: str, lease_s: float
) -> TrialAttemptLost | TrialRequeued | None:
    store = EventStore(client, ref.experiment_id)
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(ref.claim_key)
                expiry = pipe.zscore(keys.LEASES, ref.member)
                seconds, microseconds = pipe.time()
                expired = expiry is not None and expiry <= seconds * 1000 + microseconds // 1000
                if not expired or not reaping_allowed(pipe, lease_s):  # a pause since this round began
                    pipe.unwatch()
                    return None  # renewed, ended, or declared by another reaper meanwhile
                holder = worker_of(pipe.get(ref.claim_key))  # type: ignore[arg-type]
                submitted = load_submission(store, ref.trial_id)
                assert isinstance(submitted.event, TrialSubmitted)
                platform = attempt_platform(store, submitted, ref.attempt)
                pipe.multi()
                if platform_class(platform).trials_outlive_worker:
                    verdict: TrialAttemptLost | TrialRequeued
                    verdict, queued = _orphan(pipe, rq_connection, store, platform, ref, holder)
                else:
                    verdict, queued = lose_attempt(pipe, rq_connection, store, submitted, ref, holder, reaper)
                execute_enqueued(pipe, queued)
                return verdict
            except redis.WatchError:
                continue


def lose_attempt(
    pipe: Pipeline,
    rq_connection: redis.Redis,
    store: EventStore,
    submitted: StoredEvent,
    ref: AttemptRef,
    holder: str | None,
    reaper: str,
    reason: str | None = None,
) -> tuple[TrialAttemptLost, list[Job]]:
    """Queue on `pipe` (in MULTI) the end of a lost attempt: TrialAttemptLost, the release of what it
    held (where it ran), its retry when maxTrialRetries allows one (placed anew in a hybrid experiment:
    maybe on another listed platform), and the end of its lease; the verdict and the jobs, for
    `execute_enqueued`."""
    assert isinstance(submitted.event, TrialSubmitted)
    verdict = _verdict(store, submitted, ref, holder, reaper, reason)
    platform = attempt_platform(store, submitted, ref.attempt)
    jobs = [TrialJob(platform, ref.experiment_id, ref.trial_id, ref.attempt, function=RELEASE_ATTEMPT)]
    if verdict.status is TrialJobStatus.WAITING:
        listed = listed_platforms(submitted.event)
        if len(listed) > 1:
            verdict = verdict.model_copy(
                update={"retry_platform": place(store.client, rq_connection, ref.experiment_id, listed)}
            )
        jobs.append(TrialJob(verdict.retry_platform or platform, ref.experiment_id, ref.trial_id, ref.attempt + 1))
    queued = enqueue(pipe, rq_connection, store, verdict, jobs, idempotency_key=ref.ended_key)
    ref.release(pipe, LOST)
    return verdict, queued


def _orphan(
    pipe: Pipeline,
    rq_connection: redis.Redis,
    store: EventStore,
    platform: str,
    ref: AttemptRef,
    holder: str | None,
) -> tuple[TrialRequeued, list[Job]]:
    """The trial runs on without its worker (on a remote host, in a pod): hand the attempt to another
    worker of its platform, which re-attaches to it (or, finding nothing of it, declares it lost)."""
    who = f"worker {holder}" if holder else "its worker"
    record = TrialRequeued(
        experiment_id=ref.experiment_id,
        trial_id=ref.trial_id,
        attempt=ref.attempt,
        reason=f"{who} stopped renewing the lease of attempt {ref.attempt}; another worker takes it up",
    )
    job = TrialJob(platform, ref.experiment_id, ref.trial_id, ref.attempt, reattach=True)
    queued = enqueue(pipe, rq_connection, store, record, [job])
    ref.release(pipe, ORPHANED)
    return record, queued


def _verdict(
    store: EventStore, submitted: StoredEvent, ref: AttemptRef, holder: str | None, reaper: str, reason: str | None
) -> TrialAttemptLost:
    """Retry while maxTrialRetries allows, unless someone asked the trial to stop: then it ends as asked."""
    submission = submitted.event
    assert isinstance(submission, TrialSubmitted)
    _, entries = store.trial_commands(ref.trial_id)
    cancels = [e.event for e in entries if isinstance(e, StoredEvent) and isinstance(e.event, TrialCancelRequested)]
    if cancels:
        status: TrialJobStatus = cancels[0].status
    elif ref.attempt <= submission.launch.max_retries:
        status = TrialJobStatus.WAITING
    else:
        status = TrialJobStatus.FAILED
    who = f"worker {holder}" if holder else "its worker"
    return TrialAttemptLost(
        experiment_id=ref.experiment_id,
        trial_id=ref.trial_id,
        source=reaper,
        attempt=ref.attempt,
        worker=holder,
        reason=reason or f"{who} stopped renewing the lease of attempt {ref.attempt}",
        status=status,
    )
