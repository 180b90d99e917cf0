"""The openpai platform (NNI's `openpai` training service): each trial attempt is one OpenPAI job,
submitted to the cluster's REST server v2 as a protocol v2 YAML, followed by polling its state (OpenPAI
has no watch), stopped with `executionType: STOP`.

Code and output go through the shared storage NNI's PAI mode uses, mounted here at
`localStorageMountPoint` and in the job's container at `containerStorageMountPoint`: the code is
staged there once per experiment (`<exp>/nni-code`, honouring .nniignore), each attempt has its
directory (`<exp>/<trial>`, NNI_SYS_DIR) where the worker writes `parameter.cfg` and the job's command
wrapper writes the trial's stdout, stderr, exit code and NNI's metrics file. The worker reads them from
the local mount, with offsets committed to Redis with the metrics; nothing in the container reaches back.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import shutil
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import redis
import yaml

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
from workers.platforms.openpai.config import OpenpaiConfig
from workers.platforms.shared.code_package import CodeDirectoryError, check_size, pack
from workers.platforms.shared.output_reader import READ_LIMIT, OutputReader
from workers.platforms.shared.trial_contract import failure_message, read_tail, write_parameters

log = logging.getLogger(__name__)

API = "/rest-server/api/v2"
REQUEST_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
POLL_S = 1.0  # OpenPAI has no watch: a job's state is asked this often (NNI asks every 3 s)
EXIT_FILE_WAIT_S = 10.0  # an ended job's exit code file may reach the local mount a moment later (NFS caching)
UNSEEN_S = 30.0  # a submitted job the server still does not know after this long was deleted
CODE_DIR = "nni-code"  # NNI's name for the experiment's code on the storage
STDOUT, STDERR, EXIT_CODE = "trial.stdout", "trial.stderr", ".exitcode"
OUTPUT_FILES: dict[OutputStream, str] = {"stdout": STDOUT, "stderr": STDERR}
_LIVE_STATES = ("WAITING", "RUNNING")


class OpenpaiError(Exception):
    """An answer of OpenPAI's REST server that is not what was asked for, in one line."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}" if code else f"{status}: {message}")
        self.status, self.code, self.message = status, code, message


def job_name(trial: TrialAssignment[OpenpaiConfig]) -> str:
    """NNI's job name; a retry (attempt > 1) is a new job, since OpenPAI refuses a name twice."""
    name = f"nni_exp_{trial.experiment_id}_trial_{trial.trial_id}"
    return name if trial.attempt == 1 else f"{name}_attempt_{trial.attempt}"


def attempt_directory(trial: TrialAssignment[OpenpaiConfig]) -> str:
    """The attempt's directory on the storage, relative to its mount point: NNI's `<exp>/<trial>`."""
    name = trial.trial_id if trial.attempt == 1 else f"{trial.trial_id}_attempt_{trial.attempt}"
    return f"{trial.experiment_id}/{name}"


def trial_status(state: str) -> TrialJobStatus | None:
    """NNI's reading of an OpenPAI job state, for a job trialstream did not stop (it returns at once when it
    does): a job stopped (or stopping) is the cluster's doing, SYS_CANCELED. None: not ended."""
    return {
        "SUCCEEDED": TrialJobStatus.SUCCEEDED,
        "FAILED": TrialJobStatus.FAILED,
        "STOPPING": TrialJobStatus.SYS_CANCELED,
        "STOPPED": TrialJobStatus.SYS_CANCELED,
    }.get(state)


