"""The shared templates live once, in the meshlm-lib library chart, and render the same for every
caller: each component chart renders the same objects standalone and inside the umbrella (where
named templates are global), labels name the calling chart, and a packed chart carries the
library with it (no repository needed to install it)."""

from __future__ import annotations

import copy
import re
import tarfile
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from .charts import (
    CHARTS,
    COMPONENTS,
    HELM_DIR,
    LIBRARY,
    UMBRELLA,
    by_kind,
    component_values,
    example,
    manifests,
    render,
    selects,
    workloads,
)

VALUE_SETS = ("default", "cpu", "tp2", "dp2", "production", "pd")
DEFINE = re.compile(r'define\s+"([^"]+)"')
SHARED_TPL = Path("templates") / "_meshlm.tpl"


def _chart_yaml(chart: str) -> dict[str, Any]:
    return yaml.safe_load((HELM_DIR / chart / "Chart.yaml").read_text())


def _defined(chart_dir: Path) -> set[str]:
    return {n for f in (chart_dir / "templates").rglob("*") if f.is_file() for n in DEFINE.findall(f.read_text())}


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        both = isinstance(v, dict) and isinstance(out.get(k), dict)
        out[k] = _deep_merge(out[k], v) if both else copy.deepcopy(v)
    return out


def _identity(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _name_label(doc: dict[str, Any]) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/name"])


def test_component_charts_depend_on_the_one_library() -> None:
    lib = _chart_yaml(LIBRARY)
    assert lib["type"] == "library"
    assert all(f.name.startswith("_") for f in (HELM_DIR / LIBRARY / "templates").iterdir())
    shared = _defined(HELM_DIR / LIBRARY)
    assert {"meshlm.fullname", "meshlm.labels", "meshlm.commonArgs", "meshlm.hpa"} <= shared
    for chart in CHARTS:
        assert _chart_yaml(chart)["dependencies"] == [
            {"name": LIBRARY, "version": lib["version"], "repository": f"file://../{LIBRARY}"}
        ], chart
        vendored = HELM_DIR / chart / "charts" / LIBRARY
        assert vendored.is_symlink() and vendored.resolve() == (HELM_DIR / LIBRARY).resolve()
        redefined = _defined(HELM_DIR / chart) & shared
        assert not redefined, f"{chart} redefines the library's {sorted(redefined)}"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_components_render_the_same_standalone_and_in_the_umbrella(value_set: str, umbrella: Path) -> None:
    """Standalone, a chart uses its own copy of the library; in the umbrella one definition of each
    shared template serves all subcharts. Both must give every component the same objects."""
    values = {} if value_set == "default" else example(value_set)
    defaults = yaml.safe_load((HELM_DIR / UMBRELLA / "values.yaml").read_text())
    merged = _deep_merge(defaults, values)
    in_umbrella = manifests(render(umbrella, values))
    sections = {c: c for c in COMPONENTS}
    if merged["decode"]["enabled"]:
        sections["decode"] = "scheduler"
    seen = 0
    for section, component in sections.items():
        chart = HELM_DIR / f"meshlm-{component}"
        standalone = manifests(render(chart, component_values(merged, section)))
        names = {_name_label(d) for d in standalone}
        assert len(names) == 1, names
        ours = [d for d in in_umbrella if _name_label(d) in names]
        assert sorted(standalone, key=_identity) == sorted(ours, key=_identity), section
        seen += len(ours)
    assert seen == len(in_umbrella), "umbrella objects no component chart renders"


@pytest.mark.parametrize("chart", CHARTS)
def test_shared_labels_name_the_calling_chart(chart: str) -> None:
    """The library reads the caller's context: chart label and version are the component chart's,
    and every selector the library renders selects the workload's pods."""
    meta = _chart_yaml(chart)
    values = {
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
        "autoscaling": {"enabled": True},
        "pdb": {"enabled": True},
    }
    docs = manifests(render(HELM_DIR / chart, values))
    (w,) = workloads(docs)
    pod_labels = w["spec"]["template"]["metadata"]["labels"]
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["helm.sh/chart"] == f"{chart}-{meta['version']}", d["kind"]
        assert labels["app.kubernetes.io/version"] == meta["appVersion"]
        assert labels["app.kubernetes.io/part-of"] == "meshlm"
        assert labels["app.kubernetes.io/component"] == chart.removeprefix("meshlm-")
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": w["kind"], "name": w["metadata"]["name"]}
    headless = [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    assert len(headless) == 1 and selects(headless[0]["spec"]["selector"], pod_labels)
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert selects(sm["spec"]["selector"]["matchLabels"], headless[0]["metadata"]["labels"])


def test_library_lints_clean() -> None:
    report = helm.lint(HELM_DIR / LIBRARY, strict=True, kube_version="v1.37.0")
    assert not report["errors"], report
    assert {m["error"] for m in report["messages"]} <= {"icon is recommended"}, report


@pytest.mark.parametrize("chart", CHARTS)
def test_packed_chart_carries_the_library(chart: str, tmp_path: Path) -> None:
    """`helm package` follows the charts/meshlm-lib link, so the archive installs anywhere and
    renders what the directory renders."""
    archive = helm.package(HELM_DIR / chart, destination=tmp_path)
    with tarfile.open(archive) as tar:
        member = tar.extractfile(f"{chart}/charts/{LIBRARY}/{SHARED_TPL.as_posix()}")
        assert member is not None
        assert member.read() == (HELM_DIR / LIBRARY / SHARED_TPL).read_bytes()
    assert manifests(render(Path(archive))) == manifests(render(HELM_DIR / chart))


def test_umbrella_build_packs_the_library_into_every_subchart(umbrella: Path) -> None:
    for chart in CHARTS:
        (archive,) = (umbrella / "charts").glob(f"{chart}-*.tgz")
        with tarfile.open(archive) as tar:
            assert f"{chart}/charts/{LIBRARY}/{SHARED_TPL.as_posix()}" in tar.getnames(), chart
