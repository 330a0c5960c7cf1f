"""Every chart renders with Helm's engine (defaults and the example values), passes Helm's lint,
and every rendered object validates against the Kubernetes schemas (kubernetes-validate, strict).
ServiceMonitor has no built-in schema: it is checked structurally against what it must select."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from .charts import (
    CHARTS,
    COMPONENTS,
    HELM_DIR,
    K8S_VERSIONS,
    RELEASE,
    by_kind,
    component_of,
    component_values,
    container,
    example,
    flags,
    manifests,
    render,
    selects,
    workloads,
)

VALUE_SETS = ("default", "cpu", "tp2", "dp2", "production", "pd")
SEVERITY_ERROR = 3


def _values(name: str) -> dict[str, Any]:
    return {} if name == "default" else example(name)


def _cases() -> list[tuple[str, str]]:
    return [(chart, vs) for chart in (*CHARTS, "meshlm") for vs in VALUE_SETS]


def _chart_and_values(umbrella: Path, chart: str, value_set: str) -> tuple[Path, dict[str, Any]]:
    values = _values(value_set)
    if chart == "meshlm":
        return umbrella, values
    return HELM_DIR / chart, component_values(values, chart.removeprefix("meshlm-"))


def validate_structurally(sm: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """A monitoring.coreos.com/v1 ServiceMonitor must select exactly one rendered Service (in its
    namespace) whose named port exists, and scrape /metrics on it."""
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = sm["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels"}
    match = spec["selector"]["matchLabels"]
    services = [s for s in by_kind(docs, "Service") if selects(match, s["metadata"]["labels"])]
    assert len(services) == 1, f"ServiceMonitor {sm['metadata']['name']} selects {len(services)} services"
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert spec["endpoints"], "no endpoints"
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert ep["port"] in port_names and ep["path"] == "/metrics"
        assert ep["interval"].endswith(("s", "m")) and ep["scrapeTimeout"].endswith(("s", "m"))
    assert spec["namespaceSelector"] == {"matchNames": ["ml"]}


@pytest.mark.parametrize("chart", [*CHARTS, "meshlm"])
def test_helm_lint_reports_no_errors(chart: str, umbrella: Path) -> None:
    path = umbrella if chart == "meshlm" else HELM_DIR / chart
    for value_set in VALUE_SETS:
        _, values = _chart_and_values(umbrella, chart, value_set)
        report = helm.lint(path, values, strict=True, kube_version="v1.37.0")
        errors = [m for m in report["messages"] if m["severity"] >= SEVERITY_ERROR]
        assert not report["errors"] and not errors, f"{chart} ({value_set}): {report}"
        # strict mode would flag warnings too; only the informational "icon is recommended" is left
        assert {m["error"] for m in report["messages"]} <= {"icon is recommended"}, report


@pytest.mark.parametrize("chart,value_set", _cases())
def test_renders_and_validates_against_kubernetes_schemas(chart: str, value_set: str, umbrella: Path) -> None:
    path, values = _chart_and_values(umbrella, chart, value_set)
    docs = manifests(render(path, values))
    assert workloads(docs), "no workload rendered"
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            validate_structurally(doc, docs)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} invalid for k8s {version}: {e.message} at {list(e.path)}"
                )
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"


def _name(w: dict[str, Any]) -> str:
    """A workload's name label without "meshlm-": its component, or scheduler-decode."""
    return w["metadata"]["labels"]["app.kubernetes.io/name"].removeprefix("meshlm-")


