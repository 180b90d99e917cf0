"""The dlts platform (NNI's `dlts` training service, removed from NNI in 2.4 and kept here for completeness
of NNI's list): each trial attempt is one job of a DLTS (DLWorkspace) cluster, submitted, followed and
killed through the dashboard's REST API as NNI's client did: `POST api/clusters/<cluster>/jobs`, `GET
api/v2/clusters/<cluster>/jobs/<id>`, `PUT api/clusters/<cluster>/jobs/<id>/status {"status": "killing"}`,
the GPU type from `GET api/teams/<team>/clusters/<cluster>`, every call with `email` and `password` in
its query. NNI's status mapping: unapproved/queued/scheduling WAITING, running (and pausing/paused)
RUNNING, finished SUCCEEDED, failed FAILED, killing/killed canceled; a paused job is killed, as NNI did.

How the code gets in and the metrics out, without the trial ever calling back. NNI's job ran its
trial_keeper, which POSTed metrics to NNI's REST server, and found the code on the NFS home every DLTS
job mounts (NNI's manager itself ran in a DLTS job, beside the code). trialstream's worker need not run
in the cluster and the trial may not call back, so:
- the code travels inline in the job's `cmd`: DLWorkspace hands `cmd` to the pod as one environment
  variable (DLTS_LAUNCH_CMD), so it is the one field that surely reaches the container, as the
  Kubernetes platforms' ConfigMaps do; a small bootstrap in the command unpacks the experiment's
  archive (core/code_archive.py) and `workers/pod_keeper.py`, which runs the trial and prints NNI's file
  metrics on stdout. One environment value holds at most 128 KiB on Linux (MAX_ARG_STRLEN), so the
  packed code may take about 90 KiB; `check` says so before any trial, naming .nniignore as the fix.
  A shared-path key was not chosen: it needs the worker to mount the cluster's NFS, which is what
  trialstream avoids everywhere else;
- metrics are read from the job's log through the API (`GET api/clusters/<c>/jobs/<id>/log?cursor=`),
  whose cursor (the `<ms>.<seq>` sort values of the last line read) is committed with the metrics as
  two integers, so a re-attached worker resumes after what was read: none lost, none read twice;
- DLTS tells no exit code, so the bootstrap's last line is `NNI_DLTS_EXIT {"exitCode", "stderr"}`.

A job is found again (re-attach, a second delivery, release, clean-up) by its name, NNI's
`nni_exp_<experiment>_trial_<trial>` (+ `_attempt_<n>` from the second attempt), in the team's job list.
The password is a SecretStr; it is sent only in the query, as DLTS wants it, and masked in httpx's log.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import shlex
import tempfile
import threading
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx
import redis

from core.platform import (
    Abandoned,
    Deferred,
    Lost,
    OutputStream,
    OutputUnavailable,
    TrialAssignment,
    TrialControl,
    TrialOutcome,
)
from core.settings import Settings
from schemas.config import PlatformConfig
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus
from workers.platforms.dlts.config import DltsAccess, DltsConfig
from workers.platforms.shared import pod_keeper
from workers.platforms.shared.code_package import CodeDirectoryError, CodePackage, check_size, pack
from workers.platforms.shared.trial_contract import (
    MetricBatch,
    StdoutMetricPump,
    TrialPaths,
    failure_message,
    nni_environment,
)

log = logging.getLogger(__name__)

MAX_COMMAND_BYTES = 120 * 1024  # DLTS_LAUNCH_CMD is one environment value: Linux takes at most 128 KiB
COMMAND_MARGIN_BYTES = 8 * 1024  # the trial's command, parameters and NNI's variables, beside the code
EXIT_MARKER = b"NNI_DLTS_EXIT "
MAX_MARKER_LINE = 64 * 1024
REQUEST_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
UNKNOWN_AFTER_S = 5.0  # the dashboard failing this long makes a running trial UNKNOWN
LOG_DRAIN_S = 60.0  # how long an ended job's log is waited for (DLTS ships logs to its store with a delay)
JOB_LIST_LIMIT = 1000  # the team's most recent jobs searched for one by name
WAITING = ("unapproved", "queued", "scheduling")
PAUSED = ("pausing", "paused")
KILLED = ("killing", "killed")
ENDED = ("finished", "failed", "killed", "error")

# Runs in the job (python3, standard library only): unpacks the keeper and the code, runs the keeper, and
# says how it ended in the log's last line. argv[1]: base64 of the zlib'd JSON payload (shell-safe).
BOOTSTRAP = """\
import base64, json, os, signal, subprocess, sys, tempfile, zlib
p = json.loads(zlib.decompress(base64.b64decode(sys.argv[1])))
work = os.path.join(tempfile.gettempdir(), p["dir"])
archive = os.path.join(work, "archive")
os.makedirs(archive, exist_ok=True)
for name, source in p["keeper"].items():
    open(os.path.join(archive, name), "w").write(source)
