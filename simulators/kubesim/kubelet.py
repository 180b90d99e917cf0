"""One simulated node: the scheduler's fit check and a kubelet that runs each container as a local process.

Facts (kubernetes/kubernetes):
- Scheduling (`pkg/scheduler/framework/plugins/noderesources/fit.go`, `pkg/scheduler/schedule_one.go`): a pod fits
  when the sum of its containers' requests (limits when only limits are given, as defaulted) plus the requests of
  the non-terminal pods on the node fit the node's allocatable; otherwise it stays Pending with condition
  PodScheduled=False, reason Unschedulable, message `0/1 nodes are available: 1 Insufficient cpu, 1 Insufficient
  nvidia.com/gpu. preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.`
  (reasons sorted), and is retried when a pod leaves or the node grows.
- Container start (`pkg/kubelet/kuberuntime/kuberuntime_container.go`, `pkg/kubelet/container/helpers.go`):
  command+args are exec'd without a shell after `$(VAR)` expansion from the container's env (`$$(VAR)` escapes,
  undefined references stay as written; `third_party/forked/golang/expansion`). A failure to exec is
  terminated reason StartError, exit code 128.
- Exit: state.terminated {exitCode, reason Completed (0) | Error, message, startedAt, finishedAt}; the message is
  the terminationMessagePath file (at most 4096 bytes), or with FallbackToLogsOnError, an empty file and a
  non-zero exit, the last 80 lines / 2048 bytes of the log (`kubecontainer.MaxContainerTerminationMessage*`).
  restartPolicy Always/OnFailure restarts the container in place with back-off 10s doubling to 300s
  (`pkg/kubelet/kubelet.go` MaxContainerBackOff), state waiting CrashLoopBackOff meanwhile, restartCount++.
- Logs (`pkg/kubelet/kuberuntime/logs/logs.go`): stdout and stderr of a container are one log; `timestamps`
  prefixes RFC3339NanoFixed (`2006-01-02T15:04:05.000000000Z07:00`) and a space; sinceTime is inclusive.
- Deletion (`pkg/kubelet/kuberuntime/kuberuntime_container.go` killContainer): SIGTERM, then SIGKILL after the
  grace period; the kubelet writes the terminal status (phase Failed/Succeeded, containers terminated) and then
  removes the pod object (`pkg/kubelet/status/status_manager.go`).
- Eviction (`pkg/kubelet/eviction/eviction_manager.go`): the pod is killed, phase Failed, reason Evicted, with
  condition DisruptionTarget=True reason TerminationByKubelet.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simulators.kubesim import errors, pods, resources
from simulators.kubesim.controller import Controller
from simulators.kubesim.store import Event, Store, now_rfc3339
from simulators.processes import descendants

if TYPE_CHECKING:
    from simulators.kubesim.cluster import Capacity

NODE = "kubesim-node"
NODE_LABELS = {"kubernetes.io/hostname": NODE, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
MAX_MESSAGE = 4096
FALLBACK_LINES, FALLBACK_BYTES = 80, 2048
BACKOFF_START, BACKOFF_MAX = 10.0, 300.0


@dataclass
class LogLine:
    ts_ns: int
    stream: str
    data: bytes


class ContainerLog:
    """One container instance's log: lines in arrival order with their stream tag, followable."""

    def __init__(self, path: Path) -> None:
        self.lines: list[LogLine] = []
        self.cond = threading.Condition()
        self.done = False
        self._last = 0
        self._file = path.open("ab")

    def append(self, stream: str, data: bytes) -> None:
        with self.cond:
            ts = max(time.time_ns(), self._last + 1)
            self._last = ts
            self.lines.append(LogLine(ts, stream, data))
            tag = "F" if data.endswith(b"\n") else "P"
            self._file.write(f"{ts} {stream} {tag} ".encode() + data + (b"" if tag == "F" else b"\n"))
            self._file.flush()
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self._file.close()
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def select(self, since_ns: int | None, tail: int | None) -> tuple[int, list[LogLine]]:
        with self.cond:
            chosen = [x for x in self.lines if since_ns is None or x.ts_ns >= since_ns]
            if tail is not None:
                chosen = chosen[-tail:] if tail > 0 else []
            return len(self.lines), chosen

    def wait_after(self, cursor: int, broken: Any) -> tuple[int, list[LogLine], bool]:
        with self.cond:
            while len(self.lines) == cursor and not self.done and not broken():
                self.cond.wait(0.5)
            return len(self.lines), self.lines[cursor:], self.done

    def text(self) -> bytes:
        with self.cond:
            return b"".join(x.data for x in self.lines)


