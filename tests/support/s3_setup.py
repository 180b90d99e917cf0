"""A real S3-compatible server for the archive's tests: moto's server (from PyPI), on loopback, once per run."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.ports import free_port

START_DEADLINE_S = 60.0
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "trialstream-test", "AWS_SECRET_ACCESS_KEY": "trialstream-test"}


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str

    def bucket(self, prefix: str) -> str:
        """A new bucket of its own (`prefix` and a random suffix), as an archive location."""
        import boto3

        name = f"{prefix}-{secrets.token_hex(6)}"
        boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1", **_keys()).create_bucket(
            Bucket=name
        )
        return f"s3://{name}/archive"


def _keys() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    yield from _served({})


@pytest.fixture(scope="session")
def s3_server_with_auth() -> Iterator[S3Server]:
    """One that checks every request's credentials (moto's IAM, which knows none): any key is refused, as a
    real server refuses wrong ones. Its buckets are named, never created."""
    yield from _served({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})


def _served(env: dict[str, str]) -> Iterator[S3Server]:
    binary = shutil.which("moto_server")
    if binary is None:
        pytest.fail("moto_server is not installed: pip install -e '.[test]'")
    port = free_port()
    process = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        try:
            httpx.get(url, timeout=2)
            break
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"moto_server did not answer on {url}")
            time.sleep(0.1)
    yield S3Server(url)
    process.terminate()
    process.wait(10)


@pytest.fixture
def s3_credentials(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """boto3's usual variables, for this test's process and the processes it starts."""
    for name, value in {**CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    return {**CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1"}