open(os.path.join(archive, "code-000"), "wb").write(base64.b64decode(p["code"]))
env = dict(os.environ)
env.update(p["env"])
keeper = subprocess.Popen([sys.executable, os.path.join(archive, p["run"])], cwd=work, env=env)
def forward(signum, frame):
    try:
        keeper.send_signal(signum)
    except OSError:
        pass
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
code = keeper.wait()
code = code if code >= 0 else 128 - code
try:
    tail = open(os.path.join(work, "termination-log"), errors="replace").read()
except OSError:
    tail = ""
print("NNI_DLTS_EXIT " + json.dumps({"exitCode": code, "stderr": tail}), flush=True)
sys.exit(code)
"""


class _MaskPassword(logging.Filter):
    """httpx logs each request's URL at INFO: the query's password is masked there."""

    _pattern = re.compile(r"((?:password|token)=)[^&\s\"']*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(self._pattern.sub(r"\1*****", str(arg)) for arg in record.args)
        return True


logging.getLogger("httpx").addFilter(_MaskPassword())


class DashboardError(Exception):
    """The dashboard answered, and not with what was asked (its status and its text)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"{status} {text.strip()[:300]}")
        self.status = status


class Refused(Exception):
    """The cluster's RestAPI refused a job (`{"error": ...}` in a 200 answer)."""


def describe(error: Exception) -> str:
    """In one line, never with the request's URL (its query holds the password)."""
    if isinstance(error, DashboardError):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class Dashboard:
    """The calls NNI's client made, as one user of one cluster and team."""

    def __init__(self, http: httpx.Client, access: DltsAccess) -> None:
        self.http, self.access = http, access

    def _call(self, method: str, path: str, body: Any = None, **query: str | int) -> httpx.Response:
        params: dict[str, str | int] = {
            "email": self.access.email,
            "password": self.access.password.get_secret_value(),
            **query,
        }
        response = self.http.request(method, self.access.dashboard + path, params=params, json=body)
        if response.status_code >= 300:
            raise DashboardError(response.status_code, response.text)
        return response

    def team(self) -> dict[str, Any]:
        access = self.access
        answer: dict[str, Any] = self._call("GET", f"api/teams/{access.team}/clusters/{access.cluster}").json()
        return answer

    def gpu_type(self) -> str:
        """NNI's getGpuType: the first key of the team's `metadata` (a JSON string)."""
        metadata = json.loads(self.team().get("metadata") or "{}")
        if not isinstance(metadata, dict) or not metadata:
            raise DashboardError(200, f"team {self.access.team!r} has no GPU type in its metadata")
        return str(next(iter(metadata)))

    def submit(self, body: dict[str, Any]) -> str:
        answer = self._call("POST", f"api/clusters/{self.access.cluster}/jobs", body).json()
        if not isinstance(answer, dict) or not answer.get("jobId"):
            raise Refused(str(answer.get("error") if isinstance(answer, dict) else answer))
        return str(answer["jobId"])

    def job(self, job_id: str) -> dict[str, Any]:
        """The job's detail; {} when the cluster has no such job of this user."""
        answer = self._call("GET", f"api/v2/clusters/{self.access.cluster}/jobs/{job_id}").json()
        return answer if isinstance(answer, dict) else {}

    def kill(self, job_id: str) -> None:
        self._call("PUT", f"api/clusters/{self.access.cluster}/jobs/{job_id}/status", {"status": "killing"})

    def log(self, job_id: str, cursor: str | None) -> tuple[str, str | None] | None:
        """The next page of the job's log after `cursor`: its text and the cursor after it; None when none yet."""
        query: dict[str, str | int] = {"cursor": cursor} if cursor else {}
        try:
            answer = self._call("GET", f"api/clusters/{self.access.cluster}/jobs/{job_id}/log", **query).json()
        except DashboardError as error:
            if error.status == 404:  # DLWorkspace's answer for "no log (after this cursor)"
                return None
            raise
        pods = answer.get("log") or {}
        text = "".join(pods.values()) if isinstance(pods, dict) else str(pods)
        next_cursor = answer.get("cursor")
        return text, str(next_cursor) if next_cursor is not None else None

    def jobs(self) -> list[dict[str, Any]]:
        """The user's most recent jobs in the team."""
        access = self.access
        path = f"api/v2/clusters/{access.cluster}/teams/{access.team}/jobs"
        answer = self._call("GET", path, limit=JOB_LIST_LIMIT).json()
        return [job for job in answer if isinstance(job, dict)] if isinstance(answer, list) else []

    def find(self, name: str) -> dict[str, Any] | None:
        return next((job for job in self.jobs() if job.get("jobName") == name), None)


