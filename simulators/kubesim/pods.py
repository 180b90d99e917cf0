"""Pod defaulting, pod validation and resource quantities: what the apiserver does to a pod the operators create.

Facts (kubernetes/kubernetes):
- Defaults (`pkg/apis/core/v1/defaults.go`): restartPolicy Always, terminationGracePeriodSeconds 30, dnsPolicy
  ClusterFirst, schedulerName default-scheduler, container terminationMessagePath /dev/termination-log and
  terminationMessagePolicy File, imagePullPolicy Always for `:latest`/untagged images else IfNotPresent,
  serviceAccountName default (`plugin/pkg/admission/serviceaccount`), requests default to limits when only limits
  are set. The initial status is phase Pending with qosClass.
- Validation (`pkg/apis/core/validation/validation.go`): container names are DNS-1123 labels and unique, image
  is required, volume names are DNS-1123 labels and unique, every volumeMount names a volume
  (`Not found: "x"`), mountPath required, env names must be C identifiers-ish, a resource request may not exceed
  its limit (`must be less than or equal to <resource> limit of <q>`), restartPolicy one of Always|OnFailure|Never.
- Quantities (`staging/src/k8s.io/apimachinery/pkg/api/resource/quantity.go`): decimal SI suffixes
  n u m k M G T P E, binary Ki Mi Gi Ti Pi Ei, and exponents.
"""

from __future__ import annotations

import contextlib
import copy
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from simulators.kubesim import errors, schemas
from simulators.kubesim.errors import FieldError

