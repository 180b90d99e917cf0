"""NNI's search-space language: a `searchSpace` parsed and checked (every `_type` as NNI's search space spec
has it, errors naming the key and the fix), and sampled. Pure computation: no I/O."""

from __future__ import annotations

import copy
import json
import math
import random
import reprlib
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, TypeAlias


class SearchSpaceError(ValueError):
    """An invalid search space; the message starts with the offending path, e.g. `searchSpace.lr._value`."""


_TYPES = (
    "choice",
    "randint",
    "uniform",
    "quniform",
    "loguniform",
    "qloguniform",
    "normal",
    "qnormal",
    "lognormal",
    "qlognormal",
)

# What each numeric `_value` must look like, quoted in errors so the user sees the fix. No `[name, ...]`:
# a terminal that reads markup takes that for a tag and drops it ("uniform needs  with low < high").
_EXPECTED = {
    "randint": "two integers lower, upper with lower < upper",
    "uniform": "two numbers low, high with low < high",
    "quniform": "three numbers low, high, q with low < high and q > 0",
    "loguniform": "two numbers low, high with 0 < low < high",
    "qloguniform": "three numbers low, high, q with 0 < low < high and q > 0",
    "normal": "two numbers mu, sigma with sigma > 0",
    "qnormal": "three numbers mu, sigma, q with sigma > 0 and q > 0",
    "lognormal": "two numbers mu, sigma with sigma > 0",
    "qlognormal": "three numbers mu, sigma, q with sigma > 0 and q > 0",
}

OPTIMIZE_MODES = ("maximize", "minimize")


show = reprlib.repr


@dataclass(frozen=True)
class Choice:
    options: tuple[Any, ...]  # plain JSON values, or Option for nested search spaces


@dataclass(frozen=True)
class Option:
    """A nested search space offered by a choice; `_name` tells the trial which one was picked."""

    name: str
    space: Space


@dataclass(frozen=True)
class RandInt:
    lower: int
    upper: int


@dataclass(frozen=True)
class Numeric:
    """uniform/normal families; `a`, `b` are low/high or mu/sigma, `q` the quantization step."""

    type: str
    a: float
    b: float
    q: float | None

    @property
    def _normal(self) -> bool:
        return "normal" in self.type

    @property
    def _log(self) -> bool:
        return "log" in self.type

    def draw(self, rng: random.Random) -> float:
        """A sample of the underlying continuous distribution, before quantization and clipping."""
        if self._normal:
            x = rng.gauss(self.a, self.b)
            return math.exp(x) if self._log else x
        if self._log:
            return math.exp(rng.uniform(math.log(self.a), math.log(self.b)))
        return rng.uniform(self.a, self.b)

    def quantile(self, u: float) -> float:
        """Inverse CDF, so the grid can bisect probability space (NNI's way of gridding normals)."""
        if self._normal:
            x = NormalDist(self.a, self.b).inv_cdf(u)
            return math.exp(x) if self._log else x
        if self._log:
            return math.exp(math.log(self.a) + (math.log(self.b) - math.log(self.a)) * u)
        return self.a + (self.b - self.a) * u

    def clip(self, x: float) -> float:
        """Keep bounded types inside [low, high] despite rounding (NNI's clip for q types)."""
        return float(min(max(x, self.a), self.b)) if not self._normal else float(x)

    def finish(self, x: float) -> float:
        """NNI's output formula: `clip(round(x / q) * q, low, high)`, or just the clipped x."""
        return self.clip(x if self.q is None else round(x / self.q) * self.q)

    def coord_bounds(self) -> tuple[float, float]:
        """Grid coordinates reached just inside the support: the value itself, or the step count k."""
        if self._normal:
            return (0.0 if self._log else -math.inf, math.inf)
        if self.q is None:
            return (self.a, self.b)
        # round(x / q) for x strictly inside (low, high): the half-up limit at low, half-down at high.
        return (float(math.floor(self.a / self.q + 0.5)), float(math.ceil(self.b / self.q - 0.5)))

    def coord(self, u: float, bounds: tuple[float, float]) -> float:
        """The grid coordinate at probability u; distinct coordinates give distinct values."""
        x = self.quantile(u)
        raw = x if self.q is None else float(round(x / self.q))
        return min(max(raw, bounds[0]), bounds[1])

    def value(self, coord: float) -> float:
        """The parameter value a grid coordinate stands for."""
        return self.clip(coord if self.q is None else coord * self.q)


