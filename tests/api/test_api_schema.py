"""The served OpenAPI schema against the manager that serves it: schemathesis generates requests for every
operation of /api/v1 (bounded and derandomized, so a run is repeatable) against a real manager with a
real, finished experiment in Redis, and checks that no answer is a 5xx and every documented answer
matches its schema.

Half the generated experiment ids are swapped for the real experiment's (decided by the generated id
itself, so the choice is as repeatable as the rest): handlers then reach its log and views instead of
stopping at a 404. Left out, and why:
- `GET .../events/stream`: Server-Sent Events never end, so there is no response to check; the stream
  is tested by tests/api/test_api.py.
- `DELETE /experiments/{id}` keeps the generated id: deleting the fixture's experiment mid-run would
  turn every later request into a 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance

from simulators.waiting import wait_until
from tests.api.test_api import experiment_config, write_trial
from tests.conftest import Processes
from tests.support import web


@pytest.fixture(scope="module")
def manager(module_processes: Processes, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A manager the module shares, and the id of a finished experiment of two trials it ran."""
    module_processes.worker()
    url = module_processes.manager()
    code = write_trial(tmp_path_factory.mktemp("api-schema") / "code")
    (code / "gates" / "all").touch()
    created = web.post(f"{url}/api/v1/experiments", json={"config": experiment_config(code, trials=2)})
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]
    wait_until(lambda: web.get(f"{url}/api/v1/experiments/{experiment_id}").json()["status"] == "DONE", 60, what="DONE")
    yield url, experiment_id
    assert "Traceback" not in module_processes.logs(), module_processes.logs()[-4000:]


@pytest.fixture
def api_schema(manager: tuple[str, str]) -> Any:
    url, _ = manager
    return schemathesis.openapi.from_url(f"{url}/openapi.json")


FUZZING = settings(  # repeatable, bounded, and patient with a real server
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)
NNI_PATHS = r"(^/api/v1/nni/|^/nni/)"
pytestmark = pytest.mark.xdist_group("api-schema")  # one shared manager, started once
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path_regex=r"/events/stream$")
native = schema.exclude(path_regex=NNI_PATHS)
# NNI's REST API keeps NNI's wire quirks (`/version` is the bare text 3.0.0 typed as JSON, an unknown trial
# is a 200 with an empty body): its reads are fuzzed for server errors only; its shapes are checked against
# NNI's own client classes in tests/api/test_api_nni.py and tests/api/test_nni_client.py.
nni_reads = schema.include(path_regex=NNI_PATHS, method="GET")


@pytest.mark.timeout(900)
@native.parametrize()
@settings(FUZZING, max_examples=30)
def test_every_operation_answers_within_its_schema_and_never_with_a_server_error(
    case: Any, manager: tuple[str, str]
) -> None:
    url, experiment_id = manager
    parameters = case.path_parameters or {}
    generated = parameters.get("experiment_id")
    if isinstance(generated, str) and len(generated) % 2 == 0 and case.method.upper() != "DELETE":
        parameters["experiment_id"] = experiment_id
    case.call_and_validate(base_url=url, checks=[not_a_server_error, response_schema_conformance], timeout=30)


@pytest.mark.timeout(900)
@nni_reads.parametrize()
@settings(FUZZING, max_examples=15)
def test_nni_reads_never_answer_with_a_server_error(case: Any, manager: tuple[str, str]) -> None:
    url, experiment_id = manager
    parameters = case.path_parameters or {}
    generated = parameters.get("experiment_id")
    if isinstance(generated, str) and len(generated) % 2 == 0:
        parameters["experiment_id"] = experiment_id
    case.call_and_validate(base_url=url, checks=[not_a_server_error], timeout=30)


def test_the_schema_is_served(manager: tuple[str, str]) -> None:
    """The document the fuzzing above reads: every operation of /api/v1 is in it."""
    url, _ = manager
    paths = web.get(f"{url}/openapi.json").json()["paths"]
    assert "/api/v1/experiments/{experiment_id}/trials" in paths


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/trials?offset=99999999999999999999999", None),  # past Redis's 64-bit index
        ("GET", "/events?after=99999999999999999999999-0", None),  # a position XRANGE refuses
        ("GET", "/events?after=1-99999999999999999999999", None),
        ("GET", "/events?after=\uff11-0", None),  # a full-width digit: int() reads it, Redis refuses it
        ("GET", "/events/stream?after=zz", None),  # was a stream that broke after its 200
        ("PUT", "/cluster-metadata/key", '{"value": "\\ud800"}'),  # a lone surrogate Redis cannot encode
        ("POST", "/trials", '{"parameters": {"\\ud800": 1}}'),
        ("PATCH", "", '{"searchSpace": {"\\ud800": {"_type": "choice", "_value": [1]}}}'),
    ],
)
def test_requests_that_were_server_errors_are_the_client_s_mistake(
    manager: tuple[str, str], method: str, path: str, body: str | None
) -> None:
    url, experiment_id = manager
    answer = web.request(
        method,
        f"{url}/api/v1/experiments/{experiment_id}{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 422, answer.text  # refused before anything reaches Redis
    stream = web.get(f"{url}/api/v1/experiments/{experiment_id}/events/stream", headers={"Last-Event-ID": "x-1"})
    assert stream.status_code == 422


def test_a_lone_surrogate_in_a_new_experiment_is_refused_before_anything_is_written(manager: tuple[str, str]) -> None:
    url, _ = manager
    ids = lambda: [state["id"] for state in web.get(f"{url}/api/v1/experiments").json()]  # noqa: E731
    before = ids()
    answer = web.post(
        f"{url}/api/v1/experiments",
        content='{"config": {"trialCommand": "\\ud800"}}',
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 422, answer.text
    assert ids() == before
