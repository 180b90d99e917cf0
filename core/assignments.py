"""What a platform is handed for one attempt of a trial: built from the trial's TrialSubmitted event,
with the experiment's secrets (kept beside the log, never in it) put back into its platform config."""

from __future__ import annotations

import redis

from core import keys
from core.dispatch import load_submission
from core.event_store import EventStore, StoredEvent
from core.platform import Platform, TrialAssignment
from schemas.events import TrialSubmitted
from schemas.secrets import with_secrets


def assignment_of(
    platform: type[Platform] | Platform, submitted: StoredEvent, attempt: int, secrets: dict[str, str]
) -> TrialAssignment:
    submission = submitted.event
    assert isinstance(submission, TrialSubmitted)
    section = with_secrets(submission.launch.platform_config, secrets)
    return TrialAssignment(
        experiment_id=submission.experiment_id,
        trial_id=submission.trial_id,
        form=submission.form,
        launch=submission.launch,
        working_directory=submission.working_directory,
        platform_config=platform.config_model.model_validate(section),
        attempt=attempt,
    )


def load_assignment(
    client: redis.Redis, platform: type[Platform] | Platform, experiment_id: str, trial_id: str, attempt: int
) -> TrialAssignment:
    """The assignment of one attempt, read from the log and the experiment's secrets."""
    submitted = load_submission(EventStore(client, experiment_id), trial_id)
    return assignment_of(platform, submitted, attempt, experiment_secrets(client, experiment_id))


def experiment_secrets(client: redis.Redis, experiment_id: str) -> dict[str, str]:
    raw = client.hgetall(keys.secrets(experiment_id))
    return {_text(name): _text(value) for name, value in raw.items()}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
