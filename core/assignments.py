"""What a platform is handed for one attempt of a trial: built from the trial's TrialSubmitted event,
with the experiment's secrets (kept beside the log, never in it) put back into its platform config."""

from __future__ import annotations

from typing import Any

import redis

from core import keys
from core.event_store import EventStore, StoredEvent
from core.platform import Platform, TrialAssignment
from core.queueing import load_submission
from schemas.events import TrialSubmitted
from schemas.secrets import with_secrets


def assignment_of(
    platform: type[Platform[Any]] | Platform[Any], submitted: StoredEvent, attempt: int, secrets: dict[str, str]
) -> TrialAssignment[Any]:
    submission = submitted.event
    assert isinstance(submission, TrialSubmitted)
    launch = submission.launch
    section = platform_section(launch.platform_configs or launch.platform_config, platform.name, secrets)
    return TrialAssignment[Any](
        experiment_id=submission.experiment_id,
        trial_id=submission.trial_id,
        form=submission.form,
        launch=submission.launch,
        working_directory=submission.working_directory,
        platform_config=platform.config_model.model_validate(section),
        attempt=attempt,
    )


def platform_section(training_service: Any, platform: str, secrets: dict[str, str]) -> dict[str, Any]:
    """`platform`'s section of a (masked) trainingService, one section or a hybrid list of them, with the
    secrets put back: their paths start at the trainingService (`1.machineList.0.password` in a list)."""
    unmasked = with_secrets(training_service, secrets)
    sections = unmasked if isinstance(unmasked, list) else [unmasked]
    found = [section for section in sections if isinstance(section, dict) and section.get("platform") == platform]
    if len(sections) == 1 and isinstance(unmasked, dict):
        return unmasked  # a single section: its platform is the trial's, as it always was
    if not found:
        raise LookupError(f"platform {platform} is not in the experiment's trainingService list")
    return found[0]


def load_assignment(
    client: redis.Redis, platform: type[Platform[Any]] | Platform[Any], experiment_id: str, trial_id: str, attempt: int
) -> TrialAssignment[Any]:
    """The assignment of one attempt, read from the log and the experiment's secrets."""
    submitted = load_submission(EventStore(client, experiment_id), trial_id)
    return assignment_of(platform, submitted, attempt, experiment_secrets(client, experiment_id))


def experiment_secrets(client: redis.Redis, experiment_id: str) -> dict[str, str]:
    raw = client.hgetall(keys.secrets(experiment_id))
    return {_text(name): _text(value) for name, value in raw.items()}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
