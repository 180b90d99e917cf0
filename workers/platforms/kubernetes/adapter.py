"""What the Kubernetes platforms (kubeflow/ and frameworkcontroller/, below) share: reaching the cluster,
shipping the code, one watch per namespace and kind, following a pod's log, and the loop that follows one
attempt (one custom resource) to its end.

Nothing in a pod reaches back to trialstream. The code goes to the pods in ConfigMaps (no volume on
the manager's host), mounted as one projected volume; `workers/platforms/shared/pod_keeper.py`, shipped with it,
unpacks it, runs the trial and prints every metric on the pod's stdout, which the worker reads through
the API (`read_namespaced_pod_log`, following, with timestamps). The timestamp of the last metric line
read is committed with the metrics, so a restarted worker or a broken stream resumes after it: no
metric is lost or read twice.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, TypeVar

import redis
import urllib3
from kubernetes import client as k8s
from kubernetes import config as kube_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

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
from workers.platforms.kubernetes.config import KubernetesConfig
from workers.platforms.kubernetes.settings import KubernetesSettings
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

APP_LABEL = "nni-kubernetes-trial"  # NNI's `app` label on every trial's resource and pods
RESOURCE_LABEL = "trialstream/resource"  # on the pods: which custom resource they belong to
WORK_DIR = "/trialstream"  # the pod's working directory, an emptyDir
CODE_PART_BYTES = 768 * 1024  # of the packed code per ConfigMap (a ConfigMap holds at most 1 MiB)
MAX_CODE_PARTS = 40  # 30 MiB packed: beyond, bake the code into the image
REQUEST_TIMEOUT = (10.0, 30.0)  # connect, read: every call but watches and log follows
WATCH_TIMEOUT_S = 240  # the server ends a watch after this; it is taken up again from where it was
LOG_READ_TIMEOUT_S = 300.0  # a silent log stream is re-opened (from its offset) after this
FOLLOW_IDLE_S = 5.0  # a safety net: the watches, a stop or the log follower wake an attempt at once
UNSEEN_CHECK_S = 30.0  # a resource created but never seen by the watch is looked up directly after this
LOG_DRAIN_S = 60.0  # how long an ended attempt waits for the rest of its pod's log
PRIMARY_END_WAIT_S = 5.0  # how long an ended job waits for its primary pod to end (for its exit code)
UNKNOWN_AFTER_S = 5.0  # a watch failing this long makes its trials UNKNOWN (one broken stream does not)

Phase = Literal["waiting", "running", "ended"]


@dataclass(frozen=True)
class ResourceKind:
    group: str
    version: str
    plural: str
    kind: str

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.plural}.{self.group}/{self.version})"


@dataclass(frozen=True)
class JobState:
    """What the custom resource's status says, as NNI reads it."""

    phase: Phase
    status: TrialJobStatus | None = None  # when ended
    message: str | None = None
    primary_exit: dict[str, Any] | None = None  # the primary container's `terminated`, where the resource keeps it


class ClusterError(Exception):
    """The cluster cannot be reached or used as configured; says what to fix, in one line."""


def kubernetes_name(*parts: str) -> str:
    """A name made of `parts`, unique for them (ids may hold capitals, names may not). Letters and
    digits only, as FrameworkController requires of a Framework's name (NNI's are `nniexp<id>...` too);
    short enough that the operators' pod names (`<name>-<role>-<index>`) stay within a 63-character
    label. The resource's labels, not its name, say which experiment and trial it belongs to."""
    readable = "".join(re.sub(r"[^a-z0-9]+", "", part.lower())[:10] for part in parts)
    return f"nni{readable}{zlib.crc32('/'.join(parts).encode()):08x}"


def api_client(config: KubernetesConfig, settings: Settings) -> k8s.ApiClient:
    """From `kubeconfig` (and `context`), else $KUBECONFIG or ~/.kube/config, else the pod's service
    account (in-cluster); never through the client's process-wide default configuration."""
    path = config.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
    path = os.path.expanduser(path.split(os.pathsep)[0])
    try:
        if config.kubeconfig or config.context or os.path.exists(path):
            if not os.path.exists(path):
                raise ClusterError(f"kubeconfig: {path} does not exist")
            return kube_config.new_client_from_config(config_file=path, context=config.context)
        configuration = k8s.Configuration()
        account = settings.of(KubernetesSettings).kubernetes_service_account_dir
        kube_config.incluster_config.InClusterConfigLoader(
            token_filename=str(account / "token"), cert_filename=str(account / "ca.crt")
        ).load_and_set(configuration)
        return k8s.ApiClient(configuration)
    except ConfigException as error:
        where = f"kubeconfig {path}" if os.path.exists(path) else "in-cluster service account"
        raise ClusterError(f"{where}: {error}") from None


