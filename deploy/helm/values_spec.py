"""The values of the meshlm charts, declared once: default, JSON-schema type and description.

generate.py turns this into each chart's values.yaml (descriptions as `# --` comments) and
values.schema.json (descriptions as `description`). Objects we define are closed
(`additionalProperties: false`); Kubernetes types (resources, securityContext, tolerations, ...)
are closed at the level named here, and their deeper fields are checked by the Kubernetes schema
tests in tests/deploy. The schema building blocks are in schema_types.py, the values every chart
shares in shared_values.py; here what each component adds, and the umbrella chart.
"""

from __future__ import annotations

from schema_types import (
    ADDRS,
    BOOL,
    PULL_POLICY,
    QUANTITY,
    RESOURCES,
    SERVICE_TYPE,
    STR,
    STR_MAP,
    Field,
    Node,
    Obj,
    closed,
    minimum,
)
from shared_values import COMPONENTS, PORTS, common, global_block, image


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