def job_name(trial: TrialAssignment[DltsConfig]) -> str:
    """NNI's job name; a later attempt of the same trial is its own job."""
    name = f"nni_exp_{trial.experiment_id}_trial_{trial.trial_id}"
    return name if trial.attempt == 1 else f"{name}_attempt_{trial.attempt}"


def work_dir_name(trial: TrialAssignment[DltsConfig]) -> str:
    return f"nni-{trial.experiment_id}-{trial.trial_id}-{trial.attempt}"


def job_command(code: bytes, environment: Mapping[str, str], work_dir: str) -> str:
    """The job's `cmd`: the bootstrap, and everything it unpacks (the keeper's files, the code), in one
    shell-safe argument."""
    payload = {
        "keeper": pod_keeper.keeper_files(),
        "run": pod_keeper.KEEPER,
        "code": base64.b64encode(code).decode(),
        "env": dict(environment),
        "dir": work_dir,
    }
    packed = base64.b64encode(zlib.compress(json.dumps(payload).encode(), 9)).decode()
    return f"python3 -c {shlex.quote(BOOTSTRAP)} {packed}"


def _code_problem(package: CodePackage) -> str | None:
    size = len(job_command(package.path.read_bytes(), {}, "")) + COMMAND_MARGIN_BYTES
    if size <= MAX_COMMAND_BYTES:
        return None
    return (
        f"packed, it makes a DLTS job command of {size // 1024} KiB; DLTS hands the command to the job as one "
        f"environment value, at most {MAX_COMMAND_BYTES // 1024} KiB here: exclude data with .nniignore, or put it "
        "in the image"
    )


def _cursor_offsets(cursor: str | None) -> dict[str, int] | None:
    """The log cursor (`<ms>.<seq>`, elasticsearch's sort values) as the integers offsets are kept as."""
    parts = (cursor or "").split(".")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        return None
    return {"log_ms": int(parts[0]), "log_seq": int(parts[1])}


def _offsets_cursor(offsets: Mapping[str, int]) -> str | None:
    if "log_ms" not in offsets or "log_seq" not in offsets:
        return None
    return f"{offsets['log_ms']}.{offsets['log_seq']}"


class _LogReader:
    """The job's log, page after page from the committed cursor: metric lines go to the trial as they
    are read, with the cursor they were read up to; the bootstrap's exit line is kept."""

    def __init__(self, dashboard: Dashboard, job_id: str, control: TrialControl) -> None:
        self.dashboard, self.job_id, self.control = dashboard, job_id, control
        self.cursor = _offsets_cursor(control.offsets())
        self.batch = MetricBatch(control)
        self.pump = StdoutMetricPump(self.batch)
        self.line = bytearray()
        self.too_long = False
        self.exit: dict[str, Any] | None = None

    def read(self) -> None:
        """Every page there is now."""
        while True:
            page = self.dashboard.log(self.job_id, self.cursor)
            if page is None:
                return
            text, cursor = page
            data = text.encode()
            self.pump.feed(data)
            self._scan(data)
            found = self.batch.take()
            at_line_end = not self.line and not self.too_long  # else the line's start would be skipped
            offsets = _cursor_offsets(cursor) if at_line_end else None
            if found or offsets:
                self.control.metrics(found, offsets=offsets)
            if cursor is None or cursor == self.cursor:
                return
            self.cursor = cursor

    def _scan(self, data: bytes) -> None:
        for piece in data.splitlines(keepends=True):
            if not self.too_long:
                self.line += piece
                if len(self.line) > MAX_MARKER_LINE:
                    self.too_long, self.line = True, bytearray()
            if piece.endswith(b"\n"):
                if not self.too_long and self.line.startswith(EXIT_MARKER):
                    try:
                        self.exit = json.loads(bytes(self.line[len(EXIT_MARKER) :]))
                    except ValueError:
                        log.warning("job %s: an unreadable exit line", self.job_id)
                self.line, self.too_long = bytearray(), False


