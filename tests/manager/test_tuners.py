"""Behaviour of NNI-compatible search spaces and the Random and GridSearch tuners."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from typing import Any

import pytest
from rich.text import Text

from manager.algorithms import AlgorithmError, create_tuner
from manager.search_space import SearchSpaceError, validate_search_space
from manager.tuners import NativeTuner

# NNI's examples/trials/mnist-nested-search-space layer definition.
NESTED_LAYER: dict[str, Any] = {
    "_type": "choice",
    "_value": [
        {"_name": "Empty"},
        {"_name": "Conv", "kernel_size": {"_type": "choice", "_value": [1, 2, 3, 5]}},
        {"_name": "Max_pool", "pooling_size": {"_type": "choice", "_value": [2, 3, 5]}},
        {"_name": "Avg_pool", "pooling_size": {"_type": "choice", "_value": [2, 3, 5]}},
    ],
}


def draw(space: dict[str, Any], n: int = 4000, seed: int = 7) -> list[dict[str, Any]]:
    tuner = create_tuner("Random", {"seed": seed}, space)
    return [_not_none(tuner.generate_parameters(i)) for i in range(n)]


def draw_one(type_: str, value: list[Any], n: int = 4000) -> list[Any]:
    return [params["x"] for params in draw({"x": {"_type": type_, "_value": value}}, n)]


def grid_all(space: dict[str, Any], limit: int = 100_000) -> list[dict[str, Any]]:
    """Every point GridSearch offers; fails if the space does not run out within `limit`."""
    tuner = create_tuner("GridSearch", None, space)
    points: list[dict[str, Any]] = []
    for i in range(limit):
        params = tuner.generate_parameters(i)
        if params is None:
            assert tuner.generate_parameters(i + 1) is None, "an exhausted grid must stay exhausted"
            return points
        points.append(params)
    raise AssertionError(f"grid did not run out within {limit} points")


def grid_first(space: dict[str, Any], n: int) -> list[dict[str, Any]]:
    tuner = create_tuner("GridSearch", None, space)
    return [_not_none(tuner.generate_parameters(i)) for i in range(n)]


def _not_none(params: dict[str, Any] | None) -> dict[str, Any]:
    assert params is not None
    return params


def canonical(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def is_multiple(x: float, q: float) -> bool:
    return math.isclose(x / q, round(x / q), abs_tol=1e-9)


# --- Random: every type stays in range with the right distribution ----------------------------------


def test_randint_is_half_open_int_range() -> None:
    values = draw_one("randint", [3, 7])
    assert all(type(v) is int for v in values)
    assert set(values) == {3, 4, 5, 6}


def test_uniform_covers_range_evenly() -> None:
    values = draw_one("uniform", [-2, 3])
    assert all(type(v) is float and -2 <= v <= 3 for v in values)
    assert abs(statistics.fmean(values) - 0.5) < 0.15
    assert min(values) < -1.9 and max(values) > 2.9
    assert 0.45 < sum(v < 0.5 for v in values) / len(values) < 0.55


def test_quniform_matches_nni_examples() -> None:
    values = draw_one("quniform", [0, 10, 2.5])
    assert all(type(v) is float for v in values)
    assert set(values) == {0.0, 2.5, 5.0, 7.5, 10.0}
    # The ends only get half a step of the range each: round(u / q) * q.
    assert values.count(0.0) < values.count(5.0) * 0.75
    assert set(draw_one("quniform", [2, 10, 5])) == {2.0, 5.0, 10.0}


def test_quniform_clips_into_bounds() -> None:
    assert set(draw_one("quniform", [0.3, 2.6, 1])) == {0.3, 1.0, 2.0, 2.6}
    assert set(draw_one("quniform", [0.3, 2.2, 1])) == {0.3, 1.0, 2.0}  # round(2.2) stays below high


def test_loguniform_is_uniform_in_log_space() -> None:
    values = draw_one("loguniform", [1e-4, 1])
    assert all(type(v) is float and 1e-4 <= v <= 1 for v in values)
    logs = [math.log10(v) for v in values]
    assert abs(statistics.fmean(logs) + 2) < 0.1
    # Linearly uniform samples would put about 1% below 0.01; log-uniform puts half there.
    assert 0.45 < sum(v < 0.01 for v in values) / len(values) < 0.55


def test_qloguniform_is_quantized_clipped_and_log_distributed() -> None:
    values = draw_one("qloguniform", [1, 1000, 10])
    assert all(type(v) is float and 1 <= v <= 1000 for v in values)
    assert all(is_multiple(v, 10) or v == 1 for v in values)
    assert 1.0 in values  # every x < 5 rounds to 0 and is clipped up to low
    # P(value <= 30) = P(x < 35) = log(35) / log(1000) ~ 0.51; linearly it would be 3.5%.
    assert 0.45 < sum(v <= 30 for v in values) / len(values) < 0.58


def test_normal_has_given_mean_and_sigma() -> None:
    values = draw_one("normal", [10, 2])
    assert all(type(v) is float for v in values)
    assert abs(statistics.fmean(values) - 10) < 0.15
    assert abs(statistics.stdev(values) - 2) < 0.15


def test_qnormal_is_quantized_and_unclipped() -> None:
    values = draw_one("qnormal", [0, 3, 0.5])
    assert all(type(v) is float and is_multiple(v, 0.5) for v in values)
    assert abs(statistics.fmean(values)) < 0.2
    assert abs(statistics.stdev(values) - 3) < 0.2
    assert min(values) < -6 and max(values) > 6


def test_lognormal_log_is_normal() -> None:
    values = draw_one("lognormal", [1, 0.5])
    assert all(type(v) is float and v > 0 for v in values)
    logs = [math.log(v) for v in values]
    assert abs(statistics.fmean(logs) - 1) < 0.05
    assert abs(statistics.stdev(logs) - 0.5) < 0.05


def test_qlognormal_is_quantized_exp_normal() -> None:
    values = draw_one("qlognormal", [2, 0.5, 1])
    assert all(type(v) is float and v >= 0 and v.is_integer() for v in values)
    assert statistics.median(values) in (7.0, 8.0)  # round(e**2) = 7.39 rounds to 7


def test_choice_returns_the_options_themselves() -> None:
    values = draw_one("choice", ["relu", 0.5, 3, None, True, [64, 64]], n=600)
    seen = {json.dumps(v) for v in values}
    assert seen == {'"relu"', "0.5", "3", "null", "true", "[64, 64]"}
    assert {type(v) for v in values} == {str, float, int, type(None), bool, list}


def test_choice_values_do_not_alias_the_search_space() -> None:
    space: dict[str, Any] = {"x": {"_type": "choice", "_value": [[1, 2]]}}
    tuner = create_tuner("Random", {"seed": 1}, space)
    first = _not_none(tuner.generate_parameters(0))
    first["x"].append(3)
    space["x"]["_value"][0].append(4)
    assert _not_none(tuner.generate_parameters(1)) == {"x": [1, 2]}


def test_nested_choice_samples_only_the_chosen_option() -> None:
    samples = [params["layer"] for params in draw({"layer": NESTED_LAYER}, n=2000)]
    assert {layer["_name"] for layer in samples} == {"Empty", "Conv", "Max_pool", "Avg_pool"}
    for layer in samples:
        if layer["_name"] == "Empty":
            assert layer == {"_name": "Empty"}
        elif layer["_name"] == "Conv":
            assert set(layer) == {"_name", "kernel_size"} and layer["kernel_size"] in (1, 2, 3, 5)
        else:
            assert set(layer) == {"_name", "pooling_size"} and layer["pooling_size"] in (2, 3, 5)


def test_nested_continuous_parameters_are_sampled_in_range() -> None:
    space = {
        "optimizer": {
            "_type": "choice",
            "_value": [
                {"_name": "sgd", "lr": {"_type": "loguniform", "_value": [1e-3, 1e-1]}},
                {"_name": "adam", "lr": {"_type": "uniform", "_value": [5, 6]}},
            ],
        }
    }
    for params in draw(space, n=500):
        opt = params["optimizer"]
        low, high = (1e-3, 1e-1) if opt["_name"] == "sgd" else (5, 6)
        assert low <= opt["lr"] <= high


MIXED_SPACE: dict[str, Any] = {
    "a": {"_type": "choice", "_value": [1, "two"]},
    "b": {"_type": "randint", "_value": [0, 100]},
    "c": {"_type": "uniform", "_value": [0, 1]},
    "d": {"_type": "qloguniform", "_value": [1, 100, 1]},
    "e": {"_type": "qnormal", "_value": [0, 1, 0.1]},
    "f": {"_type": "lognormal", "_value": [0, 1]},
    "layer": NESTED_LAYER,
}


def test_same_seed_same_sequence_other_seed_differs() -> None:
    assert draw(MIXED_SPACE, n=50, seed=3) == draw(MIXED_SPACE, n=50, seed=3)
    assert draw(MIXED_SPACE, n=50, seed=3) != draw(MIXED_SPACE, n=50, seed=4)


def test_results_do_not_change_random_sequence() -> None:
    plain = draw(MIXED_SPACE, n=20, seed=5)
    tuner = create_tuner("Random", {"seed": 5, "optimize_mode": "minimize"}, MIXED_SPACE)
    fed = []
    for i in range(20):
        params = _not_none(tuner.generate_parameters(i))
        tuner.receive_trial_result(i, params, float(i))
        fed.append(params)
    assert fed == plain


def test_random_never_runs_out() -> None:
    tuner = create_tuner("random", None, {"x": {"_type": "choice", "_value": [1]}})
    assert all(tuner.generate_parameters(i) == {"x": 1} for i in range(100))


def test_parameters_are_plain_json() -> None:
    for params in draw(MIXED_SPACE, n=200) + grid_first(MIXED_SPACE, 200):
        assert json.loads(json.dumps(params, allow_nan=False)) == params
        assert type(params["b"]) is int
        assert all(type(params[key]) is float for key in "cdef")


# --- GridSearch ---------------------------------------------------------------------------------


def test_grid_enumerates_exact_discrete_product_then_none() -> None:
    space: dict[str, Any] = {
        "act": {"_type": "choice", "_value": ["relu", "tanh", "gelu"]},
        "depth": {"_type": "randint", "_value": [2, 5]},
        "drop": {"_type": "quniform", "_value": [0, 1, 0.5]},
    }
    points = grid_all(space)
    expected = [
        {"act": a, "depth": d, "drop": p}
        for a, d, p in itertools.product(["relu", "tanh", "gelu"], [2, 3, 4], [0.0, 0.5, 1.0])
    ]
    assert len(points) == len(expected) == 27
    assert sorted(map(canonical, points)) == sorted(map(canonical, expected))


def test_grid_skips_the_points_imported_as_nni_s_does() -> None:
    tuner = create_tuner("GridSearch", None, {"a": {"_type": "choice", "_value": [1, 2, 3]}})
    tuner.import_data([{"parameter": {"a": 2}, "value": 0.5}])
    assert [tuner.generate_parameters(i) for i in range(3)] == [{"a": 1}, {"a": 3}, None]
    random = create_tuner("Random", None, {"a": {"_type": "choice", "_value": [1]}})
    random.import_data([{"parameter": {"a": 1}, "value": 0.5}])  # learns nothing: still draws
    assert random.generate_parameters(0) == {"a": 1}


def test_grid_nested_space_is_each_option_product() -> None:
    points = grid_all({"layer0": NESTED_LAYER, "layer1": NESTED_LAYER})
    layers: list[dict[str, Any]] = [{"_name": "Empty"}]
    layers += [{"_name": "Conv", "kernel_size": k} for k in (1, 2, 3, 5)]
    layers += [{"_name": n, "pooling_size": s} for n in ("Max_pool", "Avg_pool") for s in (2, 3, 5)]
    expected = [{"layer0": x, "layer1": y} for x, y in itertools.product(layers, layers)]
    assert len(points) == 121
    assert sorted(map(canonical, points)) == sorted(map(canonical, expected))


def test_grid_quantized_types_find_every_value() -> None:
    assert [p["x"] for p in grid_all({"x": {"_type": "quniform", "_value": [2, 10, 5]}})] == [5.0, 10.0, 2.0]
    values = [p["x"] for p in grid_all({"x": {"_type": "qloguniform", "_value": [1, 100, 1]}})]
    assert sorted(values) == [float(v) for v in range(1, 101)]
    assert values[0] == 10.0  # the log-space midpoint comes first


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("type_", "value"),
    [("quniform", [0.35, 1, 0.1]), ("quniform", [-3, 4.5, 2]), ("qloguniform", [0.5, 20, 0.5])],
)
def test_grid_finds_exactly_the_values_random_reaches(type_: str, value: list[float]) -> None:
    # 0.35 / 0.1 is 3.4999... in floats: the grid must still run out rather than hunt for it forever.
    space = {"x": {"_type": type_, "_value": value}}
    grid_values = [p["x"] for p in grid_all(space)]
    assert len(grid_values) == len(set(grid_values))
    assert set(grid_values) == {p["x"] for p in draw(space, n=20_000)}


@pytest.mark.timeout(20)
def test_grid_unbounded_quantized_runs_out_far_in_the_tails() -> None:
    values = sorted(p["x"] for p in grid_all({"x": {"_type": "qnormal", "_value": [0, 1, 1]}}))
    assert values == [float(v) for v in range(-7, 8)]


def test_grid_repeated_choice_options_are_offered_once() -> None:
    points = grid_all({"x": {"_type": "choice", "_value": [1, 2, 1, [3], [3]]}})
    assert points == [{"x": 1}, {"x": 2}, {"x": [3]}]


def test_grid_continuous_refines_by_halving() -> None:
    values = [p["x"] for p in grid_first({"x": {"_type": "uniform", "_value": [0, 8]}}, 15)]
    assert values[0] == 4.0
    assert sorted(values[1:3]) == [2.0, 6.0]
    assert sorted(values[3:7]) == [1.0, 3.0, 5.0, 7.0]
    assert sorted(values[7:15]) == [0.5 + i for i in range(8)]


def test_grid_continuous_points_are_distinct_and_keep_coming() -> None:
    space = {
        "lr": {"_type": "loguniform", "_value": [1e-4, 1]},
        "m": {"_type": "normal", "_value": [0, 1]},
        "k": {"_type": "choice", "_value": ["a", "b"]},
    }
    points = grid_first(space, 3000)
    assert len({canonical(p) for p in points}) == 3000
    assert all(1e-4 < p["lr"] < 1 for p in points)
    assert math.isclose(points[0]["lr"], 1e-2)  # geometric midpoint of the log range


def test_grid_follows_nni_epoch_order() -> None:
    # The example in NNI's gridsearch_tuner.py: two epochs of choice x normal x quniform.
    space = {
        "x": {"_type": "choice", "_value": [5, 7]},
        "y": {"_type": "normal", "_value": [0, 1]},
        "z": {"_type": "quniform", "_value": [2, 3, 1]},
    }
    points = [(p["x"], round(p["y"], 2), p["z"]) for p in grid_first(space, 12)]
    assert points[:2] == [(5, 0.0, 2.0), (7, 0.0, 2.0)]
    assert points[2:7] == [(5, 0.0, 3.0), (5, -0.67, 2.0), (5, -0.67, 3.0), (5, 0.67, 2.0), (5, 0.67, 3.0)]
    assert points[7:] == [(7, 0.0, 3.0), (7, -0.67, 2.0), (7, -0.67, 3.0), (7, 0.67, 2.0), (7, 0.67, 3.0)]


def test_grid_normal_types_spread_by_quantiles() -> None:
    values = [p["x"] for p in grid_first({"x": {"_type": "lognormal", "_value": [1, 2]}}, 3)]
    assert math.isclose(values[0], math.e)
    assert math.isclose(math.log(values[1]), 1 - 2 * 0.6744897501960817)
    assert math.isclose(math.log(values[2]), 1 + 2 * 0.6744897501960817)
    qvalues = [p["x"] for p in grid_first({"x": {"_type": "qnormal", "_value": [0, 1, 1]}}, 9)]
    assert len(set(qvalues)) == 9 and all(v.is_integer() for v in qvalues)


def test_grid_nested_continuous_parameter_refines_without_repeats() -> None:
    space = {
        "opt": {
            "_type": "choice",
            "_value": [{"_name": "plain"}, {"_name": "sgd", "lr": {"_type": "uniform", "_value": [0, 1]}}],
        }
    }
    points = grid_first(space, 8)
    assert points[:2] == [{"opt": {"_name": "plain"}}, {"opt": {"_name": "sgd", "lr": 0.5}}]
    assert [p["opt"]["_name"] for p in points[2:]] == ["sgd"] * 6
    assert len({canonical(p) for p in points}) == 8


def test_grid_ignores_later_changes_to_the_space() -> None:
    space: dict[str, Any] = {"x": {"_type": "choice", "_value": [1, 2]}}
    tuner = create_tuner("GridSearch", {"optimize_mode": "minimize"}, space)
    space["x"]["_value"].append(3)
    assert [tuner.generate_parameters(i) for i in range(3)] == [{"x": 1}, {"x": 2}, None]


# --- Validation errors name the path and what is expected ------------------------------------------


@pytest.mark.parametrize(
    ("space", "fragments"),
    [
        ({"lr": {"_type": "gaussian", "_value": [0, 1]}}, ["searchSpace.lr._type", "'gaussian'", "choice, randint"]),
        ({"lr": {"_type": 3, "_value": [0, 1]}}, ["searchSpace.lr._type", "supported types are"]),
        ({"lr": {"_type": "uniform", "_value": [0]}}, ["searchSpace.lr._value", "uniform needs two numbers low, high"]),
        ({"lr": {"_type": "uniform", "_value": [0, 1, 2]}}, ["searchSpace.lr._value", "uniform needs"]),
        (
            {"lr": {"_type": "quniform", "_value": [0, 1]}},
            ["searchSpace.lr._value", "quniform needs three numbers"],
        ),
        ({"lr": {"_type": "qnormal", "_value": [0, 1]}}, ["searchSpace.lr._value", "three numbers mu, sigma, q"]),
        ({"lr": {"_type": "uniform", "_value": [1, 1]}}, ["searchSpace.lr._value", "low < high", "[1, 1]"]),
        ({"lr": {"_type": "uniform", "_value": [2, 1]}}, ["searchSpace.lr._value", "low < high"]),
        ({"lr": {"_type": "quniform", "_value": [0, 1, 0]}}, ["searchSpace.lr._value", "q > 0"]),
        ({"lr": {"_type": "uniform", "_value": [0, math.inf]}}, ["searchSpace.lr._value", "uniform needs"]),
        ({"lr": {"_type": "uniform", "_value": [0, "1"]}}, ["searchSpace.lr._value", "uniform needs"]),
        ({"lr": {"_type": "uniform", "_value": [False, True]}}, ["searchSpace.lr._value", "uniform needs"]),
        ({"lr": {"_type": "uniform", "_value": "0,1"}}, ["searchSpace.lr._value", "uniform needs"]),
        (
            {"lr": {"_type": "loguniform", "_value": [0, 1]}},
            ["searchSpace.lr._value: loguniform needs two numbers low, high with 0 < low < high"],
        ),
        ({"lr": {"_type": "qloguniform", "_value": [-1, 1, 0.1]}}, ["searchSpace.lr._value", "0 < low"]),
        ({"lr": {"_type": "normal", "_value": [0, 0]}}, ["searchSpace.lr._value", "sigma > 0"]),
        ({"lr": {"_type": "lognormal", "_value": [0, -1]}}, ["searchSpace.lr._value", "sigma > 0"]),
        ({"n": {"_type": "randint", "_value": [0.5, 3]}}, ["searchSpace.n._value", "integers"]),
        ({"n": {"_type": "randint", "_value": [3, 3]}}, ["searchSpace.n._value", "lower < upper"]),
        ({"n": {"_type": "randint", "_value": [3]}}, ["searchSpace.n._value", "randint needs"]),
        ({"c": {"_type": "choice", "_value": []}}, ["searchSpace.c._value", "non-empty list"]),
        ({"c": {"_type": "choice", "_value": "abc"}}, ["searchSpace.c._value", "non-empty list"]),
        ({"c": {"_type": "choice", "_value": [1, math.nan]}}, ["searchSpace.c._value[1]", "choice options"]),
        ({"c": {"_type": "choice", "_value": [1, {1, 2}]}}, ["searchSpace.c._value[1]", "choice options"]),
        ({"c": {"_type": "choice", "_value": [{"_name": 3, "k": 1}]}}, ["searchSpace.c._value[0]._name", "nested"]),
        ({"c": {"_type": "choice"}}, ["searchSpace.c:", '"_value"']),
        ({"c": [1, 2]}, ["searchSpace.c:", '"_type"']),
        ({"": {"_type": "choice", "_value": [1]}}, ["searchSpace:", "non-empty strings"]),
        ({}, ["searchSpace:", "at least one parameter"]),
        (
            {"layer": {"_type": "choice", "_value": [{"_name": "a"}, {"_name": "a"}]}},
            ["searchSpace.layer._value[1]._name", "duplicate", "'a'"],
        ),
        (
            {"layer": {"_type": "choice", "_value": [{"_name": "c", "k": {"_type": "uniform", "_value": [3, 1]}}]}},
            ["searchSpace.layer._value[0].k._value", "uniform needs"],
        ),
        (
            {"layer": {"_type": "choice", "_value": [{"_name": "c", "k": {"_type": "nope", "_value": [1]}}]}},
            ["searchSpace.layer._value[0].k._type", "unknown type"],
        ),
    ],
)
def test_invalid_search_space_names_path(space: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(SearchSpaceError) as caught:
        validate_search_space(space)
    for fragment in fragments:
        assert fragment in str(caught.value)
    with pytest.raises(SearchSpaceError):
        create_tuner("Random", None, space)


def test_search_space_must_be_a_mapping() -> None:
    with pytest.raises(SearchSpaceError, match=r"^searchSpace: expected a mapping"):
        validate_search_space([{"_type": "choice", "_value": [1]}])  # type: ignore[arg-type]


def test_valid_spaces_pass_validation() -> None:
    validate_search_space(MIXED_SPACE)
    validate_search_space(
        {"x": {"_type": "quniform", "_value": [0, 10, 2.5]}, "y": {"_type": "choice", "_value": [[]]}}
    )


def test_search_space_error_is_a_value_error() -> None:
    assert issubclass(SearchSpaceError, ValueError)
    with pytest.raises(SearchSpaceError):
        create_tuner("Random", None, {"x": {"_type": "bad", "_value": []}})


def test_a_dict_option_without_name_is_a_plain_value() -> None:
    """NNI's BatchTuner example offers whole parameter sets as a choice of plain dicts."""
    sets = [{"lr": 0.1, "depth": 2}, {"lr": 0.01, "depth": 3}]
    tuner = create_tuner("GridSearch", None, {"combo": {"_type": "choice", "_value": sets}})
    assert [tuner.generate_parameters(i) for i in range(3)] == [{"combo": sets[0]}, {"combo": sets[1]}, None]


