"""Kubeflow training-operator v1 (TFJob, PyTorchJob), reconciling the way v1.9.0 does.

Facts (kubeflow/training-operator v1.9.0):
- Pods (`pkg/controller.v1/common/pod.go` createNewPod, `common/util.go` GenGeneralName, `common/job_controller.go`
  GenLabels): name `<job>-<replicatype lowercased>-<index>`; labels `training.kubeflow.org/operator-name`
  (tfjob-controller / pytorchjob-controller), `training.kubeflow.org/job-name`, `.../replica-type` (lowercase),
  `.../replica-index`, and `.../job-role: master` for the master role, on top of the template's labels; one
  controller ownerReference (controller and blockOwnerDeletion true) to the job. The pod's restartPolicy is the
  replica's, except ExitCode which becomes Never (`pkg/core/pod.go` SetRestartPolicy). Defaults
  (`pkg/apis/kubeflow.org/v1/*_defaults.go`, applied in memory, not stored): replicas 1, restartPolicy Never for
  TFJob / OnFailure for PyTorchJob, cleanPodPolicy None, default container port tfjob-port 2222 /
  pytorchjob-port 23456. Env: TF_CONFIG for distributed TFJobs; PyTorchJob gets PYTHONUNBUFFERED=1,
  MASTER_ADDR/PORT (and PET_ twins), WORLD_SIZE, RANK, PET_NODE_RANK, PET_NNODES.
- Validation is a validating webhook (`pkg/webhooks/tensorflow/tfjob_webhook.go`,
  `pkg/webhooks/pytorch/pytorchjob_webhook.go`) whose field errors are returned as a plain error, so
  controller-runtime answers `admission.Denied` = 403 Forbidden, relayed as `admission webhook
  "validator.tfjob.training-operator.kubeflow.org" denied the request: <errors>`: job name must be a DNS-1035
  label; each replica needs containers, an image per container, and one container named `tensorflow` /
  `pytorch`; TFJob allows at most one Chief/Master (other replica type names are NOT rejected for TFJob: their pods
  are created and ignored by the status logic); PyTorchJob allows only Master and Worker, Master replicas must be 1.
- Conditions (`pkg/util/status.go`): type/status/reason/message/lastUpdateTime/lastTransitionTime; reasons are
  `<Kind><Reason>` (TFJobCreated, TFJobRunning, TFJobRestarting, TFJobSucceeded, TFJobFailed, TFJobSuspended,
  TFJobResumed). Setting Running removes Restarting and vice versa; setting Succeeded or Failed flips Running to
  False (keeping its reason/message); nothing changes once Failed is True; lastTransitionTime only moves when the
  status value changes. Created: `<Kind> <name> is created.`.
- Status (`pkg/controller.v1/tensorflow/tfjob_controller.go` UpdateJobStatus, `pytorch/pytorchjob_controller.go`):
  replicaStatuses[rtype] counts active (Running, not deleting), succeeded, failed (also Running+deleting); startTime
  on first reconcile; completionTime on success/failure. TFJob: with Chief/Master that replica decides (Running
  "TFJob <ns>/<name> is running.", success when all its replicas succeeded "TFJob <ns>/<name> successfully
  completed."), else Worker: success when all workers or worker 0 succeeded (default successPolicy); any failed
  replica: "TFJob <ns>/<name> has failed because <n> <rtype> replica(s) failed.". PyTorchJob with Master:
  "PyTorchJob <name> is running." / "PyTorchJob <name> is successfully completed."; failed replicas with policy
  Never: "PyTorchJob <name> is failed because <n> <rtype> replica(s) failed.", other policies: Restarting.
- Pod failure (`common/pod.go` ReconcilePods): a Failed pod with restartPolicy OnFailure/Always, or ExitCode with a
  retryable exit code (>= 128, `pkg/util/train/train_util.go`), is deleted and recreated, condition Restarting
  "job <name> is restarting because <rtype> replica(s) failed."; ExitCode with a non-retryable code fails the job
  "job \"<name>\" is failing because \"<rtype>\" replica(s) failed.".
- Finished jobs (`common/job.go` ReconcileJobs, DeletePodsAndServices): cleanPodPolicy None keeps pods, Running
  deletes Running and Pending pods, All deletes all; on success, active replicas are counted as succeeded.
  runPolicy.suspend deletes the pods, sets Running False and Suspended True (reason <Kind>Suspended, message
  "<Kind> <name> is suspended."); activeDeadlineSeconds/backoffLimit fail the job ("Job <name> has failed because
  it was active longer than specified deadline" / "... because it has reached the specified backoff limit") after
  deleting its pods; ttlSecondsAfterFinished deletes the finished job.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from simulators.kubesim import errors, resources, schemas
from simulators.kubesim.controller import Controller
from simulators.kubesim.errors import ApiError, FieldError
from simulators.kubesim.store import Event, Store, now_rfc3339

if TYPE_CHECKING:
    from simulators.kubesim.cluster import SimulatedCluster

LABEL = "training.kubeflow.org/"


@dataclass(frozen=True)
class JobKind:
    rt: resources.ResourceType
    specs_key: str
    container: str
    controller: str
    default_restart: str
    port_name: str
    port: int
    webhook: str


TF = JobKind(
    resources.TFJOBS,
    "tfReplicaSpecs",
    "tensorflow",
    "tfjob-controller",
    "Never",
    "tfjob-port",
    2222,
    "validator.tfjob.training-operator.kubeflow.org",
)
PYTORCH = JobKind(
    resources.PYTORCHJOBS,
    "pytorchReplicaSpecs",
    "pytorch",
    "pytorchjob-controller",
    "OnFailure",
    "pytorchjob-port",
    23456,
    "validator.pytorchjob.training-operator.kubeflow.org",
)
KINDS = {TF.rt.plural: TF, PYTORCH.rt.plural: PYTORCH}
BY_KIND = {TF.rt.kind: TF, PYTORCH.rt.kind: PYTORCH}
TF_TYPES = ["Chief", "Evaluator", "Master", "PS", "Worker"]
PYTORCH_TYPES = ["Master", "Worker"]


def webhook_errors(kind: JobKind, job: dict[str, Any]) -> list[str]:
    """The validating webhook's field errors, rendered as `field.Error` strings (empty when admitted)."""
    out: list[FieldError] = []
    name = job["metadata"].get("name", "")
    if len(name) > 63 or not schemas.DNS1035_LABEL.match(name):
        out.append(errors.invalid("metadata.name", name, f"should match: {schemas.DNS1035_MSG}"))
    specs = (job.get("spec") or {}).get(kind.specs_key)
    base = f"spec.{kind.specs_key}"
    if specs is None:
        out.append(errors.required(base, "must be required"))
        specs = {}
    masters = 0
    for rtype, spec in specs.items():
        role = f"{base}[{rtype}]"
        containers_path = f"{role}.template.spec.containers"
        if kind is PYTORCH and rtype not in PYTORCH_TYPES:
            out.append(errors.not_supported(role, rtype, PYTORCH_TYPES))
        containers = (((spec or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            out.append(errors.required(containers_path, "must be specified"))
        if rtype in ("Chief", "Master"):
            masters += 1
        present = False
        for i, c in enumerate(containers):
            if not c.get("image"):
                out.append(errors.required(f"{containers_path}[{i}].image", "must be required"))
            if c.get("name") == kind.container:
                present = True
        if not present:
            out.append(errors.required(containers_path, f"must have at least one container with name {kind.container}"))
        if kind is PYTORCH and rtype == "Master" and (spec or {}).get("replicas") != 1:
            out.append(errors.forbidden_field(f"{role}.replicas", "must be 1"))
        elif kind is PYTORCH and (spec or {}).get("replicas") is not None and spec["replicas"] < 1:
            out.append(errors.forbidden_field(f"{role}.replicas", "must be at least 1"))
    if kind is TF and masters > 1:
        out.append(errors.forbidden_field(base, "must not have more than 1 Chief or Master role"))
    return [str(e) for e in out]


def admit(rt: resources.ResourceType, job: dict[str, Any]) -> None:
    """Run the validating webhook for a TFJob/PyTorchJob create or update."""
    kind = KINDS.get(rt.plural)
    if kind is None:
        return
    found = webhook_errors(kind, job)
    if found:
        text = found[0] if len(found) == 1 else "[" + ", ".join(found) + "]"
        raise errors.webhook_denied(kind.webhook, text)


def _camel(specs: dict[str, Any], types: list[str]) -> dict[str, Any]:
    out = {}
    for key, value in specs.items():
        match = next((t for t in types if t.lower() == key.lower()), key)
        out[match] = value
    return out


class TrainingOperator(Controller):
    name = "training-operator"

    def __init__(self, cluster: SimulatedCluster) -> None:
        super().__init__()
        self.cluster = cluster
        self.store: Store = cluster.store
        self.store.subscribe(self._on_event)

    def _on_event(self, ev: Event) -> None:
        if ev.plural in KINDS:
            self.queue.add((ev.plural, ev.namespace, ev.obj["metadata"]["name"]))
        elif ev.plural == "pods":
            for ref in ev.obj["metadata"].get("ownerReferences") or []:
                kind = BY_KIND.get(ref.get("kind", ""))
                if ref.get("controller") and kind and ref.get("apiVersion") == "kubeflow.org/v1":
                    self.queue.add((kind.rt.plural, ev.namespace, ref["name"]))

    # ---- conditions (pkg/util/status.go) ------------------------------------------------------------------
    @staticmethod
    def _has(status: dict[str, Any], type_: str) -> bool:
        return any(c["type"] == type_ and c["status"] == "True" for c in status.get("conditions") or [])

    def _set(self, status: dict[str, Any], type_: str, value: str, reason: str, message: str) -> None:
        if self._has(status, "Failed"):
            return
        conds = status.get("conditions") or []
        current = next((c for c in conds if c["type"] == type_), None)
        if current is not None and current["status"] == value and current.get("reason") == reason:
            return
        now = now_rfc3339()
        new = {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message,
            "lastUpdateTime": now,
            "lastTransitionTime": current["lastTransitionTime"] if current and current["status"] == value else now,
        }
        kept = []
        for c in conds:
            if (
                c["type"] == type_
                or (type_ == "Restarting" and c["type"] == "Running")
                or (type_ == "Running" and c["type"] == "Restarting")
            ):
                continue
            if type_ in ("Failed", "Succeeded") and c["type"] == "Running":
                c = {**c, "status": "False"}
            kept.append(c)
        status["conditions"] = [*kept, new]

    # ---- reconcile ----------------------------------------------------------------------------------------
    def reconcile(self, key: Any) -> None:
        plural, ns, name = key
        kind = KINDS[plural]
        rt = self.cluster.registry.get(plural)
        if rt is None:
            return
        job = self.store.get(rt, ns, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return
        spec = copy.deepcopy(job.get("spec") or {})
        types = TF_TYPES if kind is TF else PYTORCH_TYPES
        replicas: dict[str, dict[str, Any]] = _camel(spec.get(kind.specs_key) or {}, types)
        for r in replicas.values():
            r.setdefault("replicas", 1)
            r.setdefault("restartPolicy", kind.default_restart)
        run_policy = spec.get("runPolicy") or {}
        clean = run_policy.get("cleanPodPolicy") or "None"
        uid = job["metadata"]["uid"]
        old_status = copy.deepcopy(job.get("status") or {})
        status = copy.deepcopy(old_status)
        if not status.get("conditions"):
            self._set(status, "Created", "True", f"{rt.kind}Created", f"{rt.kind} {name} is created.")
        all_pods = [  # the store's owner index: no scan of every pod in the namespace
            p
            for _, p in self.store.dependents(uid, resources.PODS.plural)
            if p["metadata"].get("namespace", "") == ns
            and any(r.get("uid") == uid and r.get("controller") for r in p["metadata"].get("ownerReferences") or [])
        ]
        finished = self._has(status, "Succeeded") or self._has(status, "Failed")
        if finished:
            self._cleanup(ns, all_pods, clean, finished=True)
            if self._has(status, "Succeeded"):
                for rs in (status.get("replicaStatuses") or {}).values():
                    rs["succeeded"] = rs.get("succeeded", 0) + rs.get("active", 0)
                    rs.pop("active", None)
            self._ttl(rt, job, status, run_policy)
            return self._persist(rt, ns, name, old_status, status)
        if run_policy.get("suspend"):
            self._cleanup(ns, all_pods, clean, finished=False)
            for rs in (status.get("replicaStatuses") or {}).values():
                rs.pop("active", None)
            msg = f"{rt.kind} {name} is suspended."
            if self._has(status, "Running"):
                self._set(status, "Running", "False", f"{rt.kind}Suspended", msg)
            if not self._has(status, "Suspended"):
                self._set(status, "Suspended", "True", f"{rt.kind}Suspended", msg)
            return self._persist(rt, ns, name, old_status, status)
        if self._has(status, "Suspended"):
            self._set(status, "Suspended", "False", f"{rt.kind}Resumed", f"{rt.kind} {name} is resumed.")
            status["startTime"] = now_rfc3339()
        failure = self._limits(kind, replicas, run_policy, status, all_pods, name)
        if failure is not None:
            status.setdefault("completionTime", now_rfc3339())
            self._cleanup(ns, all_pods, clean, finished=False)
            self._set(status, "Failed", "True", f"{rt.kind}Failed", failure)
            return self._persist(rt, ns, name, old_status, status)
        for rtype in sorted(replicas):
            self._reconcile_pods(kind, rt, job, status, all_pods, rtype, replicas)
        if kind is TF:
            self._tf_status(job, replicas, status)
        else:
            self._pytorch_status(job, replicas, status)
        self._persist(rt, ns, name, old_status, status)
        ads = run_policy.get("activeDeadlineSeconds")
        if ads is not None:
            self.queue.add_after(key, float(ads) + 0.1)

    def _persist(
        self, rt: resources.ResourceType, ns: str, name: str, old: dict[str, Any], status: dict[str, Any]
    ) -> None:
        if status == old:
            return

        def write(o: dict[str, Any]) -> None:
            o["status"] = status

        with contextlib.suppress(ApiError):
            self.store.update(rt, ns, name, write, subresource="status" if rt.status_subresource else None)

    def _ttl(
        self, rt: resources.ResourceType, job: dict[str, Any], status: dict[str, Any], run_policy: dict[str, Any]
    ) -> None:
        ttl = run_policy.get("ttlSecondsAfterFinished")
        done = status.get("completionTime")
        if ttl is None or not done:
            return
        import datetime as dt

        finished_at = dt.datetime.fromisoformat(done.replace("Z", "+00:00")).timestamp()
        left = finished_at + ttl - time.time()
        md = job["metadata"]
        if left <= 0:
            with contextlib.suppress(ApiError):
                self.store.delete(rt, md["namespace"], md["name"], propagation="Background", precondition_uid=md["uid"])
        else:
            self.queue.add_after((rt.plural, md["namespace"], md["name"]), left + 0.05)

    def _cleanup(self, ns: str, pods_: list[dict[str, Any]], clean: str, *, finished: bool) -> None:
        if finished and clean == "None":
            return
        for p in pods_:
            phase = (p.get("status") or {}).get("phase")
            if finished and clean == "Running" and phase not in ("Running", "Pending"):
                continue
            if p["metadata"].get("deletionTimestamp"):
                continue
            with contextlib.suppress(ApiError):
                self.store.delete(resources.PODS, ns, p["metadata"]["name"], precondition_uid=p["metadata"]["uid"])

    def _limits(
        self,
        kind: JobKind,
        replicas: dict[str, Any],
        run_policy: dict[str, Any],
        status: dict[str, Any],
        pods_: list[dict[str, Any]],
        name: str,
    ) -> str | None:
        limit = run_policy.get("backoffLimit")
        if limit is not None:
            active = sum(
                1
                for p in pods_
                if (p.get("status") or {}).get("phase") in ("Running", "Pending")
                and not p["metadata"].get("deletionTimestamp")
            )
            failed = sum(1 for p in pods_ if (p.get("status") or {}).get("phase") == "Failed")
            total = sum(int(r["replicas"]) for r in replicas.values())
            previous = sum(rs.get("failed", 0) for rs in (status.get("replicaStatuses") or {}).values())
            exceeds = failed > previous and active != total and limit < 1
            restarts = 0
            for p in pods_:
                rtype = p["metadata"].get("labels", {}).get(LABEL + "replica-type", "")
                spec = next((r for t, r in replicas.items() if t.lower() == rtype), None)
                if spec is None or spec["restartPolicy"] not in ("OnFailure", "Always"):
                    continue
                if (p.get("status") or {}).get("phase") not in ("Running", "Pending"):
                    continue
                restarts += sum(
                    c.get("restartCount", 0) for c in (p.get("status") or {}).get("containerStatuses") or []
                )
            past = restarts > 0 if limit == 0 else restarts >= limit
            if exceeds or past:
                return f"Job {name} has failed because it has reached the specified backoff limit"
        ads = run_policy.get("activeDeadlineSeconds")
        if ads is not None and status.get("startTime"):
            import datetime as dt

            started = dt.datetime.fromisoformat(status["startTime"].replace("Z", "+00:00")).timestamp()
            if time.time() - started >= ads:
                return f"Job {name} has failed because it was active longer than specified deadline"
        return None

    def _reconcile_pods(
        self,
        kind: JobKind,
        rt: resources.ResourceType,
        job: dict[str, Any],
        status: dict[str, Any],
        pods_: list[dict[str, Any]],
        rtype: str,
        replicas: dict[str, Any],
    ) -> None:
        md = job["metadata"]
        spec = replicas[rtype]
        rt_lower = rtype.lower()
        mine = [p for p in pods_ if p["metadata"].get("labels", {}).get(LABEL + "replica-type") == rt_lower]
        n = int(spec["replicas"])
        rstatuses = status.setdefault("replicaStatuses", {})
        rs: dict[str, Any] = {}
        rstatuses[rtype] = rs
        by_index: dict[int, list[dict[str, Any]]] = {}
        for p in mine:
            try:
                idx = int(p["metadata"]["labels"].get(LABEL + "replica-index", "-1"))
            except ValueError:
                continue
            by_index.setdefault(idx, []).append(p)
        for idx in range(max([n - 1, *by_index.keys()]) + 1):
            slice_ = by_index.get(idx, [])
            if len(slice_) > 1:
                continue
            if not slice_:
                if idx < n:
                    self._create_pod(kind, rt, job, rtype, idx, spec, replicas)
                continue
            pod = slice_[0]
            if idx >= n:
                self._delete_pod(pod)
            exit_code = 0xBEEF
            for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                term = (cs.get("state") or {}).get("terminated")
                if cs.get("name") == kind.container and term:
                    exit_code = term.get("exitCode", 0)
            phase = (pod.get("status") or {}).get("phase")
            if phase == "Failed":
                policy = spec["restartPolicy"]
                if (policy == "ExitCode" and exit_code >= 128) or policy in ("OnFailure", "Always"):
                    self._delete_pod(pod)
                    self._set(
                        status,
                        "Restarting",
                        "True",
                        f"{rt.kind}Restarting",
                        f"job {md['name']} is restarting because {rtype} replica(s) failed.",
                    )
                elif policy == "ExitCode":
                    status.setdefault("completionTime", now_rfc3339())
                    self._set(
                        status,
                        "Failed",
                        "True",
                        f"{rt.kind}Failed",
                        f'job "{md["name"]}" is failing because "{rtype}" replica(s) failed.',
                    )
            if phase == "Running":
                key = "failed" if pod["metadata"].get("deletionTimestamp") else "active"
                rs[key] = rs.get(key, 0) + 1
            elif phase == "Succeeded":
                rs["succeeded"] = rs.get("succeeded", 0) + 1
            elif phase == "Failed":
                rs["failed"] = rs.get("failed", 0) + 1

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        if pod["metadata"].get("deletionTimestamp"):
            return
        with contextlib.suppress(ApiError):
            self.store.delete(
                resources.PODS,
                pod["metadata"]["namespace"],
                pod["metadata"]["name"],
                precondition_uid=pod["metadata"]["uid"],
            )

    def _create_pod(
        self,
        kind: JobKind,
        rt: resources.ResourceType,
        job: dict[str, Any],
        rtype: str,
        idx: int,
        spec: dict[str, Any],
        replicas: dict[str, Any],
    ) -> None:
        md = job["metadata"]
        template = copy.deepcopy(spec.get("template") or {})
        tmeta = template.get("metadata") or {}
        labels = dict(tmeta.get("labels") or {})
        labels.update(
            {
                LABEL + "operator-name": kind.controller,
                LABEL + "job-name": md["name"].replace("/", "-"),
                LABEL + "replica-type": rtype.lower(),
                LABEL + "replica-index": str(idx),
            }
        )
        if self._is_master(kind, replicas, rtype, idx):
            labels[LABEL + "job-role"] = "master"
        pod_spec = template.get("spec") or {}
        pod_spec["restartPolicy"] = "Never" if spec["restartPolicy"] == "ExitCode" else spec["restartPolicy"]
        containers = pod_spec.get("containers") or []
        default = next(
            (c for c in containers if c.get("name") == kind.container), containers[0] if containers else None
        )
        if default is not None and not any(p.get("name") == kind.port_name for p in default.get("ports") or []):
            default.setdefault("ports", []).append({"name": kind.port_name, "containerPort": kind.port})
        self._cluster_env(kind, job, replicas, rtype, idx, containers)
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": re.sub("/", "-", f"{md['name']}-{rtype.lower()}-{idx}"),
                "namespace": md["namespace"],
                "labels": labels,
                "annotations": dict(tmeta.get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": rt.api_version,
                        "kind": rt.kind,
                        "name": md["name"],
                        "uid": md["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": pod_spec,
        }
        if tmeta.get("finalizers"):
            pod["metadata"]["finalizers"] = list(tmeta["finalizers"])
        try:
            self.cluster.create_pod(pod)
        except ApiError as e:
            if e.code != 409:
                raise  # the real operator logs FailedCreatePod and retries; the job makes no progress

    @staticmethod
    def _is_master(kind: JobKind, replicas: dict[str, Any], rtype: str, idx: int) -> bool:
        if kind is PYTORCH:
            return rtype == "Master" if "Master" in replicas else False
        if "Chief" in replicas or "Master" in replicas:
            return rtype in ("Chief", "Master")
        return rtype == "Worker" and idx == 0

    @staticmethod
    def _cluster_env(
        kind: JobKind,
        job: dict[str, Any],
        replicas: dict[str, Any],
        rtype: str,
        idx: int,
        containers: list[dict[str, Any]],
    ) -> None:
        md = job["metadata"]
        total = sum(int(r["replicas"]) for r in replicas.values())
        if kind is TF:
            if total <= 1 and not any(t in replicas for t in ("PS", "Chief", "Master", "Evaluator")):
                return
            cluster = {
                t.lower(): [
                    f"{md['name']}-{t.lower()}-{i}.{md['namespace']}.svc:{kind.port}" for i in range(int(r["replicas"]))
                ]
                for t, r in replicas.items()
                if t != "Evaluator"
            }
            tf_config = json.dumps(
                {"cluster": cluster, "task": {"type": rtype.lower(), "index": idx}, "environment": "cloud"}
            )
            for c in containers:
                if c.get("name") == kind.container:
                    c.setdefault("env", []).append({"name": "TF_CONFIG", "value": tf_config})
            return
        nproc = (job.get("spec") or {}).get("nprocPerNode")
        for c in containers:
            env = c.setdefault("env", [])
            env.append({"name": "PYTHONUNBUFFERED", "value": "1"})
            if "Master" in replicas:
                master = f"{md['name']}-master-0"
                port = str(kind.port)
                rank = idx + 1 if rtype == "Worker" else idx
                env += [
                    {"name": "MASTER_PORT", "value": port},
                    {"name": "PET_MASTER_PORT", "value": port},
                    {"name": "MASTER_ADDR", "value": master},
                    {"name": "PET_MASTER_ADDR", "value": master},
                    {"name": "WORLD_SIZE", "value": str(total)},
                    {"name": "RANK", "value": str(rank)},
                    {"name": "PET_NODE_RANK", "value": str(rank)},
                ]
            if nproc is not None:
                env.append({"name": "PET_NPROC_PER_NODE", "value": str(nproc)})
            env.append({"name": "PET_NNODES", "value": str(total)})

    # ---- job status ---------------------------------------------------------------------------------------
    def _tf_status(self, job: dict[str, Any], replicas: dict[str, Any], status: dict[str, Any]) -> None:
        md = job["metadata"]
        full = f"{md['namespace']}/{md['name']}"
        status.setdefault("startTime", now_rfc3339())
        existing_restarting = next((c for c in status.get("conditions") or [] if c["type"] == "Restarting"), None)
        has_master = "Chief" in replicas or "Master" in replicas
        worker0 = self._worker0_succeeded(job)
        success_policy = (job.get("spec") or {}).get("successPolicy") or ""
        for rtype in ["Chief", "Evaluator", "Master", "PS", "Worker"]:
            if rtype not in replicas:
                continue
            rs = (status.get("replicaStatuses") or {}).get(rtype, {})
            succeeded, running, failed = rs.get("succeeded", 0), rs.get("active", 0), rs.get("failed", 0)
            expected = int(replicas[rtype]["replicas"]) - succeeded
            if has_master:
                if rtype in ("Chief", "Master"):
                    if running > 0:
                        self._set(status, "Running", "True", "TFJobRunning", f"TFJob {full} is running.")
                    if expected == 0:
                        status.setdefault("completionTime", now_rfc3339())
                        self._set(
                            status, "Succeeded", "True", "TFJobSucceeded", f"TFJob {full} successfully completed."
                        )
            elif rtype == "Worker":
                if expected == 0 or (worker0 and success_policy != "AllWorkers"):
                    status.setdefault("completionTime", now_rfc3339())
                    self._set(status, "Succeeded", "True", "TFJobSucceeded", f"TFJob {full} successfully completed.")
                elif running > 0:
                    self._set(status, "Running", "True", "TFJobRunning", f"TFJob {full} is running.")
            if failed > 0:
                if existing_restarting is not None:
                    self._set(
                        status, "Restarting", "True", existing_restarting["reason"], existing_restarting["message"]
                    )
                else:
                    if (job.get("spec") or {}).get("enableDynamicWorker") and rtype == "Worker":
                        continue
                    status.setdefault("completionTime", now_rfc3339())
                    self._set(
                        status,
                        "Failed",
                        "True",
                        "TFJobFailed",
                        f"TFJob {full} has failed because {failed} {rtype} replica(s) failed.",
                    )

    def _worker0_succeeded(self, job: dict[str, Any]) -> bool:
        """IsWorker0Completed: the job's worker-0 pod is Succeeded."""
        md = job["metadata"]
        pod = self.store.get(resources.PODS, md["namespace"], f"{md['name']}-worker-0")
        owned = pod is not None and any(r.get("uid") == md["uid"] for r in pod["metadata"].get("ownerReferences") or [])
        return owned and (pod.get("status") or {}).get("phase") == "Succeeded"  # type: ignore[union-attr]

    def _pytorch_status(self, job: dict[str, Any], replicas: dict[str, Any], status: dict[str, Any]) -> None:
        md = job["metadata"]
        status.setdefault("startTime", now_rfc3339())
        for rtype, spec in replicas.items():
            rs = status.setdefault("replicaStatuses", {}).setdefault(rtype, {})
            labels = {
                LABEL + "job-name": md["name"],
                LABEL + "operator-name": PYTORCH.controller,
                LABEL + "replica-type": rtype.lower(),
            }
            rs["selector"] = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            succeeded, running, failed = rs.get("succeeded", 0), rs.get("active", 0), rs.get("failed", 0)
            n = int(spec["replicas"])
            expected = n - succeeded
            if "Master" in replicas:
                if rtype == "Master":
                    if running > 0:
                        self._set(
                            status, "Running", "True", "PyTorchJobRunning", f"PyTorchJob {md['name']} is running."
                        )
                    if expected == 0:
                        status.setdefault("completionTime", now_rfc3339())
                        self._set(
                            status,
                            "Succeeded",
                            "True",
                            "PyTorchJobSucceeded",
                            f"PyTorchJob {md['name']} is successfully completed.",
                        )
                        return
            elif rtype == "Worker":
                if expected == 0:
                    status.setdefault("completionTime", now_rfc3339())
                    self._set(
                        status,
                        "Succeeded",
                        "True",
                        "PyTorchJobSucceeded",
                        f"PyTorchJob {md['namespace']}/{md['name']} successfully completed.",
                    )
                elif running > 0:
                    self._set(
                        status,
                        "Running",
                        "True",
                        "PyTorchJobRunning",
                        f"PyTorchJob {md['namespace']}/{md['name']} is running.",
                    )
            if failed > 0 and n > succeeded + running:
                if spec["restartPolicy"] != "Never":
                    self._set(
                        status,
                        "Restarting",
                        "True",
                        "PyTorchJobRestarting",
                        f"PyTorchJob {md['name']} is restarting because {failed} {rtype} replica(s) failed.",
                    )
                else:
                    status.setdefault("completionTime", now_rfc3339())
                    self._set(
                        status,
                        "Failed",
                        "True",
                        "PyTorchJobFailed",
                        f"PyTorchJob {md['name']} is failed because {failed} {rtype} replica(s) failed.",
                    )
