"""Entry points import redis-py without OpenTelemetry's metrics SDK, which stays importable afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

CHECK = """
import sys
from core.lean_imports import import_redis
import_redis()
import redis
assert "opentelemetry.sdk.metrics" not in sys.modules, "redis-py loaded the SDK"
import opentelemetry.sdk.metrics  # azure's telemetry, say, imports it later as usual
print("ok")
"""


def test_redis_py_loads_without_the_telemetry_sdk_which_later_imports_still_find() -> None:
    pytest.importorskip("opentelemetry.sdk.metrics", reason="the SDK is installed with the aml extra")
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