class _AttemptFollower:
    """One attempt's job, followed to its end by polling its status and reading its log."""

    def __init__(
        self, dashboard: Dashboard, config: DltsConfig, control: TrialControl, job_id: str, trial: TrialAssignment
    ) -> None:
        self.dashboard, self.config, self.control, self.job_id, self.trial = dashboard, config, control, job_id, trial
        self.logs = _LogReader(dashboard, job_id, control)
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


class DltsPlatform:
    name: ClassVar[str] = "dlts"
    config_model: ClassVar[type[PlatformConfig]] = DltsConfig
    trials_per_process: ClassVar[int] = 256  # the worker only polls the dashboard for each
    trials_outlive_worker: ClassVar[bool] = True  # a job runs on in the cluster: re-attached by its name

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self._http = httpx.Client(timeout=REQUEST_TIMEOUT)
        self._packages: dict[str, CodePackage] = {}
        self._gpu_types: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()
        self._cache = Path(tempfile.mkdtemp(prefix="trialstream-dlts-"))

    @classmethod
    def check(cls, config: DltsConfig, code_directory: Path, settings: Settings) -> list[str]:
        """The code within what a job's command carries, the keys NNI needs, then the dashboard: reachable,
        the password right, the cluster and team there and the user's. One line per problem."""
        problems: list[str] = []
        try:
            check_size(code_directory)
            with tempfile.TemporaryDirectory() as scratch:
                problem = _code_problem(pack(code_directory, Path(scratch) / "code.tgz"))
            if problem:
                problems.append(f"trialCodeDirectory: {problem}")
        except (CodeDirectoryError, OSError) as error:
            problems.append(f"trialCodeDirectory: {error}")
        access, missing = config.resolved()
        if access is None:
            return problems + missing
        with httpx.Client(timeout=REQUEST_TIMEOUT) as http:
            try:
                Dashboard(http, access).gpu_type()
            except httpx.HTTPError as error:
                problems.append(f"dashboard: {access.dashboard} cannot be reached: {describe(error)}")
            except ValueError as error:
                problems.append(f"dashboard: {access.dashboard} does not answer as a DLTS dashboard: {error}")
            except DashboardError as error:
                problems.append(_access_problem(access, error))
        return problems

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: DltsConfig) -> None:
        """The code, packed once per experiment and worker; it travels in each job's command."""
        with self._lock:
            if experiment_id not in self._packages:
                package = pack(Path(launch.code_directory), self._cache / f"{experiment_id}.tgz")
                self._packages[experiment_id] = package

    def run_trial(
        self, trial: TrialAssignment[DltsConfig], control: TrialControl
    ) -> TrialOutcome | Deferred | Lost | Abandoned:
        config = trial.platform_config
        access, missing = config.resolved()
        if access is None:
            return TrialOutcome(TrialJobStatus.FAILED, message="; ".join(missing))
        dashboard = Dashboard(self._http, access)
        name = job_name(trial)
        try:
            found = dashboard.find(name)  # an earlier delivery of this attempt submitted it: it is followed
            job_id = str(found["jobId"]) if found else dashboard.submit(self._job(trial, config, dashboard, name))
        except Refused as error:
            return TrialOutcome(TrialJobStatus.FAILED, message=f"the DLTS cluster refused the job: {error}")
        except DashboardError as error:
            if error.status in (400, 403, 404):  # trying again would not help
                return TrialOutcome(TrialJobStatus.FAILED, message=_access_problem(access, error))
            return Deferred(f"the DLTS dashboard could not take the job: {describe(error)}")
        except (httpx.HTTPError, ValueError) as error:  # it may exist: the next delivery finds it by name
            return Deferred(f"the DLTS dashboard cannot be reached: {describe(error)}")
        return _AttemptFollower(dashboard, config, control, job_id, trial).run()

    def reattach(
        self, trial: TrialAssignment[DltsConfig], control: TrialControl
    ) -> TrialOutcome | Lost | Abandoned | None:
        config = trial.platform_config
        access, missing = config.resolved()
        if access is None:
            return Lost("; ".join(missing))
        dashboard = Dashboard(self._http, access)
        found = dashboard.find(job_name(trial))
        if found is None:
            return None
        return _AttemptFollower(dashboard, config, control, str(found["jobId"]), trial).run()

    def release(self, trial: TrialAssignment[DltsConfig]) -> None:
        """Kill what a lost attempt left running."""
        config = trial.platform_config
        access, _ = config.resolved()
        if access is None:
            return
        dashboard = Dashboard(self._http, access)
        try:
            found = dashboard.find(job_name(trial))
            if found is not None and found.get("jobStatus") not in ENDED:
                dashboard.kill(str(found["jobId"]))
        except (httpx.HTTPError, DashboardError, ValueError) as error:
            log.warning("release of %s: %s", job_name(trial), describe(error))

    def read_output(self, trial: TrialAssignment[DltsConfig], url: str, stream: OutputStream, offset: int) -> bytes:
        config = trial.platform_config
        if stream == "stderr":
            raise OutputUnavailable("DLTS keeps a job's stdout and stderr as one log: it is all under stdout")
        access, missing = config.resolved()
        if access is None:
            raise OutputUnavailable("; ".join(missing))
        dashboard = Dashboard(self._http, access)
        job_id = url.rstrip("/").rsplit("/", 1)[-1]
        text = bytearray()
        cursor: str | None = None
        try:
            while len(text) < offset + (1 << 20):
                page = dashboard.log(job_id, cursor)
                if page is None or page[1] is None or page[1] == cursor:
                    text += page[0].encode() if page else b""
                    break
                text += page[0].encode()
                cursor = page[1]
        except (httpx.HTTPError, DashboardError, ValueError) as error:
            raise OutputUnavailable(f"the log of DLTS job {job_id}: {describe(error)}") from None
        return bytes(text[offset : offset + (1 << 20)])

    def clean_up(self, experiment_id: str, config: DltsConfig) -> None:
        """Kill every job of the experiment still queued or running."""
        access, _ = config.resolved()
        if access is None:
            return
        dashboard = Dashboard(self._http, access)
        prefix = f"nni_exp_{experiment_id}_trial_"
        try:
            for job in dashboard.jobs():
                if str(job.get("jobName", "")).startswith(prefix) and job.get("jobStatus") not in ENDED:
                    dashboard.kill(str(job["jobId"]))
        except (httpx.HTTPError, DashboardError, ValueError) as error:
            log.warning("clean-up of experiment %s: %s", experiment_id, describe(error))
        with self._lock:
            package = self._packages.pop(experiment_id, None)
        if package is not None:
            package.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._http.close()
        for package in self._packages.values():
            package.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._cache.rmdir()

    def _job(
        self, trial: TrialAssignment[DltsConfig], config: DltsConfig, dashboard: Dashboard, name: str
    ) -> dict[str, Any]:
        """NNI's DLTSJobConfig, with trialstream's command (NNI's `env`, a TMPDIR the pod never got, left out)."""
        access = dashboard.access
        key = (access.dashboard, access.cluster, access.team)
        gpu_type = self._gpu_types.get(key)
        if gpu_type is None:
            gpu_type = self._gpu_types[key] = dashboard.gpu_type()
        work = work_dir_name(trial)
        paths = TrialPaths(sys_dir=work, output_dir=f"{work}/output", code_dir=f"{work}/code")
        environment = nni_environment({}, self.name, trial, paths, None)  # the keeper sets the paths it finds
        environment[pod_keeper.PARAMETERS_VARIABLE] = trial.form.hyper_parameters.value
        environment[pod_keeper.COMMAND_VARIABLE] = trial.launch.command
        command = job_command(self._packages[trial.experiment_id].path.read_bytes(), environment, work)
        return {
            "team": access.team,
            "vcName": access.team,
            "userName": access.email,
            "gpuType": gpu_type,
            "jobType": "training",
            "jobtrainingtype": "RegularJob",
            "ssh": False,
            "ipython": False,
            "tensorboard": False,
            "workPath": "",
            "enableworkpath": True,
            "dataPath": "",
            "enabledatapath": False,
            "jobPath": "",
            "enablejobpath": True,
            "mountpoints": [],
            "hostNetwork": False,
            "useGPUTopology": False,
            "isPrivileged": False,
            "hostIPC": False,
            "preemptionAllowed": "False",
            "jobName": name,
            "resourcegpu": trial.launch.gpu_number or 0,
            "image": config.image,
            "cmd": command,
            "interactivePorts": [],
        }


def _access_problem(access: DltsAccess, error: DashboardError) -> str:
    """A dashboard refusal, as the key to fix."""
    text = str(error)
    if error.status == 403:
        return (
            f"password: the dashboard at {access.dashboard} refused {access.email!r} and its password ({text}): "
            "copy the password from the dashboard's user page"
        )
    if "Cluster is not found" in text:
        return f"cluster: {access.cluster!r} is not a cluster of the dashboard at {access.dashboard} ({text})"
    if "Team is not found" in text:
        return f"team: {access.team!r} is not a team of cluster {access.cluster!r} that {access.email!r} may use"
    return f"dashboard: {access.dashboard} answered {text}"
