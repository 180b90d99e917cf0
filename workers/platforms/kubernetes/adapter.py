"""The platform both Kubernetes platforms (kubeflow/ and frameworkcontroller/, below) extend: the port's
methods, the code shipped in ConfigMaps and the pods' template; the cluster access (cluster.py), the watches
(watch.py), the pod log follower (pod_log.py) and the attempt follower (follower.py) are beside it.
docs/platforms.md says how the code gets into the pods and the metrics out."""

from __future__ import annotations

import base64
import contextlib
import logging
import tempfile
import threading
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal

import redis
import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

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
from workers.platforms.kubernetes.cluster import (
    APP_LABEL,
    REQUEST_TIMEOUT,
    RESOURCE_LABEL,
    WORK_DIR,
    ClusterError,
    JobState,
    ResourceKind,
    api_client,
    cluster_problem,
    code_map_name,
    describe,
    trial_labels,
)
from workers.platforms.kubernetes.config import KubernetesConfig, KubernetesConfigT
from workers.platforms.kubernetes.follower import AttemptFollower
from workers.platforms.kubernetes.watch import WatchedKind, bound_call
from workers.platforms.shared import pod_keeper
from workers.platforms.shared.code_package import CodeDirectoryError, CodePackage, check_size, pack
from workers.platforms.shared.trial_contract import (
    TrialPaths,
    nni_environment,
)

log = logging.getLogger(__name__)


CODE_PART_BYTES = 768 * 1024  # of the packed code per ConfigMap (a ConfigMap holds at most 1 MiB)
MAX_CODE_PARTS = 40  # 30 MiB packed: beyond, bake the code into the image


