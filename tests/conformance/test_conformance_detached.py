"""The conformance suite on a platform whose trials outlive their worker (tests/platforms/detached.py):
the core re-attaches a lost worker's running attempt instead of retrying it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.registry import add_platforms
from schemas.events import TrialAttemptLost
from schemas.trial import TrialJobStatus
from tests.conftest import Processes, wait_for_status, wait_until
from tests.support.conformance import TRIAL, PlatformConformance, PlatformHarness, history, trial_form

pytestmark = pytest.mark.xdist_group("conformance-detached")  # its class's parts and worker start once

PLATFORMS = "detached=tests.platforms.detached:DetachedPlatform"


@pytest.fixture(autouse=True)
def no_session_left(tmp_path: Path) -> Iterator[None]:
    """Detached trials outlive their workers by design: end any a test leaves behind."""
    yield
    for pid_file in tmp_path.glob("**/attempt-*/.pid"):
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)


class TestDetachedConformance(PlatformConformance):
    @pytest.fixture(scope="class")
    def harness(self) -> PlatformHarness:
        add_platforms({"detached": "tests.platforms.detached:DetachedPlatform"})
        return PlatformHarness(
            platform_config={"platform": "detached"}, worker_env={"TRIALSTREAM_PLATFORMS": PLATFORMS}
        )


def test_an_attempt_with_nothing_left_to_reattach_to_is_lost_and_retried(
    processes: Processes, make_service, code_dir: Path, tmp_path: Path
) -> None:
    """The worker and its trial both died: the worker that takes the attempt up finds nothing running."""
    add_platforms({"detached": "tests.platforms.detached:DetachedPlatform"})
    env = {"TRIALSTREAM_PLATFORMS": PLATFORMS, "TRIALSTREAM_TRIAL_LEASE_S": "1"}
    (code_dir / "conformance_trial.py").write_text(textwrap.dedent(TRIAL))
    service = make_service(
        f"{sys.executable} conformance_trial.py", platform_config={"platform": "detached"}, max_retries=1
    )
    victim = processes.worker("detached", env=env)
    held = trial_form(0, mode="hold-once", marker=str(tmp_path / "marker"), release=str(tmp_path / "release"))
    trial_id = service.submit_trial_job(held).id
    running = wait_for_status(service, trial_id, "RUNNING")
    session = int(wait_until(lambda: read(Path(running.working_directory) / "attempt-1" / ".pid")))
    wait_until((tmp_path / "marker").exists, what="the trial to start holding")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    os.killpg(session, signal.SIGKILL)
    processes.worker("detached", env=env)
    trial = wait_for_status(service, trial_id, "SUCCEEDED", "FAILED", timeout=60)
    assert trial.status is TrialJobStatus.SUCCEEDED and trial.attempt == 2
    lost = [e for e in history(service, trial_id) if isinstance(e, TrialAttemptLost)]
    assert len(lost) == 1 and "not running any more" in lost[0].reason


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
