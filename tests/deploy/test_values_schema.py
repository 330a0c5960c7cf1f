"""values.schema.json: generated files are current, every object we define is closed, bad values
are rejected with a message naming the key, and the charts share one values shape."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from .charts import CHARTS, HELM_DIR, render

ALL_CHARTS = (*CHARTS, "meshlm")
PASS_THROUGH = "validated by the API server"  # Kubernetes objects checked by the k8s schema tests


def _schema(chart: str) -> dict[str, Any]:
    return json.loads((HELM_DIR / chart / "values.schema.json").read_text())


def _objects(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if node.get("type") == "object" or "properties" in node:
        yield path or "/", node
    for key, sub in node.get("properties", {}).items():
        yield from _objects(sub, f"{path}/{key}")
    if isinstance(node.get("items"), dict):
        yield from _objects(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _objects(node["additionalProperties"], f"{path}/*")


def test_generated_files_are_current() -> None:
    proc = subprocess.run([sys.executable, str(HELM_DIR / "generate.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("chart", ALL_CHARTS)
def test_every_object_is_closed(chart: str) -> None:
    open_objects = []
    for path, node in _objects(_schema(chart)):
        if "additionalProperties" in node:
            assert node["additionalProperties"] is False or isinstance(node["additionalProperties"], dict), path
        elif PASS_THROUGH in node.get("description", ""):
            assert "properties" not in node, path
        elif path.endswith("/global") and not path.count("/global/"):
            pass  # shared with every chart of an umbrella; global.meshlm itself is closed
        else:
            open_objects.append(path)
    assert not open_objects, f"{chart}: objects without additionalProperties: {open_objects}"
    assert _schema(chart)["properties"]["global"]["properties"]["meshlm"]["additionalProperties"] is False


K8S_TYPES = {
    "resources",
    "podSecurityContext",
    "securityContext",
    "tolerations",
    "affinity",
    "extraEnv",
    "imagePullSecrets",
    "behavior",
}
KEY = re.compile(r"^( *)([A-Za-z][A-Za-z0-9]*):( |$)")


@pytest.mark.parametrize("chart", ALL_CHARTS)
def test_values_yaml_documents_every_key(chart: str) -> None:
    """Every key of values.yaml has a `# --` comment above it (keys inside a default value, such
    as resources.requests.cpu, belong to the documented key); every schema property has a
    description."""
    lines = (HELM_DIR / chart / "values.yaml").read_text().splitlines()
    default_block = -1  # indentation of the key whose default value we are inside, or -1
    for i, line in enumerate(lines):
        m = KEY.match(line)
        if not m and not line.lstrip().startswith("- "):
            continue
        indent = len(line) - len(line.lstrip())
        if default_block >= 0 and indent > default_block:
            continue
        default_block = -1
        assert m, f"{chart}/values.yaml:{i + 1}: list item outside a documented default"
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#    "):
            j -= 1
        assert lines[j].strip().startswith("# -- "), f"{chart}/values.yaml:{i + 1} {line.strip()!r} is undocumented"
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m.group(3) == "" and not nxt.strip().startswith("#"):
            default_block = indent
    for path, node in _objects(_schema(chart)):
        if K8S_TYPES & set(re.split(r"[/\[\]*]+", path)):
            continue  # a Kubernetes type: its fields are documented by Kubernetes
        for key, sub in node.get("properties", {}).items():
            assert sub.get("description"), f"{chart}: {path}/{key} has no description"


INVALID = [
    ({"replicaCont": 2}, "additional properties 'replicaCont' not allowed"),
    ({"image": {"tagg": "v1"}}, "at '/image': additional properties 'tagg' not allowed"),
    ({"replicaCount": "two"}, "at '/replicaCount': got string, want integer"),
    ({"logFormat": "xml"}, "at '/logFormat'"),
    ({"service": {"port": 70000}}, "at '/service/port'"),
    (
        {"extraEnv": [{"name": "X", "valu": "1"}]},
        "at '/extraEnv/0': additional properties 'valu' not allowed",
    ),
    (
        {"resources": {"limit": {"cpu": 1}}},
        "at '/resources': additional properties 'limit' not allowed",
    ),
    ({"terminationGracePeriodSeconds": 3}, "at '/terminationGracePeriodSeconds'"),
]


@pytest.mark.parametrize("chart", CHARTS)
@pytest.mark.parametrize("values,message", INVALID)
def test_invalid_values_are_rejected(chart: str, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render(HELM_DIR / chart, values)
    assert message in str(err.value) and chart in str(err.value)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"role": "both"}, "at '/role'"),
        ({"tp": "2"}, "at '/tp': got string, want integer"),
        ({"accelerator": "tpu"}, "at '/accelerator'"),
        ({"model": {"source": "s3"}}, "at '/model/source'"),
    ],
)
def test_invalid_scheduler_values_are_rejected(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render(HELM_DIR / "meshlm-scheduler", values)
    assert message in str(err.value)
    description = _schema("meshlm-scheduler")["properties"]["role"]["description"]
    assert "prefill" in description and "decode" in description


@pytest.mark.parametrize(
    "values,message",
    [
        ({"schedulr": {}}, "additional properties 'schedulr' not allowed"),
        (
            {"scheduler": {"replicaCont": 1}},
            "at '/scheduler': additional properties 'replicaCont' not allowed",
        ),
        ({"tokenizer": {"schedulerAddrs": "no-port"}}, "at '/tokenizer/schedulerAddrs'"),
        (
            {"global": {"meshlm": {"sytem": "x"}}},
            "at '/global/meshlm': additional properties 'sytem' not allowed",
        ),
    ],
)
def test_umbrella_rejects_invalid_values(values: dict[str, Any], message: str, umbrella: Path) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        render(umbrella, values)
    assert message in str(err.value)


@pytest.mark.parametrize("chart", ALL_CHARTS)
def test_tls_without_a_secret_is_rejected(chart: str, umbrella: Path) -> None:
    message = "tls.secretName is required when tls.enabled=true"
    if chart == "meshlm":
        with pytest.raises(helm.HelmRenderError, match=message):
            render(umbrella, {"tokenizer": {"tls": {"enabled": True}}})
        return
    with pytest.raises(helm.HelmRenderError, match=message):
        render(HELM_DIR / chart, {"tls": {"enabled": True}})
    with pytest.raises(helm.HelmValuesError, match="at '/tls': additional properties 'secret'"):
        render(HELM_DIR / chart, {"tls": {"enabled": True, "secret": "meshlm-tls"}})
    with pytest.raises(helm.HelmValuesError, match="at '/tls/healthPort'"):
        render(HELM_DIR / chart, {"tls": {"enabled": True, "secretName": "s", "healthPort": 0}})


@pytest.mark.parametrize("chart", ["meshlm-scheduler", "meshlm-tokenizer", "meshlm-detokenizer"])
def test_tls_health_port_must_not_collide(chart: str) -> None:
    tls = {"enabled": True, "secretName": "meshlm-tls", "healthPort": 9090}
    message = r"tls.healthPort \(9090\) must differ from metrics.port"
    with pytest.raises(helm.HelmRenderError, match=message):
        render(HELM_DIR / chart, {"tls": tls, "metrics": {"enabled": True}})
    with pytest.raises(helm.HelmRenderError, match=r"must differ from service.port"):
        render(HELM_DIR / chart, {"tls": tls, "service": {"port": 9090}})


def test_drain_budget_must_fit_the_grace_period() -> None:
    with pytest.raises(helm.HelmRenderError, match="must exceed preStopSleepSeconds"):
        render(
            HELM_DIR / "meshlm-gateway",
            {"terminationGracePeriodSeconds": 10, "preStopSleepSeconds": 5},
        )


def test_charts_share_one_values_shape() -> None:
    """The keys the issue lists exist in every chart with the same schema (gateway: no metrics.port,
    as it serves /metrics on its HTTP port)."""
    schemas = {c: _schema(c)["properties"] for c in CHARTS}
    shared = [
        "image",
        "replicaCount",
        "resources",
        "nodeSelector",
        "tolerations",
        "affinity",
        "podSecurityContext",
        "securityContext",
        "otlp",
        "logLevel",
        "logFormat",
        "tls",
        "extraArgs",
        "extraEnv",
        "terminationGracePeriodSeconds",
        "preStopSleepSeconds",
        "startupProbe",
        "autoscaling",
        "pdb",
        "global",
        "enabled",
    ]
    for key in shared:
        shapes = {
            c: json.dumps({**s[key], "description": ""} if key != "image" else sorted(s[key]["properties"]))
            for c, s in schemas.items()
        }
        assert len({v for v in shapes.values()}) == 1 or key in ("replicaCount", "resources"), (
            key,
            shapes,
        )
    for c, s in schemas.items():
        assert s["service"]["properties"]["port"]["type"] == "integer"
        assert set(s["metrics"]["properties"]) == (
            {"enabled", "serviceMonitor"} if c == "meshlm-gateway" else {"enabled", "port", "serviceMonitor"}
        )


def test_umbrella_dependencies_match_the_charts() -> None:
    umbrella = yaml.safe_load((HELM_DIR / "meshlm" / "Chart.yaml").read_text())
    deps = {d["alias"]: d for d in umbrella["dependencies"]}
    assert set(deps) == {c.removeprefix("meshlm-") for c in CHARTS} | {"decode"}
    assert deps["decode"]["name"] == "meshlm-scheduler"
    for alias, dep in deps.items():
        chart = yaml.safe_load((HELM_DIR / dep["name"] / "Chart.yaml").read_text())
        assert dep["repository"] == f"file://../{dep['name']}" and dep["version"] == chart["version"]
        assert dep["condition"] == f"{alias}.enabled" and chart["appVersion"] == umbrella["appVersion"]