_SUFFIX = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?:([eE][+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$"
)
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
GPU = "nvidia.com/gpu"


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity as a Decimal in base units (cores, bytes, devices); ValueError if malformed."""
    if isinstance(value, bool):
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError("quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation as e:  # pragma: no cover - the regex already checked
        raise ValueError(str(value)) from e
    if m.group(2):
        return number * (Decimal(10) ** int(m.group(2)[1:]))
    return number * _SUFFIX[m.group(3) or ""]


_DECIMAL = [(18, "E"), (15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k"), (0, ""), (-3, "m"), (-6, "u"), (-9, "n")]
_BINARY = [(60, "Ei"), (50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")]


def canonical_quantity(value: Any) -> str:
    """The string the apiserver stores for a quantity (`Quantity.String()`): e.g. 1 -> "1", "1000m" -> "1",
    "0.5" -> "500m", "1024Mi" -> "1Gi", "1000" -> "1k"."""
    number = parse_quantity(value)
    binary = isinstance(value, str) and value.strip().endswith("i")
    if binary and number == number.to_integral_value():
        for exp, suffix in _BINARY:
            if number % (1 << exp) == 0:
                return f"{int(number) >> exp}{suffix}"
        return str(int(number))
    for exp, suffix in _DECIMAL:
        scaled = number / (Decimal(10) ** exp)
        if scaled == scaled.to_integral_value() and (scaled != 0 or exp == 0):
            return f"{int(scaled)}{suffix}"
    return f"{int((number * Decimal(10) ** 9).to_integral_value(rounding='ROUND_CEILING'))}n"


def pod_requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    """Sum of container requests (after defaulting, requests include limits-only resources)."""
    total: dict[str, Decimal] = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for name, q in merged.items():
            try:
                total[name] = total.get(name, Decimal(0)) + parse_quantity(q)
            except ValueError:
                continue
    return total


def _image_pull_policy(image: str) -> str:
    tail = image.rsplit("/", 1)[-1]
    if "@" in tail:
        return "IfNotPresent"
    if ":" not in tail or tail.endswith(":latest"):
        return "Always"
    return "IfNotPresent"


def default_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """Apply the apiserver's pod defaults and initial status."""
    pod = copy.deepcopy(pod)
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("priority", 0)
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    spec["serviceAccountName"] = sa
    spec["serviceAccount"] = sa
    tolerations = spec.setdefault("tolerations", [])
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if not any(t.get("key") == key for t in tolerations):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300})
    for c in spec.get("containers") or []:
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        c.setdefault("imagePullPolicy", _image_pull_policy(c.get("image", "")))
        res = c.setdefault("resources", {})
        for kind in ("limits", "requests"):
            for name, q in list((res.get(kind) or {}).items()):
                with contextlib.suppress(ValueError):
                    res[kind][name] = canonical_quantity(q)
        if res.get("limits"):
            requests = res.setdefault("requests", {})
            for name, q in res["limits"].items():
                requests.setdefault(name, q)
        for port in c.get("ports") or []:
            port.setdefault("protocol", "TCP")
    for v in spec.get("volumes") or []:
        if "configMap" in v:
            v["configMap"].setdefault("defaultMode", 0o644)
        if "projected" in v:
            v["projected"].setdefault("defaultMode", 0o644)
    pod["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}
    return pod


def _qos_class(spec: dict[str, Any]) -> str:
    containers = spec.get("containers") or []
    if not any(
        (c.get("resources") or {}).get("requests") or (c.get("resources") or {}).get("limits") for c in containers
    ):
        return "BestEffort"
    guaranteed = all(
        {"cpu", "memory"} <= set((c.get("resources") or {}).get("limits") or {})
        and all(
            parse_quantity(((c.get("resources") or {}).get("requests") or {}).get(r, lim)) == parse_quantity(lim)
            for r, lim in ((c.get("resources") or {}).get("limits") or {}).items()
        )
        for c in containers
    )
    return "Guaranteed" if guaranteed else "Burstable"


def validate_pod(pod: dict[str, Any]) -> list[FieldError]:
    """The subset of core/v1 Pod validation that matters for these workloads."""
    out: list[FieldError] = []
    md = pod.get("metadata") or {}
    out += schemas.name_errors(md.get("name", ""))
    out += schemas.label_errors(md.get("labels"))
    out += schemas.annotation_errors(md.get("annotations"))
    spec = pod.get("spec") or {}
    volumes = spec.get("volumes") or []
    volume_names: set[str] = set()
    for i, v in enumerate(volumes):
        path = f"spec.volumes[{i}].name"
        name = v.get("name", "")
        if not name:
            out.append(errors.required(path))
        else:
            out += schemas.name_errors(name, path, label=True)
            if name in volume_names:
                out.append(errors.duplicate(path, name))
        volume_names.add(name)
    containers = spec.get("containers") or []
    if not containers:
        out.append(errors.required("spec.containers"))
    seen: set[str] = set()
    for i, c in enumerate(containers):
        base = f"spec.containers[{i}]"
        name = c.get("name", "")
        if not name:
            out.append(errors.required(f"{base}.name"))
        else:
            out += schemas.name_errors(name, f"{base}.name", label=True)
            if name in seen:
                out.append(errors.duplicate(f"{base}.name", name))
        seen.add(name)
        if not c.get("image"):
            out.append(errors.required(f"{base}.image"))
        for j, env in enumerate(c.get("env") or []):
            if not env.get("name"):
                out.append(errors.required(f"{base}.env[{j}].name"))
            elif not ENV_NAME.match(env["name"]):
                out.append(
                    errors.invalid(
                        f"{base}.env[{j}].name",
                        env["name"],
                        "a valid environment variable name must consist of alphabetic characters, "
                        "digits, '_', '-', or '.', and must not start with a digit (e.g. "
                        "'my.env-name',  or 'MY_ENV.NAME',  or 'MyEnvName1', regex used for "
                        "validation is '[-._a-zA-Z][-._a-zA-Z0-9]*')",
                    )
                )
        for j, mount in enumerate(c.get("volumeMounts") or []):
            if not mount.get("mountPath"):
                out.append(errors.required(f"{base}.volumeMounts[{j}].mountPath"))
            if mount.get("name") not in volume_names:
                out.append(errors.not_found_field(f"{base}.volumeMounts[{j}].name", mount.get("name", "")))
        res = c.get("resources") or {}
        parsed: dict[str, dict[str, Decimal]] = {"limits": {}, "requests": {}}
        for kind in ("limits", "requests"):
            for rname, q in (res.get(kind) or {}).items():
                try:
                    parsed[kind][rname] = parse_quantity(q)
                except ValueError as e:
                    out.append(errors.invalid(f"{base}.resources.{kind}[{rname}]", q, str(e)))
        for rname, req in parsed["requests"].items():
            lim = parsed["limits"].get(rname)
            if lim is not None and req > lim:
                out.append(
                    errors.invalid(
                        f"{base}.resources.requests",
                        res["requests"][rname],
                        f"must be less than or equal to {rname} limit of {res['limits'][rname]}",
                    )
                )
            if rname == GPU and lim is not None and req != lim:
                out.append(
                    errors.invalid(
                        f"{base}.resources.requests[{GPU}]",
                        res["requests"][rname],
                        f"must be equal to {GPU} limit of {res['limits'][rname]}",
                    )
                )
        policy = c.get("terminationMessagePolicy", "File")
        if policy not in ("File", "FallbackToLogsOnError"):
            out.append(
                errors.not_supported(f"{base}.terminationMessagePolicy", policy, ["FallbackToLogsOnError", "File"])
            )
    restart = spec.get("restartPolicy", "Always")
    if restart not in ("Always", "OnFailure", "Never"):
        out.append(errors.not_supported("spec.restartPolicy", restart, ["Always", "OnFailure", "Never"]))
    return out