class KubernetesPlatform(Generic[KubernetesConfigT]):
    """Shared by the Kubernetes platforms; a subclass says which resource a trial is, and how its
    status reads (`resource_kind`, `manifest`, `state_of`, `primary_pod`)."""

    name: ClassVar[str]
    config_model: ClassVar[type[KubernetesConfig]]  # the subclass's KubernetesConfigT
    trials_per_process: ClassVar[int] = 256
    trials_outlive_worker: ClassVar[bool] = True

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self._clients: dict[str, k8s.ApiClient] = {}
        self._watches: dict[tuple[str, str, str], WatchedKind] = {}
        self._staged: set[tuple[str, str, str]] = set()
        self._packages: dict[str, CodePackage] = {}
        self._lock = threading.Lock()
        self._cache = Path(tempfile.mkdtemp(prefix="trialstream-code-"))

    # what a platform says

    @classmethod
    def resource_kind(cls, config: KubernetesConfigT) -> ResourceKind:
        raise NotImplementedError

    def manifest(
        self, trial: TrialAssignment[KubernetesConfigT], config: KubernetesConfigT, name: str
    ) -> dict[str, Any]:
        """The custom resource of one attempt; its pods' templates come from `pod_template`."""
        raise NotImplementedError

    @classmethod
    def state_of(cls, resource: dict[str, Any]) -> JobState:
        raise NotImplementedError

    @classmethod
    def primary_pod(cls, name: str, config: KubernetesConfigT) -> str:
        """The pod whose log is the trial's (its metrics, and `trialstream trials logs`)."""
        raise NotImplementedError

    # the port

    @classmethod
    def check(cls, config: KubernetesConfigT, code_directory: Path, settings: Settings) -> list[str]:
        """The code within limits, then the cluster: reachable, the CRD installed, the namespace there and
        ours to use. One line per problem; the cluster's checks stop at the first that fails."""
        problems: list[str] = []
        try:
            check_size(code_directory)
            with tempfile.TemporaryDirectory() as scratch:
                _code_parts(pack(code_directory, Path(scratch) / "code.tgz"))
        except (CodeDirectoryError, OSError) as error:
            problems.append(f"trialCodeDirectory: {error}")
        try:
            api = api_client(config, settings)
        except ClusterError as error:
            return [*problems, str(error)]
        with api:
            problem = cluster_problem(api, config, cls.resource_kind(config))
        return [*problems, problem] if problem else problems

    def stage(self, experiment_id: str, launch: TrialLaunchSpec, config: KubernetesConfigT) -> None:
        """The code, packed once per experiment and worker, in ConfigMaps of the experiment's namespace."""
        key = (self._cluster_key(config), config.namespace, experiment_id)
        if key in self._staged:
            return
        package = self._packages.get(experiment_id)
        if package is None:
            package = pack(Path(launch.code_directory), self._cache / f"{experiment_id}.tgz")
            self._packages[experiment_id] = package
        core = k8s.CoreV1Api(self._api(config))
        for index, part in enumerate(_code_parts(package)):
            data: dict[str, bytes | str] = {f"code-{index:03d}": base64.b64encode(part).decode()}
            body = k8s.V1ConfigMap(
                metadata=k8s.V1ObjectMeta(
                    name=code_map_name(experiment_id, index), labels={"app": APP_LABEL, "expId": experiment_id}
                ),
                binary_data=data,
                data=pod_keeper.keeper_files() if index == 0 else None,
            )
            try:
                core.create_namespaced_config_map(config.namespace, body, _request_timeout=REQUEST_TIMEOUT)
            except ApiException as error:
                if error.status != 409:  # 409: staged by another worker (or an earlier run of this one)
                    raise
        self._staged.add(key)

    def run_trial(
        self, trial: TrialAssignment[KubernetesConfigT], control: TrialControl
    ) -> TrialOutcome | Deferred | Lost | Abandoned:
        config = trial.platform_config
        attempt = AttemptFollower(self, trial, control, config)
        try:
            attempt.create()
        except ApiException as error:
            if error.status in (400, 403, 404, 422):  # the cluster refuses it: trying again would not help
                return TrialOutcome(TrialJobStatus.FAILED, message=f"the cluster refused the trial: {describe(error)}")
            return Deferred(f"the cluster could not create it: {describe(error)}")
        except urllib3.exceptions.HTTPError as error:  # it may exist: the next delivery adopts it (409)
            return Deferred(f"the cluster cannot be reached: {describe(error)}")
        return attempt.follow()

    def reattach(
        self, trial: TrialAssignment[KubernetesConfigT], control: TrialControl
    ) -> TrialOutcome | Lost | Abandoned | None:
        config = trial.platform_config
        attempt = AttemptFollower(self, trial, control, config)
        if not attempt.exists():
            return None
        return attempt.follow()  # started again once the watch says so: the same TrialStarted, not a second

    def release(self, trial: TrialAssignment[KubernetesConfigT]) -> None:
        """Delete what a lost attempt left (its resource, and with it its pods)."""
        config = trial.platform_config
        AttemptFollower(self, trial, None, config).delete()

    def read_output(
        self, trial: TrialAssignment[KubernetesConfigT], url: str, stream: OutputStream, offset: int
    ) -> bytes:
        config = trial.platform_config
        if stream == "stderr":
            raise OutputUnavailable("Kubernetes keeps a pod's stdout and stderr as one log: it is all under stdout")
        pod = url.rsplit("/", 1)[-1]
        try:
            text: Any = k8s.CoreV1Api(self._api(config)).read_namespaced_pod_log(
                pod, config.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT
            )
        except ApiException as error:
            if error.status == 404:
                raise OutputUnavailable(f"pod {config.namespace}/{pod} is gone, and its log with it") from None
            raise OutputUnavailable(f"pod {config.namespace}/{pod}: {describe(error)}") from None
        except urllib3.exceptions.HTTPError as error:
            raise OutputUnavailable(f"the cluster cannot be reached: {describe(error)}") from None
        return bytes(text.data[offset : offset + (1 << 20)])

    def clean_up(self, experiment_id: str, config: KubernetesConfigT) -> None:
        """Every resource of the experiment (pods go with them: background propagation) and its code."""
        api = self._api(config)
        kind = self.resource_kind(config)
        selector = f"expId={experiment_id}"
        try:
            k8s.CustomObjectsApi(api).delete_collection_namespaced_custom_object(
                kind.group,
                kind.version,
                config.namespace,
                kind.plural,
                label_selector=selector,
                propagation_policy="Background",
                _request_timeout=REQUEST_TIMEOUT,
            )
            k8s.CoreV1Api(api).delete_collection_namespaced_config_map(
                config.namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT
            )
        except (ApiException, urllib3.exceptions.HTTPError) as error:
            log.warning("clean-up of experiment %s: %s", experiment_id, describe(error))
        self._staged = {key for key in self._staged if key[2] != experiment_id}

    def close(self) -> None:
        for watched in self._watches.values():
            watched.close()
        for api in self._clients.values():
            with contextlib.suppress(Exception):
                api.close()
        for package in self._packages.values():
            package.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._cache.rmdir()

    # what attempts share

    def pod_template(
        self,
        trial: TrialAssignment[KubernetesConfigT],
        config: KubernetesConfig,
        name: str,
        *,
        container: str,
        image: str,
        command: str | None,
        cpu: float,
        memory_mib: int,
        gpus: int,
    ) -> dict[str, Any]:
        """A pod running the keeper on the trial's command, with NNI's environment and labels."""
        paths = TrialPaths(sys_dir=WORK_DIR, output_dir=f"{WORK_DIR}/output", code_dir=f"{WORK_DIR}/code")
        environment = nni_environment({}, self.name, trial, paths, None)  # the keeper sets the paths it finds
        environment[pod_keeper.PARAMETERS_VARIABLE] = trial.form.hyper_parameters.value
        environment[pod_keeper.COMMAND_VARIABLE] = command or trial.launch.command
        mounts = [
            {"name": "work", "mountPath": WORK_DIR},
            {"name": "code", "mountPath": f"{WORK_DIR}/{pod_keeper.ARCHIVE_DIR}", "readOnly": True},
        ]
        volumes: list[dict[str, Any]] = [
            {"name": "work", "emptyDir": {}},
            {
                "name": "code",
                "projected": {
                    "sources": [
                        {"configMap": {"name": code_map_name(trial.experiment_id, index)}}
                        for index in range(len(_code_parts(self._packages[trial.experiment_id])))
                    ]
                },
            },
        ]
        if config.storage is not None:
            mounts.append({"name": "storage", "mountPath": f"{WORK_DIR}/{pod_keeper.STORAGE_DIR}"})
            volumes.append({"name": "storage", "nfs": {"server": config.storage.server, "path": config.storage.path}})
        limits: dict[str, str] = {"cpu": _quantity(cpu), "memory": f"{memory_mib}Mi"}
        if gpus:
            limits["nvidia.com/gpu"] = str(gpus)
        spec: dict[str, Any] = {
            "restartPolicy": "Never",  # one attempt is one run: retries are maxTrialRetries'
            "terminationGracePeriodSeconds": max(1, round(self.settings.kill_grace_s)),
            "containers": [
                {
                    "name": container,
                    "image": image,
                    "command": ["python3", f"{pod_keeper.ARCHIVE_DIR}/{pod_keeper.KEEPER}"],
                    "workingDir": WORK_DIR,
                    # `$(NAME)` in a value is Kubernetes' variable reference: `$$` keeps a `$` as it is
                    "env": [{"name": key, "value": value.replace("$", "$$")} for key, value in environment.items()],
                    "resources": {"requests": dict(limits), "limits": limits},
                    "volumeMounts": mounts,
                    "terminationMessagePath": f"{WORK_DIR}/{pod_keeper.TERMINATION_LOG}",
                    "terminationMessagePolicy": "File",
                }
            ],
            "volumes": volumes,
        }
        if config.service_account_name:
            spec["serviceAccountName"] = config.service_account_name
        return {"metadata": {"labels": {**trial_labels(trial), RESOURCE_LABEL: name}}, "spec": spec}

    def _cluster_key(self, config: KubernetesConfig) -> str:
        return f"{config.kubeconfig}|{config.context}"

    def _api(self, config: KubernetesConfig) -> k8s.ApiClient:
        key = self._cluster_key(config)
        with self._lock:
            api = self._clients.get(key)
            if api is None:
                api = self._clients[key] = api_client(config, self.settings)
            return api

    def watched(self, config: KubernetesConfigT, what: Literal["resources", "pods"]) -> WatchedKind:
        """The one watch of this namespace's trial resources (or their pods), started when first needed."""
        key = (self._cluster_key(config), config.namespace, what)
        api = self._api(config)
        with self._lock:
            watched = self._watches.get(key)
            if watched is None:
                selector = f"app={APP_LABEL}"
                if what == "pods":
                    list_pods = k8s.CoreV1Api(api).list_namespaced_pod
                    watched = WatchedKind(
                        f"pods-{config.namespace}", bound_call(list_pods, config.namespace), selector, RESOURCE_LABEL
                    )
                else:
                    kind = self.resource_kind(config)
                    list_call = k8s.CustomObjectsApi(api).list_namespaced_custom_object
                    bound = bound_call(list_call, kind.group, kind.version, config.namespace, kind.plural)
                    watched = WatchedKind(f"{kind.plural}-{config.namespace}", bound, selector, None)
                self._watches[key] = watched
            return watched


def _code_parts(package: CodePackage) -> list[bytes]:
    data = package.path.read_bytes()
    parts = [data[start : start + CODE_PART_BYTES] for start in range(0, len(data), CODE_PART_BYTES)] or [b""]
    if len(parts) > MAX_CODE_PARTS:
        raise CodeDirectoryError(
            f"packed, it is {len(data) / 2**20:.1f} MiB; the Kubernetes platforms ship at most "
            f"{MAX_CODE_PARTS * CODE_PART_BYTES // 2**20} MiB in ConfigMaps: exclude data with .nniignore, "
            "or put it in the image"
        )
    return parts


def _quantity(cpus: float) -> str:
    return str(int(cpus)) if float(cpus).is_integer() else f"{round(cpus * 1000)}m"
