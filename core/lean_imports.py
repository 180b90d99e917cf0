"""Process start-up: redis-py without the telemetry it never uses here.

redis-py 8 imports OpenTelemetry's metrics SDK when redis-py itself is imported, whenever the SDK is installed
(azure-ai-ml, the aml platform's SDK, installs it), to offer metrics trialstream never turns on: about 0.1 s
of CPU at the start of every worker, manager and command. The entry points import redis-py through
`import_redis()`, which hides the SDK from that one import; whatever imports the SDK later (azure's own
telemetry) finds it as usual.
"""

from __future__ import annotations

import importlib
import sys

_TELEMETRY = "opentelemetry.sdk.metrics"


def import_redis() -> None:
    """Import redis-py (once, first) with OpenTelemetry's metrics SDK out of its sight."""
    if "redis" in sys.modules or _TELEMETRY in sys.modules:
        return
    sys.modules[_TELEMETRY] = None  # type: ignore[assignment]  # an import of it raises ImportError meanwhile
    try:
        importlib.import_module("redis")
    finally:
        del sys.modules[_TELEMETRY]