@dataclass
class ContainerRun:
    """The live state of one container of a pod on this node."""

    name: str
    restart_count: int = 0
    process: subprocess.Popen[bytes] | None = None
    log: ContainerLog | None = None
    previous_log: ContainerLog | None = None
    started_at: str = ""
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None
    waiting: dict[str, Any] | None = field(default_factory=lambda: {"reason": "ContainerCreating"})
    restart_at: float | None = None
    backoff: float = BACKOFF_START
    container_id: str = ""


@dataclass
class PodRun:
    uid: str
    namespace: str
    name: str
    root: Path
    containers: dict[str, ContainerRun]
    started: bool = False
    killing: bool = False
    kill_deadline: float | None = None
    evicted: str | None = None
    start_time: str = field(default_factory=now_rfc3339)


class Kubelet(Controller):
    """Scheduler + kubelet for the single node; keys are ("pod", ns, name) or ("schedule",)."""

    name = "kubelet"

    def __init__(self, store: Store, root: Path, capacity: Capacity, api_port: Any) -> None:
        super().__init__()
        self.store = store
        self.root = root
        self.capacity = capacity
        self.api_port = api_port
        self.runs: dict[str, PodRun] = {}
        self.lock = threading.RLock()
        # what the scheduler needs, kept from the store's events (under its lock) rather than listing every pod:
        # pods waiting for a node, and bound pods that still hold their requests (not Succeeded or Failed)
        self._unbound: dict[tuple[str, str], dict[str, Any]] = {}
        self._holding: dict[tuple[str, str], dict[str, Any]] = {}
        store.subscribe(self._on_event)

    # ---- events -------------------------------------------------------------------------------------------
    def _on_event(self, ev: Event) -> None:
        if ev.plural == "pods":
            self._track(ev)
            self.queue.add(("pod", ev.namespace, ev.obj["metadata"]["name"], ev.obj["metadata"]["uid"]))
            if ev.type == "DELETED" or (ev.obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                self.queue.add(("schedule",))
            if ev.type == "ADDED":
                self.queue.add(("schedule",))
        elif ev.plural == "configmaps":
            self.queue.add(("schedule",))

    def _track(self, ev: Event) -> None:
        key = (ev.namespace, ev.obj["metadata"]["name"])
        self._unbound.pop(key, None)
        self._holding.pop(key, None)
        if ev.type == "DELETED":
            return
        if not ev.obj["spec"].get("nodeName"):
            if not ev.obj["metadata"].get("deletionTimestamp"):
                self._unbound[key] = ev.obj
        elif (ev.obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            self._holding[key] = ev.obj

    def set_capacity(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.queue.add(("schedule",))

    # ---- scheduling ---------------------------------------------------------------------------------------
    def _allocatable(self) -> dict[str, Decimal]:
        c = self.capacity
        return {
            "cpu": Decimal(str(c.cpu)),
            "memory": Decimal(c.memory_mib) * (1 << 20),
            pods.GPU: Decimal(c.gpu),
            "pods": Decimal(110),
            "ephemeral-storage": Decimal(1 << 40),
        }

    def _schedule(self) -> None:
        with self.store.lock:  # the events' objects are shared with watchers: read, never changed
            holding, unbound = list(self._holding.values()), list(self._unbound.values())
        used: dict[str, Decimal] = {}
        for p in holding:
            for r, q in pods.pod_requests(p).items():
                used[r] = used.get(r, Decimal(0)) + q
            used["pods"] = used.get("pods", Decimal(0)) + 1
        pending = sorted(
            unbound, key=lambda p: (p["metadata"]["creationTimestamp"], int(p["metadata"]["resourceVersion"]))
        )
        allocatable = self._allocatable()
        for p in pending:
            need = pods.pod_requests(p)
            need["pods"] = Decimal(1)
            short = sorted(
                f"Insufficient {r}"
                for r, q in need.items()
                if q > 0 and used.get(r, Decimal(0)) + q > allocatable.get(r, Decimal(0))
            )
            selector = p["spec"].get("nodeSelector") or {}
            if any(NODE_LABELS.get(k) != v for k, v in selector.items()):
                short = ["node(s) didn't match Pod's node affinity/selector"]
            if short:
                reasons = ", ".join(f"1 {s}" for s in short)
                message = (
                    f"0/1 nodes are available: {reasons}. preemption: 0/1 nodes are available: "
                    "1 No preemption victims found for incoming pod."
                )
                self._set_condition(
                    p, {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
                )
                continue
            for r, q in need.items():
                used[r] = used.get(r, Decimal(0)) + q
            self._bind(p)

    def _set_condition(self, pod: dict[str, Any], cond: dict[str, Any]) -> None:
        def apply(o: dict[str, Any]) -> None:
            status = o.setdefault("status", {})
            conds = [c for c in status.get("conditions") or [] if c["type"] != cond["type"]]
            old = next((c for c in status.get("conditions") or [] if c["type"] == cond["type"]), None)
            same = old is not None and all(old.get(k) == v for k, v in cond.items())
            if same:
                return
            conds.append({**cond, "lastProbeTime": None, "lastTransitionTime": now_rfc3339()})
            status["conditions"] = conds

        with contextlib.suppress(errors.ApiError):
            self.store.update(
                resources.PODS,
                pod["metadata"]["namespace"],
                pod["metadata"]["name"],
                apply,
                subresource="status",
                expect_uid=pod["metadata"]["uid"],
            )

    def _bind(self, pod: dict[str, Any]) -> None:
        def bind(o: dict[str, Any]) -> None:
            o["spec"]["nodeName"] = NODE

        def scheduled(o: dict[str, Any]) -> None:
            status = o.setdefault("status", {})
            conds = [c for c in status.get("conditions") or [] if c["type"] != "PodScheduled"]
            conds.append(
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}
            )
            status["conditions"] = conds

        md = pod["metadata"]
        with contextlib.suppress(errors.ApiError), self.store.lock:
            self.store.update(
                resources.PODS, md["namespace"], md["name"], bind, subresource="spec-binding", expect_uid=md["uid"]
            )
            self.store.update(
                resources.PODS, md["namespace"], md["name"], scheduled, subresource="status", expect_uid=md["uid"]
            )

    # ---- reconcile ----------------------------------------------------------------------------------------
    def reconcile(self, key: Any) -> None:
        if key[0] == "schedule":
            self._schedule()
            return
        _, ns, name, uid = key
        with self.lock:
            pod = self.store.get(resources.PODS, ns, name)
            if pod is not None and pod["metadata"]["uid"] != uid:
                pod = None
            run = self.runs.get(uid)
            if pod is None:
                if run is not None:  # force-deleted: kill what is left
                    self._kill(run, signal.SIGKILL)
                    if not self._alive(run):
                        self.runs.pop(uid, None)
                return
            if not pod["spec"].get("nodeName"):
                if pod["metadata"].get("deletionTimestamp"):
                    self.store.finalize(resources.PODS, ns, name, uid)
                return
            if run is None:
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    if pod["metadata"].get("deletionTimestamp"):
                        self.store.finalize(resources.PODS, ns, name, uid)
                    return
                run = self._admit(pod)
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(pod, run)
                return
            if run.evicted is not None:
                return
            self._sync_containers(pod, run)

    def _admit(self, pod: dict[str, Any]) -> PodRun:
        md = pod["metadata"]
        root = self.root / "pods" / md["namespace"] / md["uid"]
        (root / "fs").mkdir(parents=True, exist_ok=True)
        (root / "logs").mkdir(exist_ok=True)
        run = PodRun(
            md["uid"],
            md["namespace"],
            md["name"],
            root,
            {c["name"]: ContainerRun(c["name"]) for c in pod["spec"]["containers"]},
        )
        self.runs[md["uid"]] = run
        self._write_status(pod, run)
        return run

    # ---- volumes ------------------------------------------------------------------------------------------
    def _materialize(self, pod: dict[str, Any], run: PodRun) -> str | None:
        """Create the pod's volumes and mounts; returns a waiting message if a configMap is missing."""
        fs = run.root / "fs"
        volumes_dir = run.root / "volumes"
        volumes_dir.mkdir(exist_ok=True)
        sources: dict[str, Path] = {}
        for v in pod["spec"].get("volumes") or []:
            name = v["name"]
            target = volumes_dir / name
            if "configMap" in v or "projected" in v:
                if target.exists():
                    shutil.rmtree(target)
                target.mkdir()
                refs = (
                    [v["configMap"]]
                    if "configMap" in v
                    else [s["configMap"] for s in v["projected"].get("sources") or [] if "configMap" in s]
                )
                for ref in refs:
                    cm = self.store.get(resources.CONFIGMAPS, run.namespace, ref.get("name", ""))
                    if cm is None:
                        if ref.get("optional"):
                            continue
                        return f'MountVolume.SetUp failed for volume "{name}" : configmap "{ref.get("name")}" not found'
                    files: dict[str, bytes] = {k: val.encode() for k, val in (cm.get("data") or {}).items()}
                    files.update({k: base64.b64decode(val) for k, val in (cm.get("binaryData") or {}).items()})
                    items = ref.get("items")
                    chosen = (
                        [(it["key"], it["path"], it.get("mode")) for it in items]
                        if items
                        else [(k, k, None) for k in files]
                    )
                    for k, rel, mode in chosen:
                        if k not in files:
                            if ref.get("optional"):
                                continue
                            return (
                                f'MountVolume.SetUp failed for volume "{name}" : configmap references non-existent '
                                f"config key: {k}"
                            )
                        dest = target / rel
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        dest.write_bytes(files[k])
                        dest.chmod(
                            mode
                            if mode is not None
                            else int((v.get("configMap") or v.get("projected") or {}).get("defaultMode", 0o644))
                        )
            elif "emptyDir" in v:
                target.mkdir(exist_ok=True)
                target.chmod(0o777)
            elif "nfs" in v:
                target = self.root / "nfs" / v["nfs"]["server"] / v["nfs"]["path"].lstrip("/")
                target.mkdir(parents=True, exist_ok=True)
            elif "persistentVolumeClaim" in v:
                target = self.root / "pvc" / run.namespace / v["persistentVolumeClaim"]["claimName"]
                target.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in v:
                target = self.root / "hostpath" / v["hostPath"]["path"].lstrip("/")
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.mkdir(exist_ok=True)
            sources[name] = target
        for c in pod["spec"]["containers"]:
            for mount in c.get("volumeMounts") or []:
                src = sources[mount["name"]]
                if mount.get("subPath"):
                    src = src / mount["subPath"]
                    src.mkdir(parents=True, exist_ok=True)
                dest = fs / mount["mountPath"].lstrip("/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if dest.is_symlink() or dest.exists():
                    continue
                dest.symlink_to(src, target_is_directory=True)
        return None

    # ---- containers ---------------------------------------------------------------------------------------
    def _sync_containers(self, pod: dict[str, Any], run: PodRun) -> None:
        now = time.monotonic()
        if not run.started:
            waiting = self._materialize(pod, run)
            if waiting is not None:
                self.queue.add_after(("pod", run.namespace, run.name, run.uid), 1.0)
                return
            run.started = True
            for spec in pod["spec"]["containers"]:
                self._start(pod, run, spec)
        policy = pod["spec"].get("restartPolicy", "Always")
        for spec in pod["spec"]["containers"]:
            c = run.containers[spec["name"]]
            if (
                c.process is not None
                and c.process.poll() is not None
                and c.terminated is None
                and c.log is not None
                and c.log.done
            ):
                c.terminated = self._terminated_state(spec, run, c, c.process.returncode)
                c.process = None
            if c.terminated is not None and c.restart_at is None:
                restart = policy == "Always" or (policy == "OnFailure" and c.terminated["exitCode"] != 0)
                if restart:
                    c.last_terminated = c.terminated
                    c.restart_at = now + c.backoff
                    c.waiting = {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {int(c.backoff)}s restarting failed container={c.name} "
                        f"pod={run.name}_{run.namespace}({run.uid})",
                    }
                    c.backoff = min(c.backoff * 2, BACKOFF_MAX)
                    self.queue.add_after(("pod", run.namespace, run.name, run.uid), c.restart_at - now + 0.01)
            if c.restart_at is not None and now >= c.restart_at:
                c.last_terminated = c.terminated
                c.terminated = None
                c.restart_at = None
                c.restart_count += 1
                self._start(pod, run, spec)
        self._write_status(pod, run)

    def _env(self, pod: dict[str, Any], spec: dict[str, Any], run: PodRun) -> dict[str, str]:
        port = str(self.api_port())
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(run.root / "fs"),
            "HOSTNAME": run.name[:63],
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://127.0.0.1:{port}",
            f"KUBERNETES_PORT_{port}_TCP": f"tcp://127.0.0.1:{port}",
            f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{port}_TCP_PORT": port,
            f"KUBERNETES_PORT_{port}_TCP_ADDR": "127.0.0.1",
        }
        defined: dict[str, str] = {}
        for item in spec.get("env") or []:
            value = item.get("value")
            ref = item.get("valueFrom") or {}
            if value is not None:
                value = expand(value, defined)
            elif "fieldRef" in ref:
                value = self._field_ref(pod, ref["fieldRef"].get("fieldPath", ""))
            elif "configMapKeyRef" in ref:
                cm = self.store.get(resources.CONFIGMAPS, run.namespace, ref["configMapKeyRef"].get("name", ""))
                value = ((cm or {}).get("data") or {}).get(ref["configMapKeyRef"].get("key", ""), "")
            else:
                value = ""
            defined[item["name"]] = value
        env.update(defined)
        return env

    @staticmethod
    def _field_ref(pod: dict[str, Any], path: str) -> str:
        md = pod["metadata"]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (md.get(m[1]) or {}).get(m[2], "")
        return {
            "metadata.name": md["name"],
            "metadata.namespace": md["namespace"],
            "metadata.uid": md["uid"],
            "spec.nodeName": NODE,
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
            "status.podIP": "127.0.0.1",
            "status.hostIP": "127.0.0.1",
        }.get(path, "")

    def _start(self, pod: dict[str, Any], run: PodRun, spec: dict[str, Any]) -> None:
        c = run.containers[spec["name"]]
        env = self._env(pod, spec, run)
        argv = [expand(a, env) for a in (spec.get("command") or []) + (spec.get("args") or [])]
        fs = run.root / "fs"
        workdir = fs / (spec.get("workingDir") or "").lstrip("/")
        workdir.mkdir(parents=True, exist_ok=True)
        msg_path = fs / spec.get("terminationMessagePath", "/dev/termination-log").lstrip("/")
        msg_path.parent.mkdir(parents=True, exist_ok=True)
        msg_path.write_bytes(b"")
        if c.log is not None:
            c.previous_log = c.log
        c.log = ContainerLog(run.root / "logs" / f"{c.name}-{c.restart_count}.log")
        c.started_at = now_rfc3339()
        c.waiting = None
        c.container_id = "kubesim://" + uuid.uuid4().hex
        try:
            if not argv:
                raise FileNotFoundError("no command specified")
            c.process = subprocess.Popen(
                argv,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            c.process = None
            c.log.finish()
            c.terminated = {
                "exitCode": 128,
                "reason": "StartError",
                "message": f"failed to create containerd task: failed to create shim task: OCI runtime create "
                f"failed: runc create failed: unable to start container process: exec: "
                f'"{argv[0] if argv else ""}": {e.strerror or e}: unknown',
                "startedAt": "1970-01-01T00:00:00Z",
                "finishedAt": now_rfc3339(),
                "containerID": c.container_id,
            }
            return
        key = ("pod", run.namespace, run.name, run.uid)
        readers = [
            threading.Thread(target=_pump, args=(c.process.stdout, "stdout", c.log), daemon=True),
            threading.Thread(target=_pump, args=(c.process.stderr, "stderr", c.log), daemon=True),
        ]
        for t in readers:
            t.start()
        log, proc = c.log, c.process

        def waiter() -> None:
            proc.wait()
            for t in readers:
                t.join()
            log.finish()
            self.queue.add(key)

        threading.Thread(target=waiter, daemon=True).start()

    def _terminated_state(self, spec: dict[str, Any], run: PodRun, c: ContainerRun, code: int) -> dict[str, Any]:
        signal_no = 0
        if code < 0:
            signal_no = -code
            code = 128 + signal_no
        state: dict[str, Any] = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": c.container_id,
        }
        msg_file = run.root / "fs" / spec.get("terminationMessagePath", "/dev/termination-log").lstrip("/")
        try:
            message = msg_file.read_bytes()[:MAX_MESSAGE]
        except OSError:
            message = b""
        if not message and code != 0 and spec.get("terminationMessagePolicy") == "FallbackToLogsOnError" and c.log:
            text = c.log.text()
            lines = text.splitlines(keepends=True)[-FALLBACK_LINES:]
            message = b"".join(lines)[-FALLBACK_BYTES:]
        if message:
            state["message"] = message.decode(errors="replace")
        return state

    # ---- status -------------------------------------------------------------------------------------------
    def _container_status(self, spec: dict[str, Any], c: ContainerRun) -> dict[str, Any]:
        running = c.process is not None and c.terminated is None and c.waiting is None
        if running:
            state: dict[str, Any] = {"running": {"startedAt": c.started_at}}
        elif c.waiting is not None:
            state = {"waiting": dict(c.waiting)}
        elif c.terminated is not None:
            state = {"terminated": dict(c.terminated)}
        else:
            state = {"waiting": {"reason": "ContainerCreating"}}
        status: dict[str, Any] = {
            "name": c.name,
            "state": state,
            "ready": running,
            "restartCount": c.restart_count,
            "image": spec.get("image", ""),
            "imageID": "",
            "started": running,
        }
        if c.container_id and not (c.waiting and c.waiting.get("reason") == "ContainerCreating"):
            status["containerID"] = c.container_id
        status["lastState"] = {"terminated": dict(c.last_terminated)} if c.last_terminated else {}
        return status

    def _phase(self, pod: dict[str, Any], run: PodRun) -> str:
        policy = pod["spec"].get("restartPolicy", "Always")
        cs = list(run.containers.values())
        if not run.started:
            return "Pending"
        if all(c.terminated is not None and c.restart_at is None for c in cs):
            if policy == "Always":
                return "Running"
            if all(c.terminated["exitCode"] == 0 for c in cs):  # type: ignore[index]
                return "Succeeded"
            if policy == "Never" or any(c.terminated["exitCode"] != 0 for c in cs):  # type: ignore[index]
                return "Failed" if policy == "Never" else "Running"
        if any(c.process is not None or c.restart_at is not None or c.terminated is not None for c in cs):
            return "Running"
        return "Pending"

    def _write_status(
        self, pod: dict[str, Any], run: PodRun, *, phase: str | None = None, extra: dict[str, Any] | None = None
    ) -> None:
        specs = {c["name"]: c for c in pod["spec"]["containers"]}
        statuses = [self._container_status(specs[name], c) for name, c in run.containers.items()]
        phase = phase or self._phase(pod, run)
        ready = phase == "Running" and all(s["ready"] for s in statuses)
        now = now_rfc3339()

        def apply(o: dict[str, Any]) -> None:
            status = o.setdefault("status", {})
            old = {c["type"]: c for c in status.get("conditions") or []}

            def cond(type_: str, ok: bool, reason: str | None = None) -> dict[str, Any]:
                value = "True" if ok else "False"
                prev = old.get(type_)
                c: dict[str, Any] = {
                    "type": type_,
                    "status": value,
                    "lastProbeTime": None,
                    "lastTransitionTime": prev["lastTransitionTime"] if prev and prev["status"] == value else now,
                }
                if reason and not ok:
                    c["reason"] = reason
                return c

            not_ready = "PodCompleted" if phase in ("Succeeded", "Failed") else "ContainersNotReady"
            conds = [
                cond("PodReadyToStartContainers", True),
                cond("Initialized", True),
                cond("Ready", ready, not_ready),
                cond("ContainersReady", ready, not_ready),
                old.get("PodScheduled") or cond("PodScheduled", True),
            ]
            if "DisruptionTarget" in old:
                conds.append(old["DisruptionTarget"])
            if not ready and not_ready == "ContainersNotReady":
                names = [s["name"] for s in statuses if not s["ready"]]
                for c in conds:
                    if c["type"] in ("Ready", "ContainersReady") and c["status"] == "False":
                        c["message"] = f"containers with unready status: [{' '.join(names)}]"
            status.update(
                {
                    "phase": phase,
                    "conditions": conds,
                    "hostIP": "127.0.0.1",
                    "hostIPs": [{"ip": "127.0.0.1"}],
                    "podIP": "127.0.0.1",
                    "podIPs": [{"ip": "127.0.0.1"}],
                    "startTime": run.start_time,
                    "containerStatuses": statuses,
                }
            )
            if extra:
                status.update(extra)

        with contextlib.suppress(errors.ApiError):
            self.store.update(resources.PODS, run.namespace, run.name, apply, subresource="status", expect_uid=run.uid)

    # ---- killing ------------------------------------------------------------------------------------------
    @staticmethod
    def _alive(run: PodRun) -> bool:
        return any(c.process is not None and c.process.poll() is None for c in run.containers.values()) or any(
            c.log is not None and not c.log.done for c in run.containers.values() if c.process is not None
        )

    @staticmethod
    def _kill(run: PodRun, sig: int) -> None:
        """SIGTERM to each container's process group; SIGKILL to every process its main process started, in
        whatever session, as a runtime kills every process of the container's PID namespace (a pod keeper that
        starts its trial in a session of its own would otherwise leave the trial running)."""
        for c in run.containers.values():
            if c.process is not None and c.process.poll() is None:
                if sig == signal.SIGKILL:
                    _kill_tree(c.process.pid)
                    continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.process.pid, sig)

    def _terminate(self, pod: dict[str, Any], run: PodRun) -> None:
        """Graceful deletion: SIGTERM now, SIGKILL at the deadline, then final status and removal."""
        if not run.killing:
            run.killing = True
            grace = int(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
            run.kill_deadline = time.monotonic() + grace
            for c in run.containers.values():
                c.restart_at = None
            self._kill(run, signal.SIGTERM)
            self.queue.add_after(("pod", run.namespace, run.name, run.uid), grace + 0.05)
        if self._alive(run):
            if run.kill_deadline is not None and time.monotonic() >= run.kill_deadline:
                self._kill(run, signal.SIGKILL)
            self.queue.add_after(("pod", run.namespace, run.name, run.uid), 0.1)
            return
        specs = {c["name"]: c for c in pod["spec"]["containers"]}
        for name, c in run.containers.items():
            if c.process is not None and c.terminated is None:
                c.terminated = self._terminated_state(specs[name], run, c, c.process.returncode)
                c.process = None
            if c.terminated is None and c.waiting is not None:
                c.waiting = None
                c.terminated = {
                    "exitCode": 137,
                    "reason": "ContainerStatusUnknown",
                    "message": "The container could not be located when the pod was terminated",
                    "startedAt": None,
                    "finishedAt": now_rfc3339(),
                }
        if run.evicted is None and run.started:
            codes = [c.terminated["exitCode"] for c in run.containers.values() if c.terminated]
            current = (pod.get("status") or {}).get("phase")
            if current not in ("Succeeded", "Failed"):
                phase = "Succeeded" if codes and all(x == 0 for x in codes) else "Failed"
                self._write_status(pod, run, phase=phase)
        self.runs.pop(run.uid, None)
        self.store.finalize(resources.PODS, run.namespace, run.name, run.uid)

    def kill_all(self) -> None:
        with self.lock:
            runs = list(self.runs.values())
        for run in runs:
            self._kill(run, signal.SIGKILL)

    def evict(self, namespace: str, name: str, message: str) -> None:
        pod = self.store.must_get(resources.PODS, namespace, name)
        with self.lock:
            run = self.runs.get(pod["metadata"]["uid"])
            if run is None:
                run = self._admit(pod)
            run.evicted = message
            for c in run.containers.values():
                c.restart_at = None
            self._kill(run, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self._alive(run) and time.monotonic() < deadline:
                time.sleep(0.01)
            specs = {c["name"]: c for c in pod["spec"]["containers"]}
            for cname, c in run.containers.items():
                if c.terminated is None:
                    code = c.process.returncode if c.process is not None else 137
                    c.terminated = self._terminated_state(specs[cname], run, c, code if code is not None else 137)
                    c.process = None
                c.waiting = None
            with self.store.lock:

                def disrupt(o: dict[str, Any]) -> None:
                    conds = [
                        x for x in (o.get("status") or {}).get("conditions") or [] if x["type"] != "DisruptionTarget"
                    ]
                    conds.append(
                        {
                            "type": "DisruptionTarget",
                            "status": "True",
                            "reason": "TerminationByKubelet",
                            "message": message,
                            "lastProbeTime": None,
                            "lastTransitionTime": now_rfc3339(),
                        }
                    )
                    o.setdefault("status", {})["conditions"] = conds

                self.store.update(resources.PODS, namespace, name, disrupt, subresource="status")
                self._write_status(pod, run, phase="Failed", extra={"reason": "Evicted", "message": message})

    def container_log(self, pod: dict[str, Any], container: str, *, previous: bool) -> ContainerLog:
        with self.lock:
            run = self.runs.get(pod["metadata"]["uid"])
            c = run.containers.get(container) if run else None
            log = (c.previous_log if previous else c.log) if c else None
        if previous and log is None:
            raise errors.bad_request(
                f'previous terminated container "{container}" in pod "{pod["metadata"]["name"]}" not found'
            )
        if log is None:
            raise errors.bad_request(
                f'container "{container}" in pod "{pod["metadata"]["name"]}" is waiting to start: ContainerCreating'
            )
        return log


def _pump(pipe: Any, stream: str, log: ContainerLog) -> None:
    for line in iter(pipe.readline, b""):
        log.append(stream, line)
    pipe.close()


_EXPAND = re.compile(r"\$\$|\$\(([^)]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`, the rest stays."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _EXPAND.sub(sub, text)


def _kill_tree(root: int) -> None:
    """SIGKILL `root` and its descendants: all stopped first, until no new one appears, so none forks away."""
    stopped: set[int] = set()
    while fresh := ({root} | descendants(root)) - stopped:
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= fresh
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