Param: TypeAlias = Choice | RandInt | Numeric
Space: TypeAlias = tuple[tuple[str, Param], ...]


class NestedTooDeep(ValueError):
    """A value nested more than MAX_DEPTH levels deep; the message starts with where, e.g. `parameters.x[0]`."""


class NotJson(ValueError):
    """Text that must be JSON and is not; the message starts with where."""


MAX_DEPTH = 64
"""Levels of JSON nesting a value of the user's that an event holds (a search space, classArgs, a customized
trial's parameters) may have, itself the first: far above any real one (NNI's nested choices are a few levels
deep), and far below what the log's reader takes (pydantic parses an event's JSON to 200 levels, the event's own
included) or what the recursive checks after `check_depth` can walk."""


def check_depth(value: Any, path: str = "searchSpace", what: str = "a search space") -> None:
    """Refuse a value (`what`, at `path`) nested more than MAX_DEPTH levels deep, naming where. Iterative, so
    that no depth breaks it: it runs before anything recursive walks the value, custom tuners' checks included."""
    pending: list[tuple[Any, int, str]] = [(value, 1, path)]
    while pending:
        item, depth, where = pending.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise NestedTooDeep(
                f"{where}: nested more than {MAX_DEPTH} levels deep; {what} may have at most {MAX_DEPTH} levels"
            )
        steps = item.items() if isinstance(item, dict) else enumerate(item)
        step = "{}.{}" if isinstance(item, dict) else "{}[{}]"
        pending.extend((inner, depth + 1, step.format(where, key)) for key, inner in steps)


def check_parameter_names(parameters: dict[str, Any], space: Any, path: str) -> None:
    """Refuse a parameter set (at `path`) that does not name exactly the search space's parameters (a ValueError
    saying which), as tuners read each one by name; any set, when the space is empty (a tuner that makes its own)."""
    if not isinstance(space, dict) or not space:
        return
    if missing := [name for name in space if name not in parameters]:
        raise ValueError(f"{path}: missing {', '.join(missing)}, of the search space")
    if unknown := [name for name in parameters if name not in space]:
        raise ValueError(f"{path}.{unknown[0]}: not in the search space (its parameters: {', '.join(space)})")


