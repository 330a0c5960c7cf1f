"""The values of the meshlm charts, declared once: default, JSON-schema type and description.

generate.py turns this into each chart's values.yaml (descriptions as `# --` comments) and
values.schema.json (descriptions as `description`). Objects we define are closed
(`additionalProperties: false`); Kubernetes types (resources, securityContext, tolerations, ...)
are closed at the level named here, and their deeper fields are checked by the Kubernetes schema
tests in tests/deploy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMPONENTS = ("gateway", "tokenizer", "scheduler", "detokenizer")
PORTS = {"gateway": 30000, "tokenizer": 50051, "scheduler": 30010, "detokenizer": 50053}


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

# ---- schema building blocks --------------------------------------------------------------------
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


# ---- the values every chart shares -------------------------------------------------------------
def global_block() -> Obj:
    system = (
        "Name of the meshlm system this component belongs to. Every resource is named "
        "<system>-meshlm-<component>, and peers are found at "
        "<system>-meshlm-<peer>-headless:<port>. Empty = the release name (right for the "
        "umbrella chart); give standalone charts of one system the same value. At most 30 "
        "characters."
    )
    registry = "Registry prefixed to every image.repository (e.g. ghcr.io/acme); empty = none."
    meshlm = Obj(
        "meshlm-wide settings.", {"system": Field(system, DNS_LABEL, ""), "imageRegistry": Field(registry, STR, "")}
    )
    # Open: an umbrella's global is shared with charts that are not ours.
    return Obj(
        "Shared by every meshlm chart; in the umbrella chart set them once under global.",
        {"meshlm": meshlm},
        closed=False,
    )


def image(repository: str, tag_doc: str) -> Obj:
    return Obj(
        "Container image.",
        {
            "repository": Field(
                "Image repository (global.meshlm.imageRegistry is prefixed).",
                {"type": "string", "minLength": 1},
                repository,
            ),
            "tag": Field(tag_doc, STR, ""),
            "pullPolicy": Field("Image pull policy.", PULL_POLICY, "IfNotPresent"),
        },
    )


def metrics(component: str) -> Obj:
    gateway = component == "gateway"
    fields: dict[str, Node] = {
        "enabled": Field(
            "Expose Prometheus metrics (meshlm: prefix)"
            + (
                "; the gateway always serves /metrics on its HTTP port, this enables the ServiceMonitor option."
                if gateway
                else " on metrics.port (--metrics-port)."
            ),
            BOOL,
            False,
        )
    }
    if not gateway:
        fields["port"] = Field("Port of the /metrics HTTP endpoint (--metrics-port).", PORT, 9090)
    fields["serviceMonitor"] = Obj(
        "A prometheus-operator ServiceMonitor (needs its CRDs).",
        {
            "enabled": Field(
                "Render a monitoring.coreos.com/v1 ServiceMonitor for the headless service (needs metrics.enabled).",
                BOOL,
                False,
            ),
            "interval": Field("Scrape interval.", DURATION, "30s"),
            "scrapeTimeout": Field("Scrape timeout.", DURATION, "10s"),
            "labels": Field("Extra labels, e.g. the release label your Prometheus selects.", STR_MAP, {}),
        },
    )
    return Obj("Prometheus metrics.", fields)


def common(component: str, resources: dict[str, Any], grace: int, startup: tuple[int, int]) -> dict[str, Node]:
    port = PORTS[component]
    kind = "HTTP" if component == "gateway" else "gRPC"
    replicas = (
        "Data-parallel replicas: one pod per TP group, each addressed through the headless service."
        if component == "scheduler"
        else "Number of pods (ignored while autoscaling.enabled)."
    )
    return {
        "global": global_block(),
        "enabled": Field("Read by the umbrella chart's dependency condition; ignored standalone.", BOOL, True),
        "imagePullSecrets": Field("Secrets for pulling the images.", PULL_SECRETS, []),
        "replicaCount": Field(replicas, minimum(0), 1),
        "resources": Field("Container resources (the scheduler adds its GPUs to limits).", RESOURCES, resources),
        "nodeSelector": Field("Node labels the pods must match.", STR_MAP, {}),
        "tolerations": Field("Pod tolerations.", {"type": "array", "items": TOLERATION}, []),
        "affinity": Field("Pod affinity / anti-affinity.", AFFINITY, {}),
        "podAnnotations": Field("Extra pod annotations.", STR_MAP, {}),
        "podLabels": Field("Extra pod labels.", STR_MAP, {}),
        "podSecurityContext": Field(
            "Pod security context; the images run as the non-root user 10001.",
            POD_SECURITY_CONTEXT,
            {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "runAsGroup": 10001,
                "fsGroup": 10001,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
        ),
        "securityContext": Field(
            "Container security context; the root file system is read-only (/tmp and /cache are emptyDirs).",
            SECURITY_CONTEXT,
            {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "runAsNonRoot": True,
                "capabilities": {"drop": ["ALL"]},
            },
        ),
        "service": Obj(
            "The service's port.",
            {
                "port": Field(
                    f"{kind} port of the container and its services (--port). Peers default to {port}; "
                    "change their *Addrs when you change it.",
                    PORT,
                    port,
                )
            },
        ),
        "metrics": metrics(component),
        "otlp": Obj(
            "OpenTelemetry trace export.",
            {"endpoint": Field("OTLP/gRPC endpoint (host:port) for spans (--otlp-endpoint); empty = off.", STR, "")},
        ),
        "logLevel": Field("Log level (--log-level).", {"enum": ["debug", "info", "warning", "error"]}, "info"),
        "logFormat": Field("Log format (--log-format).", {"enum": ["text", "json"]}, "json"),
        "tls": Obj(
            "Mutual TLS on every gRPC link: each service presents the Secret's certificate and "
            "accepts only peers whose certificate ca.crt signed. Give every chart of a system the "
            "same tls values (a TLS service refuses plaintext peers); clients of the tokenizer's "
            "public gRPC API then need a certificate of that CA too. The gateway's HTTP side is "
            "unchanged: only its gRPC client to the tokenizers uses TLS.",
            {
                "enabled": Field(
                    "Mount tls.secretName read-only at /etc/meshlm/tls, pass --tls-cert-file, "
                    "--tls-key-file and --tls-ca-file, and move the gRPC probes to "
                    "tls.healthPort.",
                    BOOL,
                    False,
                ),
                "secretName": Field(
                    "Existing kubernetes.io/tls Secret holding tls.crt, tls.key and ca.crt (e.g. "
                    "a cert-manager Certificate); required when tls.enabled. The certificate must "
                    "allow server and client auth and name every peer address the services dial "
                    "(<system>-meshlm-<tokenizer|scheduler|detokenizer>-headless, or your *Addrs "
                    "hosts). Files are mode 0440, readable through podSecurityContext.fsGroup.",
                    STR,
                    "",
                ),
                "healthPort": Field(
                    "Plaintext port that serves grpc.health.v1 and nothing else (--health-port), "
                    "for the kubelet's gRPC probes, which cannot speak TLS; used while "
                    "tls.enabled. The gateway's HTTP probes do not need it.",
                    PORT,
                    8081,
                ),
            },
        ),
        "extraArgs": Field(
            "Extra flags appended to the container args, as --flag=value (see `meshlm serve <component> --help`).",
            STR_LIST,
            [],
        ),
        "extraEnv": Field(
            "Extra environment variables (MESHLM_<COMPONENT>_<FLAG> sets any flag).",
            {"type": "array", "items": ENV_VAR},
            [],
        ),
        "terminationGracePeriodSeconds": Field(
            "Pod termination grace period. The service drains for --grace-period-s = this - "
            "preStopSleepSeconds - 5, so the drain ends before SIGKILL.",
            minimum(7),
            grace,
        ),
        "preStopSleepSeconds": Field(
            "preStop sleep before SIGTERM, so endpoint removal reaches clients before the drain starts.", minimum(0), 5
        ),
        "startupProbe": Obj(
            "Start-up allowance: periodSeconds x failureThreshold before liveness applies.",
            {
                "periodSeconds": Field("Seconds between start-up checks.", minimum(1), startup[0]),
                "failureThreshold": Field("Failed checks before the container is restarted.", minimum(1), startup[1]),
            },
        ),
        "autoscaling": Obj(
            "HorizontalPodAutoscaler (autoscaling/v2); replaces replicaCount when enabled.",
            {
                "enabled": Field("Render the HPA.", BOOL, False),
                "minReplicas": Field("Lower bound.", minimum(1), 1),
                "maxReplicas": Field("Upper bound.", minimum(1), 4),
                "targetCPUUtilizationPercentage": Field(
                    "Average CPU utilization target (% of requests); null = off.",
                    {"type": ["integer", "null"], "minimum": 1},
                    70,
                ),
                "targetMemoryUtilizationPercentage": Field(
                    "Average memory utilization target; null = off.", {"type": ["integer", "null"], "minimum": 1}, None
                ),
                "behavior": Field("HPA scaling behavior (scaleUp / scaleDown rules).", HPA_BEHAVIOR, {}),
            },
        ),
        "pdb": Obj(
            "PodDisruptionBudget.",
            {
                "enabled": Field("Render the PDB.", BOOL, True),
                "minAvailable": Field(
                    "Pods that must stay up (number or percentage); when set it "
                    "wins over maxUnavailable. Empty = unset.",
                    INT_OR_PERCENT,
                    "",
                ),
                "maxUnavailable": Field("Pods that may be down at once (number or percentage).", INT_OR_PERCENT, 1),
            },
        ),
    }


def model_block(component: str) -> Obj:
    scheduler = component == "scheduler"
    what = "the model" if scheduler else "the model's tokenizer files (tokenizer.json, ...)"
    path = "pvc / hostPath: the model's path inside the volume, an HF directory (config.json, weights, tokenizer)" + (
        "; a .gguf file works too (converted at start-up into /cache)."
        if scheduler
        else "; the tokenizer files are read from it."
    )
    return Obj(
        f"Where {what} comes from; the container sees it under /models.",
        {
            "source": Field(
                "init: an init container runs resolve_model_path (converting the packaged SmolLM2 "
                "GGUF, or model.init.source) into an emptyDir; pvc: a PersistentVolumeClaim; "
                "hostPath: a node directory.",
                {"enum": ["init", "pvc", "hostPath"]},
                "init",
            ),
            "path": Field(path, STR, ""),
            "pvc": Obj("source=pvc.", {"claimName": Field("Claim mounted read-only at /models.", STR, "")}),
            "hostPath": Obj("source=hostPath.", {"path": Field("Node directory mounted at /models.", STR, "")}),
            "init": Obj(
                "source=init.",
                {
                    "image": Obj(
                        "Image of the init container (it needs the scheduler extra).",
                        {
                            "repository": Field(
                                "Repository; " + ("empty = image.repository." if scheduler else "the scheduler image."),
                                STR,
                                "" if scheduler else "meshlm-scheduler",
                            ),
                            "tag": Field(
                                "Tag; "
                                + (
                                    "empty = the scheduler's own tag."
                                    if scheduler
                                    else "empty = <appVersion>-cpu (the scheduler CPU image)."
                                ),
                                STR,
                                "",
                            ),
                            "pullPolicy": Field("Pull policy.", PULL_POLICY, "IfNotPresent"),
                        },
                    ),
                    "source": Field(
                        "A .gguf file or HF directory inside the init image; empty = the "
                        "packaged SmolLM2-135M-Instruct.",
                        STR,
                        "",
                    ),
                    "sizeLimit": Field("Size limit of the emptyDir holding the converted model.", QUANTITY, "4Gi"),
                    "resources": Field("Init container resources.", RESOURCES, {}),
                },
            ),
        },
    )


def addrs(peer: str) -> Field:
    return Field(
        f"{peer.capitalize()}s, host:port list (--{peer}-addrs); empty = "
        f"<system>-meshlm-{peer}-headless:{PORTS[peer]}.",
        ADDRS,
        "",
    )


def specific(component: str) -> dict[str, Node]:
    """What only this component has, in values.yaml order."""
    f: dict[str, Node] = {}
    if component == "gateway":
        f["tokenizerAddrs"] = addrs("tokenizer")
        f["servedModelName"] = Field("Model name of /v1/* (--served-model-name); empty = the tokenizer's.", STR, "")
        f["requestTimeoutSeconds"] = Field(
            "Deadline of one call to a tokenizer (--request-timeout-s).", {"type": "number", "exclusiveMinimum": 0}, 600
        )
        f["apiKey"] = Obj(
            "API key: MESHLM_GATEWAY_API_KEY from a Secret; every route but /health, "
            "/health_generate and /metrics then needs `Authorization: Bearer <key>`.",
            {
                "secretName": Field("Existing Secret holding the key; empty = no key required.", STR, ""),
                "secretKey": Field("Key inside the Secret.", {"type": "string", "minLength": 1}, "api-key"),
            },
        )
        f["helmTest"] = Obj(
            "The `helm test` hook: GET /health, then POST /generate with max_new_tokens 1.",
            {
                "enabled": Field("Render the test pod.", BOOL, True),
                "prompt": Field("Prompt of the test request.", {"type": "string", "minLength": 1}, "Say hi."),
            },
        )
    elif component == "tokenizer":
        f["schedulerAddrs"] = addrs("scheduler")
        f["detokenizerAddrs"] = addrs("detokenizer")
        f["routingPolicy"] = Field(
            "How requests pick a scheduler (--routing-policy).",
            {"enum": ["round_robin", "shortest_queue"]},
            "round_robin",
        )
        f["maxQueuedRequests"] = Field("Most in-flight requests per replica (--max-queued-requests).", minimum(1), 4096)
        f["servedModelName"] = Field("Model name to report (--served-model-name); empty = the scheduler's.", STR, "")
        f["model"] = model_block(component)
    elif component == "detokenizer":
        f["model"] = model_block(component)
    else:
        f["detokenizerAddrs"] = addrs("detokenizer")
        f["accelerator"] = Field(
            "cuda: GPUs and --device=cuda; cpu: no GPU requested and --device=cpu (clusters without GPUs).",
            {"enum": ["cuda", "cpu"]},
            "cuda",
        )
        f["tp"] = Field(
            "Tensor-parallel size: GPUs per pod (gpuResourceName) and --tp-size. "
            "The pod runs tp rank processes, rank r on GPU r; tp must divide the "
            "model's attention heads.",
            minimum(1),
            1,
        )
        f["gpuResourceName"] = Field(
            "Extended resource name of a GPU.", {"type": "string", "minLength": 1}, "nvidia.com/gpu"
        )
        f["role"] = Field(
            "Scheduler role (--disaggregation-mode; also the pod label meshlm.io/role). "
            "unified: prefill and decode here. prefill: computes prompts and hands "
            "their KV + first token to the decode schedulers of decodeAddrs; "
            "tokenizers connect to it as to a unified one. decode: continues requests "
            "handed over by prefill schedulers; its resources are named "
            "<system>-meshlm-scheduler-decode. prefill and decode need tp 1.",
            {"enum": ["unified", "prefill", "decode"]},
            "unified",
        )
        f["decodeAddrs"] = Field(
            "role prefill: decode schedulers, host:port list (--decode-addrs); "
            "empty = <system>-meshlm-scheduler-decode-headless:30010.",
            ADDRS,
            "",
        )
        f["shmSizeLimit"] = Field(
            "Size of the in-memory /dev/shm (NCCL and torch need more than the 64Mi default).", QUANTITY, "2Gi"
        )
        f["model"] = model_block(component)
    return f


RESOURCE_DEFAULTS = {
    "gateway": ({"cpu": "250m", "memory": "256Mi"}, "1Gi", 40, (2, 30)),
    "tokenizer": ({"cpu": "500m", "memory": "512Mi"}, "2Gi", 40, (2, 60)),
    "detokenizer": ({"cpu": "250m", "memory": "512Mi"}, "2Gi", 30, (2, 60)),
    "scheduler": ({"cpu": "2", "memory": "8Gi"}, "32Gi", 60, (10, 180)),
}


LIBRARY = "meshlm-lib"  # the library chart of the shared templates, a dependency of every component


def library_slot() -> Field:
    """Helm gives every dependency a values key, the library chart too, and copies global into
    it; the closed schemas must allow that key (and nothing else in it)."""
    return Field(
        f"Filled in by Helm for the {LIBRARY} dependency (the shared templates), which takes no values.",
        closed({"global": {"type": "object", "description": "copied from global"}}),
        schema_only=True,
    )


def component_spec(component: str) -> Obj:
    requests, memory_limit, grace, startup = RESOURCE_DEFAULTS[component]
    shared = common(component, {"requests": requests, "limits": {"memory": memory_limit}}, grace, startup)
    tag_doc = (
        "Image tag; empty = <appVersion>-<accelerator> (cuda or cpu)."
        if component == "scheduler"
        else "Image tag; empty = the chart's appVersion."
    )
    head = ["global", "enabled"]
    fields: dict[str, Node] = {k: shared[k] for k in head}
    fields["image"] = image(f"meshlm-{component}", tag_doc)
    fields.update({k: shared[k] for k in ("imagePullSecrets", "replicaCount")})
    fields.update(specific(component))
    fields.update({k: v for k, v in shared.items() if k not in fields})
    if component in ("gateway", "tokenizer"):
        service = fields["service"]
        assert isinstance(service, Obj)
        what = "client-facing" if component == "gateway" else "public gRPC API (TokenizerService)"
        service.fields["type"] = Field(f"Type of the {what} service.", SERVICE_TYPE, "ClusterIP")
        if component == "gateway":
            service.fields["annotations"] = Field("Annotations of that service.", STR_MAP, {})
    fields[LIBRARY] = library_slot()
    return Obj(f"Values of the meshlm-{component} chart.", fields)


# Umbrella value key -> the chart behind it: `decode` is a second meshlm-scheduler, the decode
# role of prefill/decode disaggregation (off by default).
UMBRELLA_SUBCHARTS = {**{c: c for c in COMPONENTS}, "decode": "scheduler"}


def umbrella_spec() -> Obj:
    fields: dict[str, Node] = {"global": global_block()}
    for c in COMPONENTS:
        enabled = component_spec(c).fields["enabled"]
        fields[c] = Obj(
            f"Values of the meshlm-{c} subchart (every key of its values.yaml); {c}.enabled=false leaves it out.",
            {"enabled": enabled},
        )
    fields["decode"] = Obj(
        "Prefill/decode disaggregation: a second meshlm-scheduler subchart (every key of its "
        "values.yaml) running the decode role. Enable it together with scheduler.role=prefill.",
        {
            "enabled": Field("Render the decode schedulers.", BOOL, False),
            "role": Field("Keep decode.", {"enum": ["decode"]}, "decode"),
        },
    )
    return Obj("Values of the meshlm umbrella chart.", fields)
