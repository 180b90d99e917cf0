"""Loading an NNI v2 experiment YAML into a validated experiment spec.

Every problem is reported as `key.path: what is wrong`, all at once, so a user fixes a config in
one go. Platform sections are validated by the platform's own model, found through the registry.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import ValidationError

from core.registry import UnknownPlatform, platform_class
from manager.algorithms import Algorithm, AlgorithmError, resolve
from manager.search_space import MAX_DEPTH, NestedTooDeep, SearchSpaceError, check_depth
from schemas.config import (
    AlgorithmConfig,
    ConfigError,
    ExperimentConfig,
    NniConfigModel,
    PlatformConfig,
    describe_validation_error,
)
from schemas.secrets import secret_values


@dataclass(frozen=True)
class ExperimentSpec:
    config: ExperimentConfig
    search_space: dict[str, Any]
    code_directory: Path
    platforms: tuple[PlatformConfig, ...]  # one, or a hybrid list (NNI's trainingService list), in config order
    source: Path

    @property
    def platform(self) -> PlatformConfig:
        """The platform of a single-platform experiment (a hybrid one's first)."""
        return self.platforms[0]

    @property
    def hybrid(self) -> bool:
        return len(self.platforms) > 1

    @property
    def platform_names(self) -> list[str]:
        return [platform.platform for platform in self.platforms]

    @property
    def training_service(self) -> dict[str, Any] | list[dict[str, Any]]:
        """The trainingService as stored (secrets masked): one section, or a hybrid list of them."""
        sections = [platform.model_dump(mode="json", by_alias=True, exclude_none=True) for platform in self.platforms]
        return sections if self.hybrid else sections[0]

    @property
    def secrets(self) -> dict[str, str]:
        """The platforms' secrets by path from the trainingService (`1.machineList.0.password` in a list)."""
        if not self.hybrid:
            return secret_values(self.platform)
        return {
            f"{index}.{path}": value
            for index, platform in enumerate(self.platforms)
            for path, value in secret_values(platform).items()
        }

    def algorithms(self, files_dir: Path | None = None) -> tuple[Algorithm, Algorithm | None]:
        """The tuner (or advisor) and the assessor, checked; files they write go under `files_dir`."""
        tuner = resolve(self.config.tuner_section, "tuner", files_dir)
        assessor = resolve(self.config.assessor, "assessor") if self.config.assessor else None
        return tuner, assessor

    @property
    def as_event_config(self) -> dict[str, Any]:
        """The config as stored in ExperimentCreated: NNI's keys, the search space inlined."""
        data = self.config.model_dump(mode="json", by_alias=True, exclude_none=True)
        data.update(searchSpace=self.search_space, trialCodeDirectory=str(self.code_directory))
        data.pop("searchSpaceFile", None)
        data["trainingService"] = self.training_service
        return data


def load_experiment_config(path: str | Path) -> ExperimentSpec:
    source = Path(path).expanduser().resolve()
    return _validated(_read_yaml(source), source, source.parent)


def experiment_spec(config: dict[str, Any], source: str) -> ExperimentSpec:
    """A spec from a config sent over the API: `source` names it in errors; paths must be absolute. No file of
    the manager's host is read for it (searchSpaceFile): its sender has only the API."""
    return _validated(config, Path(source), Path("/"), sent=True)


def stored_experiment_spec(config: dict[str, Any], working_directory: str) -> ExperimentSpec:
    """The spec an experiment was created with, from the config its ExperimentCreated event holds.

    That config has its search space inlined and an absolute code directory, so a resumed
    experiment needs neither the YAML file nor the directory it was run from.
    """
    return _validated(config, Path(working_directory) / "ExperimentCreated.config", Path("/"), stored=True)


def _validated(
    data: dict[str, Any], source: Path, base: Path, sent: bool = False, stored: bool = False
) -> ExperimentSpec:
    """The spec of a config: new (`sent` over the API, or read from a file), or `stored` in an experiment's log,
    which is taken as it was accepted (limits added since, MAX_DEPTH on its search space and classArgs, do not
    keep it from resuming)."""
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_explain(error, source)) from None
    config = _with_absolute_code_directories(config, base)
    code_directory = (base / Path(config.trial_code_directory).expanduser()).resolve()
    if not code_directory.is_dir():
        raise ConfigError(f"{source}: trialCodeDirectory: {code_directory} is not a directory")
    platforms = _platforms(config, source)
    if not stored:
        _check_class_args_depth(config, source)  # before the algorithms' checks walk them
    tuner = _algorithm(config, source, "tuner")
    if config.assessor is not None:
        if tuner.kind == "advisor":
            raise ConfigError(f"{source}: assessor: {tuner.label} is an advisor, which early-stops trials itself")
        _algorithm(config, source, "assessor")
    if sent and config.search_space_file is not None:
        raise ConfigError(
            f"{source}: searchSpaceFile: a config sent to the manager carries its search space as searchSpace (the"
            " CLI inlines the file); the manager reads no file of its host for it"
        )
    search_space = _search_space(config, base, tuner.own_space)
    try:
        if not stored:
            check_depth(search_space)  # first: the tuner's checks walk it recursively, and its event must read back
        tuner.check_search_space(search_space)
    except (NestedTooDeep, SearchSpaceError) as error:
        raise ConfigError(f"{source}: {error}") from None
    return ExperimentSpec(config, search_space, code_directory, platforms, source)


