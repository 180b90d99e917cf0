"""The RQ job that runs one trial: the only entry point workers execute (queued by core.queueing)."""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.client import Pipeline

from core import keys
from core.assignments import assignment_of, experiment_secrets, load_assignment, platform_section
from core.connections import until_redis_answers
from core.event_store import CommandsIndex, EventStore, LogEntry, StoredEvent
from core.leases import AttemptRef, Lease
from core.placement import attempt_platform
from core.platform import Abandoned, Deferred, Lost, Platform, TrialAssignment, TrialOutcome
from core.queueing import TrialJob, checked_submission, execute_enqueued, park, submission_key, wake_parked, worker_name
from core.reaper import lose_attempt
from core.settings import Settings
from schemas.config import PlatformConfig
from schemas.events import (
    PLATFORM_CONFIG,
    ClusterMetadataSet,
    ExperimentFinished,
    ExperimentResumed,
    TrialDeferred,
    TrialEnded,
    TrialLaunchSpec,
    TrialReattached,
    TrialSubmitted,
)
from schemas.trial import ExperimentView, TrialJobStatus
from workers.runtime.control import LogTrialControl

log = logging.getLogger(__name__)


@dataclass
class WorkerRuntime:
    """What a worker process holds for the jobs it runs: its settings, one client, one platform
    instance (made once: its long-lived clients serve every trial), and the experiments staged."""

    settings: Settings
    client: redis.Redis
    rq_connection: redis.Redis
    platform: Platform[Any]
    name: str = field(default_factory=worker_name)
    _staged: set[str] = field(default_factory=set)
    _staging: threading.Lock = field(default_factory=threading.Lock)

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: PlatformConfig) -> None:
        with self._staging:  # once per experiment and process, even with several trials starting at once
            if experiment_id not in self._staged:
                self.platform.stage(experiment_id, launch, config)
                self._staged.add(experiment_id)


_runtime: WorkerRuntime | None = None


def install(runtime: WorkerRuntime | None) -> None:
    """Make `runtime` the one this process's jobs use (`trialstream worker` does, before serving)."""
    global _runtime
    _runtime = runtime


def current_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise RuntimeError("trialstream jobs run inside `trialstream worker`, which installs their runtime")
    return _runtime


_prepared = threading.local()  # what `hand_over` left for the job this thread runs


def hand_over(preparation: Pipeline) -> None:
    """RQ's records of the job this thread is about to run, queued by the worker on a transaction of the runtime's
    client and not sent: the trial's pick-up sends its own commands in it. One round trip in a row fewer on the way
    from a dequeue to the start, and under `appendfsync always` one fsync fewer."""
    _prepared.pipeline = preparation


def taken_preparation() -> Pipeline | None:
    """What `hand_over` left and nothing has sent yet, taken: by the pick-up, or by the worker for a job that
    ended before its pick-up (it raised first)."""
    preparation: Pipeline | None = getattr(_prepared, "pipeline", None)
    _prepared.pipeline = None
    return preparation


