"""Following one DLTS job to its end: its status mapped as NNI mapped it, its log read for metrics and the
exit line, a paused job killed as NNI did."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from core.platform import (
    Abandoned,
    TrialAssignment,
    TrialControl,
    TrialOutcome,
)
from schemas.trial import TrialJobStatus
from workers.platforms.dlts.client import Dashboard, DashboardError, describe
from workers.platforms.dlts.config import DltsConfig
from workers.platforms.dlts.job import work_dir_name
from workers.platforms.dlts.log_reader import LogReader
from workers.platforms.shared.trial_contract import (
    failure_message,
)

log = logging.getLogger(__name__)

UNKNOWN_AFTER_S = 5.0  # the dashboard failing this long makes a running trial UNKNOWN

LOG_DRAIN_S = 60.0  # how long an ended job's log is waited for (DLTS ships logs to its store with a delay)

WAITING = ("unapproved", "queued", "scheduling")

PAUSED = ("pausing", "paused")

KILLED = ("killing", "killed")


class AttemptFollower:
    """One attempt's job, followed to its end by polling its status and reading its log."""

    def __init__(
        self, dashboard: Dashboard, config: DltsConfig, control: TrialControl, job_id: str, trial: TrialAssignment[Any]
    ) -> None:
        self.dashboard, self.config, self.control, self.job_id, self.trial = dashboard, config, control, job_id, trial
        self.logs = LogReader(dashboard, job_id, control)
        self.started = False
        self.failing_since: float | None = None
        self.unknown = False

    @property
    def url(self) -> str:
        """Where NNI's web UI pointed: the job's page on the dashboard."""
        access = self.dashboard.access
        return f"{access.dashboard}job/{access.team}/{access.cluster}/{self.job_id}"

    def run(self) -> TrialOutcome | Abandoned:
        while True:
            stop = self.control.stop_request()
            if stop is not None:
                if stop.lease_lost:  # another worker follows it now; it runs on
                    return Abandoned(stop.reason)
                self._kill()
                return TrialOutcome(stop.status, message=stop.reason)
            try:
                detail = self.dashboard.job(self.job_id)
                if detail.get("jobStatus") not in WAITING:
                    self.logs.read()
            except (httpx.HTTPError, DashboardError, ValueError) as error:
                self._failing(describe(error))
                self.control.wait(min(1.0, self.config.poll_interval))
                continue
            self._healthy()
            outcome = self._step(detail)
            if outcome is not None:
                return outcome
            self.control.wait(self.config.poll_interval)

    def _step(self, detail: dict[str, Any]) -> TrialOutcome | None:
        status = detail.get("jobStatus")
        if not detail:
            return TrialOutcome(
                TrialJobStatus.FAILED, message=f"the DLTS job {self.job_id} is no longer on the cluster"
            )
        if status in WAITING:
            return None
        if not self.started:
            self.started = True
            work = f"$TMPDIR/{work_dir_name(self.trial)} in DLTS job {self.job_id}"
            self.control.started(work, url=self.url)
        if status == "running":
            return None
        if status in PAUSED:  # NNI cancels a paused job: it would hold its trial RUNNING with nothing running
            self._kill()
            return TrialOutcome(
                TrialJobStatus.SYS_CANCELED, message=f"the DLTS job {self.job_id} was paused on the cluster; killed"
            )
        if status in KILLED:
            return TrialOutcome(
                TrialJobStatus.SYS_CANCELED, message=f"the DLTS job {self.job_id} was killed outside trialstream"
            )
        if status in ("finished", "failed"):
            return self._ended(status == "finished", str(detail.get("errorMsg") or ""))
        return TrialOutcome(
            TrialJobStatus.FAILED, message=f"DLTS says job {self.job_id} is {status!r}: {detail.get('errorMsg') or ''}"
        )

    def _ended(self, finished: bool, error: str) -> TrialOutcome:
        """Reads the log to the bootstrap's exit line (it may reach DLTS's log store after the end)."""
        deadline = time.monotonic() + LOG_DRAIN_S
        while self.logs.exit is None and time.monotonic() < deadline:
            if self.control.stop_request() is not None:
                break
            try:
                self.logs.read()
            except (httpx.HTTPError, DashboardError, ValueError) as error:
                log.info("log of job %s: %s", self.job_id, describe(error))
            if self.logs.exit is None:
                self.control.wait(min(1.0, self.config.poll_interval))
        ended = self.logs.exit or {}
        code = ended.get("exitCode")
        exit_code = code if isinstance(code, int) else None
        if finished:
            return TrialOutcome(TrialJobStatus.SUCCEEDED, exit_code)
        if exit_code:
            return TrialOutcome(
                TrialJobStatus.FAILED, exit_code, failure_message(exit_code, str(ended.get("stderr", "")).strip())
            )
        return TrialOutcome(TrialJobStatus.FAILED, exit_code, error or f"the DLTS job {self.job_id} failed")

    def _kill(self) -> None:
        try:
            self.dashboard.kill(self.job_id)
        except (httpx.HTTPError, DashboardError, ValueError) as error:  # clean-up kills what is left
            log.warning("killing DLTS job %s: %s", self.job_id, describe(error))

    def _failing(self, reason: str) -> None:
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        if self.started and not self.unknown and now - self.failing_since >= UNKNOWN_AFTER_S:
            self.unknown = True
            self.control.unreachable(f"the DLTS dashboard cannot be reached: {reason}")

    def _healthy(self) -> None:
        self.failing_since = None
        if self.unknown:
            self.unknown = False
            self.control.unreachable(None)
