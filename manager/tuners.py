"""NNI-compatible search spaces and the native Random and GridSearch tuners.

The search space format and the meaning of every `_type` follow NNI's search space spec, so an
NNI experiment's `searchSpace` works unchanged. The two tuners speak NNI's Tuner interface (so the
dispatcher drives them as it drives NNI's own) and need no `nni` package. Everything here is pure
computation (no I/O) so tests can drive it directly.
"""

from __future__ import annotations

import copy
import json
import math
import random
import reprlib
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
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

# Grid intervals narrower than this (in probability space) are not split further: no float-valued
# parameter can tell such points apart, and it bounds the search where quantization hides a value.
_MIN_WIDTH = 2.0**-40

_show = reprlib.repr


@dataclass(frozen=True)
class _Choice:
    options: tuple[Any, ...]  # plain JSON values, or _Option for nested search spaces


@dataclass(frozen=True)
class _Option:
    """A nested search space offered by a choice; `_name` tells the trial which one was picked."""

    name: str
    space: _Space


@dataclass(frozen=True)
class _RandInt:
    lower: int
    upper: int


@dataclass(frozen=True)
class _Numeric:
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


_Param: TypeAlias = _Choice | _RandInt | _Numeric
_Space: TypeAlias = tuple[tuple[str, _Param], ...]


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
    _parse_space(space, allow_empty)


def _nas_type(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("_type") in NAS_TYPES


def _check_nas(spec: dict[str, Any], path: str) -> None:
    value = spec.get("_value")
    if spec["_type"] == "layer_choice":
        if not isinstance(value, list) or not value:
            raise SearchSpaceError(f"{path}._value: layer_choice needs a non-empty list of layers; got {_show(value)}")
        return
    candidates = value.get("candidates") if isinstance(value, dict) else None
    chosen = value.get("n_chosen") if isinstance(value, dict) else None
    counted = isinstance(candidates, list) and _is_int(chosen)
    if not counted or not 0 < int(chosen or 0) <= len(candidates or []):
        raise SearchSpaceError(
            f"{path}._value: input_choice needs candidates (a non-empty list) and n_chosen (1 to their number); "
            f"got {_show(value)}"
        )


def _parse_space(space: Any, allow_empty: bool = False) -> _Space:
    parsed = _parse_params(space, "searchSpace")
    if not parsed and not allow_empty:
        raise SearchSpaceError("searchSpace: must define at least one parameter")
    return parsed


def _parse_params(space: Any, path: str) -> _Space:
    if not isinstance(space, dict):
        raise SearchSpaceError(
            f'{path}: expected a mapping of parameter names to {{"_type": ..., "_value": [...]}}; got {_show(space)}'
        )
    params = []
    for name, spec in space.items():
        if not isinstance(name, str) or not name:
            raise SearchSpaceError(f"{path}: parameter names must be non-empty strings; got {_show(name)}")
        params.append((name, _parse_param(spec, f"{path}.{name}")))
    return tuple(params)


def _parse_param(spec: Any, path: str) -> _Param:
    if not isinstance(spec, dict) or "_type" not in spec or "_value" not in spec:
        raise SearchSpaceError(f'{path}: expected {{"_type": ..., "_value": [...]}}; got {_show(spec)}')
    type_, value = spec["_type"], spec["_value"]
    if type_ in NAS_TYPES:
        raise SearchSpaceError(
            f"{path}._type: {type_} is an architecture choice: only RegularizedEvolution and PPO take it"
        )
    if not isinstance(type_, str) or type_ not in _TYPES:
        raise SearchSpaceError(f"{path}._type: unknown type {_show(type_)}; supported types are {', '.join(_TYPES)}")
    if type_ == "choice":
        return _parse_choice(value, path)
    bad = SearchSpaceError(f"{path}._value: {type_} needs {_EXPECTED[type_]}; got {_show(value)}")
    if type_ == "randint":
        integers = isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)
        if not integers or value[0] >= value[1]:
            raise bad
        return _RandInt(value[0], value[1])
    numbers = [_finite(v) for v in value] if isinstance(value, list) else []
    if len(numbers) != (3 if type_.startswith("q") else 2) or None in numbers:
        raise bad
    a, b, *rest = (n for n in numbers if n is not None)
    q = rest[0] if rest else None
    ordered = b > 0 if "normal" in type_ else a < b and (a > 0 or "log" not in type_)
    if not ordered or (q is not None and q <= 0):
        raise bad
    return _Numeric(type_, a, b, q)