def describe(error: Exception) -> str:
    """An API error as the server told it (its Status message), else the connection problem."""
    if isinstance(error, ApiException):
        with contextlib.suppress(ValueError, TypeError):
            return str(json.loads(error.body or "")["message"])
        return f"{error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------------------------------------------
# one watch per namespace and kind


class WatchedKind:
    """The objects of one kind in one namespace, kept current by one list-then-watch, shared by every
    attempt this process follows there. Bookmarks keep its resourceVersion fresh; a 410 Gone relists."""

    def __init__(self, name: str, list_call: Callable[..., Any], label_selector: str, index_label: str | None) -> None:
        self._list = list_call
        self._selector = label_selector
        self._index_label = index_label  # pods: grouped by the resource they belong to
        self._objects: dict[str, dict[str, Any]] = {}
        self._listeners: dict[str, set[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.synced = threading.Event()
        self._failing: tuple[float, str] | None = None  # since when, and why, the watch cannot be kept
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)
        self._thread.start()

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(name)

    def grouped(self, key: str) -> list[dict[str, Any]]:
        """The objects whose index label is `key` (a resource's pods)."""
        with self._lock:
            return [obj for obj in self._objects.values() if _labels(obj).get(self._index_label or "") == key]

    def trouble(self) -> str | None:
        """Why the cluster cannot be followed, once the watch has failed for UNKNOWN_AFTER_S."""
        failing = self._failing
        if failing is None or time.monotonic() - failing[0] < UNKNOWN_AFTER_S:
            return None
        return failing[1]

    def listen(self, key: str, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.setdefault(key, set()).add(callback)

    def forget(self, key: str, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.get(key, set()).discard(callback)
            if not self._listeners.get(key):
                self._listeners.pop(key, None)

    def close(self) -> None:
        self._closed.set()
        _interrupt(self._response)

    def _run(self) -> None:
        pause = 0.2
        version: str | None = None
        while not self._closed.is_set():
            try:
                if version is None:
                    version = self._relist()
                version = self._watch(version)
                pause = 0.2
            except ApiException as error:
                if error.status == 410:  # our resourceVersion is older than the server's history
                    version = None
                    continue
                log.warning("watch: %s", describe(error))
                self._fail(describe(error))
            except Exception as error:  # a broken connection: taken up again from the last version seen
                if self._closed.is_set():
                    return
                log.info("watch interrupted: %s", describe(error))
                self._fail(describe(error))
            self._closed.wait(pause)
            pause = min(pause * 2, 5.0)

    def _fail(self, reason: str) -> None:
        self._failing = (self._failing[0] if self._failing else time.monotonic(), reason)

    def _healthy(self) -> None:
        if self._failing is not None:
            self._failing = None
            for callback in self._all_listeners():
                callback()

    def _all_listeners(self) -> list[Callable[[], None]]:
        with self._lock:
            return [callback for callbacks in self._listeners.values() for callback in callbacks]

    def _relist(self) -> str:
        response = self._list(label_selector=self._selector, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
        listed = json.loads(response.data or b"{}")
        objects = {obj["metadata"]["name"]: obj for obj in listed.get("items") or []}
        with self._lock:
            changed = set(objects) ^ set(self._objects) | {
                name for name, obj in objects.items() if self._objects.get(name) != obj
            }
            self._objects = objects
        self.synced.set()
        self._healthy()
        for name in changed:
            self._notify(name, objects.get(name))
        return str(listed["metadata"]["resourceVersion"])

    def _watch(self, version: str) -> str:
        watcher = k8s_watch.Watch()
        stream = watcher.stream(
            self._list,
            label_selector=self._selector,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=(REQUEST_TIMEOUT[0], WATCH_TIMEOUT_S + 30),
        )
        for event in stream:
            if self._closed.is_set():
                watcher.stop()
                break
            obj = event["raw_object"]
            version = str(obj["metadata"]["resourceVersion"])
            self._healthy()
            if event["type"] == "BOOKMARK":
                continue
            name = obj["metadata"]["name"]
            with self._lock:
                previous = self._objects.get(name)
                if event["type"] == "DELETED":
                    self._objects.pop(name, None)
                else:
                    self._objects[name] = obj
            self._notify(name, obj if event["type"] != "DELETED" else None, previous)
        return watcher.resource_version or version

    def _notify(self, name: str, obj: dict[str, Any] | None, previous: dict[str, Any] | None = None) -> None:
        keys = {name}
        if self._index_label:
            keys |= {_labels(o).get(self._index_label, "") for o in (obj, previous) if o is not None}
        with self._lock:
            callbacks = [callback for key in keys for callback in self._listeners.get(key, ())]
        for callback in callbacks:
            callback()


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


# ---------------------------------------------------------------------------------------------------
# following a pod's log


def _timestamp_ns(text: str) -> int:
    """RFC 3339 with up to nanoseconds, as the kubelet prefixes log lines."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    seconds = datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9])


class LogFollower:
    """Reads one pod's log to its end, through the API, parsing metric lines. What it has committed is
    (`log_ns`, `log_skip`): the timestamp of the last metric line and how many lines of that very
    timestamp were read, so a re-opened stream skips exactly what was read."""

    def __init__(
        self, core: k8s.CoreV1Api, namespace: str, pod: str, control: TrialControl, pod_ended: Callable[[], bool]
    ) -> None:
        self.core, self.namespace, self.pod, self.control = core, namespace, pod, control
        self._pod_ended = pod_ended
        self.batch = MetricBatch(control)
        self.pump = StdoutMetricPump(self.batch)
        offsets = control.offsets()
        self.read_ns, self.read_same = offsets.get("log_ns", 0), offsets.get("log_skip", 0)
        self.done = threading.Event()
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"log-{pod}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.is_alive() or self.done.is_set()

    def stop(self) -> None:
        self._stop.set()
        _interrupt(self._response)

    def _run(self) -> None:
        pause = 0.2
        try:
            while not self._stop.is_set():
                try:
                    self._read_once()
                    pause = 0.2
                except ApiException as error:
                    if error.status == 404:  # the pod is gone, and its log with it
                        return
                    log.info("log of pod %s: %s", self.pod, describe(error))
                except Exception as error:  # a broken stream: re-opened from the offset
                    log.info("log of pod %s interrupted: %s", self.pod, describe(error))
                if self._pod_ended() and not self._stop.is_set():
                    self._read_once()  # what was written after the stream broke, to the end
                    return
                self._stop.wait(pause)
                pause = min(pause * 2, 5.0)
        except Exception as error:
            log.warning("log of pod %s: %s", self.pod, describe(error))
        finally:
            self.done.set()
            self.control.wake()

    def _read_once(self) -> None:
        """One stream, from the start of the log (the client offers no sinceTime, and a sinceSeconds from
        this machine's clock could miss lines on a cluster whose clock is ahead): what was read is skipped."""
        response: Any = self.core.read_namespaced_pod_log(
            self.pod,
            self.namespace,
            follow=not self._pod_ended(),
            timestamps=True,
            _preload_content=False,
            _request_timeout=(REQUEST_TIMEOUT[0], LOG_READ_TIMEOUT_S),
        )
        self._response = response
        try:
            same = 0  # lines of the current timestamp seen in this stream
            last = 0
            for line in _lines(response):
                stamp, _, text = line.partition(b" ")
                at = _timestamp_ns(stamp.decode())
                same = same + 1 if at == last else 1
                last = at
                if at < self.read_ns or (at == self.read_ns and same <= self.read_same):
                    continue  # read before this stream was opened
                self.pump.feed(text)
                found = self.batch.take()
                if found:
                    self.read_ns, self.read_same = at, same
                    self.control.metrics(found, offsets={"log_ns": at, "log_skip": same})
        finally:
            self._response = None
            response.release_conn()


def _interrupt(response: Any) -> None:
    """Closes a stream another thread is blocked reading, if there is one: the reader wakes at once."""
    if response is not None:
        with contextlib.suppress(Exception):
            response.close()


def _lines(response: urllib3.HTTPResponse) -> Iterator[bytes]:
    """Whole lines as they arrive (a chunk may hold several, or part of one)."""
    rest = b""
    for chunk in response.stream(64 * 1024, decode_content=False):
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


# ---------------------------------------------------------------------------------------------------
# the platform


KubernetesConfigT = TypeVar("KubernetesConfigT", bound=KubernetesConfig)


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
            problem = _cluster_problem(api, config, cls.resource_kind(config))
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
        attempt = _AttemptFollower(self, trial, control, config)
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
        attempt = _AttemptFollower(self, trial, control, config)
        if not attempt.exists():
            return None
        return attempt.follow()  # started again once the watch says so: the same TrialStarted, not a second

    def release(self, trial: TrialAssignment[KubernetesConfigT]) -> None:
        """Delete what a lost attempt left (its resource, and with it its pods)."""
        config = trial.platform_config
        _AttemptFollower(self, trial, None, config).delete()

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


def bound_call(call: Callable[..., Any], *args: str) -> Callable[..., Any]:
    """`call` with its positional arguments bound; keeps the docstring the client's Watch reads its return type from."""

    def bound(**kwargs: Any) -> Any:
        return call(*args, **kwargs)

    bound.__doc__ = call.__doc__
    return bound


def trial_labels(trial: TrialAssignment[KubernetesConfigT]) -> dict[str, str]:
    return {"app": APP_LABEL, "expId": trial.experiment_id, "trialId": trial.trial_id}


def resource_name(trial: TrialAssignment[KubernetesConfigT]) -> str:
    return kubernetes_name(trial.experiment_id, trial.trial_id, str(trial.attempt))


def code_map_name(experiment_id: str, index: int) -> str:
    return f"{kubernetes_name(experiment_id)}-code-{index:03d}"


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


_ACCESS = [("create", ""), ("get", ""), ("list", ""), ("watch", ""), ("delete", ""), ("deletecollection", "")]
_POD_ACCESS = [("list", "pods", ""), ("watch", "pods", ""), ("get", "pods", "log"), ("create", "configmaps", "")]


def _cluster_problem(api: k8s.ApiClient, config: KubernetesConfig, kind: ResourceKind) -> str | None:
    """The first thing that would keep trials from running in the cluster, in one line."""
    where = api.configuration.host
    try:
        k8s.VersionApi(api).get_code(_request_timeout=REQUEST_TIMEOUT)
    except ApiException as error:
        if error.status in (401, 403):
            return f"cluster at {where}: the credentials were refused ({describe(error)})"
        return f"cluster at {where}: {describe(error)}"
    except urllib3.exceptions.HTTPError as error:
        return f"cluster at {where} cannot be reached: {describe(error)}"
    try:
        resources = k8s.CustomObjectsApi(api).get_api_resources(
            kind.group, kind.version, _request_timeout=REQUEST_TIMEOUT
        )
        installed = any(resource.name == kind.plural for resource in resources.resources)
    except ApiException as error:
        if error.status != 404:
            return f"cluster at {where}: {describe(error)}"
        installed = False
    if not installed:
        return f"the {kind.label} custom resource is not installed in the cluster at {where}: install its operator"
    try:
        k8s.CoreV1Api(api).read_namespace(config.namespace, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as error:
        if error.status == 404:
            return (
                f"namespace {config.namespace!r} does not exist in the cluster at {where}: create it or set 'namespace'"
            )
        if error.status != 403:  # an account bound to a Role may not read namespaces: the reviews below tell
            return f"cluster at {where}: {describe(error)}"
    needed = [(verb, kind.plural, kind.group, "") for verb, _ in _ACCESS]
    needed += [(verb, resource, "", sub) for verb, resource, sub in _POD_ACCESS]
    authorization = k8s.AuthorizationV1Api(api)
    for verb, resource, group, subresource in needed:
        attributes = k8s.V1ResourceAttributes(
            namespace=config.namespace, verb=verb, group=group, resource=resource, subresource=subresource or None
        )
        review = authorization.create_self_subject_access_review(
            k8s.V1SelfSubjectAccessReview(spec=k8s.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes)),
            _request_timeout=REQUEST_TIMEOUT,
        )
        if review.status is None or not review.status.allowed:
            what = f"{resource}/{subresource}" if subresource else resource
            return (
                f"namespace {config.namespace!r}: the cluster's account may not {verb} {what} there: "
                "bind it to the Role in deploy/kubernetes/rbac.yaml"
            )
    return None


class _AttemptFollower:
    """One attempt of a trial: its custom resource, created, then followed to its end."""

    def __init__(
        self,
        platform: KubernetesPlatform,
        trial: TrialAssignment[KubernetesConfigT],
        control: TrialControl | None,
        config: KubernetesConfig,
    ) -> None:
        self.platform, self.trial, self.config = platform, trial, config
        self.control = control
        self.kind = platform.resource_kind(config)
        self.name = resource_name(trial)
        self.pod = platform.primary_pod(self.name, config)
        self.custom = k8s.CustomObjectsApi(platform._api(config))
        self.started = False
        self.seen = False
        self.deleted = False
        self.logs: LogFollower | None = None
        self.unschedulable_since: float | None = None
        self.told: str | None = None
        self.created_at = time.monotonic()
        self.last_primary: dict[str, Any] | None = None  # FrameworkController deletes pods as the attempt ends
        self.unknown = False
        self.ended_at: float | None = None
        self.recheck_s = FOLLOW_IDLE_S

    def create(self) -> None:
        kind = self.kind
        try:
            self.custom.create_namespaced_custom_object(
                kind.group,
                kind.version,
                self.config.namespace,
                kind.plural,
                self.platform.manifest(self.trial, self.config, self.name),
                field_validation="Strict",
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as error:
            if error.status != 409:  # 409: an earlier delivery of this attempt created it: it is followed
                raise
        self.created_at = time.monotonic()

    def exists(self) -> bool:
        kind = self.kind
        try:
            self.custom.get_namespaced_custom_object(
                kind.group,
                kind.version,
                self.config.namespace,
                kind.plural,
                self.name,
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        self.created_at = time.monotonic()
        return True

    def delete(self) -> None:
        """With its pods (background propagation). What the cluster cannot be asked now, clean-up deletes."""
        kind = self.kind
        self.deleted = True
        try:
            self.custom.delete_namespaced_custom_object(
                kind.group,
                kind.version,
                self.config.namespace,
                kind.plural,
                self.name,
                propagation_policy="Background",
                _request_timeout=REQUEST_TIMEOUT,
            )
        except ApiException as error:
            if error.status != 404:
                log.warning("deleting %s %s: %s", kind.kind, self.name, describe(error))
        except urllib3.exceptions.HTTPError as error:
            log.warning("deleting %s %s: %s", kind.kind, self.name, describe(error))

    def follow(self) -> TrialOutcome | Lost | Abandoned:
        control = self.control
        assert control is not None
        resources = self.platform.watched(self.config, "resources")
        pods = self.platform.watched(self.config, "pods")
        resources.listen(self.name, control.wake)
        pods.listen(self.name, control.wake)
        try:
            while True:
                self.recheck_s = FOLLOW_IDLE_S
                outcome = self._step(resources, pods, control)
                if outcome is not None:
                    return outcome
                control.wait(self.recheck_s)
        finally:
            resources.forget(self.name, control.wake)
            pods.forget(self.name, control.wake)
            if self.logs is not None:
                self.logs.stop()

    def _step(
        self, resources: WatchedKind, pods: WatchedKind, control: TrialControl
    ) -> TrialOutcome | Abandoned | None:
        stop = control.stop_request()
        if stop is not None:
            if stop.lease_lost:  # another worker follows it now; it runs on
                return Abandoned(stop.reason)
            self.delete()
            return TrialOutcome(stop.status, message=stop.reason)
        trouble = resources.trouble() or pods.trouble()
        if self.started and (trouble is not None) != self.unknown:  # UNKNOWN while the cluster cannot be followed
            self.unknown = trouble is not None
            control.unreachable(f"the cluster cannot be reached: {trouble}" if trouble else None)
        if trouble is not None:
            self.recheck_s = 1.0
            return None
        resource = resources.get(self.name)
        if resource is None:
            if not (self.seen or self._gone_unseen(resources)):
                return None
            return TrialOutcome(
                TrialJobStatus.FAILED,
                message=f"the {self.kind.kind} {self.config.namespace}/{self.name} was deleted outside trialstream",
            )
        self.seen = True
        state = self.platform.state_of(resource)
        own_pods = {pod["metadata"]["name"]: pod for pod in pods.grouped(self.name)}
        primary = own_pods.get(self.pod) or self.last_primary
        self.last_primary = primary
        if not self.started and (state.phase != "waiting" or _container_started(primary)):
            self.started = True
            control.started(WORK_DIR, url=f"kubernetes://{self.config.namespace}/pods/{self.pod}")
        if self.logs is None and _container_started(primary):
            self.logs = LogFollower(
                k8s.CoreV1Api(self.platform._api(self.config)),
                self.config.namespace,
                self.pod,
                control,
                lambda: _container_ended(pods.get(self.pod)),
            )
            self.logs.start()
        stopped = _stopped_by_cluster(own_pods.values())
        if stopped is not None and state.phase != "waiting":
            state = JobState("ended", TrialJobStatus.SYS_CANCELED, stopped)
        if state.phase == "ended":
            primary_now = pods.get(self.pod)
            if self._primary_still_ending(primary_now):
                return None
            if _container_ended(primary_now):  # else its log has no end to wait for
                self._drain_logs(control)
            if state.status is TrialJobStatus.SYS_CANCELED:
                self.delete()  # nothing of it may start again unobserved (a suspended job resumed)
            return self._outcome(state, primary)
        if state.phase == "waiting":
            return self._unschedulable(own_pods.values(), control)
        return None

    def _primary_still_ending(self, primary: dict[str, Any] | None) -> bool:
        """The job's end can be seen before its primary pod's: its exit code is worth a moment's wait."""
        if _container_ended(primary):
            return False
        now = time.monotonic()
        if self.ended_at is None:
            self.ended_at = now
        self.recheck_s = 0.2
        return now - self.ended_at < PRIMARY_END_WAIT_S

    def _gone_unseen(self, resources: WatchedKind) -> bool:
        """Created, yet never seen by the watch: after a while, asked directly whether it exists."""
        if not resources.synced.is_set() or time.monotonic() - self.created_at < UNSEEN_CHECK_S:
            return False
        if self.exists():
            self.seen = True  # it is there; the watch will bring it
            return False
        return True

    def _drain_logs(self, control: TrialControl) -> None:
        """Every metric of the pod's log read before the end is recorded (the stream ends with the container)."""
        if self.logs is None:
            return
        deadline = time.monotonic() + LOG_DRAIN_S
        while not self.logs.done.is_set() and time.monotonic() < deadline:
            if control.stop_request() is not None:
                return
            control.wait(0.5)

    def _outcome(self, state: JobState, primary: dict[str, Any] | None) -> TrialOutcome:
        terminated = _terminated(primary) or state.primary_exit or {}
        exit_code = terminated.get("exitCode") if terminated else None
        status = state.status or TrialJobStatus.FAILED
        if status is TrialJobStatus.FAILED:
            if exit_code:
                return TrialOutcome(
                    status, exit_code, failure_message(exit_code, terminated.get("message", "").strip())
                )
            return TrialOutcome(status, exit_code, state.message or "the job failed")
        return TrialOutcome(status, exit_code, state.message if status is not TrialJobStatus.SUCCEEDED else None)

    def _unschedulable(self, pods: Any, control: TrialControl) -> TrialOutcome | None:
        """A pod the cluster cannot place: told in the trial's message after a while, FAILED after its limit."""
        reasons = [
            f"pod {pod['metadata']['name']} cannot be scheduled: {condition.get('message') or 'Unschedulable'}"
            for pod in pods
            for condition in pod.get("status", {}).get("conditions") or []
            if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable"
        ]
        if not reasons:
            self.unschedulable_since = None
            return None
        now = time.monotonic()
        if self.unschedulable_since is None:
            self.unschedulable_since = now
        waited = now - self.unschedulable_since
        limit = self.config.fail_unschedulable_after
        if limit is not None and waited >= limit:
            self.delete()
            return TrialOutcome(TrialJobStatus.FAILED, message=f"{reasons[0]} (for {waited:.0f} s)")
        if waited >= self.config.report_unschedulable_after:
            if reasons[0] != self.told:
                self.told = reasons[0]
                control.waiting(reasons[0])
        else:
            self.recheck_s = min(self.recheck_s, self.config.report_unschedulable_after - waited)
        if limit is not None:
            self.recheck_s = min(self.recheck_s, max(0.1, limit - waited))
        return None


def _container_status(pod: dict[str, Any] | None) -> dict[str, Any]:
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or []
    return statuses[0].get("state") or {} if statuses else {}


def _container_started(pod: dict[str, Any] | None) -> bool:
    state = _container_status(pod)
    return "running" in state or "terminated" in state


def _container_ended(pod: dict[str, Any] | None) -> bool:
    return pod is None or "terminated" in _container_status(pod)


def _terminated(pod: dict[str, Any] | None) -> dict[str, Any]:
    terminated: dict[str, Any] = _container_status(pod).get("terminated") or {}
    return terminated


def _stopped_by_cluster(pods: Any) -> str | None:
    """A pod the cluster took away (evicted, preempted): the trial did not fail, it was stopped."""
    for pod in pods:
        status = pod.get("status", {})
        if status.get("phase") == "Failed" and status.get("reason") in ("Evicted", "Preempted", "Shutdown"):
            detail = f": {status['message']}" if status.get("message") else ""
            return f"the cluster stopped pod {pod['metadata']['name']} ({status['reason']}{detail})"
    return None