def _with_absolute_code_directories(config: ExperimentConfig, base: Path) -> ExperimentConfig:
    """Custom algorithms' codeDirectory, relative to the config file as in NNI, made absolute: the
    stored config must load the same classes when resumed from anywhere."""
    update = {}
    for key in ("tuner", "assessor", "advisor"):
        section: AlgorithmConfig | None = getattr(config, key)
        if section is not None and section.code_directory is not None:
            directory = (base / Path(section.code_directory).expanduser()).resolve()
            update[key] = section.model_copy(update={"code_directory": str(directory)})
    return config.model_copy(update=update) if update else config


def _check_class_args_depth(config: ExperimentConfig, source: Path) -> None:
    """Each algorithm's classArgs held to MAX_DEPTH, as the search space: the event that holds them must read back."""
    for key in ("tuner", "assessor", "advisor"):
        section: AlgorithmConfig | None = getattr(config, key)
        if section is not None and section.class_args is not None:
            try:
                check_depth(section.class_args, f"{key}.classArgs", "classArgs")
            except NestedTooDeep as error:
                raise ConfigError(f"{source}: {error}") from None


def _algorithm(config: ExperimentConfig, source: Path, role: Literal["tuner", "assessor"]) -> Algorithm:
    section = config.tuner_section if role == "tuner" else config.assessor
    assert section is not None
    key = "advisor" if role == "tuner" and config.advisor is not None else role
    try:
        return resolve(section, role)
    except AlgorithmError as error:
        raise ConfigError(f"{source}: {key}.{error.key}: {error}") from None