def run_trial(
    experiment_id: str,
    trial_id: str,
    attempt: int = 1,
    deferrals: int = 0,
    last_deferral: str = "",
    reattach: bool = False,
) -> str:
    """Run one attempt of a trial on this worker's platform and append how it ended; with `reattach`,
    follow an attempt that a lost worker launched and whose trial ran on."""
    runtime = current_runtime()
    store = EventStore(runtime.client, experiment_id)
    ref = AttemptRef(experiment_id, trial_id, attempt)
    lease = Lease(runtime.client, ref, runtime.name, runtime.settings.trial_lease_s)
    picked = _pick_up(runtime, store, lease, reattach)
    if not picked.claimed:
        return "already claimed by another delivery"
    try:
        submitted = checked_submission(picked.submitted, experiment_id, trial_id)
    except LookupError as missing:
        # An orphan: its submission was refused (a superseded runner's, an archived experiment's) in the MULTI that
        # queued it (core.queueing.execute_enqueued), or reached a master lost before replicating it (the runner
        # sends it again, with a job of its own). Nothing to run, nothing to record.
        lease.give_up(lambda pipe: None)
        log.warning("%s: its job is dropped", missing, extra={"experiment": experiment_id, "trial": trial_id})
        return f"dropped: {missing}"
    submission = submitted.event
    assert isinstance(submission, TrialSubmitted)
    placed = attempt_platform(store, submitted, attempt)  # a hybrid experiment places each attempt anew
    if placed != runtime.platform.name:
        lease.give_up(lambda pipe: None)
        raise RuntimeError(f"trial {trial_id} attempt {attempt} is for platform {placed}, not {runtime.platform.name}")

    control = LogTrialControl(store, submitted, lease, picked.commands)
    try:
        stop = control.stop_request()
        if stop is not None and not reattach:  # ends it even if the cancel came while an earlier attempt ran
            control.close()
            _end_attempt(runtime, store, lease, _ended(lease, stop.status, None, stop.reason), control)
            return "canceled before it started"
        assignment = assignment_of(runtime.platform, submitted, attempt, picked.secrets)
        try:
            runtime.stage(experiment_id, submission.launch, assignment.platform_config)
            if reattach:
                found = _reattach(runtime, store, submitted, lease, assignment, control)
                if found is None:
                    return "nothing left to re-attach to: declared lost"
                outcome: TrialOutcome | Deferred | Lost | Abandoned = found
            else:
                outcome = runtime.platform.run_trial(assignment, control)
        except Exception as error:
            log.exception(
                "trial %s: platform %s failed",
                trial_id,
                submission.platform,
                extra={"experiment": experiment_id, "trial": trial_id},
            )
            control.close()
            failed = _ended(lease, TrialJobStatus.FAILED, None, f"internal error: {error}")
            _end_attempt(runtime, store, lease, failed, control)
            raise
        if isinstance(outcome, Deferred):
            control.close()
            return _park(runtime, store, lease, outcome, deferrals, last_deferral)
        if isinstance(outcome, Lost):
            control.close()
            _lose(runtime, store, submitted, lease, outcome.reason)
            return f"lost: {outcome.reason}"
        if isinstance(outcome, Abandoned):  # the attempt is not this worker's any more: nothing to record
            control.close()
            return f"abandoned: {outcome.reason}"
        control.close()  # no lease renewal may race the end of the attempt
        _end_attempt(runtime, store, lease, _ended(lease, outcome.status, outcome.exit_code, outcome.message), control)
        return str(outcome.status)
    finally:
        control.close()


@dataclass(frozen=True)
class _PickUp:
    claimed: bool
    submitted: LogEntry | None  # the entry under the trial's submission key
    commands: CommandsIndex  # the trial's commands stream so far
    secrets: dict[str, str]  # the platform's, for its config


def _pick_up(runtime: WorkerRuntime, store: EventStore, lease: Lease, take_over: bool) -> _PickUp:
    """Claim the attempt and read what its start needs, in one round trip: its submission, the commands sent to it
    so far (a cancel that came before the worker did) and the platform's secrets. They were four round trips in a
    row on the way from a freed slot to the next start, each waiting for Redis's fsync of whatever was written then.

    Through the lease's own client, as its later writes (a give-up, the end) go: the claim, a write, puts that
    client's connection on the master of the moment, where a connection of another client could still read a
    master demoted by a failover (tests/faults/test_failover.py: a give-up read no claim there, and the claim it
    left behind kept the trial from running). With replicas, the answers count once the claim's WAIT has returned
    (core.replication: after the pipeline): the replicas then hold what the master held at the claim.

    The worker's records of the job (`hand_over`) go first, in one MULTI with them: RQ's records and the claim land
    together."""
    ref, client = lease.ref, runtime.client
    commands_key = keys.trial_commands(ref.experiment_id, ref.trial_id)
    prepared = taken_preparation()
    try:
        with prepared if prepared is not None else client.pipeline(transaction=False) as pipe:
            lease.acquire_on(pipe, take_over)
            store.keyed_read(submission_key(ref.trial_id), pipe)
            pipe.xrange(commands_key)
            pipe.hgetall(keys.secrets(ref.experiment_id, runtime.platform.name))
            *_, claimed, submission, commands, secrets = pipe.execute()
    except UnicodeDecodeError:  # a submission that is not UTF-8 (a log imported from elsewhere): read as bytes
        claimed = lease.acquire(take_over)  # the claim first, as above: made already, the same delivery's own again
        index: Any = client.xrange(commands_key)
        secrets = experiment_secrets(client, ref.experiment_id, [runtime.platform.name])
        return _PickUp(claimed, store.read_keyed(submission_key(ref.trial_id)), index, secrets)
    return _PickUp(bool(claimed), store.keyed_entry(submission), commands, secrets)


