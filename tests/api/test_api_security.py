"""The manager's API guards, on real `trialstream manager` processes: no open network bind without a
token, Host and Origin (DNS rebinding, other sites' pages), the token itself (header, login cookie, token
file), body limits, CORS, what cluster metadata may be set, and secrets (an SSH
password, the Redis password, the token) kept out of every answer, event and log line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from core.connections import connect
from core.variables import PREFIX
from manager.api.app import MAX_BODY_BYTES, TOKEN_COOKIE
from simulators.waiting import wait_until
from tests.api.test_api import experiment_config, write_trial
from tests.conftest import REPO, Processes, RedisServer, free_port, processes_on_own_redis
from tests.support import web

TOKEN_ENV = f"{PREFIX}MANAGER_TOKEN"
TOKEN = "tok-3c1f0e9a-do-not-leak"
NO_TOKEN = {TOKEN_ENV: ""}  # whatever the environment running the tests holds

pytestmark = pytest.mark.xdist_group("api-security")  # the guarded and the open manager are started once


def refused_start(processes: Processes, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Start a manager that must refuse to start: its exit status and its output."""
    port = free_port()
    process = processes.start("manager", "--port", str(port), *args, env={**NO_TOKEN, **(env or {})})
    code = process.wait(30)
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "something listens on the refused manager's port"
    output = processes.logs().strip().splitlines()
    return code, output[-1] if output else ""


def test_a_network_bind_without_a_token_is_refused_at_start(processes: Processes) -> None:
    code, message = refused_start(processes, "--host", "0.0.0.0")
    assert code != 0
    assert "0.0.0.0 is not a loopback address" in message and TOKEN_ENV in message, message
    assert "Traceback" not in processes.logs()


def answers(url: str) -> bool:
    try:
        return web.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_manager_given_no_token_makes_one_for_its_user_and_that_users_cli_finds_it(
    processes: Processes, tmp_path: Path
) -> None:
    """Loopback is open to every user of the machine (who could send an experiment whose trials run as the manager's
    user): given no token, and not --no-token, a manager makes one, in a file only its user reads. That user's CLI
    finds it; a request without it is refused; the log names the file, never the token; it goes with the manager."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    env = {**NO_TOKEN, "XDG_RUNTIME_DIR": str(runtime)}
    port = free_port()
    process = processes.start("manager", "--port", str(port), env=env)
    url = f"http://127.0.0.1:{port}"
    made = runtime / "trialstream" / f"manager-{port}.token"
    wait_until(lambda: answers(f"{url}/api/v1/health"), 30, what="the manager to answer")
    assert made.stat().st_mode & 0o777 == 0o600 and made.parent.stat().st_mode & 0o777 == 0o700
    token = made.read_text().strip()
    assert web.get(f"{url}/api/v1/experiments").status_code == 401
    assert web.get(f"{url}/api/v1/experiments", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    cli = [sys.executable, "-m", "manager.cli", "--manager", url, "experiments", "list", "--json"]
    listed = subprocess.run(cli, env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    assert str(made) in processes.logs() and token not in processes.logs()
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0
    assert not made.exists()
    code, message = refused_start(processes, "--no-token", env={TOKEN_ENV: "a-token"})
    assert code != 0 and "--no-token, and a token given" in message, message


def test_an_empty_token_file_is_refused(processes: Processes, tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    code, message = refused_start(processes, "--host", "0.0.0.0", "--token-file", str(empty))
    assert code != 0 and f"--token-file {empty} is empty" in message, message


def test_a_token_file_host_or_port_that_cannot_be_used_is_refused_at_start(
    processes: Processes, tmp_path: Path
) -> None:
    """Each named with its option, in one line: an unreadable token file and a host name that resolves to nothing
    were tracebacks (FileNotFoundError, socket.gaierror); --port 99999 was announced, and 99999 - 65536 served."""
    absent = tmp_path / "absent"
    for arguments, reason in (
        (("--token-file", str(absent)), f"--token-file {absent}: cannot read it (No such file or directory)"),
        (("--token-file", str(tmp_path)), f"--token-file {tmp_path}: cannot read it (Is a directory)"),
        (("--host", "no.such.host.invalid"), "--host no.such.host.invalid: no such address ("),
        (("--port", "99999"), "--port 99999: give a port from 1 to 65535"),
    ):
        code, message = refused_start(processes, *arguments)
        assert code != 0 and reason in message, message
    assert "Traceback" not in processes.logs()


def test_a_port_in_use_or_an_unknown_host_is_said_before_the_manager_says_it_serves(processes: Processes) -> None:
    """The manager binds before it announces itself or starts experiments: left to uvicorn, a port in use was
    announced as served, then only logged as uvicorn's bind error (exit 3), and with a token, an unknown
    --host the same way."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, message = refused_start(processes, "--port", str(port))
    assert code == 1 and message == f"trialstream: error: --port {port}: 127.0.0.1:{port} is in use; stop what " + (
        "listens there, or choose another port"
    ), message
    code, message = refused_start(processes, "--host", "no.such.host.invalid", env={TOKEN_ENV: TOKEN})
    assert code == 1 and "--host no.such.host.invalid: no such address (" in message, message
    assert "manager on" not in processes.logs() and "Traceback" not in processes.logs()


