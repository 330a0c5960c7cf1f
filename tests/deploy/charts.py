"""Helpers for the chart tests: render with Helm's Go engine (helm-python-sdk, no helm binary),
split manifests, and build the umbrella chart's dependencies in a scratch copy."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
HELM_DIR = REPO / "deploy" / "helm"
DOCKER_DIR = REPO / "deploy" / "docker"
EXAMPLES = HELM_DIR / "examples"
COMPONENTS = ("gateway", "tokenizer", "scheduler", "detokenizer")
CHARTS = tuple(f"meshlm-{c}" for c in COMPONENTS)
UMBRELLA, LIBRARY = "meshlm", "meshlm-lib"
RELEASE, NAMESPACE = "prod", "ml"
# Newest schema set kubernetes-validate ships, and the charts' kubeVersion floor.
K8S_VERSIONS = ("1.37.0", "1.27.0")


def build_umbrella(dest: Path) -> Path:
    """Copy deploy/helm to dest and run `helm dependency build` on the umbrella there (it packs
    the file:// subcharts into charts/), so the checkout is never written to. The component
    charts' charts/meshlm-lib links are copied as links: they are the library's one copy."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        built = {"charts", "Chart.lock"} if Path(directory).name == UMBRELLA else set()
        return {n for n in names if n in built or n == "__pycache__"}

    shutil.copytree(HELM_DIR, dest, symlinks=True, ignore=ignore)
    helm.dependency_build(dest / UMBRELLA)
    return dest / UMBRELLA


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()) or {}


def component_values(umbrella_values: dict[str, Any], component: str) -> dict[str, Any]:
    """What a standalone chart gets from an umbrella values file: its section plus global."""
    out = copy.deepcopy(umbrella_values.get(component, {}))
    if "global" in umbrella_values:
        out["global"] = copy.deepcopy(umbrella_values["global"])
    return out


def render(chart: Path, values: dict[str, Any] | None = None, **kw: Any) -> dict[str, str]:
    """Template path -> rendered text (schema validation included, as `helm template` does)."""
    kw.setdefault("name", RELEASE)
    kw.setdefault("namespace", NAMESPACE)
    with helm.Chart.load(chart) as c:
        return c.render(values, **kw)


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a render (NOTES.txt and empty templates dropped)."""
    out = []
    for path, text in sorted(rendered.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", {})
                out.append(doc)
    return out


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def component_of(obj: dict[str, Any]) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def flags(c: dict[str, Any]) -> dict[str, str]:
    """--name=value args as a dict (the charts render every flag in that form)."""
    out = {}
    for a in c.get("args", []):
        assert a.startswith("--") and "=" in a, f"arg {a!r} is not --flag=value"
        k, v = a[2:].split("=", 1)
        out[k] = v
    return out


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