def release_attempt(experiment_id: str, trial_id: str, attempt: int) -> str:
    """Free what a lost attempt still holds on this platform, then wake the trials waiting for it."""
    runtime = current_runtime()
    runtime.platform.release(load_assignment(runtime.client, runtime.platform, experiment_id, trial_id, attempt))
    wake_parked(runtime.client, runtime.rq_connection, runtime.platform.name, "an attempt was released", False)
    return "released"


def clean_up_experiment(experiment_id: str) -> str:
    """The experiment ended: its platform removes what its trials left where they ran."""
    runtime = current_runtime()
    clean_up = getattr(runtime.platform, "clean_up", None)  # optional for third-party platforms
    if clean_up is None:
        return f"platform {runtime.platform.name} leaves nothing to clean up"
    running, training_service = _ended_experiment(EventStore(runtime.client, experiment_id))
    if running:
        return "the experiment has not finished (or was resumed since): nothing to clean up"
    if training_service is None:
        return "no platform config in the log: nothing to clean up"
    secrets = experiment_secrets(runtime.client, experiment_id, [runtime.platform.name])
    section = platform_section(json.loads(training_service), runtime.platform.name, secrets)  # hybrid: its own
    clean_up(experiment_id, runtime.platform.config_model.model_validate(section))
    return "cleaned up"


_ENDED_KINDS = frozenset({"ClusterMetadataSet", "ExperimentFinished", "ExperimentResumed"})


def _ended_experiment(store: EventStore) -> tuple[bool, str | None]:
    """(running: never finished, or resumed since it last finished; its masked platform config) as of the log's
    end: from the experiment's view and the entries past the view's position (one read of the view and, usually,
    an empty one of the log), or from the whole log where no view is kept. The log of a long experiment is ~100
    entries a trial, and a clean-up needs two facts of it. A clean-up job whose ExperimentFinished was refused
    (core.queueing.execute_enqueued) finds the experiment running."""
    view_keys = keys.ViewKeys(store.experiment_id)
    with store.client.pipeline(transaction=True) as pipe:  # the view and its position agree
        pipe.hget(view_keys.position, "position")
        pipe.hget(view_keys.experiment, "view")
        position, raw = pipe.execute()
    view = ExperimentView.model_validate_json(raw) if position and raw else None
    running = view is None or view.status == "RUNNING"
    training_service = view.metadata.get(PLATFORM_CONFIG) if view is not None else None
    past = store.read(after=position if view is not None else "0-0", where=lambda f: f.get("type") in _ENDED_KINDS)
    for entry in past:
        match entry.event if isinstance(entry, StoredEvent) else None:
            case ExperimentFinished() | ExperimentResumed() as event:
                running = isinstance(event, ExperimentResumed)
            case ClusterMetadataSet(key=key, value=value) if key == PLATFORM_CONFIG:
                training_service = value
    return running, training_service


