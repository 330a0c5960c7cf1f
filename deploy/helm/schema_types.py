"""JSON-schema building blocks of the chart values: a value (Field: doc, schema, default) or an
object of them (Obj, closed unless said), and the schemas of the Kubernetes types the values
embed (resources, security contexts, tolerations, env vars, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Field:
    doc: str
    schema: dict[str, Any]
    default: Any = None
    schema_only: bool = False  # a key Helm fills in itself: in values.schema.json, not values.yaml


@dataclass
class Obj:
    doc: str
    fields: dict[str, Node] = field(default_factory=dict)
    closed: bool = True


Node = Field | Obj


STR, BOOL, INT = {"type": "string"}, {"type": "boolean"}, {"type": "integer"}


STR_MAP = {"type": "object", "additionalProperties": STR}


STR_LIST = {"type": "array", "items": STR}


PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


PULL_POLICY = {"enum": ["Always", "IfNotPresent", "Never"]}


DURATION = {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"}


QUANTITY = {"anyOf": [{"type": "string", "pattern": r"^[0-9.]+[a-zA-Z]*$"}, {"type": "number", "minimum": 0}]}


INT_OR_PERCENT = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^([0-9]+%?)?$"}]}


ADDRS = {"type": "string", "pattern": r"^([^,:\s]+:[0-9]+(,[^,:\s]+:[0-9]+)*)?$"}


DNS_LABEL = {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", "maxLength": 30}


def minimum(n: int, kind: str = "integer") -> dict[str, Any]:
    return {"type": kind, "minimum": n}


def closed(props: dict[str, Any], *required: str) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
    return {**out, "required": list(required)} if required else out


def k8s(what: str) -> dict[str, Any]:
    return {"type": "object", "description": f"a Kubernetes {what}; validated by the API server"}


QUANTITY_MAP = {"type": "object", "additionalProperties": QUANTITY}


CLAIM = closed({"name": STR, "request": STR}, "name")


RESOURCES = closed({"limits": QUANTITY_MAP, "requests": QUANTITY_MAP, "claims": {"type": "array", "items": CLAIM}})


SECCOMP = closed({"type": {"enum": ["RuntimeDefault", "Localhost", "Unconfined"]}, "localhostProfile": STR})


POD_SECURITY_CONTEXT = closed(
    {
        "runAsNonRoot": BOOL,
        "runAsUser": INT,
        "runAsGroup": INT,
        "fsGroup": INT,
        "fsGroupChangePolicy": {"enum": ["OnRootMismatch", "Always"]},
        "supplementalGroups": {"type": "array", "items": INT},
        "seccompProfile": SECCOMP,
        "sysctls": {"type": "array", "items": closed({"name": STR, "value": STR}, "name", "value")},
    }
)


SECURITY_CONTEXT = closed(
    {
        "runAsNonRoot": BOOL,
        "runAsUser": INT,
        "runAsGroup": INT,
        "privileged": BOOL,
        "readOnlyRootFilesystem": BOOL,
        "allowPrivilegeEscalation": BOOL,
        "seccompProfile": SECCOMP,
        "capabilities": closed({"add": STR_LIST, "drop": STR_LIST}),
    }
)


TOLERATION = closed(
    {
        "key": STR,
        "operator": {"enum": ["Exists", "Equal"]},
        "value": STR,
        "effect": {"enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
        "tolerationSeconds": INT,
    }
)


AFFINITY = closed(
    {"nodeAffinity": k8s("NodeAffinity"), "podAffinity": k8s("PodAffinity"), "podAntiAffinity": k8s("PodAntiAffinity")}
)


KEY_REF = closed({"name": STR, "key": STR, "optional": BOOL}, "key")


ENV_VAR = closed(
    {
        "name": {"type": "string", "minLength": 1},
        "value": STR,
        "valueFrom": closed(
            {
                "secretKeyRef": KEY_REF,
                "configMapKeyRef": KEY_REF,
                "fieldRef": closed({"apiVersion": STR, "fieldPath": STR}, "fieldPath"),
                "resourceFieldRef": closed({"containerName": STR, "resource": STR, "divisor": QUANTITY}, "resource"),
            }
        ),
    },
    "name",
)


PULL_SECRETS = {"type": "array", "items": closed({"name": STR}, "name")}


HPA_BEHAVIOR = closed({"scaleUp": k8s("HPAScalingRules"), "scaleDown": k8s("HPAScalingRules")})


SERVICE_TYPE = {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}
