"""Experiment configs written the way a user writes them, and the rejection a config that must fail gets."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from manager.config import load_experiment_config
from schemas.config import ConfigError


def write_config_file(directory: Path, config: dict[str, Any], name: str = "config.yml") -> Path:
    """`config` as YAML (keys in their order) at `directory/name`."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def nested(levels: int) -> Any:
    """A list of a list of ... of 1: `levels` levels of JSON nesting, itself the first."""
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def deep_space(levels: int) -> dict[str, Any]:
    """A search space of `levels` levels of JSON nesting, itself the first: a choice of one option, a list of a
    list of ... of 1, the innermost list `levels` deep (`searchSpace.a._value` is level 3)."""
    return {"a": {"_type": "choice", "_value": nested(levels - 2)}}


TOO_DEEP = f"searchSpace.a._value{'[0]' * 62}: nested more than 64 levels deep"  # `deep_space(65)`'s level 65


def deep_mapping(levels: int, key: str = "x") -> dict[str, Any]:
    """`{key: [[...[1]...]]}`, `levels` levels of JSON nesting, itself the first (classArgs, a trial's parameters)."""
    return {key: nested(levels - 1)}


def too_deep(path: str) -> str:
    """How the refusal of `deep_mapping(65)` at `path` (its key included) starts: naming its level 65."""
    return f"{path}{'[0]' * 63}: nested more than 64 levels deep"


def write_config(
    directory: Path, training_service: Any, search_space: dict[str, Any], name: str | None = None, **top: Any
) -> Path:
    """config.yml in `directory` for one trial of `print(1)` on `training_service`, its code in `directory/code`
    (so the config is not shipped with it); `top` adds or replaces top-level keys."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "code").mkdir(exist_ok=True)
    config: dict[str, Any] = {
        **({"experimentName": name} if name is not None else {}),
        "trialCommand": f'{sys.executable} -c "print(1)"',
        "trialCodeDirectory": "code",
        "trialConcurrency": 1,
        "maxTrialNumber": 1,
        "searchSpace": search_space,
        "tuner": {"name": "Random"},
        "trainingService": training_service,
        "experimentWorkingDirectory": str(directory / "experiments"),
        **top,
    }
    return write_config_file(directory, config)


def config_error(path: Path) -> str:
    """The ConfigError message loading the config at `path` raises."""
    with pytest.raises(ConfigError) as raised:
        load_experiment_config(path)
    return str(raised.value)


def rejection(path: Path) -> list[str]:
    """The lines of the ConfigError loading `path` raises, each checked to start with the file's path."""
    lines = config_error(path).splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    return [line.removeprefix(f"{path}: ") for line in lines]


def write_local_config(directory: Path, trial: str, **overrides: object) -> Path:
    """`trial` as trial.py in `directory`, four trials of it two at a time on the local platform (seeded Random
    tuner), its experiments under `directory/experiments`; `overrides` replaces top-level keys."""
    (directory / "trial.py").write_text(textwrap.dedent(trial))
    config = {
        "trialCommand": f"{sys.executable} trial.py",
        "trialCodeDirectory": ".",
        "trialConcurrency": 2,
        "maxTrialNumber": 4,
        "searchSpace": {"x": {"_type": "choice", "_value": [1, 2, 3, 4]}},
        "tuner": {"name": "Random", "classArgs": {"seed": 1}},
        "trainingService": {"platform": "local"},
        "experimentWorkingDirectory": str(directory / "experiments"),
    }
    config.update(overrides)
    path = directory / "config.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path
