"""Every Redis key trialstream uses, in one place.

The event log lives under the `ts` prefix and is never rebuilt. Views live under a namespace
(`ts` too by default) so that a rebuild can target a scratch namespace and be compared.
"""

from __future__ import annotations

from dataclasses import dataclass

LOG_PREFIX = "ts"
EXPERIMENTS = f"{LOG_PREFIX}:experiments"  # zset: experiment id -> creation time (ms)
PROJECTOR_HEARTBEAT = f"{LOG_PREFIX}:projector:heartbeat"
ACTIVITY = f"{LOG_PREFIX}:log-activity"  # zset: experiment id -> clock tick of its latest append
ACTIVITY_CLOCK = f"{LOG_PREFIX}:log-activity:clock"  # counter ticked once per appending script call
LEASES = f"{LOG_PREFIX}:leases"  # zset: `<exp>/<trial>/<attempt>` -> lease expiry (Redis server time, ms)
REAP_ROUND = f"{LOG_PREFIX}:reaper:round"  # "<server time ms> <run_id>" of the last reap round
MANAGER_HOSTED = f"{LOG_PREFIX}:manager:hosted"  # set: experiments a `trialstream manager` runs, resumed at its start
REAP_HOLD = f"{LOG_PREFIX}:reaper:hold"  # no reaping before this server time (ms): after a pause or restart
REPLICATION_TIMEOUTS = f"{LOG_PREFIX}:replication:timeouts"  # counter: appends that too few replicas confirmed in time
ARCHIVED = f"{LOG_PREFIX}:archived"  # hash: experiment id -> where its archive is (manager.archive.ArchiveRecord), JSON


def events(experiment_id: str) -> str:
    """The experiment's stream: its total order is the replay order."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:events"


def idempotency(experiment_id: str) -> str:
    """Hash: idempotency key -> id of the event stored under it."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:idem"


def trial_commands(experiment_id: str, trial_id: str) -> str:
    """Stream of the log ids of the commands to one trial (cancels, new parameter sets), written with
    them: its worker follows these instead of reading every event of the experiment."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:commands:{trial_id}"


def commands_wake(reader: str) -> str:
    """Stream one worker process's commands reader follows beside its trials' commands streams: an entry
    added when a trial starts wakes the reader's blocked XREAD, so that it follows the new trial at once."""
    return f"{LOG_PREFIX}:wake:{reader}"


def trial_claim(experiment_id: str, trial_id: str, attempt: int) -> str:
    """The worker holding an attempt (then `ended` or `lost`): a duplicate delivery of its job does nothing."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:claim:{trial_id}:{attempt}"


def secrets(experiment_id: str, platform: str) -> str:
    """Hash: dotted config path -> secret value (an SSH password) of one platform's section: kept out of
    the log, which holds the config masked, and read by that platform's workers alone (one key per
    platform, so that an ACL key pattern gives each platform's worker user its own: core.acl)."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:secrets:{platform}"


def legacy_secrets(experiment_id: str) -> str:
    """Hash: every secret of an experiment created before they were kept per platform (moved by `resume`)."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:secrets"


def read_offsets(experiment_id: str, trial_id: str, attempt: int) -> str:
    """Hash: output file -> how far the attempt's follower has read it, written with the metrics read."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:offsets:{trial_id}:{attempt}"


def runner(experiment_id: str) -> str:
    """The runner driving the experiment, with a short TTL it keeps renewing: one runner at a time."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:runner"


def runner_epoch(experiment_id: str) -> str:
    """Counted up each time a runner claims the experiment: a runner whose claim lapsed takes it back
    only if nobody claimed it since, and its appends are refused once another claimed it (the fence they carry,
    read by the append script: core.event_store.Fence)."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:runner-epoch"