def job_command(trial: TrialAssignment[OpenpaiConfig], config: OpenpaiConfig, command: str) -> str:
    """The one command line the job's container runs (NNI's PAI trial command, without its keeper):
    NNI's environment, the code copied from the storage, the trial run with its stdout, stderr and exit
    code written to its directory on the storage. It exits with the trial's exit code."""
    sys_dir = f"{config.container_storage_mount_point}/{attempt_directory(trial)}"
    code = f"{config.container_storage_mount_point}/{trial.experiment_id}/{CODE_DIR}"
    d = shlex.quote(sys_dir)
    environment = {
        "NNI_PLATFORM": "openpai",
        "NNI_EXP_ID": trial.experiment_id,
        "NNI_TRIAL_JOB_ID": trial.trial_id,
        "NNI_SYS_DIR": sys_dir,
        "NNI_OUTPUT_DIR": f"{sys_dir}/nnioutput",
        "NNI_TRIAL_SEQ_ID": str(trial.form.sequence_id),
        "NNI_CODE_DIR": f"{sys_dir}/code",
        "MULTI_PHASE": "false",
        "PYTHONUNBUFFERED": "1",
    }
    exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in environment.items())
    return (
        f"export {exports} && mkdir -p {d}/code {d}/nnioutput {d}/.nni && cp -r {shlex.quote(code)}/. {d}/code "
        f"&& cd {d}/code && {{ sh -c {shlex.quote(command)} >{d}/{STDOUT} 2>{d}/{STDERR}; code=$?; "
        f"echo $code >{d}/{EXIT_CODE}.partial && mv {d}/{EXIT_CODE}.partial {d}/{EXIT_CODE}; exit $code; }}"
    )


def job_protocol(trial: TrialAssignment[OpenpaiConfig], config: OpenpaiConfig) -> dict[str, Any]:
    """The protocol v2 job of one attempt: NNI's own, or the user's openpaiConfig with NNI's name and
    each task role's commands wrapped (as NNI does)."""
    gpus = config.trial_gpu_number if config.trial_gpu_number is not None else trial.launch.gpu_number or 0
    template = config.openpai_config
    if template is not None:
        job = yaml.safe_load(yaml.safe_dump(template))  # a deep copy of plain data
        job["name"] = job_name(trial)
        for role in job["taskRoles"].values():
            role["commands"] = [job_command(trial, config, " && ".join(role["commands"]))]
        extras = job.setdefault("extras", {})
        if not any(storage.get("name") == config.storage_config_name for storage in extras.get("storages", [])):
            extras.setdefault("storages", []).append({"name": config.storage_config_name})
        if config.virtual_cluster:
            job.setdefault("defaults", {}).setdefault("virtualCluster", config.virtual_cluster)
        return dict(job)
    job = {
        "protocolVersion": 2,
        "name": job_name(trial),
        "type": "job",
        "jobRetryCount": 0,  # one attempt is one run: retries are maxTrialRetries'
        "prerequisites": [{"type": "dockerimage", "uri": config.docker_image, "name": "docker_image_0"}],
        "taskRoles": {
            "taskrole": {
                "instances": 1,
                "completion": {"minFailedInstances": 1, "minSucceededInstances": -1},
                "taskRetryCount": 0,
                "dockerImage": "docker_image_0",
                "resourcePerInstance": {
                    "gpu": gpus,
                    "cpu": config.trial_cpu_number,
                    "memoryMB": config.trial_memory_size,
                },
                "commands": [job_command(trial, config, trial.launch.command)],
            }
        },
        "extras": {"storages": [{"name": config.storage_config_name}], "submitFrom": "submit-job-v2"},
    }
    if config.virtual_cluster:
        job["defaults"] = {"virtualCluster": config.virtual_cluster}
    return job


