"""The aml platform (NNI's `aml` training service): each trial attempt is one command job in an Azure
Machine Learning workspace, on its `computeTarget`, through the maintained SDK (azure-ai-ml, v2).

The experiment's code goes up once as a code asset (the packed code directory and the keeper of
workers/pod_keeper.py, which unpacks it, runs the trial and prints NNI's file metrics on stdout). A job
is followed by reading its status from the workspace and its stdout, `user_logs/std_log.txt` in the
workspace's default datastore, by byte offset: the offset after the last metric line read is committed
with the metrics, so a re-attached worker resumes there. Nothing in the job reaches back to trialstream.
The job's last line is the trial's exit code (Azure ML's job status has none).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import redis
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)

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
from schemas.events import TrialLaunchSpec
from schemas.trial import TrialJobStatus
from workers.platforms.aml.config import AmlConfig
from workers.platforms.shared import pod_keeper
from workers.platforms.shared.code_package import CodeDirectoryError, CodePackage, check_size, pack
from workers.platforms.shared.trial_contract import (
    MetricBatch,
    StdoutMetricPump,
    TrialPaths,
    failure_message,
    nni_environment,
)

if TYPE_CHECKING:  # the SDK takes seconds to import: a worker imports it with its first trial, not at start
    from azure.ai.ml import MLClient
    from azure.ai.ml.entities import Job
    from azure.core.credentials import TokenCredential
    from azure.storage.blob import BlobClient

log = logging.getLogger(__name__)
logging.getLogger("azure").setLevel(logging.WARNING)  # azure-core logs every request (URLs with SAS tokens) at INFO

EXIT_LINE = re.compile(rb"^trialstream: the trial exited with code (\d+)\s*$", re.MULTILINE)
# The code asset is the job's working directory: the keeper finds it as its `archive` beside a fresh work
# directory (NNI_SYS_DIR), where it unpacks the code and runs the trial.
# `trap : TERM`: a canceled job's SIGTERM reaches the keeper (which stops the trial) and this shell, which
# then still tells the trial's exit, rather than leave the worker waiting LOG_DRAIN_S for a line never written.
JOB_COMMAND = (
    "trap : TERM; "
    f'work=$(mktemp -d) && ln -s "$PWD" "$work/{pod_keeper.ARCHIVE_DIR}" && cd "$work" && '
    f"python3 {pod_keeper.ARCHIVE_DIR}/keeper.py; status=$?; "
    'echo "trialstream: the trial exited with code $status"; exit $status'
)
WAITING_STATUSES = {"NotStarted", "Queued", "Preparing", "Provisioning", "Starting"}  # any other runs, till it ends
ENDED_STATUSES = {"Completed", "Failed", "Canceled"}
READ_BYTES = 1 << 20  # of std_log per read
TAIL_BYTES = 2000  # of std_log told when a trial fails
UNREACHABLE_AFTER_S = 10.0  # the workspace failing this long makes the trial UNKNOWN; one failed call does not
LOG_DRAIN_S = 30.0  # how long an ended job's std_log is waited for (it is uploaded as the job ends)


def job_name(trial: TrialAssignment[AmlConfig]) -> str:
    """One job per attempt, named so that a second delivery or a re-attached worker finds it (letters,
    digits and underscores, as Azure ML allows); its tags, not its name, say which trial it is."""
    readable = "_".join(re.sub(r"[^a-z0-9]+", "", part.lower())[:12] for part in (trial.experiment_id, trial.trial_id))
    key = "/".join((trial.experiment_id, trial.trial_id, str(trial.attempt)))
    return f"nni_{readable}_{trial.attempt}_{zlib.crc32(key.encode()):08x}"


def std_log_path(name: str) -> str:
    """Where Azure ML keeps a job's stdout and stderr (merged) in the workspace's default datastore."""
    return f"ExperimentRun/dcid.{name}/user_logs/std_log.txt"


def _credential(config: AmlConfig) -> TokenCredential:
    from azure.identity import (
        AzureCliCredential,
        DefaultAzureCredential,
        EnvironmentCredential,
        ManagedIdentityCredential,
    )

    if config.credential == "environment":
        return EnvironmentCredential()
    if config.credential == "managedIdentity":
        return ManagedIdentityCredential()
    if config.credential == "azureCli":
        return AzureCliCredential()
    return DefaultAzureCredential()


def ml_client(config: AmlConfig, credential: TokenCredential | None = None) -> MLClient:
    """A client of the workspace; no request is made until it is used."""
    from azure.ai.ml import MLClient

    options: dict[str, Any] = {"enable_telemetry": False, "show_progress": False}
    if config.cloud:
        options["cloud"] = config.cloud
    return MLClient(
        credential or _credential(config),
        config.subscription_id,
        config.resource_group,
        config.workspace_name,
        **options,
    )


def describe(error: Exception) -> str:
    """An SDK error in one line: the service's message where it gave one."""
    if isinstance(error, HttpResponseError) and error.error is not None and error.error.message:
        return f"{error.error.code}: {error.error.message}" if error.error.code else str(error.error.message)
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _workspace_problem(client: MLClient, config: AmlConfig) -> str | None:
    """The first thing that keeps trials from running in the workspace, in one line."""
    where = (
        f"workspace {config.workspace_name!r} (resource group {config.resource_group!r}, "
        f"subscription {config.subscription_id})"
    )
    try:
        client.workspaces.get(config.workspace_name)
    except ClientAuthenticationError as error:
        return f"credential: signing in to Azure failed ({config.credential}): {describe(error)}"
    except ResourceNotFoundError:
        return f"workspaceName: {where} does not exist: check subscriptionId, resourceGroup and workspaceName"
    except (ServiceRequestError, ServiceResponseError) as error:
        return f"{where} cannot be reached: {describe(error)}"
    except HttpResponseError as error:
        return f"{where}: {describe(error)}"
    try:
        client.compute.get(config.compute_target)
    except ResourceNotFoundError:
        return f"computeTarget: {config.compute_target!r} is not a compute of {where}: create it or name another"
    except (HttpResponseError, ServiceRequestError, ServiceResponseError) as error:
        return f"computeTarget {config.compute_target!r}: {describe(error)}"
    return None