def thawed(experiment_id: str) -> str:
    """Set of the keys an archived experiment's read-through copy restored, expiring with them."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:thawed"


def staging(experiment_id: str, token: str) -> str:
    """Prefix of the keys a restore writes before it renames them into place at once; they expire if it dies."""
    return f"{LOG_PREFIX}:staging:{experiment_id}:{token}{':' if token else ''}"


def placement_turn(experiment_id: str) -> str:
    """Counter: placements made in a hybrid experiment; whose turn it is among its platforms with room."""
    return f"{LOG_PREFIX}:exp:{experiment_id}:placement-turn"


def parked(platform: str) -> str:
    """Zset: attempts of `platform` that could not start yet (JSON member) -> when to check again (ms)."""
    return f"{LOG_PREFIX}:parked:{platform}"


@dataclass(frozen=True)
class ViewKeys:
    """Keys of the disposable views of one experiment in one namespace."""

    experiment_id: str
    namespace: str = LOG_PREFIX

    @property
    def _base(self) -> str:
        return f"{self.namespace}:view:{self.experiment_id}"

    @property
    def position(self) -> str:
        """Hash {position, applied}: how far the projection has read, written with the views."""
        return f"{self._base}:position"

    @property
    def trials(self) -> str:
        """Hash: trial id -> TrialJobDetail JSON."""
        return f"{self._base}:trials"

    @property
    def experiment(self) -> str:
        """Hash: status, config, times and cluster metadata of the experiment."""
        return f"{self._base}:experiment"

    @property
    def metric_keys(self) -> str:
        """Set of `trial|attempt|parameter|type|sequence` projected outside their stream's range (metric_marks)."""
        return f"{self._base}:metric-keys"

    @property
    def metric_marks(self) -> str:
        """Hash: `trial|attempt|parameter|type` -> "low high", the sequences [low, high) all projected (metrics
        are counted once: manager.metric_marks)."""
        return f"{self._base}:metric-marks"

    @property
    def unreadable(self) -> str:
        """Hash: id -> error of log entries that could not be decoded; recorded, then skipped."""
        return f"{self._base}:unreadable"

    @property
    def order(self) -> str:
        """Sorted set: trial id -> sequence id. Pages of trials in NNI's order, without reading them all."""
        return f"{self._base}:order"

    @property
    def ranking(self) -> str:
        """Sorted set: trial id -> its final metric's score, for trials that have a numeric one."""
        return f"{self._base}:ranking"

    @property
    def counts(self) -> str:
        """Hash: status -> trials in it, and `lost` / `retried` attempts: what /metrics reports."""
        return f"{self._base}:counts"

    @property
    def timeline(self) -> str:
        """Hash: the timeline's fold (manager.timeline) but its trials and markers; `head` is the position."""
        return f"{self._base}:timeline"

    @property
    def timeline_trials(self) -> str:
        """Hash: trial id -> its attempts on the timeline and its view changes, JSON."""
        return f"{self._base}:timeline:trials"

    @property
    def timeline_markers(self) -> str:
        """List of the timeline's experiment markers, JSON, in log order."""
        return f"{self._base}:timeline:markers"

    @property
    def kept_when_archived(self) -> frozenset[str]:
        """The views an archived experiment keeps in Redis (a few hundred bytes): what lists experiments
        (status, times, counts) reads them without bringing the experiment back."""
        return frozenset({self.position, self.experiment, self.counts})

    @property
    def fixed(self) -> frozenset[str]:
        """The views' keys but the per-trial ones."""
        return frozenset(
            {
                self.position,
                self.trials,
                self.experiment,
                self.metric_keys,
                self.metric_marks,
                self.unreadable,
                self.order,
                self.ranking,
                self.counts,
                self.timeline,
                self.timeline_trials,
                self.timeline_markers,
            }
        )

    def per_trial(self, trial_id: str) -> tuple[str, str]:
        """The keys one trial's views may have."""
        return self.metrics(trial_id), self.timeline_entries(trial_id)

    def metrics(self, trial_id: str) -> str:
        """List of MetricRecord JSON of one trial, in log order."""
        return f"{self._base}:metrics:{trial_id}"

    def timeline_entries(self, trial_id: str) -> str:
        """String: the ids of one trial's entries, 16 bytes each (manager.timeline), appended in log order."""
        return f"{self._base}:timeline:entries:{trial_id}"

    @property
    def pattern(self) -> str:
        return f"{self._base}:*"