def test_only_a_tuner_with_its_own_space_takes_an_empty_one() -> None:
    validate_search_space({}, allow_empty=True)
    with pytest.raises(SearchSpaceError, match="must define at least one parameter"):
        validate_search_space({})


# --- Tuner construction ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Random", "random", "RANDOM", "GridSearch", "gridsearch", "GRIDSEARCH"])
def test_tuner_names_are_case_insensitive(name: str) -> None:
    tuner: NativeTuner = create_tuner(name, {}, {"x": {"_type": "choice", "_value": [1]}})
    assert tuner.generate_parameters(0) == {"x": 1}


@pytest.mark.parametrize("name", ["Grid_Search", "", "Randomized"])
def test_unknown_tuner_lists_supported(name: str) -> None:
    with pytest.raises(AlgorithmError) as caught:
        create_tuner(name, None, {"x": {"_type": "choice", "_value": [1]}})
    assert str(caught.value).startswith(f"unknown tuner {name!r}: supported tuners are Random, GridSearch, TPE, ")
    assert caught.value.key == "name"


@pytest.mark.parametrize(
    ("name", "class_args", "fragments"),
    [
        ("Random", {"sead": 1}, ["unknown classArg 'sead'", "accepted classArgs are seed, optimize_mode"]),
        ("GridSearch", {"seed": 1}, ["unknown classArg 'seed' for GridSearch", "are optimize_mode"]),
        ("random", {"seed": "1"}, ["seed: expected an integer", "'1'"]),
        ("Random", {"seed": True}, ["seed: expected an integer"]),
        ("GridSearch", {"optimize_mode": "max"}, ["optimize_mode: expected one of maximize, minimize"]),
    ],
)
def test_bad_class_args_are_named(name: str, class_args: Any, fragments: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        create_tuner(name, class_args, {"x": {"_type": "choice", "_value": [1]}})
    assert not isinstance(caught.value, SearchSpaceError)
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_optimize_mode_is_kept() -> None:
    space = {"x": {"_type": "choice", "_value": [1]}}
    random_tuner: Any = create_tuner("Random", None, space)
    grid_tuner: Any = create_tuner("GridSearch", {"optimize_mode": "minimize"}, space)
    assert (random_tuner.optimize_mode, grid_tuner.optimize_mode) == ("maximize", "minimize")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"_type": "uniform", "_value": [2, 1]},
            "searchSpace.lr._value: uniform needs two numbers low, high with low < high; got [2, 1]",
        ),
        (
            {"_type": "randint", "_value": [3, 3]},
            "searchSpace.lr._value: randint needs two integers lower, upper with lower < upper; got [3, 3]",
        ),
        (
            {"_type": "qnormal", "_value": [0, 1]},
            "searchSpace.lr._value: qnormal needs three numbers mu, sigma, q with sigma > 0 and q > 0; got [0, 1]",
        ),
    ],
)
def test_a_reversed_or_malformed_range_names_what_it_needs_in_full(spec: dict[str, Any], message: str) -> None:
    """The text is whole, and stays whole on a terminal that reads `[word]` as markup."""
    with pytest.raises(SearchSpaceError) as error:
        validate_search_space({"lr": spec})
    assert str(error.value) == message
    assert Text.from_markup(str(error.value)).plain == message


def test_architecture_choices_are_only_for_the_tuners_that_search_architectures() -> None:
    layers = {"conv": {"_type": "layer_choice", "_value": ["conv3x3", "conv5x5"]}}
    with pytest.raises(SearchSpaceError, match=r"^searchSpace.conv._type: layer_choice is an architecture choice"):
        validate_search_space(layers)
    validate_search_space(layers, nas=True)
    validate_search_space(
        {"skip": {"_type": "input_choice", "_value": {"candidates": [0, 1], "n_chosen": 1}}}, nas=True
    )
    with pytest.raises(SearchSpaceError, match=r"^searchSpace.skip._value: input_choice needs candidates"):
        validate_search_space(
            {"skip": {"_type": "input_choice", "_value": {"candidates": [0], "n_chosen": 2}}}, nas=True
        )