def _umbrella_docs(umbrella: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    return manifests(render(umbrella, values))


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_peers_are_addressed_by_rendered_headless_services(value_set: str, umbrella: Path) -> None:
    """Each *-addrs flag names a rendered headless Service and one of its ports, and that Service
    selects the peer's pods and targets its gRPC container port."""
    docs = _umbrella_docs(umbrella, _values(value_set))
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    pods = {_name(w): w["spec"]["template"] for w in workloads(docs)}
    expected = {
        "gateway": {"tokenizer-addrs": "tokenizer"},
        "tokenizer": {"scheduler-addrs": "scheduler", "detokenizer-addrs": "detokenizer"},
        "scheduler": {"detokenizer-addrs": "detokenizer", "decode-addrs": "scheduler-decode"},
        "scheduler-decode": {"detokenizer-addrs": "detokenizer"},
    }
    for w in workloads(docs):
        for flag, peer in expected.get(_name(w), {}).items():
            if flag not in flags(container(w)):
                assert flag == "decode-addrs"  # only a prefill scheduler has decode peers
                continue
            host, port = flags(container(w))[flag].rsplit(":", 1)
            svc = services[host]
            assert svc["spec"]["clusterIP"] == "None", f"{host} is not headless"
            (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
            assert selects(svc["spec"]["selector"], pods[peer]["metadata"]["labels"])
            others = [n for n in pods if n != peer]
            assert not any(selects(svc["spec"]["selector"], pods[n]["metadata"]["labels"]) for n in others)
            named = {p["name"]: p["containerPort"] for p in pods[peer]["spec"]["containers"][0]["ports"]}
            assert named[svc_port["targetPort"]] == int(port)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_workload_contract(value_set: str, umbrella: Path) -> None:
    """Probes, drain budget, entrypoints, security and the scheduler's TP / accelerator / role."""
    values = _values(value_set)
    docs = _umbrella_docs(umbrella, values)
    assert {component_of(w) for w in workloads(docs)} == set(COMPONENTS)
    for w in workloads(docs):
        comp, pod = component_of(w), w["spec"]["template"]["spec"]
        c, f = container(w), flags(container(w))
        assert c["command"] == ["meshlm", "serve", comp]
        grace = pod["terminationGracePeriodSeconds"]
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert float(f["grace-period-s"]) == grace - sleep - 5 > 0
        probe_kind = "httpGet" if comp == "gateway" else "grpc"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe_kind in c[probe], (comp, probe)
        if comp == "gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        else:  # under TLS the kubelet probes the plaintext health port
            probe_port = f["health-port"] if "tls-cert-file" in f else f["port"]
            assert c["readinessProbe"]["grpc"]["port"] == int(probe_port)
        assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {"/tmp", "/cache"} <= mounts
        if comp == "scheduler":
            decode = _name(w) == "scheduler-decode"
            sv = values.get("decode" if decode else "scheduler", {})
            tp, acc = sv.get("tp", 1), sv.get("accelerator", "cuda")
            role = sv.get("role", "decode" if decode else "unified")
            assert f.get("disaggregation-mode", "unified") == role
            assert w["kind"] == "StatefulSet" and w["spec"]["replicas"] == sv.get("replicaCount", 1)
            assert f["tp-size"] == str(tp) and f["device"] == acc
            gpus = c["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus == (tp if acc == "cuda" else None)
            assert w["spec"]["template"]["metadata"]["labels"]["meshlm.io/role"] == role
            assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
            assert w["spec"]["serviceName"] in {s["metadata"]["name"] for s in by_kind(docs, "Service")}


def test_production_helm_test_hook_and_options(umbrella: Path) -> None:
    docs = _umbrella_docs(umbrella, example("production"))
    hooks = [d for d in docs if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    assert [h["kind"] for h in hooks] == ["Pod"]
    script = hooks[0]["spec"]["containers"][0]["command"][2]
    assert "/health" in script and "/generate" in script and '"max_new_tokens": 1' in script
    hook_env = {e["name"]: e for e in hooks[0]["spec"]["containers"][0]["env"]}
    assert hook_env["MESHLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "meshlm-auth", "key": "api-key"}
    assert {component_of(h) for h in by_kind(docs, "HorizontalPodAutoscaler")} == {
        "gateway",
        "tokenizer",
        "detokenizer",
    }
    assert len(by_kind(docs, "PodDisruptionBudget")) == 4 and len(by_kind(docs, "ServiceMonitor")) == 4
    otlp = {component_of(w): flags(container(w)).get("otlp-endpoint") for w in workloads(docs)}
    assert set(otlp.values()) == {"otel-collector.observability:4317"}


AUTH_DIR = "/etc/meshlm/auth"


def _auth_of(workload: dict[str, Any]) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]]:
    """(auth flags, auth volumes, auth mounts) of a workload."""
    c = container(workload)
    f = {k: v for k, v in flags(c).items() if k in ("api-key-file", "internal-token-file", "api-key", "internal-token")}
    volumes = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    mounts = [m for m in c["volumeMounts"] if m["name"] == "auth"]
    return f, volumes, mounts


@pytest.mark.parametrize("chart", [*CHARTS, "meshlm"])
def test_auth_from_an_existing_secret_reaches_every_component(chart: str, umbrella: Path) -> None:
    """global.meshlm.auth.existingSecret: each component mounts its items of the Secret as files
    and gets --api-key-file (gateway, tokenizer) and --internal-token-file (all); no secret is in
    args or plain env; with a key name emptied that secret is left out; without the value nothing."""
    path = umbrella if chart == "meshlm" else HELM_DIR / chart
    values: dict[str, Any] = {"global": {"meshlm": {"auth": {"existingSecret": "sec", "internalTokenKey": "ring"}}}}
    if chart == "meshlm":
        values["scheduler"] = {"role": "prefill"}
        values["decode"] = {"enabled": True}
    docs = manifests(render(path, values))
    assert workloads(docs)
    for w in workloads(docs):
        component = component_of(w)
        public = component in ("gateway", "tokenizer")
        f, volumes, mounts = _auth_of(w)
        expected = {"internal-token-file": f"{AUTH_DIR}/internal-token"}
        items = [{"key": "ring", "path": "internal-token"}]
        if public:
            expected["api-key-file"] = f"{AUTH_DIR}/api-key"
            items.insert(0, {"key": "api-key", "path": "api-key"})
        assert f == expected, component
        assert volumes == [{"name": "auth", "secret": {"secretName": "sec", "defaultMode": 288, "items": items}}]
        assert mounts == [{"name": "auth", "mountPath": AUTH_DIR, "readOnly": True}], component
        env = container(w).get("env", [])
        assert not any("API_KEY" in e["name"] or "INTERNAL_TOKEN" in e["name"] for e in env), component
    if chart == "meshlm":
        assert {w["metadata"]["name"] for w in workloads(docs)} >= {"prod-meshlm-scheduler-decode"}
    # only the internal token: the public APIs stay open, the ring still needs the token
    values["global"]["meshlm"]["auth"]["apiKeyKey"] = ""
    for w in workloads(manifests(render(path, values))):
        f, volumes, _ = _auth_of(w)
        assert f == {"internal-token-file": f"{AUTH_DIR}/internal-token"}
        assert [i["path"] for i in volumes[0]["secret"]["items"]] == ["internal-token"]
    # only the API key: the scheduler and the detokenizer mount nothing
    values["global"]["meshlm"]["auth"] = {"existingSecret": "sec", "internalTokenKey": ""}
    for w in workloads(manifests(render(path, values))):
        f, volumes, mounts = _auth_of(w)
        public = component_of(w) in ("gateway", "tokenizer")
        assert f == ({"api-key-file": f"{AUTH_DIR}/api-key"} if public else {})
        assert bool(volumes) == bool(mounts) == public
    for w in workloads(manifests(render(path, {}))):
        assert _auth_of(w) == ({}, [], [])


TLS_ON = {"enabled": True, "secretName": "meshlm-tls"}
TLS_DIR = "/etc/meshlm/tls"


@pytest.mark.parametrize("chart", [*CHARTS, "meshlm"])
def test_tls_mounts_the_secret_passes_the_flags_and_moves_the_probes(chart: str, umbrella: Path) -> None:
    if chart == "meshlm":
        path, health_port = umbrella, 8081  # the default
        values: dict[str, Any] = {c: {"tls": TLS_ON} for c in COMPONENTS}
    else:
        path, health_port = HELM_DIR / chart, 8181
        values = {"tls": {**TLS_ON, "healthPort": health_port}}
    docs = manifests(render(path, values))
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    assert workloads(docs)
    for w in workloads(docs):
        comp, pod = component_of(w), w["spec"]["template"]["spec"]
        c, f = container(w), flags(container(w))
        assert [v for v in pod["volumes"] if v["name"] == "tls"] == [
            {"name": "tls", "secret": {"secretName": "meshlm-tls", "defaultMode": 0o440}}
        ]
        assert [m for m in c["volumeMounts"] if m["name"] == "tls"] == [
            {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
        ]
        for init in pod.get("initContainers", []):
            assert "tls" not in {m["name"] for m in init["volumeMounts"]}
        assert (f["tls-cert-file"], f["tls-key-file"], f["tls-ca-file"]) == (
            f"{TLS_DIR}/tls.crt",
            f"{TLS_DIR}/tls.key",
            f"{TLS_DIR}/ca.crt",
        )
        if comp == "gateway":  # HTTP probes; TLS only on its gRPC client
            assert "health-port" not in f and "readinessProbe" in c
            assert [p["name"] for p in c["ports"]] == ["http"]
            assert all("httpGet" in c[p] for p in ("startupProbe", "livenessProbe"))
            continue
        assert int(f["health-port"]) == health_port != int(f["port"])
        assert {"name": "health", "containerPort": health_port, "protocol": "TCP"} in c["ports"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": health_port}, (comp, probe)
    plain = manifests(render(path, {} if chart == "meshlm" else {"tls": {"secretName": "x"}}))
    for w in workloads(plain):
        c = container(w)
        assert not any(a.startswith(("--tls-", "--health-port")) for a in c["args"])
        assert "tls" not in {v["name"] for v in w["spec"]["template"]["spec"]["volumes"]}


def test_disabled_component_is_left_out(umbrella: Path) -> None:
    docs = _umbrella_docs(umbrella, {"gateway": {"enabled": False}})
    assert "gateway" not in {component_of(d) for d in docs if "labels" in d["metadata"]}


def test_standalone_charts_of_one_system_find_each_other() -> None:
    """Installed as four releases with one global.meshlm.system, the names line up."""
    values = {"global": {"meshlm": {"system": "chat"}}}
    docs = [d for chart in CHARTS for d in manifests(render(HELM_DIR / chart, values, name=f"r-{chart}"))]
    services = {s["metadata"]["name"] for s in by_kind(docs, "Service")}
    for w in workloads(docs):
        for flag, value in flags(container(w)).items():
            if flag.endswith("-addrs"):
                assert value.rsplit(":", 1)[0] in services, (flag, value)


@pytest.mark.parametrize("chart", ["meshlm-scheduler", "meshlm-tokenizer", "meshlm-detokenizer"])
def test_model_sources(chart: str) -> None:
    """init: an emptyDir filled by the init container; pvc / hostPath: mounted, no init container."""
    path_flag = "model-path" if chart == "meshlm-scheduler" else "tokenizer-path"
    cases = {
        "pvc": ({"pvc": {"claimName": "models"}}, {"persistentVolumeClaim"}),
        "hostPath": ({"hostPath": {"path": "/srv/models"}}, {"hostPath"}),
    }
    for source, (extra, volume_keys) in cases.items():
        values = {"model": {"source": source, "path": "qwen2/", **extra}}
        (w,) = workloads(manifests(render(HELM_DIR / chart, values)))
        pod = w["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "models"]
        assert volume_keys <= set(vol) and "initContainers" not in pod
        assert flags(container(w))[path_flag] == "/models/qwen2"
        kubernetes_validate.validate(w, K8S_VERSIONS[0], strict=True)
    (w,) = workloads(manifests(render(HELM_DIR / chart, {})))
    (init,) = w["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][:2] == ["python", "-c"] and "resolve_model_path" in init["command"][2]
    assert flags(container(w))[path_flag] == "/models/model"
    with pytest.raises(helm.HelmRenderError, match="model.pvc.claimName is required"):
        render(HELM_DIR / chart, {"model": {"source": "pvc", "path": "x"}})


def test_prefill_decode_roles(umbrella: Path) -> None:
    """pd: the tokenizers' schedulers prefill and name the decode StatefulSet's headless service;
    the decode pods have their own name, label and service."""
    docs = _umbrella_docs(umbrella, example("pd"))
    by_name = {_name(w): w for w in workloads(docs)}
    prefill, decode = by_name["scheduler"], by_name["scheduler-decode"]
    assert prefill["metadata"]["name"] == f"{RELEASE}-meshlm-scheduler"
    assert decode["metadata"]["name"] == f"{RELEASE}-meshlm-scheduler-decode"
    assert decode["spec"]["replicas"] == 2
    pf, df = flags(container(prefill)), flags(container(decode))
    assert pf["disaggregation-mode"] == "prefill" and df["disaggregation-mode"] == "decode"
    assert pf["decode-addrs"] == f"{RELEASE}-meshlm-scheduler-decode-headless:30010"
    assert "decode-addrs" not in df
    assert decode["spec"]["serviceName"] == f"{RELEASE}-meshlm-scheduler-decode-headless"


@pytest.mark.parametrize(
    "values,message",
    [
        ({"decode": {"enabled": True}}, "decode.enabled=true needs scheduler.role=prefill"),
        ({"scheduler": {"role": "prefill"}}, "scheduler.role=prefill needs decode schedulers"),
        ({"scheduler": {"role": "prefill", "tp": 2}, "decode": {"enabled": True}}, "role prefill needs tp 1"),
    ],
)
def test_inconsistent_roles_fail_the_render(values: dict[str, Any], message: str, umbrella: Path) -> None:
    with pytest.raises(Exception) as err:
        render(umbrella, values)
    assert message in str(err.value)