def _reattach(
    runtime: WorkerRuntime,
    store: EventStore,
    submitted: StoredEvent,
    lease: Lease,
    assignment: TrialAssignment[Any],
    control: LogTrialControl,
) -> TrialOutcome | Lost | Abandoned | None:
    """Take the attempt up where its lost worker left it; if nothing of it runs any more, it is lost."""
    ref = lease.ref
    record = TrialReattached(
        experiment_id=ref.experiment_id, trial_id=ref.trial_id, attempt=ref.attempt, source=runtime.name
    )
    store.append(record, idempotency_key=f"reattached:{ref.trial_id}:{ref.attempt}:{runtime.name}")
    outcome = runtime.platform.reattach(assignment, control)
    if outcome is not None:
        return outcome
    control.close()
    _lose(
        runtime,
        store,
        submitted,
        lease,
        f"attempt {ref.attempt} was not running any more when worker {runtime.name} took it up",
    )
    return None


def _lose(runtime: WorkerRuntime, store: EventStore, submitted: StoredEvent, lease: Lease, reason: str) -> None:
    """Declare the attempt lost (retried when maxTrialRetries allows, else FAILED) and end its lease."""
    ref = lease.ref

    def commit() -> None:
        with store.client.pipeline(transaction=True) as pipe:
            pipe.multi()
            _, queued = lose_attempt(
                pipe, runtime.rq_connection, store, submitted, ref, lease.worker, runtime.name, reason
            )
            pipe.delete(keys.read_offsets(ref.experiment_id, ref.trial_id, ref.attempt))
            execute_enqueued(pipe, queued)

    until_redis_answers(commit, f"trial {ref.trial_id}")  # safe to repeat: keyed append, absolute writes


def _park(
    runtime: WorkerRuntime, store: EventStore, lease: Lease, deferred: Deferred, deferrals: int, last_deferral: str
) -> str:
    """Give the attempt up until what it waits for may be free (core.queueing.park); TrialDeferred
    records it when the reason is new, so a long wait writes one event, not one per re-check."""
    ref = lease.ref
    job = TrialJob(
        runtime.platform.name,
        ref.experiment_id,
        ref.trial_id,
        ref.attempt,
        deferrals=deferrals + 1,
        last_deferral=deferred.reason,
    )

    def then(pipe: Pipeline) -> None:
        if deferred.reason != last_deferral:
            event = TrialDeferred(experiment_id=ref.experiment_id, trial_id=ref.trial_id, reason=deferred.reason)
            store.append(event, pipeline=pipe)
        seconds, microseconds = runtime.client.time()
        park(pipe, job, seconds * 1000 + microseconds // 1000)

    parked = lease.give_up(then)
    return f"deferred: {deferred.reason}" if parked else "deferred, then declared lost meanwhile"


def _end_attempt(
    runtime: WorkerRuntime, store: EventStore, lease: Lease, ended: TrialEnded, control: LogTrialControl
) -> None:
    """Append how the attempt ended and release its lease, atomically: a reaper never sees one without the other.
    Its metrics' idempotency keys go with it: they only served retried appends of the running attempt.
    Then trials parked on this platform may start: what this one held is free. Whether any is parked is asked in the
    same transaction: most ends have none to wake, and no round trip of their own to pay for it.

    If the attempt was already declared lost, the shared idempotency key keeps that verdict.
    """
    name = runtime.platform.name

    def commit() -> int:
        with store.client.pipeline(transaction=True) as pipe:
            pipe.multi()
            store.append(ended, idempotency_key=lease.ref.ended_key, pipeline=pipe)
            lease.end(pipe)
            if control.metric_keys:
                pipe.hdel(keys.idempotency(store.experiment_id), *control.metric_keys)
            pipe.delete(control.offsets_key)
            pipe.exists(keys.parked(name))
            return int(pipe.execute()[-1])

    parked = until_redis_answers(commit, f"trial {lease.ref.trial_id}")  # safe to repeat: keyed append, absolute writes
    if parked:
        until_redis_answers(
            lambda: wake_parked(runtime.client, runtime.rq_connection, name, "a trial ended", False), "parked trials"
        )


def _ended(lease: Lease, status: TrialJobStatus, exit_code: int | None, message: str | None) -> TrialEnded:
    return TrialEnded(
        experiment_id=lease.ref.experiment_id,
        trial_id=lease.ref.trial_id,
        attempt=lease.ref.attempt,
        source=lease.worker,
        status=status,
        exit_code=exit_code,
        message=message,
    )