@dataclass
class _Workspace:
    """One workspace as this worker uses it: its client, and its default datastore's container (std_logs)."""

    client: MLClient
    credential: TokenCredential  # the client's: for a datastore that takes the identity rather than a key
    container: Any = None  # azure.storage.blob.ContainerClient, made on first use

    def logs(self) -> Any:
        if self.container is None:
            from azure.storage.blob import BlobServiceClient

            datastore = self.client.datastores.get_default(include_secrets=True)
            account_url = f"{datastore.protocol or 'https'}://{datastore.account_name}.blob.{datastore.endpoint}"
            secret = getattr(datastore.credentials, "account_key", None)
            credential: Any
            if secret:
                credential = {"account_name": datastore.account_name, "account_key": secret}
            else:
                credential = getattr(datastore.credentials, "sas_token", None) or self.credential
            service = BlobServiceClient(account_url, credential=credential)
            self.container = service.get_container_client(datastore.container_name)
        return self.container


class AmlPlatform:
    name: ClassVar[str] = "aml"
    config_model: ClassVar[type[AmlConfig]] = AmlConfig
    trials_per_process: ClassVar[int] = 64
    trials_outlive_worker: ClassVar[bool] = True

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self._workspaces: dict[tuple[str, ...], _Workspace] = {}
        self._codes: dict[tuple[tuple[str, ...], str], str] = {}  # (workspace, experiment) -> code asset id
        self._packages: dict[str, CodePackage] = {}
        self._lock = threading.Lock()
        self._cache = Path(tempfile.mkdtemp(prefix="trialstream-aml-"))

    @classmethod
    def check(cls, config: AmlConfig, code_directory: Path, settings: Settings) -> list[str]:
        """The code within NNI's limits, then the workspace: signed in, found, and its compute target there."""
        problems: list[str] = []
        try:
            check_size(code_directory)
        except (CodeDirectoryError, OSError) as error:
            problems.append(f"trialCodeDirectory: {error}")
        try:
            problem = _workspace_problem(ml_client(config), config)
        except Exception as error:  # the SDK refuses the settings themselves (an unknown cloud)
            problem = f"cloud: {describe(error)}"
        return [*problems, problem] if problem else problems

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: AmlConfig) -> None:
        """The packed code and the keeper as one code asset, `nni-<experiment>` versioned by the code's hash:
        uploaded once (a worker finding it there already, by its hash, uploads nothing)."""
        from azure.ai.ml.entities._assets import Code  # azure-ai-ml has no public class for a code asset

        workspace_key = _key(config)
        if (workspace_key, experiment_id) in self._codes:
            return
        package = self._packages.get(experiment_id)
        if package is None:
            package = pack(Path(launch.code_directory), self._cache / f"{experiment_id}.tgz")
            self._packages[experiment_id] = package
        staged = self._cache / experiment_id
        if not staged.exists():
            partial = self._cache / f".{experiment_id}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            shutil.copyfile(package.path, partial / "code-000")
            shutil.copyfile(pod_keeper.__file__, partial / "keeper.py")
            partial.rename(staged)
        name, version = f"nni-{experiment_id}", package.sha256[:16]
        codes = self._workspace(config).client._code
        try:
            created = codes.create_or_update(Code(name=name, version=version, path=str(staged)))
        except Exception as error:  # another worker created this version first: its path is the asset's (immutable)
            try:
                created = codes.get(name, version)
            except ResourceNotFoundError:
                raise error from None
        self._codes[(workspace_key, experiment_id)] = str(created.id)

    def run_trial(
        self, trial: TrialAssignment[AmlConfig], control: TrialControl
    ) -> TrialOutcome | Deferred | Lost | Abandoned:
        config = trial.platform_config
        attempt = _AttemptFollower(self, trial, control, config)
        try:
            if attempt.get() is None:  # else an earlier delivery of this attempt created it: it is followed
                attempt.create()
        except (ServiceRequestError, ServiceResponseError, ClientAuthenticationError) as error:
            return Deferred(f"the workspace cannot be reached: {describe(error)}")
        except HttpResponseError as error:
            if error.status_code is not None and 400 <= error.status_code < 500 and error.status_code != 429:
                return TrialOutcome(TrialJobStatus.FAILED, message=f"the workspace refused the job: {describe(error)}")
            return Deferred(f"the workspace could not create the job: {describe(error)}")
        return attempt.follow()

    def reattach(
        self, trial: TrialAssignment[AmlConfig], control: TrialControl
    ) -> TrialOutcome | Lost | Abandoned | None:
        config = trial.platform_config
        attempt = _AttemptFollower(self, trial, control, config)
        if attempt.get() is None:
            return None
        return attempt.follow()

    def release(self, trial: TrialAssignment[AmlConfig]) -> None:
        """Cancel the job a lost attempt left running."""
        config = trial.platform_config
        _AttemptFollower(self, trial, None, config).cancel()

    def read_output(self, trial: TrialAssignment[AmlConfig], url: str, stream: OutputStream, offset: int) -> bytes:
        config = trial.platform_config
        if stream == "stderr":
            raise OutputUnavailable("Azure ML keeps a job's stdout and stderr as one std_log: it is all under stdout")
        name = url.rsplit("/", 1)[-1]
        try:
            return _read(self._workspace(config).logs().get_blob_client(std_log_path(name)), offset, READ_BYTES)
        except ResourceNotFoundError:
            raise OutputUnavailable(f"job {name} has no std_log (yet)") from None
        except (HttpResponseError, ServiceRequestError, ServiceResponseError) as error:
            raise OutputUnavailable(f"the workspace's datastore: {describe(error)}") from None

    def clean_up(self, experiment_id: str, config: AmlConfig) -> None:
        """Cancel every job of the experiment still running (their std_logs stay in the workspace)."""
        client = self._workspace(config).client
        try:
            for job in client.jobs.list():
                if (job.tags or {}).get("nni.experiment") == experiment_id and _status(job) not in ENDED_STATUSES:
                    client.jobs.begin_cancel(job.name)
        except (HttpResponseError, ServiceRequestError, ServiceResponseError) as error:
            log.warning("clean-up of experiment %s: %s", experiment_id, describe(error))
        self._codes = {key: code for key, code in self._codes.items() if key[1] != experiment_id}

    def close(self) -> None:
        for workspace in self._workspaces.values():
            if workspace.container is not None:
                with contextlib.suppress(Exception):
                    workspace.container.close()
        shutil.rmtree(self._cache, ignore_errors=True)

    def _workspace(self, config: AmlConfig) -> _Workspace:
        key = _key(config)
        with self._lock:
            workspace = self._workspaces.get(key)
            if workspace is None:
                credential = _credential(config)
                workspace = self._workspaces[key] = _Workspace(ml_client(config, credential), credential)
            return workspace

    def job_environment(self, trial: TrialAssignment[AmlConfig]) -> dict[str, str]:
        """NNI's environment for the trial, and what the keeper needs: never this worker's own variables."""
        paths = TrialPaths(sys_dir="", output_dir="", code_dir="")  # the keeper sets them where it lays the trial out
        environment = nni_environment({}, self.name, trial, paths, None)
        environment[pod_keeper.PARAMETERS_VARIABLE] = trial.form.hyper_parameters.value
        environment[pod_keeper.COMMAND_VARIABLE] = trial.launch.command
        return environment


