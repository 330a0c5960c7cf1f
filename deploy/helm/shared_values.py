"""The values every meshlm chart has (global, image, metrics, resources, probes, TLS, autoscaling,
PDB, ...), with the ports the components listen on."""

from __future__ import annotations

from typing import Any

from schema_types import (
    AFFINITY,
    BOOL,
    DNS_LABEL,
    DURATION,
    ENV_VAR,
    HPA_BEHAVIOR,
    INT_OR_PERCENT,
    POD_SECURITY_CONTEXT,
    PORT,
    PULL_POLICY,
    PULL_SECRETS,
    RESOURCES,
    SECURITY_CONTEXT,
    STR,
    STR_LIST,
    STR_MAP,
    TOLERATION,
    Field,
    Node,
    Obj,
    minimum,
)

COMPONENTS = ("gateway", "tokenizer", "scheduler", "detokenizer")


PORTS = {"gateway": 30000, "tokenizer": 50051, "scheduler": 30010, "detokenizer": 50053}


def global_block() -> Obj:
    system = (
        "Name of the meshlm system this component belongs to. Every resource is named "
        "<system>-meshlm-<component>, and peers are found at "
        "<system>-meshlm-<peer>-headless:<port>. Empty = the release name (right for the "
        "umbrella chart); give standalone charts of one system the same value. At most 30 "
        "characters."
    )
    registry = "Registry prefixed to every image.repository (e.g. ghcr.io/acme); empty = none."
    auth = Obj(
        "Authentication from one existing Secret, mounted read-only as files under "
        "/etc/meshlm/auth (mode 0440), never in args or env. The API key guards the gateway's "
        "HTTP routes (all but /health, /health_generate, /metrics) and the tokenizer's public "
        "gRPC API (`authorization: Bearer <key>`); the internal token goes on every call between "
        "the services and their internal RPCs require it (gRPC health stays open, so probes "
        "work). Set it once under global in the umbrella chart, or the same in every standalone "
        "chart of a system.",
        {
            "existingSecret": Field("Name of the Secret; empty = no authentication (every API open).", STR, ""),
            "apiKeyKey": Field(
                "Key of the API key in the Secret (--api-key-file; gateway and tokenizer); empty = no API key.",
                STR,
                "api-key",
            ),
            "internalTokenKey": Field(
                "Key of the internal token in the Secret (--internal-token-file; every component); "
                "empty = no internal token.",
                STR,
                "internal-token",
            ),
        },
    )
    meshlm = Obj(
        "meshlm-wide settings.",
        {"system": Field(system, DNS_LABEL, ""), "imageRegistry": Field(registry, STR, ""), "auth": auth},
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
