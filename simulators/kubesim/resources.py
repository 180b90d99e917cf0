"""The API resources the simulator serves, and their discovery documents.

Facts: discovery shapes follow `staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/types.go` (APIVersions,
APIGroupList, APIResourceList). The training-operator CRDs (kubeflow/training-operator v1.9.0
`manifests/base/crds/kubeflow.org_tfjobs.yaml`, `..._pytorchjobs.yaml`) are namespaced, group kubeflow.org, version
v1, with a `status` subresource. FrameworkController's CRD (microsoft/frameworkcontroller
`pkg/apis/frameworkcontroller/v1/crd.go` BuildFrameworkCRD) is namespaced, group frameworkcontroller.microsoft.com,
version v1, and has NO subresources: its status is written through the main resource (`+genclient:noStatus` in
`pkg/apis/frameworkcontroller/v1/types.go`), so a spec write can also change status there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CRUD_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


@dataclass(frozen=True)
class ResourceType:
    plural: str
    singular: str
    kind: str
    group: str
    version: str
    namespaced: bool = True
    status_subresource: bool = False
    custom: bool = False
    verbs: tuple[str, ...] = tuple(CRUD_VERBS)
    short_names: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    def discovery(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = [
            {
                "name": self.plural,
                "singularName": self.singular,
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": list(self.verbs),
                **({"shortNames": list(self.short_names)} if self.short_names else {}),
                "storageVersionHash": "sim" + self.plural[:8],
            }
        ]
        for sub in self.subresources:
            verbs = ["get"] if sub == "log" else ["get", "patch", "update"]
            kind = "Pod" if sub == "log" else self.kind
            entries.append(
                {
                    "name": f"{self.plural}/{sub}",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": kind,
                    "verbs": verbs,
                }
            )
        return entries


NAMESPACES = ResourceType(
    "namespaces",
    "namespace",
    "Namespace",
    "",
    "v1",
    namespaced=False,
    verbs=("create", "delete", "get", "list", "watch"),
    short_names=("ns",),
)
PODS = ResourceType(
    "pods", "pod", "Pod", "", "v1", short_names=("po",), subresources=("log", "status"), status_subresource=True
)
CONFIGMAPS = ResourceType("configmaps", "configmap", "ConfigMap", "", "v1", short_names=("cm",))
TFJOBS = ResourceType(
    "tfjobs", "tfjob", "TFJob", "kubeflow.org", "v1", status_subresource=True, custom=True, subresources=("status",)
)
PYTORCHJOBS = ResourceType(
    "pytorchjobs",
    "pytorchjob",
    "PyTorchJob",
    "kubeflow.org",
    "v1",
    status_subresource=True,
    custom=True,
    subresources=("status",),
)
FRAMEWORKS = ResourceType(
    "frameworks", "framework", "Framework", "frameworkcontroller.microsoft.com", "v1", custom=True
)
SELF_SUBJECT_ACCESS_REVIEWS = ResourceType(
    "selfsubjectaccessreviews",
    "selfsubjectaccessreview",
    "SelfSubjectAccessReview",
    "authorization.k8s.io",
    "v1",
    namespaced=False,
    verbs=("create",),
)

CORE = (NAMESPACES, PODS, CONFIGMAPS)
CUSTOM = {r.plural: r for r in (TFJOBS, PYTORCHJOBS, FRAMEWORKS)}


@dataclass
class Registry:
    """Which resources are served now; CRDs come and go with install_crds/remove_crd."""

    installed: dict[str, ResourceType] = field(default_factory=lambda: {r.plural: r for r in CORE})

    def install(self, plural: str) -> ResourceType:
        if plural not in CUSTOM:
            raise ValueError(f"unknown CRD plural {plural!r}; known: {sorted(CUSTOM)}")
        self.installed[plural] = CUSTOM[plural]
        return CUSTOM[plural]

    def remove(self, plural: str) -> None:
        self.installed.pop(plural, None)

    def get(self, plural: str) -> ResourceType | None:
        return self.installed.get(plural)

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        r = self.installed.get(plural)
        if r is None or r.group != group or r.version != version:
            return None
        return r

    def group_versions(self) -> dict[str, list[ResourceType]]:
        """Installed non-core groups ("group/version" -> resources), authorization always present."""
        out: dict[str, list[ResourceType]] = {"authorization.k8s.io/v1": [SELF_SUBJECT_ACCESS_REVIEWS]}
        for r in self.installed.values():
            if r.group:
                out.setdefault(r.api_version, []).append(r)
        return out


def version_info() -> dict[str, str]:
    return {
        "major": "1",
        "minor": "31",
        "gitVersion": "v1.31.0-kubesim",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2024-08-13T00:00:00Z",
        "goVersion": "go1.22.5",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
    }


def api_group_list(registry: Registry) -> dict[str, Any]:
    groups = []
    for gv in registry.group_versions():
        group, version = gv.split("/")
        entry = {"groupVersion": gv, "version": version}
        groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def resource_list(group_version: str, resources: list[ResourceType]) -> dict[str, Any]:
    out: list[dict[str, Any]] = []
    for r in resources:
        out.extend(r.discovery())
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": out}