def _status(job: Job) -> str:
    """The service's status name (the SDK gives a str enum, whose str() is its Python name)."""
    return str(getattr(job.status, "value", job.status))


def _key(config: AmlConfig) -> tuple[str, ...]:
    return (config.subscription_id, config.resource_group, config.workspace_name, config.credential, config.cloud or "")


def _read(blob: BlobClient, offset: int, length: int) -> bytes:
    """Bytes of the blob from `offset` (b"" at its end): one ranged GET."""
    size = blob.get_blob_properties().size
    if offset >= size:
        return b""
    return bytes(blob.download_blob(offset=offset, length=min(length, size - offset)).readall())


class _AttemptFollower:
    """One attempt of a trial: its command job, created, then followed to its end."""

    def __init__(
        self, platform: AmlPlatform, trial: TrialAssignment[AmlConfig], control: TrialControl | None, config: AmlConfig
    ):
        self.platform, self.trial, self.control, self.config = platform, trial, control, config
        self.name = job_name(trial)
        self.workspace = platform._workspace(config)
        self.started = False
        self.offset = control.offsets().get("std_log", 0) if control is not None else 0
        self.tail = b""  # the end of std_log read so far: the failure message, and the exit code line
        self.failing_since: float | None = None
        self.unknown = False

    def get(self) -> Job | None:
        try:
            job: Job = self.workspace.client.jobs.get(self.name)
            return job
        except ResourceNotFoundError:
            return None

    def create(self) -> None:
        from azure.ai.ml import command
        from azure.ai.ml.entities import Environment

        trial, config = self.trial, self.config
        code = self.platform._codes[(_key(config), trial.experiment_id)]
        job = command(
            name=self.name,
            display_name=f"{trial.trial_id} (attempt {trial.attempt})",
            experiment_name=config.experiment_name or f"nni-{trial.experiment_id}",
            command=JOB_COMMAND,
            code=code,
            environment=Environment(image=config.docker_image),
            compute=config.compute_target,
            environment_variables=self.platform.job_environment(trial),
            tags={
                "nni.experiment": trial.experiment_id,
                "nni.trial": trial.trial_id,
                "nni.attempt": str(trial.attempt),
            },
        )
        self.workspace.client.jobs.create_or_update(job)

    def cancel(self) -> None:
        """Asked, not waited for: the job's status says when it has stopped."""
        try:
            self.workspace.client.jobs.begin_cancel(self.name)
        except ResourceNotFoundError:
            pass
        except (HttpResponseError, ServiceRequestError, ServiceResponseError) as error:
            log.warning("cancelling job %s: %s", self.name, describe(error))

    def follow(self) -> TrialOutcome | Lost | Abandoned:
        control = self.control
        assert control is not None
        while True:
            stop = control.stop_request()
            if stop is not None:
                if stop.lease_lost:  # another worker follows it now; it runs on
                    return Abandoned(stop.reason)
                self.cancel()
                return TrialOutcome(stop.status, message=stop.reason)
            try:
                job = self.get()
                self._reachable(control)
            except (HttpResponseError, ServiceRequestError, ServiceResponseError, ClientAuthenticationError) as error:
                self._unreachable(control, describe(error))
                control.wait(min(self.config.poll_interval, 1.0))
                continue
            if job is None:
                return TrialOutcome(TrialJobStatus.FAILED, message=f"job {self.name} was deleted outside trialstream")
            status = _status(job)
            if not self.started and status not in WAITING_STATUSES:
                self.started = True
                where = f"aml://{self.config.workspace_name}/jobs/{self.name}"
                control.started(std_log_path(self.name).rsplit("/", 2)[0], url=where)
            if self.started:
                self._read_log(control)
            if status in ENDED_STATUSES:
                return self._outcome(status, control)
            control.wait(self.config.poll_interval)

    def _read_log(self, control: TrialControl) -> bool:
        """Every whole line of std_log after the offset; metrics committed with the offset after them. False
        when the log could not be read now (not written yet, or the datastore failing)."""
        blob = self.workspace.logs().get_blob_client(std_log_path(self.name))
        batch = MetricBatch(control)
        pump = StdoutMetricPump(batch)
        while True:
            try:
                data = _read(blob, self.offset, READ_BYTES)
            except ResourceNotFoundError:
                return False
            except (HttpResponseError, ServiceRequestError, ServiceResponseError) as error:
                log.info("std_log of job %s: %s", self.name, describe(error))
                return False
            end = data.rfind(b"\n") + 1
            if end == 0:
                return True
            pump.feed(data[:end])
            self.tail = (self.tail + data[:end])[-TAIL_BYTES - 200 :]
            self.offset += end
            found = batch.take()
            if found:
                control.metrics(found, offsets={"std_log": self.offset})
            if len(data) < READ_BYTES:
                return True

    def _outcome(self, status: str, control: TrialControl) -> TrialOutcome:
        deadline = time.monotonic() + LOG_DRAIN_S
        while EXIT_LINE.search(self.tail) is None and time.monotonic() < deadline:  # the log's last upload
            if control.stop_request() is not None or not self._read_log(control):
                break
            if EXIT_LINE.search(self.tail) is None:
                control.wait(0.5)
        found = EXIT_LINE.search(self.tail)
        exit_code = int(found.group(1)) if found else None
        if status == "Completed":
            return TrialOutcome(TrialJobStatus.SUCCEEDED, exit_code if exit_code is not None else 0)
        if status == "Canceled":
            return TrialOutcome(
                TrialJobStatus.SYS_CANCELED, exit_code, f"job {self.name} was canceled in the workspace"
            )
        told = EXIT_LINE.sub(b"", self.tail)
        lines = [line for line in told.splitlines() if line.strip() and not line.startswith(b"NNISDK_MEb")]
        tail = b"\n".join(lines)[-TAIL_BYTES:].decode(errors="replace").strip()
        if exit_code:
            return TrialOutcome(TrialJobStatus.FAILED, exit_code, failure_message(exit_code, tail))
        return TrialOutcome(
            TrialJobStatus.FAILED, exit_code, f"job {self.name} failed" + (f"; std_log: {tail}" if tail else "")
        )

    def _unreachable(self, control: TrialControl, reason: str) -> None:
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        if self.started and not self.unknown and now - self.failing_since >= UNREACHABLE_AFTER_S:
            self.unknown = True
            control.unreachable(f"the workspace cannot be reached: {reason}")

    def _reachable(self, control: TrialControl) -> None:
        self.failing_since = None
        if self.unknown:
            self.unknown = False
            control.unreachable(None)
