"""The port every platform adapter implements, and what it is handed.

A platform runs one trial to its end and says how it ended. It reports what happens through a
`TrialControl`, which turns each report into an event; it never touches the log itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, Literal, NamedTuple, Protocol, TypeVar

import redis

from core.settings import Settings
from schemas.config import ExperimentConfig, PlatformConfig
from schemas.events import TrialLaunchSpec
from schemas.trial import JobApplicationForm, TrialJobStatus


class ParsedMetric(NamedTuple):
    """A metric record read from a trial (workers.platforms.shared.metrics checks its fields' types and values). A
    tuple: a worker makes thousands a second, and schemas.compact.compact_metrics encodes them as they come."""

    parameter_id: str
    metric_type: str
    sequence: int
    data: str  # NNI's `data`: the JSON encoding of the (already JSON-encoded) value string


ConfigT = TypeVar("ConfigT", bound=PlatformConfig)
"""A platform's own config model: what its methods are given, so none of them checks the type it got."""


@dataclass(frozen=True)
class TrialAssignment(Generic[ConfigT]):
    experiment_id: str
    trial_id: str
    form: JobApplicationForm
    launch: TrialLaunchSpec
    working_directory: str
    platform_config: ConfigT  # validated with the platform's config_model
    attempt: int = 1  # > 1 when the trial is retried after its worker was lost


@dataclass(frozen=True)
class StopRequest:
    """Why a running trial must stop, and the status it then ends in."""

    status: TrialJobStatus
    reason: str
    lease_lost: bool = False  # the attempt may be another worker's now: its trial is this worker's no more


@dataclass(frozen=True)
class TrialOutcome:
    status: TrialJobStatus
    exit_code: int | None = None
    message: str | None = None


@dataclass(frozen=True)
class Deferred:
    """The trial cannot start yet (its resources are busy): try again later, it stays WAITING."""

    reason: str


@dataclass(frozen=True)
class Lost:
    """The attempt can no longer be followed where it ran (its host stayed unreachable): it is lost,
    as if its worker had died, so it is retried (elsewhere) when maxTrialRetries allows, else FAILED."""

    reason: str


@dataclass(frozen=True)
class Abandoned:
    """The worker lost its lease on the attempt (StopRequest.lease_lost) while the trial runs on where
    it runs: another worker re-attaches to it. Nothing is recorded and nothing is stopped."""

    reason: str


OutputStream = Literal["stdout", "stderr"]


class OutputUnavailable(LookupError):
    """A trial's output cannot be read (never written, removed, or its host unreachable); says why."""


class TrialControl(Protocol):
    def started(self, working_directory: str, url: str | None = None, gpu_indices: list[int] | None = None) -> None:
        """The trial is running."""

    def metrics(self, metrics: Sequence[ParsedMetric], offsets: Mapping[str, int] | None = None) -> None:
        """The trial reported these metrics (all those read at once: they are stored in one round trip).
        `offsets`: how far the platform has read the trial's output files, committed with the metrics
        (see `offsets()`); given without metrics, they are committed alone."""

    def offsets(self) -> dict[str, int]:
        """The read offsets last committed for this attempt: where a re-attached follower resumes
        reading, so that no metric is lost or read twice."""

    def unreachable(self, reason: str | None) -> None:
        """Where the trial runs cannot be reached (it is UNKNOWN, with `reason`); None: reachable again."""

    def rejected(self, reason: str) -> None:
        """The trial wrote a metric record that could not be read."""

    def waiting(self, reason: str) -> None:
        """The trial is launched but cannot start yet (a pod the cluster cannot place): told in its
        `message` while it is WAITING. Called when the reason changes, not on every check."""

    def stop_request(self) -> StopRequest | None:
        """A cancel from the log, or the trial's maxTrialDuration passed."""

    def new_forms(self) -> list[JobApplicationForm]:
        """Parameter sets sent by update_trial_job and not handed out yet (multi-phase)."""

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking early when a stop or a new form arrives, or on wake()."""

    def wake(self) -> None:
        """End a wait() early (from another thread): the platform has news of its own, e.g. its trial exited."""


class Platform(Protocol[ConfigT]):
    """A platform adapter: in its folder under `workers/platforms/`, found by name (core.registry).

    One instance per worker process, made with that process's settings: long-lived clients (an SSH
    connection, a Kubernetes API client) belong to it. Its methods may be called from several
    threads at once when `trials_per_process` > 1. The manager makes one too, to read a trial's output,
    so making one starts nothing that only running trials need (`warm_up` does).
    """

    name: ClassVar[str]
    config_model: ClassVar[type[PlatformConfig]]
    trials_per_process: ClassVar[int]
    """How many trials one worker process may supervise at once: 1 where a trial runs on the worker
    itself (local), many where it runs elsewhere and the worker only follows it (remote, Kubernetes)."""
    trials_outlive_worker: ClassVar[bool]
    """Whether a trial keeps running when its worker dies (on a remote host, in a pod): its attempt is
    then re-attached by another worker, not declared lost."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None: ...

    @classmethod
    def check(cls, config: ConfigT, code_directory: Path, settings: Settings) -> list[str]:
        """Before an experiment starts: can its trials run there (hosts reachable, credentials right,
        code directory within what can be shipped)? One line per problem, naming what and why."""
        ...

    @classmethod
    def config_problems(cls, config: ConfigT, experiment: ExperimentConfig, settings: Settings) -> dict[str, str]:
        """Before an experiment starts: what its config asks that the platform can never give where its trials
        would run (local: more GPUs than any machine has). Key path (`trialGpuNumber`,
        `trainingService.gpuIndices`) -> why and the fix; refused as a bad config. Optional."""
        ...

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: ConfigT) -> None:
        """Make the experiment's code available where its trials run. Called before every trial (and
        before every re-attachment): cheap when the code is staged already."""

    def run_trial(
        self, trial: TrialAssignment[ConfigT], control: TrialControl
    ) -> TrialOutcome | Deferred | Lost | Abandoned:
        """Run the trial to its end (blocking); a stop request must end it promptly."""
        ...

    def reattach(
        self, trial: TrialAssignment[ConfigT], control: TrialControl
    ) -> TrialOutcome | Lost | Abandoned | None:
        """Follow to its end an attempt that a worker, since lost, launched; None when nothing of it
        runs any more (its worker took it along: the attempt is lost)."""
        ...

    def read_output(self, trial: TrialAssignment[ConfigT], url: str, stream: OutputStream, offset: int) -> bytes:
        """What the trial wrote to `stream` from byte `offset` on (b"" when nothing more, so far), wherever
        it ran; `url` is where its latest attempt ran (TrialStarted.url). Raises OutputUnavailable."""
        ...

    def clean_up(self, experiment_id: str, config: ConfigT) -> None:
        """The experiment ended: remove what its trials left where they ran (unless the config keeps it)."""

    def release(self, trial: TrialAssignment[ConfigT]) -> None:
        """Free what a lost attempt still holds (GPUs, a process on a host, a pod). Runs as a job of
        this platform's queue, so on a worker that has the platform's settings and clients."""

    def warm_up(self) -> None:
        """The worker is about to take jobs: start ahead what its first trial would otherwise wait for (local:
        the keepers' zygote). Optional."""

    def keep_alive(self) -> None:
        """Every housekeeping round of the worker (about a second apart): renew what says its machine still serves
        (local: the record of its GPUs that an experiment's check counts, when due). Optional; cheap when not due."""

    def close(self) -> None:
        """The worker stops: close what __init__ opened."""
