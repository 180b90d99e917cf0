"""What a platform is handed for one attempt of a trial: built from the trial's TrialSubmitted event,
with the experiment's secrets (kept beside the log, never in it) put back into its platform config."""

from __future__ import annotations

from typing import Any

import redis

from core import keys
from core.connections import text_fields
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
    """The assignment of one attempt, read from the log and its platform's secrets."""
    submitted = load_submission(EventStore(client, experiment_id), trial_id)
    return assignment_of(platform, submitted, attempt, experiment_secrets(client, experiment_id, [platform.name]))


def secrets_by_platform(training_service: Any, secrets: dict[str, str]) -> dict[str, dict[str, str]]:
    """Each secret under the platform of its section, as `keys.secrets` keeps them: a hybrid list's paths
    start with the section's index (`1.machineList.0.password`), a single section's belong to it."""
    grouped: dict[str, dict[str, str]] = {}
    for path, value in secrets.items():
        if isinstance(training_service, list):
            section = training_service[int(path.split(".", 1)[0])]
        else:
            section = training_service
        grouped.setdefault(str(section["platform"]), {})[path] = value
    return grouped


def experiment_secrets(client: redis.Redis, experiment_id: str, platforms: list[str]) -> dict[str, str]:
    """The secrets of `platforms`' sections (a worker asks for its own platform's only)."""
    found: dict[str, str] = {}
    for platform in platforms:
        found.update(text_fields(client.hgetall(keys.secrets(experiment_id, platform))))
    return found


def configured_platforms(training_service: Any) -> list[str]:
    """The platforms of a (masked) trainingService: its one section's, or each listed one's."""
    sections = training_service if isinstance(training_service, list) else [training_service]
    return [str(section["platform"]) for section in sections if isinstance(section, dict)]