def test_a_url_prefix_the_web_ui_would_misread_and_unsafe_host_or_origin_options_are_refused_at_start(
    processes: Processes,
) -> None:
    """Every prefix routes (tests/api/test_api_nni.py); one NNI's web UI cannot read back from its page's path
    (issue 24, A6; which ones: tests/api/test_api_nni.py) is refused with the reason; so are an --allowed-host
    with a port and, with no token, `--cors-origin '*'` (every site's pages could drive the manager)."""
    for arguments, reason in (
        (("--url-prefix", "oview/ui"), "cutting the first '/oview'"),
        (("--allowed-host", "proxy.example:8080"), "without a port"),
        (("--cors-origin", "*"), "give it a token"),
    ):
        code, message = refused_start(processes, *arguments)
        assert code != 0 and f"{arguments[0]} {arguments[1]}: " in message and reason in message, message


@pytest.fixture(scope="module")
def guarded(module_processes: Processes) -> str:
    """A manager bound to every address (allowed: it has a token), reached through loopback; its tests only
    read, so they share it."""
    return module_processes.manager("--host", "0.0.0.0", env={TOKEN_ENV: TOKEN})


def test_the_token_is_required_everywhere_but_health(guarded: str, module_processes: Processes) -> None:
    api = f"{guarded}/api/v1"
    assert web.get(f"{api}/health").status_code == 200  # open: a container health check has no token
    for path in ("/experiments", "/ready", "/experiments/x/trials", "/openapi.json", "/docs"):
        url = guarded + path if path.startswith("/openapi") or path == "/docs" else api + path
        missing = web.get(url)
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer", (path, missing.text)
        assert web.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert web.get(url, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
        assert web.get(url, cookies={TOKEN_COOKIE: "wrong"}).status_code == 401
    assert web.post(f"{api}/experiments", json={"config": {}}).status_code == 401  # refused before the body
    good = web.get(f"{api}/experiments", headers={"Authorization": f"Bearer {TOKEN}"})
    assert good.status_code == 200 and good.json() == []

    wrong = web.get(f"{guarded}/login", params={"token": "wrong"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    login = web.get(f"{guarded}/login", params={"token": TOKEN})
    assert login.status_code == 303
    cookie = login.headers["set-cookie"]
    assert cookie.startswith(f"{TOKEN_COOKIE}=") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert web.get(f"{api}/experiments", cookies=login.cookies).status_code == 200
    assert TOKEN not in module_processes.logs()


def test_the_web_ui_manifest_alone_is_served_without_the_token(guarded: str) -> None:
    """index.html links `./manifest.json` with no `crossorigin`, so a browser fetches it without the cookie:
    that public file of NNI's build is open, at the root and under an experiment's prefix, and nothing else
    of that name is (a trial's own `manifest.json` stays behind the token)."""
    for path in ("/manifest.json", "/nni/some-experiment/manifest.json"):
        manifest = web.get(guarded + path)
        assert manifest.status_code == 200 and "start_url" in manifest.json(), (path, manifest.text)
    for path in (
        "/api/v1/nni/trial-file/abc/manifest.json",
        "/nni/x/api/v1/nni/trial-file/abc/manifest.json",
        "/static/manifest.json",
        "/manifest.json/x",
    ):
        assert web.get(guarded + path).status_code == 401, path


class Open:
    """A manager with no token and no other option, on a Redis of its own that no test flushes: the tests
    that need nothing else of it share it, each isolating by the experiments it creates."""

    def __init__(self, processes: Processes) -> None:
        self.processes = processes
        self.url = processes.manager(env=NO_TOKEN)
        self.client = connect(processes.redis_url)

    def experiment_ids(self) -> list[str]:
        return sorted(experiment["id"] for experiment in web.get(f"{self.url}/api/v1/experiments").json())


@pytest.fixture(scope="module")
def open_manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Open]:
    with processes_on_own_redis(tmp_path_factory.mktemp("open")) as running:
        yield Open(running)


def test_a_token_file(processes: Processes, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    url = processes.manager("--token-file", str(token_file), env=NO_TOKEN)
    assert web.get(f"{url}/api/v1/experiments").status_code == 401
    assert web.get(f"{url}/api/v1/experiments", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_bodies_over_the_limit_are_refused_whether_or_not_they_say_their_length(open_manager: Open) -> None:
    url = open_manager.url
    over = b"x" * (MAX_BODY_BYTES + 1)
    declared = web.post(f"{url}/api/v1/experiments", content=over, headers={"content-type": "application/json"})
    assert declared.status_code == 413, declared.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b" " * 65536

    chunked = web.post(f"{url}/api/v1/experiments", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    assert chunked.json() == {"error": f"request body over {MAX_BODY_BYTES} bytes"}
    # under the limit, the same path answers as usual (an invalid config, not a size problem)
    small = web.post(f"{url}/api/v1/experiments", json={"config": {}})
    assert small.status_code == 422, small.text
    assert web.get(f"{url}/api/v1/health").status_code == 200  # the manager is still serving
    assert "Traceback" not in open_manager.processes.logs()


def test_cors_is_off_unless_an_origin_is_configured(open_manager: Open, processes: Processes) -> None:
    """Without --cors-origin another site's page is refused outright (the Origin rule), preflight or not."""
    origin = "http://ui.example"
    plain = open_manager.url
    answer = web.get(f"{plain}/api/v1/experiments", headers={"Origin": origin})
    assert answer.status_code == 403 and "access-control-allow-origin" not in answer.headers
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    refused = web.options(f"{plain}/api/v1/experiments", headers=preflight)
    assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers

    allowing = processes.manager("--cors-origin", origin, env=NO_TOKEN)
    answer = web.get(f"{allowing}/api/v1/experiments", headers={"Origin": origin})
    assert answer.headers["access-control-allow-origin"] == origin
    checked = web.options(f"{allowing}/api/v1/experiments", headers=preflight)
    assert checked.status_code == 200 and checked.headers["access-control-allow-origin"] == origin
    other = web.get(f"{allowing}/api/v1/experiments", headers={"Origin": "http://evil.example"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_cors_with_a_token_answers_the_preflight_and_marks_the_answers(processes: Processes) -> None:
    """A browser's preflight never carries the token: CORS answers it before the token is asked for."""
    origin = "http://ui.example"
    url = processes.manager("--cors-origin", origin, env={TOKEN_ENV: TOKEN})
    preflight = web.options(
        f"{url}/api/v1/experiments",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answer = web.get(f"{url}/api/v1/experiments", headers={"Origin": origin, "Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    refused = web.get(f"{url}/api/v1/experiments", headers={"Origin": origin})  # the page can tell it needs the token
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin
    other = web.get(f"{url}/api/v1/experiments", headers={"Origin": "http://evil.example"})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_the_token_cookie_is_read_beside_another_apps_malformed_cookie(guarded: str) -> None:
    """Browsers send every cookie of the host: one another app set (a JSON value) must not hide ours."""
    cookies = f'other={{"a": 1}}; {TOKEN_COOKIE}={TOKEN}; last=1'
    assert web.get(f"{guarded}/api/v1/experiments", headers={"Cookie": cookies}).status_code == 200
    wrong = f'other={{"a": 1}}; {TOKEN_COOKIE}=wrong'
    assert web.get(f"{guarded}/api/v1/experiments", headers={"Cookie": wrong}).status_code == 401


def test_login_takes_a_base64_token_as_it_is_written(processes: Processes) -> None:
    """`+` in a query is a `+` (only form bodies make it a space): a base64 token pasted into the URL works."""
    token = "b64+tok/3c1f+0e9a=="
    url = processes.manager(env={TOKEN_ENV: token})
    login = web.get(f"{url}/login?token={token}")
    assert login.status_code == 303, login.text
    assert web.get(f"{url}/api/v1/experiments", cookies=login.cookies).status_code == 200
    assert web.get(f"{url}/login", params={"token": token}).status_code == 303  # percent-encoded: %2B, %2F, %3D
    assert web.get(f"{url}/login?token={token.replace('+', ' ')}").status_code == 401


def test_login_redirects_only_within_the_manager(guarded: str) -> None:
    """However the login path starts, the redirect is a path of this host, never `//elsewhere`."""
    for path, target in (
        ("/login", "/oview"),
        ("//evil.example/login", "/evil.example/oview"),
        ("///evil.example/login", "/evil.example/oview"),
        ("/%5Cevil.example/login", "/%5Cevil.example/oview"),  # a browser reads `/\` as `//`
        ("/%09/evil.example/login", "/%09/evil.example/oview"),  # and drops a tab
    ):
        login = web.get(f"{guarded}{path}?token={TOKEN}")
        assert login.status_code == 303, (path, login.text)
        assert login.headers["location"] == target, path


def test_an_ssh_password_is_not_in_the_refusal(open_manager: Open, tmp_path: Path) -> None:
    password = "ssh-pa55-7d1e-do-not-leak"
    url = open_manager.url
    before = open_manager.experiment_ids()
    config = experiment_config(write_trial(tmp_path / "code"), trials=1)
    config["trainingService"] = {
        "platform": "remote",
        "machineList": [{"host": "127.0.0.1", "port": free_port(), "user": "nobody", "password": password}],
    }
    answer = web.post(f"{url}/api/v1/experiments", json={"config": config})
    assert answer.status_code in (409, 422), answer.text
    assert password not in answer.text and "127.0.0.1" in answer.text  # it names the machine, not its password
    assert open_manager.experiment_ids() == before  # none created
    assert password not in open_manager.processes.logs()


def test_a_config_sent_over_the_api_reads_no_file_of_the_managers_host(open_manager: Open, tmp_path: Path) -> None:
    """searchSpaceFile would have the manager read any file it may (its answer quoted what it found there): a
    config sent to it carries its space inline, as the CLI sends it."""
    secret = tmp_path / "secret.json"
    secret.write_text('{"do-not-leak-7f3e": 1}')
    before = open_manager.experiment_ids()
    config = experiment_config(write_trial(tmp_path / "code"), trials=1)
    del config["searchSpace"]
    for key in ("searchSpaceFile", "search_space_file"):
        answer = web.post(f"{open_manager.url}/api/v1/experiments", json={"config": {**config, key: str(secret)}})
        assert answer.status_code == 422, answer.text
        assert "do-not-leak" not in answer.text
        assert "searchSpaceFile: a config sent to the manager carries its search space as searchSpace" in answer.text
    assert open_manager.experiment_ids() == before


def test_no_page_may_frame_any_answer(open_manager: Open) -> None:
    """A site's page framing the web UI would have its clicks sent as the UI's own: every answer, a refusal
    too, says DENY; the timeline keeps its own policy, which says the same."""
    url = open_manager.url
    for path, headers in (
        ("/oview", {}),
        ("/api/v1/experiments", {}),
        ("/api/v1/experiments", {"Host": "evil.example"}),  # refused
        ("/timeline/", {}),
    ):
        answer = web.get(f"{url}{path}", headers=headers)
        assert answer.headers["x-frame-options"] == "DENY", path
        assert answer.headers.get_list("content-security-policy") != [], path
        assert all("frame-ancestors 'none'" in policy for policy in answer.headers.get_list("content-security-policy"))


def test_the_config_cluster_metadata_cannot_be_put(open_manager: Open, tmp_path: Path) -> None:
    """PUT cluster-metadata of `platform_config` or `trial_config` (issue 24, A7), valid or not, is refused
    with the key and what to do instead: an SSH password sent there is in no answer, event or stream, and
    the next trials run with the section the platform checked. Any other key is stored as before."""
    password = "ssh-pa55-5e0c-do-not-leak"
    api = f"{open_manager.url}/api/v1"
    created = web.post(f"{api}/experiments", json={"config": experiment_config(write_trial(tmp_path / "code"))})
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]
    base = f"{api}/experiments/{experiment_id}/cluster-metadata"
    platform_before = web.get(f"{base}/platform_config").json()
    trial_before = web.get(f"{base}/trial_config").json()
    machine = {"host": "127.0.0.1", "port": free_port(), "user": "nobody", "password": password}
    for key, value in (
        ("platform_config", {"platform": "remote", "machineList": [machine]}),
        ("platform_config", {"platform": "remote", "machineList": [{**machine, "nosuchkey": 1}]}),
        ("platform_config", {"platform": "nope"}),
        ("trial_config", {"command": "id > pwned.txt", "codeDirectory": str(tmp_path)}),
    ):
        refused = web.put(f"{base}/{key}", json={"value": json.dumps(value)})
        assert refused.status_code == 409, refused.text
        assert f"{key!r}" in refused.json()["error"] and "create an experiment" in refused.json()["error"]
        assert password not in refused.text
    assert web.get(f"{base}/platform_config").json() == platform_before
    assert web.get(f"{base}/trial_config").json() == trial_before
    events = web.get(f"{api}/experiments/{experiment_id}/events", params={"limit": 10000})
    assert events.status_code == 200 and password not in events.text and "pwned" not in events.text
    stream = json.dumps(open_manager.client.xrange(f"ts:exp:{experiment_id}:events"), default=str)
    assert "ClusterMetadataSet" in stream and password not in stream and "pwned" not in stream
    note = web.put(f"{base}/note", json={"value": "kept"})
    assert note.status_code == 200 and web.get(f"{base}/note").json() == {"value": "kept"}


def test_without_a_token_another_host_or_sites_page_changes_nothing(open_manager: Open, tmp_path: Path) -> None:
    """DNS rebinding and cross-site requests against a manager with no token (issue 24, A4): a request whose
    Host is not a loopback name (nor an --allowed-host), or whose Origin is not the manager's own, is
    refused before it creates or changes anything, the event stream included. Its own pages still write."""
    url = open_manager.url
    port = int(url.rsplit(":", 1)[1])
    before = open_manager.experiment_ids()  # the other tests' experiments on this manager
    api = f"{url}/api/v1"
    code = write_trial(tmp_path / "code")
    created = web.post(f"{api}/experiments", json={"config": experiment_config(code, trials=2, concurrency=1)})
    assert created.status_code == 201, created.text
    experiment_id = created.json()["id"]
    attack = {"config": experiment_config(code, trials=1, trialCommand="id > pwned.txt")}
    more = {"params": {"trialConcurrency": 50}}
    rebound = {"Host": f"attacker.example:{port}"}
    for headers, named in ((rebound, "Host"), ({"Origin": f"http://attacker.example:{port}"}, "Origin")):
        answers = [
            web.post(f"{api}/experiments", json=attack, headers=headers),
            web.patch(f"{api}/experiments/{experiment_id}", json={"trialConcurrency": 50}, headers=headers),
            web.put(f"{api}/nni/experiment?update_type=TRIAL_CONCURRENCY", json=more, headers=headers),
            web.post(f"{api}/experiments/{experiment_id}/stop", headers=headers),
            web.get(f"{api}/experiments", headers=headers),
        ]
        for answer in answers:
            assert answer.status_code == 403 and answer.json()["error"].startswith(named), answer.text
        with web.stream("GET", f"{api}/experiments/{experiment_id}/events/stream", headers=headers) as events:
            assert events.status_code == 403
    assert open_manager.experiment_ids() == sorted([*before, experiment_id])
    state = web.get(f"{api}/experiments/{experiment_id}").json()
    assert state["status"] == "RUNNING" and state["config"]["trialConcurrency"] == 1

    for host in (
        "localhost",
        f"localhost:{port}",
        f"LocalHost.:{port}",
        f"ui.localhost:{port}",
        f"127.0.0.1:{port}",
        f"127.8.9.10:{port}",
        f"[::1]:{port}",
    ):
        assert web.get(f"{api}/experiments", headers={"Host": host}).status_code == 200, host
    for host in (
        "attacker.example",
        f"127.0.0.1.attacker.example:{port}",
        f"localhost.attacker.example:{port}",
        f"0.0.0.0:{port}",
        f"10.0.0.5:{port}",
        f"attacker.example@localhost:{port}",
        f"[::1:{port}",
    ):
        assert web.get(f"{api}/experiments", headers={"Host": host}).status_code == 403, host
    own = {"Host": f"localhost:{port}"}
    for origin in ("null", f"http://localhost:{port + 1}", f"http://127.0.0.1:{port}", "http://localhost"):
        refused = web.post(f"{api}/experiments", json=attack, headers={**own, "Origin": origin})
        assert refused.status_code == 403, origin
    answer = web.post(f"{api}/experiments", json={"config": {}}, headers={**own, "Origin": f"http://localhost:{port}"})
    assert answer.status_code == 422, answer.text  # past the guard: an invalid config
    assert open_manager.experiment_ids() == sorted([*before, experiment_id])
    # what the web UI does: a write from its own page
    page = {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}"}
    edited = web.put(
        f"{api}/nni/experiment?update_type=TRIAL_CONCURRENCY", json={"params": {"trialConcurrency": 2}}, headers=page
    )
    assert edited.status_code == 200, edited.text
    wait_until(
        lambda: web.get(f"{api}/experiments/{experiment_id}").json()["config"]["trialConcurrency"] == 2,
        10,
        what="the edit",
    )


def test_an_allowed_host_is_answered_without_a_token(processes: Processes) -> None:
    """`--allowed-host NAME` (a reverse proxy's name): its Host and its pages' Origin are answered too."""
    url = processes.manager("--allowed-host", "Proxy.Example", env=NO_TOKEN)
    api = f"{url}/api/v1"
    for headers in ({"Host": "proxy.example"}, {"Host": "proxy.example:8443", "Origin": "https://proxy.example"}):
        assert web.get(f"{api}/experiments", headers=headers).status_code == 200, headers
    for headers in ({"Host": "other.example"}, {"Host": "proxy.example", "Origin": "https://other.example"}):
        assert web.get(f"{api}/experiments", headers=headers).status_code == 403, headers


def test_with_a_token_any_host_is_answered_but_not_another_pages_origin(guarded: str) -> None:
    """With a token the Host is free (a rebinding page has no token), but a page of another origin is refused,
    even one of the same site, to which the SameSite cookie is still sent (another port of the same host)."""
    port = int(guarded.rsplit(":", 1)[1])
    api = f"{guarded}/api/v1"
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert web.get(f"{api}/experiments", headers={**bearer, "Host": f"ml.example:{port}"}).status_code == 200
    assert web.get(f"{api}/experiments", headers={"Host": f"ml.example:{port}"}).status_code == 401
    login = web.get(f"{guarded}/login", params={"token": TOKEN})
    for origin in (f"http://127.0.0.1:{port + 1}", "http://evil.example", "null"):
        with_cookie = web.post(
            f"{api}/experiments", json={"config": {}}, headers={"Origin": origin}, cookies=login.cookies
        )
        with_bearer = web.post(f"{api}/experiments", json={"config": {}}, headers={"Origin": origin, **bearer})
        assert with_cookie.status_code == with_bearer.status_code == 403, (origin, with_cookie.text)
    own = {"Origin": f"http://127.0.0.1:{port}"}
    answer = web.post(f"{api}/experiments", json={"config": {}}, headers=own, cookies=login.cookies)
    assert answer.status_code == 422, answer.text  # past the guards: an invalid config


@pytest.fixture
def redis_with_password(tmp_path: Path) -> Iterator[tuple[RedisServer, str]]:
    server = RedisServer(tmp_path / "redis-data")
    server.start()
    password = "redis-pw-91f2-do-not-leak"
    redis.Redis(host="127.0.0.1", port=server.port).config_set("requirepass", password)
    yield server, password
    server.stop()


def process_named(name: str) -> int | None:
    """The pid of a live process whose argv[0] is `name`."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().split(b"\0")[0] == name.encode():
                return int(entry.name)
        except OSError:
            continue
    return None


def test_the_redis_password_and_the_token_appear_in_no_answer_event_or_log(
    redis_with_password: tuple[RedisServer, str], tmp_path: Path
) -> None:
    server, password = redis_with_password
    url = f"redis://:{password}@127.0.0.1:{server.port}/0"
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    processes = Processes(url, log_dir)
    try:
        processes.worker()
        manager = processes.manager("--log-format", "json", env={TOKEN_ENV: TOKEN})
        http = httpx.Client(base_url=f"{manager}/api/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        code = write_trial(tmp_path / "code")
        created = http.post("/experiments", json={"config": experiment_config(code, trials=2)})
        assert created.status_code == 201, created.text
        experiment_id = created.json()["id"]
        stand_in = wait_until(lambda: process_named(f"trialstream-experiment-{experiment_id}"), 30, what="its process")
        assert Path(f"/proc/{stand_in}/environ").read_bytes() == b""  # nothing of the manager's to read there
        (code / "gates" / "all").touch()
        wait_until(lambda: http.get(f"/experiments/{experiment_id}").json()["status"] == "DONE", 60, what="DONE")
        trial_id = http.get(f"/experiments/{experiment_id}/trials").json()["items"][0]["id"]

        answers: list[httpx.Response] = [
            http.get(path)
            for path in (
                "/experiments",
                f"/experiments/{experiment_id}",
                f"/experiments/{experiment_id}/trials",
                f"/experiments/{experiment_id}/trials/{trial_id}",
                f"/experiments/{experiment_id}/trials/{trial_id}/metrics",
                f"/experiments/{experiment_id}/events?limit=10000",
                f"/experiments/{experiment_id}/cluster-metadata/trial_config",
                f"/experiments/{experiment_id}/cluster-metadata/platform_config",
                "/ready",
                "/health",
                "/experiments/nope",
            )
        ]
        answers.append(http.get(f"{manager}/openapi.json"))
        answers.append(http.post("/experiments", json={"config": {"nonsense": True}}))
        assert [answer.status_code for answer in answers][:10] == [200] * 10, [a.text for a in answers]
        events = json.dumps(answers[5].json())
        assert "TrialEnded" in events
        for answer in answers:
            assert password not in answer.text and TOKEN not in answer.text, answer.request.url
            assert all(password not in value and TOKEN not in value for value in answer.headers.values())
        stored = redis.Redis(host="127.0.0.1", port=server.port, password=password)
        log: Any = stored.xrange(f"ts:exp:{experiment_id}:events")
        assert log
        for entry_id, fields in log:
            assert all(password.encode() not in value for value in fields.values()), entry_id
        processes.stop()  # the whole life of each process is in its log, shutdown included
        logs = processes.logs()
        assert "manager on http" in logs and password not in logs and TOKEN not in logs
        assert "***@127.0.0.1" in logs  # the URL is shown, its password hidden
    finally:
        processes.stop()


def test_a_manager_refuses_to_start_when_its_redis_needs_a_password_it_lacks(
    redis_with_password: tuple[RedisServer, str], tmp_path: Path
) -> None:
    """The Redis error names the server, not the password it was given."""
    server, password = redis_with_password
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    processes = Processes(f"redis://:wrong-{password}@127.0.0.1:{server.port}/0", log_dir)
    process = processes.start("manager", "--port", str(free_port()), env={**NO_TOKEN, f"{PREFIX}REDIS_RETRY_S": "0"})
    try:
        assert process.wait(60) != 0
    except subprocess.TimeoutExpired:
        processes.stop()
        raise
    logs = processes.logs()
    assert password not in logs and "Traceback" not in logs, logs
