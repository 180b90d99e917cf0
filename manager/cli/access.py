"""Opening an experiment: through a manager's API (`--manager`), on the shared Redis the settings name,
or where an embedded run keeps it.

The CLI's areas read and ask through `ExperimentAccess`, one port with two adapters, so what they print
is the same whichever way the data comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from core.connections import connect
from core.event_store import LogEntry, StoredEvent, stream_position
from core.platform import OutputStream, Platform, TrialAssignment
from core.registry import add_platforms, platform_class
from core.settings import Settings
from core.variables import REDIS_URL_ENV
from manager.experiments import resolve_experiment
from manager.replay import follow_log, read_log
from manager.runner import RunnerError
from manager.stack import experiment_dir, experiments_root, served_data
from manager.training_service import TrainingService
from manager.trial_files import ReadOutput, output_reader
from schemas.trial import MetricRecord, TrialJobDetail

if TYPE_CHECKING:  # httpx and the client load only for --manager
    from manager.api_client import ManagerClient

_LAST_SEQUENCE = 2**64 - 1
T = TypeVar("T")


class ExperimentAccess(Protocol):
    """What the CLI reads of one experiment and asks of it."""

    experiment_id: str

    def config(self) -> dict[str, Any]: ...

    def trials(self) -> list[TrialJobDetail]: ...

    def trial(self, trial_id: str) -> TrialJobDetail: ...

    def metrics(self, trial_id: str) -> list[MetricRecord]: ...

    def cancel(self, trial_id: str) -> TrialJobDetail: ...

    def head(self) -> str:
        """The id of the log's newest entry (0-0 when empty): where following starts."""
        ...

    def log(
        self, since: str = "-", until: str = "+", trial: str | None = None, types: set[str] | None = None
    ) -> Iterator[LogEntry]:
        """Entries from `since` to `until` (both inclusive: ids, or epoch ms), in log order."""
        ...

    def follow(self, after: str, trial: str | None = None, types: set[str] | None = None) -> Iterator[LogEntry]:
        """Entries appended after `after`, as they come, until interrupted."""
        ...

    def output(self, trial: TrialJobDetail, attempt: int, stream: OutputStream, offset: int) -> bytes:
        """What the attempt wrote to `stream` from `offset` on, as it is (empty: nothing more yet)."""
        ...


@contextmanager
def opened(settings: Settings, experiment_id: str | None, *, following: bool = False) -> Iterator[ExperimentAccess]:
    """The experiment (the newest one without an id), from the manager if one is given, else Redis. `following`:
    the command follows it (`events --follow`, `trials logs --follow`), so all it reads of a manager rides out an
    outage as following does."""
    if settings.manager_url is not None:
        yield ManagerExperiment(manager_client(settings), experiment_id, settings.manager_wait_s, following)
        return
    with opened_experiment(settings, experiment_id) as (service, _):
        redis_experiment = RedisExperiment(service, settings)
        try:
            yield redis_experiment
        finally:
            redis_experiment.close()


def manager_client(settings: Settings) -> ManagerClient:
    assert settings.manager_url is not None
    token = settings.manager_token.get_secret_value() if settings.manager_token else None
    from manager.api_client import ManagerClient

    return ManagerClient(settings.manager_url, token)


@contextmanager
def opened_experiment(settings: Settings, experiment_id: str | None) -> Iterator[tuple[TrainingService, str]]:
    """The experiment's TrainingService (the newest experiment without an id), and its id: for the
    commands that work on Redis itself (replay, export)."""
    redis_required(settings)
    url = settings.redis_url
    if url is not None:
        options = settings.redis_options()
        client = connect(url, options=options)
        experiment_id = resolve_experiment(client, experiment_id)
        yield TrainingService(client, connect(url, options=options, decode=False), experiment_id), experiment_id
        return
    with served_data(experiment_dir(experiments_root(settings), experiment_id)) as served_url:
        client = connect(served_url)
        experiment_id = resolve_experiment(client, experiment_id)
        yield TrainingService(client, connect(served_url, decode=False), experiment_id), experiment_id