def _parse_choice(value: Any, path: str) -> _Choice:
    if not isinstance(value, list) or not value:
        raise SearchSpaceError(f"{path}._value: choice needs a non-empty list of options; got {_show(value)}")
    options: list[Any] = []
    names: set[str] = set()
    for index, option in enumerate(value):
        where = f"{path}._value[{index}]"
        if isinstance(option, dict) and "_name" in option:
            name = option["_name"]
            if not isinstance(name, str) or not name:
                raise SearchSpaceError(
                    f"{where}._name: a dict option is a nested search space and needs a non-empty "
                    f"string '_name'; got {_show(name)}"
                )
            if name in names:
                raise SearchSpaceError(f"{where}._name: duplicate option name {name!r}; names must be unique")
            names.add(name)
            nested = {key: spec for key, spec in option.items() if key != "_name"}
            options.append(_Option(name, _parse_params(nested, where)))
        elif _is_json_literal(option):
            options.append(copy.deepcopy(option))
        else:
            raise SearchSpaceError(
                f"{where}: choice options must be strings, numbers, booleans, null, lists, mappings or "
                f"nested search spaces (mappings with a '_name'); got {_show(option)}"
            )
    return _Choice(tuple(options))


def _is_int(v: Any) -> bool:
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
    if v is None or isinstance(v, bool | str) or _is_int(v):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_is_json_literal(item) for item in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json_literal(item) for k, item in v.items())
    return False