def check_json_text(text: str, path: str, what: str) -> None:
    """Refuse text that a trial and the views parse as JSON (`what`, at `path`) unless it is JSON nested at most
    MAX_DEPTH levels: it is stored as text, so the event reads back, but each reader would fail on it."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise NestedTooDeep(f"{path}: nested too deep to read; {what} may have at most {MAX_DEPTH} levels") from None
    except ValueError as error:
        raise NotJson(f"{path}: not JSON ({error}); {what} is JSON text") from None
    check_depth(value, path, what)


NAS_TYPES = ("layer_choice", "input_choice")  # NNI's classic NAS space: RegularizedEvolution and PPO take it


def validate_search_space(space: dict[str, Any], allow_empty: bool = False, nas: bool = False) -> None:
    """Reject a search space NNI tuners could not sample, naming the parameter path and the fix.

    Only a tuner that defines its own space (NetworkMorphism, a custom tuner) may take an empty one;
    only one that searches architectures (`nas`) takes layer_choice and input_choice."""
    if nas and isinstance(space, dict):
        architecture = {name: spec for name, spec in space.items() if _nas_type(spec)}
        for name, spec in architecture.items():
            _check_nas(spec, f"searchSpace.{name}")
        space = {name: spec for name, spec in space.items() if name not in architecture}
        allow_empty = allow_empty or bool(architecture)
    parse_space(space, allow_empty)


def _nas_type(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("_type") in NAS_TYPES


def _check_nas(spec: dict[str, Any], path: str) -> None:
    value = spec.get("_value")
    if spec["_type"] == "layer_choice":
        if not isinstance(value, list) or not value:
            raise SearchSpaceError(f"{path}._value: layer_choice needs a non-empty list of layers; got {show(value)}")
        return
    candidates = value.get("candidates") if isinstance(value, dict) else None
    chosen = value.get("n_chosen") if isinstance(value, dict) else None
    counted = isinstance(candidates, list) and is_int(chosen)
    if not counted or not 0 < int(chosen or 0) <= len(candidates or []):
        raise SearchSpaceError(
            f"{path}._value: input_choice needs candidates (a non-empty list) and n_chosen (1 to their number); "
            f"got {show(value)}"
        )


def parse_space(space: Any, allow_empty: bool = False) -> Space:
    parsed = parse_params(space, "searchSpace")
    if not parsed and not allow_empty:
        raise SearchSpaceError("searchSpace: must define at least one parameter")
    return parsed


def parse_params(space: Any, path: str) -> Space:
    if not isinstance(space, dict):
        raise SearchSpaceError(
            f'{path}: expected a mapping of parameter names to {{"_type": ..., "_value": [...]}}; got {show(space)}'
        )
    params = []
    for name, spec in space.items():
        if not isinstance(name, str) or not name:
            raise SearchSpaceError(f"{path}: parameter names must be non-empty strings; got {show(name)}")
        params.append((name, _parse_param(spec, f"{path}.{name}")))
    return tuple(params)


def _parse_param(spec: Any, path: str) -> Param:
    if not isinstance(spec, dict) or "_type" not in spec or "_value" not in spec:
        raise SearchSpaceError(f'{path}: expected {{"_type": ..., "_value": [...]}}; got {show(spec)}')
    type_, value = spec["_type"], spec["_value"]
    if type_ in NAS_TYPES:
        raise SearchSpaceError(
            f"{path}._type: {type_} is an architecture choice: only RegularizedEvolution and PPO take it"
        )
    if not isinstance(type_, str) or type_ not in _TYPES:
        raise SearchSpaceError(f"{path}._type: unknown type {show(type_)}; supported types are {', '.join(_TYPES)}")
    if type_ == "choice":
        return _parse_choice(value, path)
    bad = SearchSpaceError(f"{path}._value: {type_} needs {_EXPECTED[type_]}; got {show(value)}")
    if type_ == "randint":
        integers = isinstance(value, list) and len(value) == 2 and all(is_int(v) for v in value)
        if not integers or value[0] >= value[1]:
            raise bad
        return RandInt(value[0], value[1])
    numbers = [_finite(v) for v in value] if isinstance(value, list) else []
    if len(numbers) != (3 if type_.startswith("q") else 2) or None in numbers:
        raise bad
    a, b, *rest = (n for n in numbers if n is not None)
    q = rest[0] if rest else None
    ordered = b > 0 if "normal" in type_ else a < b and (a > 0 or "log" not in type_)
    if not ordered or (q is not None and q <= 0):
        raise bad
    return Numeric(type_, a, b, q)


def _parse_choice(value: Any, path: str) -> Choice:
    if not isinstance(value, list) or not value:
        raise SearchSpaceError(f"{path}._value: choice needs a non-empty list of options; got {show(value)}")
    options: list[Any] = []
    names: set[str] = set()
    for index, option in enumerate(value):
        where = f"{path}._value[{index}]"
        if isinstance(option, dict) and "_name" in option:
            name = option["_name"]
            if not isinstance(name, str) or not name:
                raise SearchSpaceError(
                    f"{where}._name: a dict option is a nested search space and needs a non-empty "
                    f"string '_name'; got {show(name)}"
                )
            if name in names:
                raise SearchSpaceError(f"{where}._name: duplicate option name {name!r}; names must be unique")
            names.add(name)
            nested = {key: spec for key, spec in option.items() if key != "_name"}
            options.append(Option(name, parse_params(nested, where)))
        elif _is_json_literal(option):
            options.append(copy.deepcopy(option))
        else:
            raise SearchSpaceError(
                f"{where}: choice options must be strings, numbers, booleans, null, lists, mappings or "
                f"nested search spaces (mappings with a '_name'); got {show(option)}"
            )
    return Choice(tuple(options))


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> float | None:
    """The number as a float, or None when it is not a finite real (bools are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        x = float(v)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def _is_json_literal(v: Any) -> bool:
    """Whether the value survives a JSON round trip unchanged, so trials receive exactly the option."""
    if v is None or isinstance(v, bool | str) or is_int(v):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_is_json_literal(item) for item in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json_literal(item) for k, item in v.items())
    return False