def redis_required(settings: Settings) -> None:
    """A command that works on the log in Redis itself has no equivalent in the manager's API."""
    if settings.manager_url is not None:
        raise RunnerError("this command works on Redis itself, not through a manager: use --redis URL instead")


def required_url(settings: Settings) -> str:
    """The shared Redis of a service process: they never start an embedded one."""
    if settings.redis_url is None:
        raise RunnerError(f"no Redis given: set {REDIS_URL_ENV} or pass --redis URL")
    return settings.redis_url


class RedisExperiment:
    """The experiment in Redis; trial output is read through the trial's platform, wherever it ran."""

    def __init__(self, service: TrainingService, settings: Settings) -> None:
        self.service = service
        self.experiment_id = service.experiment_id
        self._settings = settings
        self._platform: Platform[Any] | None = None
        self._readers: dict[tuple[str, int], tuple[ReadOutput, TrialAssignment[Any]]] = {}

    def config(self) -> dict[str, Any]:
        return self.service.experiment_view().config

    def trials(self) -> list[TrialJobDetail]:
        return self.service.list_trial_jobs()

    def trial(self, trial_id: str) -> TrialJobDetail:
        return self.service.get_trial_job(trial_id)

    def metrics(self, trial_id: str) -> list[MetricRecord]:
        return self.service.views.metrics(trial_id)

    def cancel(self, trial_id: str) -> TrialJobDetail:
        self.service.cancel_trial_job(trial_id)
        return self.service.get_trial_job(trial_id)

    def head(self) -> str:
        return self.service.store.head()

    def log(
        self, since: str = "-", until: str = "+", trial: str | None = None, types: set[str] | None = None
    ) -> Iterator[LogEntry]:
        return read_log(
            self.service.store.client, self.experiment_id, since=since, until=until, trial=trial, types=types
        )

    def follow(self, after: str, trial: str | None = None, types: set[str] | None = None) -> Iterator[LogEntry]:
        return follow_log(self.service.store.client, self.experiment_id, after, trial=trial, types=types)

    def output(self, trial: TrialJobDetail, attempt: int, stream: OutputStream, offset: int) -> bytes:
        if self._platform is None:
            add_platforms(self._settings.platforms)
            self._platform = platform_class(trial.platform)(self._settings, self.service.store.client)
        key = (trial.id, attempt)
        if key not in self._readers:
            self._readers[key] = output_reader(self._platform, self.service.store.client, trial, attempt)
        read_output, assignment = self._readers[key]
        return bytes(read_output(assignment, trial.url or trial.working_directory, stream, offset))

    def close(self) -> None:
        if self._platform is not None:
            self._platform.close()