def _read_mapping(path: Path, prefix: str, missing: str, invalid: str, not_mapping: str) -> dict[str, Any]:
    """A YAML (or JSON) file holding a mapping; each failure a ConfigError starting with `prefix`."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{prefix}: {missing}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{prefix}: cannot read {path}: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{prefix}: {invalid}: {error}") from None
    except RecursionError:  # PyYAML's parser recurses, a level or two of Python's stack per level of nesting
        raise ConfigError(f"{prefix}: nested too deep to read (at most {MAX_DEPTH} levels are taken)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: {not_mapping}")
    return data


def _read_yaml(source: Path) -> dict[str, Any]:
    return _read_mapping(
        source,
        str(source),
        missing="no such config file",
        invalid="invalid YAML",
        not_mapping="the config must be a YAML mapping of NNI v2 keys (trialCommand, ...)",
    )


def _search_space(config: ExperimentConfig, base: Path, optional: bool) -> dict[str, Any]:
    if config.search_space is not None:
        return config.search_space
    if config.search_space_file is None:
        if optional:  # the tuner defines its own space
            return {}
        raise ConfigError("searchSpace: required key is missing (or give searchSpaceFile)")
    path = base / Path(config.search_space_file).expanduser()
    return _read_mapping(
        path,
        "searchSpaceFile",
        missing=f"{path} does not exist",
        invalid=f"{path} is not valid JSON or YAML",
        not_mapping=f"{path} must hold a mapping of parameter names",
    )


def _platforms(config: ExperimentConfig, source: Path) -> tuple[PlatformConfig, ...]:
    """The trainingService: one platform section, or NNI's hybrid list of them (each a full section;
    the trial keys, trialGpuNumber included, apply to all). Each platform may be listed once."""
    if isinstance(config.training_service, dict):
        return (_platform(config, config.training_service, source, "trainingService"),)
    sections = config.training_service
    if not sections:
        raise ConfigError(f"{source}: trainingService: the list is empty; give one platform section or several")
    platforms: list[PlatformConfig] = []
    for index, section in enumerate(sections):
        platform = _platform(config, section, source, f"trainingService.{index}")
        earlier = [other.platform for other in platforms]
        if platform.platform in earlier:
            raise ConfigError(
                f"{source}: trainingService.{index}.platform: {platform.platform} is listed twice (also "
                f"trainingService.{earlier.index(platform.platform)}); list each platform once, with all its "
                "machines or settings in one section"
            )
        platforms.append(platform)
    return tuple(platforms)


def _platform(config: ExperimentConfig, section: dict[str, Any], source: Path, prefix: str) -> PlatformConfig:
    name = next((value for key, value in section.items() if str(key).lower() == "platform"), None)
    if name is None:
        raise ConfigError(f"{source}: {prefix}.platform: required key is missing (e.g. platform: local)")
    if not isinstance(name, str):
        raise ConfigError(
            f"{source}: {prefix}.platform: expected a platform's name (e.g. platform: local), got {name!r}"
        )
    try:
        model = platform_class(name).config_model
        platform = model.model_validate(section)
    except UnknownPlatform as error:
        raise ConfigError(f"{source}: {prefix}.platform: {error}") from None
    except ValidationError as error:
        raise ConfigError(_explain(error, source, prefix, model)) from None
    problems = platform.problems_with(config)
    if problems:
        raise ConfigError("\n".join(f"{source}: {prefix}.{key}: {what}" for key, what in problems.items()))
    return platform


def _explain(
    error: ValidationError, source: Path, prefix: str = "", platform: type[PlatformConfig] | None = None
) -> str:
    lines = describe_validation_error(error, prefix).splitlines()
    for index, problem in enumerate(error.errors()):
        if problem["type"] == "extra_forbidden":
            suggestion = difflib.get_close_matches(str(problem["loc"][-1]), _known_keys(platform), n=1)
            if suggestion:
                lines[index] += f" (did you mean {suggestion[0]!r}?)"
    return "\n".join(f"{source}: {line}" for line in lines)


def _known_keys(platform: type[PlatformConfig] | None = None) -> list[str]:
    models: list[type[NniConfigModel]] = []
    for model in (ExperimentConfig, AlgorithmConfig, *([platform] if platform else [])):
        _with_nested(model, models)
    return sorted({field.alias or name for model in models for name, field in model.model_fields.items()})


def _with_nested(annotation: Any, models: list[type[NniConfigModel]]) -> None:
    """`annotation`'s config models and those of its fields, at any depth (a remote machineList's
    machines): a misspelt key of a nested section gets its suggestion too."""
    if isinstance(annotation, type) and issubclass(annotation, NniConfigModel):
        if annotation in models:
            return
        models.append(annotation)
        for field in annotation.model_fields.values():
            _with_nested(field.annotation, models)
    for argument in get_args(annotation):
        _with_nested(argument, models)
