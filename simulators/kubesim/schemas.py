"""Hand-written structural schemas for the served custom resources, and the validator/pruner that applies them.

Facts:
- Validation messages follow kube-openapi as the apiextensions apiserver reports them
  (`staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/validation/validation.go`): a type error is
  FieldValueTypeInvalid `Invalid value: "string": <path> in body must be of type integer: "string"`, a missing
  property `Required value`, an enum `Unsupported value: "x": supported values: "a", "b"`, a minimum
  `Invalid value: -1: <path> in body should be greater than or equal to 0`, a pattern
  `Invalid value: "x": <path> in body should match '<re>'`. Paths are dotted, map keys included
  (`spec.tfReplicaSpecs.Worker.replicas`), list items indexed (`spec.taskRoles[0].name`).
- Unknown fields (`staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning`) are pruned unless
  the node has x-kubernetes-preserve-unknown-fields. With `fieldValidation=Strict` they are a 400 BadRequest
  `<Kind> in version "v1" cannot be handled as a <Kind>: strict decoding error: unknown field "spec.foo"`; with Warn
  (the default for clients that do not ask) the response carries `Warning: 299 - "unknown field \"spec.foo\""`.
- TFJob/PyTorchJob shapes: kubeflow/training-operator v1.9.0 `manifests/base/crds/kubeflow.org_tfjobs.yaml` and
  `kubeflow.org_pytorchjobs.yaml` (spec.tfReplicaSpecs / spec.pytorchReplicaSpecs required; replica spec
  {replicas int32, restartPolicy string, template PodTemplateSpec}; runPolicy {cleanPodPolicy, ttlSecondsAfterFinished,
  activeDeadlineSeconds, backoffLimit, suspend, managedBy, schedulingPolicy}; the embedded pod template's containers
  require only `name`). The real CRDs carry no enum for restartPolicy/cleanPodPolicy and no minimum for replicas:
  this simulator is deliberately stricter there (enum Always|OnFailure|Never|ExitCode, All|Running|None, replicas
  >= 0) so that code passing here cannot rely on values the operator would not understand.
- Framework shape: microsoft/frameworkcontroller `pkg/apis/frameworkcontroller/v1/crd.go` (metadata.name and
  taskRoles[].name pattern `^[a-z0-9]{1,63}$`; executionType enum Create|Start|Stop; retryPolicy.maxRetryCount
  minimum -2; taskNumber 0..10000; min*TaskCount minimum -1; podGracefulDeletionTimeoutSec nullable). The real CRD
  declares task.pod as x-kubernetes-preserve-unknown-fields and requires nothing; this simulator validates the pod
  template like the training-operator one (container name and image required) and requires
  frameworkAttemptCompletionPolicy — stricter than the real apiserver, which would accept those Frameworks and let
  FrameworkController fail the pod creation later (PodCreationPermanentError, code -200).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from simulators.kubesim import errors
from simulators.kubesim.errors import FieldError

Schema = dict[str, Any]
QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def obj(props: dict[str, Schema] | None = None, required: list[str] | None = None, **extra: Any) -> Schema:
    s: Schema = {"type": "object"}
    if props is not None:
        s["properties"] = props
    if required:
        s["required"] = required
    s.update(extra)
    return s


def arr(items: Schema, **extra: Any) -> Schema:
    return {"type": "array", "items": items, **extra}


def string(**extra: Any) -> Schema:
    return {"type": "string", **extra}


def integer(**extra: Any) -> Schema:
    return {"type": "integer", **extra}


def boolean() -> Schema:
    return {"type": "boolean"}


def string_map() -> Schema:
    return obj(additionalProperties=string())


def opaque() -> Schema:
    """A sub-tree kept as is (trimmed from the real schema)."""
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


QUANTITY_MAP = obj(additionalProperties={"x-kubernetes-int-or-string": True, "pattern": QUANTITY})

CONTAINER = obj(
    {
        "name": string(),
        "image": string(),
        "command": arr(string()),
        "args": arr(string()),
        "env": arr(obj({"name": string(), "value": string(), "valueFrom": opaque()}, ["name"])),
        "envFrom": arr(opaque()),
        "resources": obj({"limits": QUANTITY_MAP, "requests": QUANTITY_MAP, "claims": arr(opaque())}),
        "volumeMounts": arr(
            obj(
                {
                    "name": string(),
                    "mountPath": string(),
                    "readOnly": boolean(),
                    "subPath": string(),
                    "subPathExpr": string(),
                    "mountPropagation": string(),
                    "recursiveReadOnly": string(),
                },
                ["mountPath", "name"],
            )
        ),
        "workingDir": string(),
        "terminationMessagePath": string(),
        "terminationMessagePolicy": string(enum=["File", "FallbackToLogsOnError"]),
        "imagePullPolicy": string(),
        "ports": arr(
            obj(
                {
                    "containerPort": integer(),
                    "name": string(),
                    "protocol": string(),
                    "hostPort": integer(),
                    "hostIP": string(),
                },
                ["containerPort"],
            )
        ),
        "securityContext": opaque(),
        "livenessProbe": opaque(),
        "readinessProbe": opaque(),
        "startupProbe": opaque(),
        "lifecycle": opaque(),
        "stdin": boolean(),
        "stdinOnce": boolean(),
        "tty": boolean(),
        "restartPolicy": string(),
    },
    ["name"],
)

KEY_TO_PATH = arr(obj({"key": string(), "path": string(), "mode": integer()}, ["key", "path"]))

VOLUME = obj(
    {
        "name": string(),
        "configMap": obj({"name": string(), "items": KEY_TO_PATH, "defaultMode": integer(), "optional": boolean()}),
        "projected": obj(
            {
                "sources": arr(
                    obj(
                        {
                            "configMap": obj({"name": string(), "items": KEY_TO_PATH, "optional": boolean()}),
                            "secret": opaque(),
                            "downwardAPI": opaque(),
                            "serviceAccountToken": opaque(),
                        }
                    )
                ),
                "defaultMode": integer(),
            }
        ),
        "emptyDir": obj({"medium": string(), "sizeLimit": {"x-kubernetes-int-or-string": True, "pattern": QUANTITY}}),
        "nfs": obj({"server": string(), "path": string(), "readOnly": boolean()}, ["path", "server"]),
        "persistentVolumeClaim": obj({"claimName": string(), "readOnly": boolean()}, ["claimName"]),
        "hostPath": obj({"path": string(), "type": string()}, ["path"]),
        "secret": opaque(),
        "downwardAPI": opaque(),
    },
    ["name"],
)

POD_SPEC = obj(
    {
        "containers": arr(CONTAINER),
        "initContainers": arr(CONTAINER),
        "volumes": arr(VOLUME),
        "restartPolicy": string(),
        "serviceAccountName": string(),
        "serviceAccount": string(),
        "automountServiceAccountToken": boolean(),
        "terminationGracePeriodSeconds": integer(),
        "activeDeadlineSeconds": integer(),
        "nodeSelector": string_map(),
        "nodeName": string(),
        "tolerations": arr(
            obj(
                {
                    "key": string(),
                    "operator": string(),
                    "value": string(),
                    "effect": string(),
                    "tolerationSeconds": integer(),
                }
            )
        ),
        "affinity": opaque(),
        "schedulerName": string(),
        "priorityClassName": string(),
        "priority": integer(),
        "hostname": string(),
        "subdomain": string(),
        "hostNetwork": boolean(),
        "hostIPC": boolean(),
        "hostPID": boolean(),
        "shareProcessNamespace": boolean(),
        "dnsPolicy": string(),
        "dnsConfig": opaque(),
        "imagePullSecrets": arr(obj({"name": string()})),
        "securityContext": opaque(),
        "runtimeClassName": string(),
        "enableServiceLinks": boolean(),
        "setHostnameAsFQDN": boolean(),
        "topologySpreadConstraints": arr(opaque()),
        "hostAliases": arr(opaque()),
        "readinessGates": arr(opaque()),
    },
    ["containers"],
)

POD_TEMPLATE = obj(
    {
        "metadata": obj(
            {
                "annotations": string_map(),
                "finalizers": arr(string()),
                "labels": string_map(),
                "name": string(),
                "namespace": string(),
            }
        ),
        "spec": POD_SPEC,
    }
)

RUN_POLICY = obj(
    {
        "cleanPodPolicy": string(enum=["All", "Running", "None"]),
        "ttlSecondsAfterFinished": integer(),
        "activeDeadlineSeconds": integer(),
        "backoffLimit": integer(),
        "suspend": boolean(),
        "managedBy": string(),
        "schedulingPolicy": obj(
            {
                "minAvailable": integer(),
                "queue": string(),
                "minResources": QUANTITY_MAP,
                "priorityClass": string(),
                "scheduleTimeoutSeconds": integer(),
            }
        ),
    }
)

REPLICA_SPEC = obj(
    {
        "replicas": integer(minimum=0),
        "restartPolicy": string(enum=["Always", "OnFailure", "Never", "ExitCode"]),
        "template": POD_TEMPLATE,
    }
)


def _root(spec: Schema, metadata: Schema | None = None, status: Schema | None = None) -> Schema:
    return obj(
        {
            "apiVersion": string(),
            "kind": string(),
            "metadata": metadata or obj(x_meta=True),
            "spec": spec,
            "status": status or opaque(),
        }
    )


TFJOB = _root(
    obj(
        {
            "runPolicy": RUN_POLICY,
            "successPolicy": string(),
            "enableDynamicWorker": boolean(),
            "tfReplicaSpecs": obj(additionalProperties=REPLICA_SPEC),
        },
        ["tfReplicaSpecs"],
    )
)

PYTORCHJOB = _root(
    obj(
        {
            "runPolicy": RUN_POLICY,
            "elasticPolicy": opaque(),
            "nprocPerNode": string(),
            "pytorchReplicaSpecs": obj(additionalProperties=REPLICA_SPEC),
        },
        ["pytorchReplicaSpecs"],
    )
)

FC_NAME = "^[a-z0-9]{1,63}$"
FC_RETRY = obj({"maxRetryCount": integer(minimum=-2), "fancyRetryPolicy": boolean()})
FC_POD_TEMPLATE = obj(
    {
        "metadata": POD_TEMPLATE["properties"]["metadata"],
        "spec": obj(
            {**POD_SPEC["properties"], "containers": arr(obj(CONTAINER["properties"], ["image", "name"]))},
            ["containers"],
        ),
    }
)

FRAMEWORK = _root(
    obj(
        {
            "description": string(nullable=True),
            "executionType": string(enum=["Create", "Start", "Stop"]),
            "retryPolicy": FC_RETRY,
            "taskRoles": arr(
                obj(
                    {
                        "name": string(pattern=FC_NAME),
                        "taskNumber": integer(minimum=0, maximum=10000),
                        "frameworkAttemptCompletionPolicy": obj(
                            {"minFailedTaskCount": integer(minimum=-1), "minSucceededTaskCount": integer(minimum=-1)},
                            ["minFailedTaskCount", "minSucceededTaskCount"],
                        ),
                        "task": obj(
                            {
                                "retryPolicy": FC_RETRY,
                                "podGracefulDeletionTimeoutSec": integer(nullable=True),
                                "pod": FC_POD_TEMPLATE,
                            },
                            ["pod"],
                        ),
                    },
                    ["frameworkAttemptCompletionPolicy", "name", "task", "taskNumber"],
                )
            ),
        },
        ["taskRoles"],
    ),
    metadata=obj({"name": string(pattern=FC_NAME)}, x_meta=True),
    status={"type": "object", "nullable": True, "x-kubernetes-preserve-unknown-fields": True},
)

SCHEMAS: dict[str, Schema] = {"tfjobs": TFJOB, "pytorchjobs": PYTORCHJOB, "frameworks": FRAMEWORK}


@dataclass
class Outcome:
    value: Any
    errors: list[FieldError] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return _JSON_TYPES.get(type(value), "object")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def validate(schema: Schema, value: Any) -> Outcome:
    """Prune unknown fields and collect validation errors, like the apiextensions apiserver."""
    out = Outcome(None)
    out.value = _walk(schema, value, "", out)
    return out


def _walk(schema: Schema, value: Any, path: str, out: Outcome) -> Any:
    shown = path or "<root>"
    if value is None:
        if schema.get("nullable"):
            return None
        expected = schema.get("type")
        if expected:
            out.errors.append(errors.type_invalid(shown, "null", f'{shown} in body must be of type {expected}: "null"'))
        return None
    if schema.get("x-kubernetes-int-or-string"):
        if not isinstance(value, int | str) or isinstance(value, bool):
            out.errors.append(
                errors.type_invalid(
                    shown, _type_name(value), f'{shown} in body must be of type integer,string: "{_type_name(value)}"'
                )
            )
            return value
        if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
            out.errors.append(errors.invalid(shown, value, f"{shown} in body should match '{schema['pattern']}'"))
        return value
    expected = schema.get("type")
    ok = {
        None: True,
        "object": isinstance(value, dict),
        "array": isinstance(value, list),
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, int | float) and not isinstance(value, bool),
    }[expected]
    if not ok:
        out.errors.append(
            errors.type_invalid(
                shown, _type_name(value), f'{shown} in body must be of type {expected}: "{_type_name(value)}"'
            )
        )
        return value
    if "enum" in schema and value not in schema["enum"]:
        out.errors.append(errors.not_supported(shown, value, schema["enum"]))
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.errors.append(
                errors.invalid(
                    shown, value, f"{shown} in body should be greater than or equal to {_num(schema['minimum'])}"
                )
            )
        if "maximum" in schema and value > schema["maximum"]:
            out.errors.append(
                errors.invalid(
                    shown, value, f"{shown} in body should be less than or equal to {_num(schema['maximum'])}"
                )
            )
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        out.errors.append(errors.invalid(shown, value, f"{shown} in body should match '{schema['pattern']}'"))
    if isinstance(value, list):
        items = schema.get("items")
        return [_walk(items, v, f"{path}[{i}]", out) if items else v for i, v in enumerate(value)]
    if isinstance(value, dict):
        if schema.get("x_meta"):
            return value  # object metadata is validated by ObjectMeta rules, not the schema
        props: dict[str, Schema] = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        preserve = schema.get("x-kubernetes-preserve-unknown-fields", False)
        result: dict[str, Any] = {}
        for k, v in value.items():
            sub = f"{path}.{k}" if path else k
            if k in props:
                result[k] = _walk(props[k], v, sub, out)
            elif isinstance(additional, dict):
                result[k] = _walk(additional, v, sub, out)
            elif preserve or (path == "" and k in ("apiVersion", "kind", "metadata")):
                result[k] = v
            else:
                out.unknown.append(sub)
        for r in schema.get("required", []):
            if r not in value:
                out.errors.append(errors.required(f"{path}.{r}" if path else r))
        return result
    return value


# ---- ObjectMeta rules (`staging/src/k8s.io/apimachinery/pkg/api/validation/objectmeta.go`,
#      `pkg/util/validation/validation.go`) ----------------------------------------------------------------------
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")

SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end "
    "with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
DNS1035_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation "
    "is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
QUALIFIED_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)


def name_errors(name: str, path: str = "metadata.name", *, label: bool = False) -> list[FieldError]:
    """DNS-1123 subdomain (<= 253) names, or DNS-1123 labels (<= 63) where `label`."""
    if not name:
        return [errors.required(path, "name or generateName is required")]
    limit, pattern, msg = (63, DNS1123_LABEL, LABEL_MSG) if label else (253, DNS1123_SUBDOMAIN, SUBDOMAIN_MSG)
    out = []
    if len(name) > limit:
        out.append(errors.invalid(path, name, f"must be no more than {limit} characters"))
    if not pattern.match(name):
        out.append(errors.invalid(path, name, msg))
    return out


def label_errors(labels: Any, path: str = "metadata.labels") -> list[FieldError]:
    out: list[FieldError] = []
    if labels is None:
        return out
    if not isinstance(labels, dict):
        return [errors.type_invalid(path, _type_name(labels), f"{path} in body must be of type object")]
    for key, value in labels.items():
        out.extend(_qualified_key_errors(key, path))
        if not isinstance(value, str):
            out.append(errors.type_invalid(path, _type_name(value), f"{path} in body must be of type string"))
            continue
        if len(value) > 63:
            out.append(errors.invalid(path, value, "must be no more than 63 characters"))
        if not LABEL_VALUE.match(value):
            out.append(errors.invalid(path, value, LABEL_VALUE_MSG))
    return out


def _qualified_key_errors(key: str, path: str) -> list[FieldError]:
    prefix, _, name = key.rpartition("/")
    out = []
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        out.append(errors.invalid(path, key, "prefix part " + SUBDOMAIN_MSG))
    if not name or len(name) > 63 or not QUALIFIED_NAME.match(name):
        out.append(errors.invalid(path, key, QUALIFIED_MSG))
    return out


def annotation_errors(annotations: Any, path: str = "metadata.annotations") -> list[FieldError]:
    if annotations is None:
        return []
    if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
        return [errors.type_invalid(path, "object", f"{path} in body must be of type object")]
    out: list[FieldError] = []
    for key in annotations:
        out.extend(_qualified_key_errors(key, path))
    if sum(len(k) + len(v) for k, v in annotations.items()) > 256 * 1024:
        out.append(errors.too_long(path, 256 * 1024))
    return out