class ManagerExperiment:
    """The experiment as a manager's API shows it (the newest one without an id).

    The experiment goes on there whether or not the manager answers this command, so a command that follows it
    asks a manager that does not answer again, for up to `wait_s` seconds: `follow` always, and, when
    `following`, every read too (the experiment, its trial, the log's head and history, a trial's output), which
    are all safe to repeat: `trials logs --follow` asks again from the byte it had printed up to. Other commands
    read once and fail at once."""

    def __init__(self, client: ManagerClient, experiment_id: str | None, wait_s: float, following: bool) -> None:
        from manager.cli.patience import Patience

        self.client = client
        self._following = following
        self._followed: str | None = None  # the last entry `follow` read: where a new follow goes on
        self._printed: tuple[str, OutputStream, int] | None = None  # the trial output `output` was last asked from
        self._patience = Patience(client.url, wait_s, "this command goes on where it left off once it does", self._lost)
        self.experiment_id = self._read(partial(client.resolve, experiment_id))

    def _read(self, request: Callable[[], T]) -> T:
        return self._patience(request) if self._following else request()

    def _lost(self) -> str:
        """How to go on from what this command printed."""
        command = f"trialstream --manager {self.client.url}"
        if self._printed is not None:  # `trials logs --follow`, which has no option to start at a byte
            trial_id, stream, offset = self._printed
            stderr = " --stderr" if stream == "stderr" else ""
            logs = f"{command} trials logs {trial_id} -e {self.experiment_id}{stderr} --follow"
            return (
                f"this command printed trial {trial_id}'s {stream} up to byte {offset}: `{logs}` prints it"
                " again from its start once the manager answers"
            )
        after = self._followed
        if after is None:  # no output asked for, no follow yet (the history is printed once all of it is read)
            return "nothing was printed yet: the same command prints it all once the manager answers"
        milliseconds, sequence = stream_position(after)
        follow = f"{command} events {self.experiment_id} --follow --since {milliseconds}-{sequence + 1}"  # inclusive
        return f"the last event of experiment {self.experiment_id} this command read is {after}: `{follow}` goes on"

    def config(self) -> dict[str, Any]:
        return self.client.experiment(self.experiment_id).config

    def trials(self) -> list[TrialJobDetail]:
        return self.client.trials(self.experiment_id)

    def trial(self, trial_id: str) -> TrialJobDetail:
        return self._read(partial(self.client.trial, self.experiment_id, trial_id))

    def metrics(self, trial_id: str) -> list[MetricRecord]:
        return self.client.metrics(self.experiment_id, trial_id)

    def cancel(self, trial_id: str) -> TrialJobDetail:
        return self.client.cancel(self.experiment_id, trial_id)

    def head(self) -> str:
        return self._read(partial(self.client.head, self.experiment_id))

    def log(
        self, since: str = "-", until: str = "+", trial: str | None = None, types: set[str] | None = None
    ) -> Iterator[LogEntry]:
        last = None if until == "+" else _position(until, end=True)
        after = "0-0" if since == "-" else _just_before(_position(since, end=False))
        while page := self._read(partial(self.client.events, self.experiment_id, after)):  # again from `after`
            for entry in page:
                if last is not None and stream_position(entry.id) > last:
                    return
                if _wanted(entry, trial, types):
                    yield entry
            after = page[-1].id

    def follow(self, after: str, trial: str | None = None, types: set[str] | None = None) -> Iterator[LogEntry]:
        """The stream asked for again after the last entry it gave whenever it ends or breaks (the manager
        stopped, restarted, or the connection dropped), so that no entry is given twice or left out; a manager
        that does not answer is asked again for up to `wait_s` seconds."""
        from manager.api_client import ManagerUnreachable

        self._followed = after
        while True:
            try:
                for entry in self.client.follow(self.experiment_id, self._followed, self._patience.answered):
                    self._followed = entry.id
                    if _wanted(entry, trial, types):
                        yield entry
            except ManagerUnreachable as error:
                self._patience.failed(error)

    def output(self, trial: TrialJobDetail, attempt: int, stream: OutputStream, offset: int) -> bytes:
        """The manager reads the trial's latest started attempt, as `trials logs` follows it. Output is asked
        for from the byte printed up to, so `offset` is also what this command printed."""
        self._printed = (trial.id, stream, offset)
        return self._read(partial(self.client.output, self.experiment_id, trial.id, stream, offset))


def _position(position: str, *, end: bool) -> tuple[int, int]:
    """An XRANGE bound (an id, or epoch ms: its whole millisecond as an end) as (ms, sequence)."""
    if "-" in position:
        return stream_position(position)
    return int(position), _LAST_SEQUENCE if end else 0


def _just_before(position: tuple[int, int]) -> str:
    """The id to page `after` so that `position` is the first entry read."""
    ms, sequence = position
    if sequence > 0:
        return f"{ms}-{sequence - 1}"
    return f"{ms - 1}-{_LAST_SEQUENCE}" if ms > 0 else "0-0"


def _wanted(entry: LogEntry, trial: str | None, types: set[str] | None) -> bool:
    """The filter Redis applies to an entry's `trial` and `type` fields, applied here to what the API sent."""
    if isinstance(entry, StoredEvent):
        entry_trial, entry_type = getattr(entry.event, "trial_id", ""), str(entry.event.type)
    else:
        entry_trial, entry_type = entry.fields.get("trial", ""), entry.fields.get("type", "")
    return (trial is None or entry_trial == trial) and (types is None or entry_type in types)