class NativeTuner:
    """NNI's Tuner interface (the part its dispatcher calls), for tuners that need no `nni` package.

    `generate_parameters` returns None once the search space is exhausted (only GridSearch does);
    `generate_multiple_parameters` then returns fewer sets than asked, as NNI's does on NoMoreTrialError.
    """

    def __init__(self, optimize_mode: str | None = "maximize") -> None:
        if optimize_mode is None:
            optimize_mode = "maximize"
        if optimize_mode not in OPTIMIZE_MODES:
            raise ValueError(f"optimize_mode: expected one of {', '.join(OPTIMIZE_MODES)}; got {_show(optimize_mode)}")
        self.optimize_mode = optimize_mode
        self._space: _Space = ()

    def update_search_space(self, search_space: dict[str, Any]) -> None:
        self._space = _parse_space(search_space)

    def generate_parameters(self, parameter_id: int, **kwargs: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def generate_multiple_parameters(self, parameter_id_list: list[int], **kwargs: Any) -> list[dict[str, Any]]:
        generated = []
        for parameter_id in parameter_id_list:
            parameters = self.generate_parameters(parameter_id, **kwargs)
            if parameters is None:
                break
            generated.append(parameters)
        return generated

    def receive_trial_result(self, parameter_id: int, parameters: dict[str, Any], value: Any, **kwargs: Any) -> None:
        """Results steer neither random nor grid search."""

    def trial_end(self, parameter_id: int, success: bool, **kwargs: Any) -> None:
        """Nothing to forget: no trial's end changes what comes next."""


class RandomTuner(NativeTuner):
    """Independent samples of every parameter; NNI's baseline, reproducible when seeded."""

    def __init__(self, seed: int | None = None, optimize_mode: str | None = "maximize") -> None:
        super().__init__(optimize_mode)
        if seed is not None and not _is_int(seed):
            raise ValueError(f"seed: expected an integer; got {_show(seed)}")
        self._rng = random.Random(seed)

    def generate_parameters(self, parameter_id: int, **kwargs: Any) -> dict[str, Any]:
        return _sample_space(self._space, self._rng)


def _sample_space(space: _Space, rng: random.Random) -> dict[str, Any]:
    return {name: _sample(param, rng) for name, param in space}


def _sample(param: _Param, rng: random.Random) -> Any:
    if isinstance(param, _Choice):
        option = rng.choice(param.options)
        if isinstance(option, _Option):
            return {"_name": option.name, **_sample_space(option.space, rng)}
        return copy.deepcopy(option)
    if isinstance(param, _RandInt):
        return rng.randrange(param.lower, param.upper)
    return param.finish(param.draw(rng))


@dataclass(frozen=True)
class _Plain:
    """A plain choice option, boxed so no option value can pass for a nested (name, nodes) pair."""

    value: Any


class _ChoiceAxis:
    """A choice's grid: its distinct options, each nested space expanded in turn."""

    def __init__(self, choice: _Choice, axes: list[_Axis]) -> None:
        self.bar = 0
        self._options: list[_Plain | tuple[str, list[_Node]]] = []
        keys: set[str] = set()
        for option in choice.options:
            if isinstance(option, _Option):
                self._options.append((option.name, _grid_nodes(option.space, axes)))
            # Random keeps repeats (they weight the draw); for the grid they are one point.
            elif (key := json.dumps(option, sort_keys=True)) not in keys:
                keys.add(key)
                self._options.append(_Plain(option))

    @property
    def size(self) -> int:
        return len(self._options)

    def expand(self, index: int) -> Iterator[tuple[Any, bool]]:
        option = self._options[index]
        if isinstance(option, _Plain):
            yield copy.deepcopy(option.value), False
            return
        name, nodes = option
        for params, new in _walk(nodes):
            yield {"_name": name, **params}, new


class _IntAxis:
    """randint is unordered in NNI's grid (like choice), so every integer is on the first grid."""

    def __init__(self, param: _RandInt) -> None:
        self.bar = 0
        self._lower = param.lower
        self.size = param.upper - param.lower

    def expand(self, index: int) -> Iterator[tuple[Any, bool]]:
        yield self._lower + index, False


class _NumericAxis:
    """Points of an ordered parameter, added by bisecting probability space one level per epoch.

    Each grid point is the midpoint of a kept interval; an interval is kept only while a value not
    yet on the grid may lie inside it, so quantized types run out exactly when every value is found.
    """

    def __init__(self, spec: _Numeric) -> None:
        self.bar = 0
        self._values: list[float] = []
        self._spec = spec
        self._bounds = spec.coord_bounds()
        self._seen: list[float] = []  # sorted coordinates of self._values
        self._intervals = [(0.0, self._bounds[0], 1.0, self._bounds[1])]  # (u, coord, u, coord)

    @property
    def size(self) -> int:
        return len(self._values)

    @property
    def divisible(self) -> bool:
        return bool(self._intervals)

    def expand(self, index: int) -> Iterator[tuple[Any, bool]]:
        yield self._values[index], False

    def split(self) -> bool:
        """Add every kept interval's midpoint; True when that put a new value on the grid."""
        added = False
        kept = []
        for low_u, low_c, high_u, high_c in self._intervals:
            mid_u = (low_u + high_u) / 2
            mid_c = self._spec.coord(mid_u, self._bounds)
            at = bisect_left(self._seen, mid_c)
            if at == len(self._seen) or self._seen[at] != mid_c:
                self._seen.insert(at, mid_c)
                self._values.append(self._spec.value(mid_c))
                added = True
            for part in ((low_u, low_c, mid_u, mid_c), (mid_u, mid_c, high_u, high_c)):
                if part[2] - part[0] >= _MIN_WIDTH and self._may_hold_new(part[1], part[3]):
                    kept.append(part)
        self._intervals = kept
        return added

    def _may_hold_new(self, low: float, high: float) -> bool:
        if math.isinf(low) or math.isinf(high):
            return True
        if self._spec.q is None:
            return low < high
        found = bisect_right(self._seen, high) - bisect_left(self._seen, low)
        return found < high - low + 1


_Axis: TypeAlias = _ChoiceAxis | _IntAxis | _NumericAxis
_Node: TypeAlias = tuple[str, _Axis]


def _grid_nodes(space: _Space, axes: list[_Axis]) -> list[_Node]:
    """One axis per parameter, nested ones included; `axes` collects them all so epochs can advance."""
    nodes: list[_Node] = []
    for name, param in space:
        axis: _Axis
        if isinstance(param, _Choice):
            axis = _ChoiceAxis(param, axes)
        elif isinstance(param, _RandInt):
            axis = _IntAxis(param)
        else:
            axis = _NumericAxis(param)
        axes.append(axis)
        nodes.append((name, axis))
    return nodes


def _walk(nodes: Sequence[_Node]) -> Iterator[tuple[dict[str, Any], bool]]:
    """The cartesian product of the current grid, last parameter fastest, flagging combinations
    that use at least one point added this epoch (the others were offered in earlier epochs)."""
    if not nodes:
        yield {}, False
        return
    (name, axis), rest = nodes[0], nodes[1:]
    for index in range(axis.size):
        for value, nested_new in axis.expand(index):
            for tail, tail_new in _walk(rest):
                yield {name: value, **tail}, index >= axis.bar or nested_new or tail_new


class GridSearchTuner(NativeTuner):
    """NNI 2.7+ grid search: all discrete combinations, with numeric ranges divided ever finer.

    The first epoch uses every choice/randint value and the midpoint of each numeric parameter; each
    later epoch adds the midpoints between existing points and offers only combinations not seen yet.
    """

    def __init__(self, optimize_mode: str | None = "maximize") -> None:
        super().__init__(optimize_mode)
        self.update_search_space({})

    def update_search_space(self, search_space: dict[str, Any]) -> None:
        self._axes: list[_Axis] = []
        self._nodes = _grid_nodes(_parse_params(search_space, "searchSpace"), self._axes)
        self._numeric = [axis for axis in self._axes if isinstance(axis, _NumericAxis)]
        for axis in self._numeric:
            axis.split()
        self._epoch: Iterator[dict[str, Any]] | None = self._new_epoch()

    def _new_epoch(self) -> Iterator[dict[str, Any]]:
        return (params for params, new in _walk(self._nodes) if new)

    def generate_parameters(self, parameter_id: int, **kwargs: Any) -> dict[str, Any] | None:
        """The next unseen grid point, or None once no parameter can be divided further."""
        while self._epoch is not None:
            params = next(self._epoch, None)
            if params is not None:
                return params
            self._epoch = self._new_epoch() if self._refine() else None
        return None

    def _refine(self) -> bool:
        """Start the next epoch; False when the whole space has been offered."""
        for axis in self._axes:
            axis.bar = axis.size
        while any(axis.divisible for axis in self._numeric):
            added = [axis.split() for axis in self._numeric]
            if any(added):
                return True
        return False
