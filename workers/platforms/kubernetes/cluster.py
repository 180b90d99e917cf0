"""Reaching a cluster for the Kubernetes platforms: credentials (kubeconfig or the in-cluster account),
resource names and labels, errors a user can act on, and the access check run before an experiment."""

from __future__ import annotations

import contextlib
import json
import os
import re
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import urllib3
from kubernetes import client as k8s
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from core.platform import (
    TrialAssignment,
)
from core.settings import Settings
from schemas.trial import TrialJobStatus
from workers.platforms.kubernetes.config import KubernetesConfig, KubernetesConfigT
from workers.platforms.kubernetes.settings import KubernetesSettings

APP_LABEL = "nni-kubernetes-trial"  # NNI's `app` label on every trial's resource and pods
RESOURCE_LABEL = "trialstream/resource"  # on the pods: which custom resource they belong to
WORK_DIR = "/trialstream"  # the pod's working directory, an emptyDir
REQUEST_TIMEOUT = (10.0, 30.0)  # connect, read: every call but watches and log follows

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
            api: k8s.ApiClient = kube_config.new_client_from_config(config_file=path, context=config.context)
            return api
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


def trial_labels(trial: TrialAssignment[KubernetesConfigT]) -> dict[str, str]:
    return {"app": APP_LABEL, "expId": trial.experiment_id, "trialId": trial.trial_id}


def resource_name(trial: TrialAssignment[KubernetesConfigT]) -> str:
    return kubernetes_name(trial.experiment_id, trial.trial_id, str(trial.attempt))


def code_map_name(experiment_id: str, index: int) -> str:
    return f"{kubernetes_name(experiment_id)}-code-{index:03d}"


_ACCESS = [("create", ""), ("get", ""), ("list", ""), ("watch", ""), ("delete", ""), ("deletecollection", "")]
_POD_ACCESS = [("list", "pods", ""), ("watch", "pods", ""), ("get", "pods", "log"), ("create", "configmaps", "")]


def cluster_problem(api: k8s.ApiClient, config: KubernetesConfig, kind: ResourceKind) -> str | None:
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
