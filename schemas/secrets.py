"""Secrets in configs (SSH passwords, API tokens): pydantic `SecretStr` fields, which serialize masked.

A config is stored in the log masked; its secret values are kept beside the log, by their dotted
path (`machineList.0.password`), and put back where a platform needs them. Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, SecretStr


def secret_values(model: BaseModel) -> dict[str, str]:
    """Every secret in `model`, by the dotted path of its key as written in the config."""
    found: dict[str, str] = {}
    _collect(model, "", found)
    return found


def with_secrets(data: Any, secrets: dict[str, str]) -> Any:
    """A copy of the masked `data` (a mapping, or a list of them: a hybrid trainingService) with the
    secrets put back at their paths (paths absent are skipped)."""
    data = _copy(data)
    for path, value in secrets.items():
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = _item(node, part) if isinstance(node, list) else node.get(part)
            if node is None:
                break
        else:
            if isinstance(node, dict):
                node[last] = value
    return data


def _collect(value: Any, path: str, found: dict[str, str]) -> None:
    if isinstance(value, SecretStr):
        found[path] = value.get_secret_value()
    elif isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            _collect(getattr(value, name), _join(path, field.alias or name), found)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _collect(item, _join(path, str(index)), found)


def _item(items: list[Any], part: str) -> Any:
    return items[int(part)] if part.isdigit() and int(part) < len(items) else None


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value
