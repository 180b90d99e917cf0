"""SimulatedCluster: wires the store, the HTTPS apiserver, the garbage collector, the operators and the kubelet."""

from __future__ import annotations

import base64
import copy
import shutil
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from simulators.kubesim import errors, pods, resources
from simulators.kubesim.frameworkcontroller import FrameworkController
from simulators.kubesim.gc import GarbageCollector
from simulators.kubesim.kubelet import Kubelet
from simulators.kubesim.resources import Registry, ResourceType
from simulators.kubesim.server import ApiServer, Token
from simulators.kubesim.store import Store
from simulators.kubesim.training_operator import TrainingOperator, admit
from simulators.tls import make_self_signed

ADMIN_TOKEN = "sim-admin-token"


@dataclass(frozen=True)
class Capacity:
    """The single node's allocatable resources."""

    cpu: float = 64
    memory_mib: int = 262144
    gpu: int = 0


class SimulatedCluster:
    """A protocol-level Kubernetes API server with operators and a process-running kubelet (see package doc)."""

    def __init__(
        self,
        root: Path,
        *,
        namespaces: Sequence[str] = ("default",),
        capacity: Capacity = Capacity(),
        bookmark_interval_s: float = 1.0,
        history_limit: int = 10000,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.bookmark_interval_s = bookmark_interval_s
        self.registry = Registry()
        self.store = Store(history_limit)
        for rt in resources.CORE:
            self.store.register(rt)
        for rt in resources.CUSTOM.values():
            self.store.register(rt)
        for plural in resources.CUSTOM:
            self.registry.install(plural)
        for ns in namespaces:
            self.store.create(
                resources.NAMESPACES,
                {
                    "metadata": {"name": ns, "labels": {"kubernetes.io/metadata.name": ns}},
                    "spec": {"finalizers": ["kubernetes"]},
                    "status": {"phase": "Active"},
                },
            )
        self._cert, self._key = make_self_signed(self.root / "pki", "kubesim-apiserver")
        self.api = ApiServer(self, self._cert, self._key)
        self.api.tokens[ADMIN_TOKEN] = Token("kubernetes-admin", None)
        self.gc = GarbageCollector(self.store)
        self.kubelet = Kubelet(self.store, self.root, capacity, lambda: self.api.port)
        self.training_operator = TrainingOperator(self)
        self.framework_controller = FrameworkController(self)
        self._started = False
        self._lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> SimulatedCluster:
        with self._lock:
            if self._started:
                return self
            self._started = True
            for part in (self.gc, self.kubelet, self.training_operator, self.framework_controller):
                part.start()
            self.api.start()
            return self

    def stop(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
        self.kubelet.kill_all()
        self.api.stop()
        for part in (self.framework_controller, self.training_operator, self.kubelet, self.gc):
            part.stop()
        self.kubelet.kill_all()

    def __enter__(self) -> SimulatedCluster:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # ---- access -------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.api.port}"

    @property
    def ca_path(self) -> Path:
        return self._cert

    def add_token(
        self,
        token: str,
        *,
        user: str = "system:serviceaccount:default:trialstream",
        namespaces: Sequence[str] | None = None,
    ) -> None:
        self.api.tokens[token] = Token(user, frozenset(namespaces) if namespaces is not None else None)

    def write_kubeconfig(
        self,
        path: Path,
        *,
        token: str = ADMIN_TOKEN,
        context: str = "sim",
        namespace: str | None = None,
        extra_contexts: dict[str, str] | None = None,
    ) -> Path:
        ca = base64.b64encode(self.ca_path.read_bytes()).decode()
        contexts = {context: token, **(extra_contexts or {})}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kubesim", "cluster": {"server": self.url, "certificate-authority-data": ca}}],
            "users": [{"name": f"user-{name}", "user": {"token": tok}} for name, tok in contexts.items()],
            "contexts": [
                {
                    "name": name,
                    "context": {
                        "cluster": "kubesim",
                        "user": f"user-{name}",
                        **({"namespace": namespace} if namespace else {}),
                    },
                }
                for name in contexts
            ],
            "current-context": context,
            "preferences": {},
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    # ---- CRDs and capacity --------------------------------------------------------------------------------
    def install_crds(self, *plurals: str) -> None:
        for plural in plurals or tuple(resources.CUSTOM):
            self.registry.install(plural)

    def remove_crd(self, plural: str) -> None:
        rt = self.registry.get(plural)
        if rt is None or not rt.custom:
            raise ValueError(f"{plural!r} is not an installed CRD")
        self.registry.remove(plural)
        self.store.drop_all(rt)

    def set_capacity(self, capacity: Capacity) -> None:
        self.kubelet.set_capacity(capacity)

    # ---- faults and inspection ----------------------------------------------------------------------------
    def break_watches(self) -> int:
        return self.api.cut_streams("watch")

    def break_log_streams(self) -> int:
        return self.api.cut_streams("log")

    def compact(self) -> None:
        self.store.compact()

    def evict(
        self,
        namespace: str,
        pod_name: str,
        message: str = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi. ",
    ) -> None:
        self.kubelet.evict(namespace, pod_name, message)

    def objects(self, plural: str, namespace: str = "default") -> list[dict[str, Any]]:
        rt = resources.CUSTOM.get(plural) or next((r for r in resources.CORE if r.plural == plural), None)
        if rt is None:
            raise ValueError(f"unknown resource {plural!r}")
        return self.store.list(rt, namespace if rt.namespaced else None)[0]

    @property
    def requests(self) -> Counter[str]:
        return self.api.requests

    def reset_requests(self) -> None:
        self.api.requests.clear()

    # ---- internal hooks -----------------------------------------------------------------------------------
    def admission_webhooks(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        admit(rt, obj)

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create a pod the way the apiserver would (defaults, validation, namespace check)."""
        pod = pods.default_pod(copy.deepcopy(pod))
        ns = pod["metadata"].get("namespace", "")
        if self.store.get(resources.NAMESPACES, "", ns) is None:
            raise errors.not_found("namespaces", "", ns)
        found = pods.validate_pod(pod)
        if found:
            raise errors.invalid_object("Pod", "", pod["metadata"].get("name", ""), found)
        return self.store.create(resources.PODS, pod)

    def wipe(self) -> None:
        """Remove the simulator's files (pods' filesystems, logs)."""
        shutil.rmtree(self.root / "pods", ignore_errors=True)