class OpenpaiClient:
    """OpenPAI's REST server v2 for one user: the token goes in the Authorization header only, never in
    a URL, a message or a log line."""

    def __init__(self, http: httpx.Client, config: OpenpaiConfig) -> None:
        self.http = http
        self.host = config.host
        self.username = config.username
        self._headers = {"Authorization": f"Bearer {config.token.get_secret_value()}"}

    def request(self, method: str, path: str, content_type: str | None = None, **kwargs: Any) -> Any:
        """The answer's JSON (None when it has none); OpenpaiError for a refusal; httpx.HTTPError unreachable."""
        headers = {**self._headers, **({"Content-Type": content_type} if content_type else {})}
        url = f"{self.host}{API}{path}"
        answer = self.http.request(method, url, headers=headers, timeout=REQUEST_TIMEOUT, **kwargs)
        if answer.status_code >= 400:
            code, message = "", answer.text[:300]
            with contextlib.suppress(ValueError):
                body = answer.json()
                if isinstance(body, dict):  # OpenPAI's error answer: {"code": ..., "message": ...}
                    code, message = str(body.get("code") or ""), str(body.get("message") or message)
            raise OpenpaiError(answer.status_code, code, " ".join(message.split()))
        with contextlib.suppress(ValueError):
            return answer.json()
        return None

    def submit(self, job: dict[str, Any]) -> None:
        """NNI's submission: the protocol as YAML (`text/yaml`), answered 202."""
        self.request("POST", "/jobs", content_type="text/yaml", content=yaml.safe_dump(job, sort_keys=False).encode())

    def job(self, name: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/jobs/{self.username}~{name}"))

    def stop(self, name: str) -> None:
        self.request("PUT", f"/jobs/{self.username}~{name}/executionType", json={"value": "STOP"})

    def jobs(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/jobs", params={"username": self.username}) or [])

    def detail_url(self, name: str) -> str:
        return f"{self.host}/job-detail.html?username={self.username}&jobName={name}"


def describe(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class OpenpaiPlatform:
    name: ClassVar[str] = "openpai"
    config_model: ClassVar[type[PlatformConfig]] = OpenpaiConfig
    trials_per_process: ClassVar[int] = 256
    trials_outlive_worker: ClassVar[bool] = True

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per poll: one per trial per second
        self._http = httpx.Client(follow_redirects=True)
        self._staged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @classmethod
    def check(cls, config: OpenpaiConfig, code_directory: Path, settings: Settings) -> list[str]:
        """One line per problem: the code within NNI's limits, the local mount point, then the cluster
        (reachable, the token accepted, the virtual cluster and the storage there)."""
        problems: list[str] = []
        try:
            check_size(code_directory)
        except (CodeDirectoryError, OSError) as error:
            problems.append(f"trialCodeDirectory: {error}")
        mount = Path(config.local_storage_mount_point).expanduser()
        if not mount.is_dir():
            problems.append(
                f"localStorageMountPoint: {mount} is not a directory: mount the storage "
                f"{config.storage_config_name!r} there (the jobs see it at {config.container_storage_mount_point})"
            )
        with httpx.Client(follow_redirects=True) as http:
            problem = _cluster_problem(OpenpaiClient(http, config), config)
        return [*problems, problem] if problem else problems

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: OpenpaiConfig) -> None:
        """The code on the storage once per experiment (`<exp>/nni-code`): unpacked beside it, then renamed,
        so a job never copies half of it and two workers staging at once leave one whole copy."""
        target = Path(config.local_storage_mount_point).expanduser() / experiment_id / CODE_DIR
        key = (str(target), experiment_id)
        if key in self._staged or target.is_dir():
            self._staged.add(key)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".nni-code-", dir=target.parent) as scratch:
            package = pack(Path(launch.code_directory), Path(scratch) / "code.tgz")
            unpacked = Path(scratch) / "code"
            unpacked.mkdir()
            with tarfile.open(package.path) as tar:
                tar.extractall(unpacked, filter="data")
            unpacked.chmod(0o755)
            with contextlib.suppress(OSError):  # another worker renamed its copy first: that one is used
                unpacked.rename(target)
        self._staged.add(key)

    def run_trial(
        self, trial: TrialAssignment[OpenpaiConfig], control: TrialControl
    ) -> TrialOutcome | Deferred | Lost | Abandoned:
        config = trial.platform_config
        attempt = _AttemptFollower(self, trial, control, config)
        attempt.directory.mkdir(parents=True, exist_ok=True)
        write_parameters(attempt.directory, trial.form.hyper_parameters.value)
        try:
            attempt.api.submit(job_protocol(trial, config))
        except OpenpaiError as error:
            if error.status == 409:  # an earlier delivery of this attempt submitted it: it is followed
                return attempt.follow()
            if error.status >= 500:
                return Deferred(f"OpenPAI at {config.host} could not take the job: {error}")
            return TrialOutcome(TrialJobStatus.FAILED, message=f"OpenPAI at {config.host} refused the job: {error}")
        except httpx.HTTPError as error:  # it may have arrived: the next delivery finds it (409) and follows it
            return Deferred(f"OpenPAI at {config.host} cannot be reached: {describe(error)}")
        return attempt.follow()

    def reattach(
        self, trial: TrialAssignment[OpenpaiConfig], control: TrialControl
    ) -> TrialOutcome | Lost | Abandoned | None:
        config = trial.platform_config
        attempt = _AttemptFollower(self, trial, control, config)
        try:
            attempt.api.job(attempt.name)
        except OpenpaiError as error:
            if error.status == 404:
                return None
        except httpx.HTTPError:
            pass  # unreachable now: followed (UNKNOWN) until it answers
        return attempt.follow()

    def release(self, trial: TrialAssignment[OpenpaiConfig]) -> None:
        """Stop what a lost attempt left running (its job)."""
        config = trial.platform_config
        _AttemptFollower(self, trial, None, config).stop()

    def read_output(self, trial: TrialAssignment[OpenpaiConfig], url: str, stream: OutputStream, offset: int) -> bytes:
        """From the local mount of the storage, where the job's wrapper writes it."""
        config = trial.platform_config
        path = _AttemptFollower(self, trial, None, config).directory / OUTPUT_FILES[stream]
        try:
            with path.open("rb") as file:
                file.seek(offset)
                return file.read(READ_LIMIT)
        except FileNotFoundError:
            raise OutputUnavailable(f"{path} does not exist (not started yet, or the storage is not mounted)") from None
        except OSError as error:
            raise OutputUnavailable(f"{path}: {error}") from None

    def clean_up(self, experiment_id: str, config: OpenpaiConfig) -> None:
        """Stop every job of the experiment still waiting or running, and remove its staged code; the trials'
        directories (their output) stay on the storage, as under NNI."""
        api = OpenpaiClient(self._http, config)
        prefix = f"nni_exp_{experiment_id}_trial_"
        try:
            for job in api.jobs():
                name = str(job.get("name", ""))
                if name.startswith(prefix) and job.get("state") in _LIVE_STATES:
                    api.stop(name)
        except (OpenpaiError, httpx.HTTPError) as error:
            log.warning("clean-up of experiment %s at %s: %s", experiment_id, config.host, describe(error))
        code = Path(config.local_storage_mount_point).expanduser() / experiment_id / CODE_DIR
        shutil.rmtree(code, ignore_errors=True)
        self._staged = {key for key in self._staged if key[1] != experiment_id}

    def close(self) -> None:
        self._http.close()


def _cluster_problem(api: OpenpaiClient, config: OpenpaiConfig) -> str | None:
    """The first thing that keeps trials from running on the cluster, in one line."""
    try:
        clusters = api.request("GET", "/virtual-clusters")
    except httpx.HTTPError as error:
        return f"host: cannot reach OpenPAI at {config.host}: {describe(error)}; check the address and the network"
    except OpenpaiError as error:
        if error.status == 401:
            return (
                f"token: OpenPAI at {config.host} refused it ({error.message}): "
                "copy a valid token from the web portal's profile page"
            )
        return f"host: OpenPAI at {config.host} answered {error}"
    wanted = config.virtual_cluster or "default"
    known = sorted(clusters) if isinstance(clusters, dict) else []
    if wanted not in known:
        return (
            f"virtualCluster: {wanted!r} is not a virtual cluster of OpenPAI at {config.host}; "
            f"it has {', '.join(known) or 'none'}"
        )
    try:
        api.request("GET", f"/storages/{config.storage_config_name}")
    except OpenpaiError as error:
        if error.status == 404:
            return (
                f"storageConfigName: OpenPAI at {config.host} has no storage {config.storage_config_name!r} "
                f"({error.message}): give the name of a storage your user may mount"
            )
        return f"storageConfigName: OpenPAI at {config.host} answered {error}"
    except httpx.HTTPError as error:
        return f"host: cannot reach OpenPAI at {config.host}: {describe(error)}"
    return None


class _AttemptFollower:
    """One attempt of a trial: its job, followed to its end, and its directory on the local mount."""

    def __init__(
        self,
        platform: OpenpaiPlatform,
        trial: TrialAssignment[OpenpaiConfig],
        control: TrialControl | None,
        config: OpenpaiConfig,
    ) -> None:
        self.trial, self.control, self.config = trial, control, config
        self.api = OpenpaiClient(platform._http, config)
        self.name = job_name(trial)
        self.directory = Path(config.local_storage_mount_point).expanduser() / attempt_directory(trial)
        self.container_directory = f"{config.container_storage_mount_point}/{attempt_directory(trial)}"
        self.started = False
        self.seen = False
        self.unknown = False
        self.created_at = time.monotonic()
        self.output = OutputReader(control, self._read, STDOUT) if control is not None else None

    def stop(self) -> None:
        try:
            self.api.stop(self.name)
        except OpenpaiError as error:
            if error.status != 404:
                log.warning("stopping OpenPAI job %s: %s", self.name, error)
        except httpx.HTTPError as error:
            log.warning("stopping OpenPAI job %s: %s", self.name, describe(error))

    def follow(self) -> TrialOutcome | Lost | Abandoned:
        control = self.control
        assert control is not None
        while True:
            stop = control.stop_request()
            if stop is not None:
                if stop.lease_lost:  # another worker follows it now; it runs on
                    return Abandoned(stop.reason)
                self.stop()
                self.pull(final=False)
                return TrialOutcome(stop.status, message=stop.reason)
            outcome = self._step(control)
            if outcome is not None:
                return outcome
            control.wait(POLL_S)

    def _step(self, control: TrialControl) -> TrialOutcome | None:
        try:
            job = self.api.job(self.name)
        except (OpenpaiError, httpx.HTTPError) as error:
            if isinstance(error, OpenpaiError) and error.status == 404:
                if self.seen or time.monotonic() - self.created_at > UNSEEN_S:
                    return TrialOutcome(TrialJobStatus.FAILED, message=f"OpenPAI job {self.name} was deleted")
                return None  # just submitted: the server may not list it yet (as NNI notes)
            if self.started and not self.unknown:
                self.unknown = True
                control.unreachable(f"OpenPAI at {self.config.host} cannot be asked: {describe(error)}")
            return None
        if self.unknown:
            self.unknown = False
            control.unreachable(None)
        self.seen = True
        status = job.get("jobStatus") or {}
        state = str(status.get("state", ""))
        if not self.started and state not in ("", "WAITING"):
            self.started = True
            control.started(self.container_directory, url=self.api.detail_url(self.name))
        ended = trial_status(state)
        if ended is None:
            self.pull(final=False)
            return None
        exit_code = self._exit_code(control, status) if ended is not TrialJobStatus.SYS_CANCELED else None
        self.pull(final=True)
        if ended is TrialJobStatus.SYS_CANCELED:
            return TrialOutcome(ended, message=f"OpenPAI stopped job {self.name} ({state})")
        if ended is TrialJobStatus.FAILED:
            tail = read_tail(self.directory / STDERR)
            if exit_code:
                return TrialOutcome(ended, exit_code, failure_message(exit_code, tail))
            return TrialOutcome(ended, exit_code, f"OpenPAI job {self.name} failed; stderr: {tail}")
        return TrialOutcome(ended, exit_code)

    def _exit_code(self, control: TrialControl, status: dict[str, Any]) -> int | None:
        """The trial's own, from the file its wrapper wrote; else OpenPAI's appExitCode."""
        path = self.directory / EXIT_CODE
        deadline = time.monotonic() + EXIT_FILE_WAIT_S
        while not path.exists() and time.monotonic() < deadline and control.stop_request() is None:
            control.wait(0.2)
        with contextlib.suppress(OSError, ValueError):
            return int(path.read_text().strip())
        code = status.get("appExitCode")
        return int(code) if isinstance(code, int) else None

    def pull(self, final: bool) -> None:
        """Read what the trial wrote since the committed offsets (see workers.platforms.shared.output_reader)."""
        assert self.output is not None
        self.output.pull(final)

    def _read(self, name: str, offset: int, limit: int) -> bytes:
        try:
            with (self.directory / name).open("rb") as file:
                file.seek(offset)
                return file.read(limit)
        except FileNotFoundError:
            return b""
