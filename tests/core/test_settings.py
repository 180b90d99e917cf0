"""Settings: read once from TRIALSTREAM_* variables and flags, handed to child processes, kept from trials."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.settings import SettingError, Settings, trial_environment
from workers.platforms.local.settings import LocalSettings, default_machine_id
from workers.platforms.remote.settings import RemoteSettings


def test_variables_then_flags_make_the_settings() -> None:
    environ = {"TRIALSTREAM_TRIAL_LEASE_S": "2.5", "TRIALSTREAM_KILL_GRACE_S": "1", "UNRELATED": "x"}
    settings = Settings.from_environment(environ, redis_url="redis://localhost/0", kill_grace_s=None)
    assert settings.trial_lease_s == 2.5 and settings.kill_grace_s == 1.0  # a flag left unset changes nothing
    assert Settings.from_environment(environ, trial_lease_s=7).trial_lease_s == 7


def test_a_bad_value_names_the_setting() -> None:
    with pytest.raises(SettingError, match=r"TRIALSTREAM_TRIAL_LEASE_S: .*greater than 0"):
        Settings.from_environment({"TRIALSTREAM_TRIAL_LEASE_S": "-1"})
    with pytest.raises(SettingError, match=r"TRIALSTREAM_PLATFORMS: .*name=module:Class"):
        Settings.from_environment({"TRIALSTREAM_PLATFORMS": "detached"})


def test_child_processes_get_the_same_settings() -> None:
    settings = Settings.from_environment(
        {"TRIALSTREAM_PLATFORMS": "a=x.y:A, b=z:B", "TRIALSTREAM_FAKE_GPUS": "/tmp/gpus.json"},
        redis_url="redis://:secret@localhost/0",
    )
    assert settings.platforms == {"a": "x.y:A", "b": "z:B"} and settings.of(LocalSettings).fake_gpus == Path(
        "/tmp/gpus.json"
    )
    again = Settings.from_environment(settings.as_environment())
    assert again == settings and again.of(LocalSettings) == settings.of(LocalSettings)  # the platforms' too


def test_a_platform_reads_its_own_settings_and_a_bad_one_names_its_variable() -> None:
    settings = Settings.from_environment({"TRIALSTREAM_SSH_TIMEOUT_S": "3", "TRIALSTREAM_TRIAL_LEASE_S": "2"})
    assert settings.of(RemoteSettings).ssh_timeout_s == 3 and settings.trial_lease_s == 2
    assert "ssh_timeout_s" not in Settings.model_fields  # core names no platform's setting
    with pytest.raises(SettingError, match=r"TRIALSTREAM_SSH_TIMEOUT_S: .*greater than 0"):
        Settings.from_environment({"TRIALSTREAM_SSH_TIMEOUT_S": "0"}).of(RemoteSettings)


def test_the_redis_password_never_shows_in_a_repr() -> None:
    settings = Settings(redis_url="redis://:hunter2-redis@localhost/0")
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings)


def test_trials_get_the_users_environment_without_trialstream_settings() -> None:
    environ = {"HOME": "/root", "TRIALSTREAM_REDIS_URL": "redis://:secret@x/0", "TRIALSTREAM_TRIAL_LEASE_S": "1"}
    assert trial_environment(environ) == {"HOME": "/root"}


def test_the_machine_id_is_the_machine_s() -> None:
    machine_id = Path("/etc/machine-id")
    if machine_id.exists() and machine_id.read_text().strip():
        assert default_machine_id() == machine_id.read_text().strip()
    assert Settings().of(LocalSettings).machine_id == default_machine_id()
