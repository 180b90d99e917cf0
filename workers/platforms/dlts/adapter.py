"""The dlts platform: each trial attempt is one job of a DLTS (DLWorkspace) cluster, submitted, followed and
killed through the dashboard's REST API (docs/platforms.md, DLTS, says how the code gets in and the metrics
out)."""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
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
from workers.platforms.dlts.client import Dashboard, DashboardError, Refused, describe
from workers.platforms.dlts.config import DltsAccess, DltsConfig
from workers.platforms.dlts.follower import AttemptFollower
from workers.platforms.dlts.job import code_problem, job_command, job_name, work_dir_name
from workers.platforms.shared import pod_keeper
from workers.platforms.shared.code_package import CodeDirectoryError, CodePackage, check_size, pack
from workers.platforms.shared.trial_contract import (
    TrialPaths,
    nni_environment,
)

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = httpx.Timeout(30.0, connect=10.0)

ENDED = ("finished", "failed", "killed", "error")


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
                problem = code_problem(pack(code_directory, Path(scratch) / "code.tgz"))
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
        return AttemptFollower(dashboard, config, control, job_id, trial).run()

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
        return AttemptFollower(dashboard, config, control, str(found["jobId"]), trial).run()

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
