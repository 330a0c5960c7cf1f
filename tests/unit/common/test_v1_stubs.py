"""meshlm.v1's stubs come from one command; importing the package only checks them.

Each test works on a scratch copy of the layout (protos/, services/common/meshlm/v1/{__init__,
_gen}.py, scripts/gen_protos.py) and imports it in a subprocess whose sys.path starts there, so
the checkout's own stubs are never read or written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
V1 = Path("services") / "common" / "meshlm" / "v1"
COMMAND = "python3 scripts/gen_protos.py"


def _run(tree: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree / "services" / "common"), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def _import(tree: Path) -> subprocess.CompletedProcess[str]:
    code = "import meshlm.v1, meshlm.v1.tokenizer_pb2_grpc as m; print(meshlm.v1.__file__, m.__file__)"
    return _run(tree, "-c", code)


def _snapshot(tree: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(tree)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(tree.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch tree whose stubs the script generated."""
    tree = tmp_path_factory.mktemp("stubs")
    shutil.copytree(REPO / "protos", tree / "protos")
    (tree / V1).mkdir(parents=True)
    for name in ("__init__.py", "_gen.py"):
        shutil.copy2(REPO / V1 / name, tree / V1 / name)
    (tree / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "gen_protos.py", tree / "scripts" / "gen_protos.py")
    proc = _run(tree, "scripts/gen_protos.py")
    assert proc.returncode == 0, proc.stderr
    return tree


@pytest.fixture
def tree(generated: Path, tmp_path: Path) -> Path:
    shutil.copytree(generated, tmp_path / "tree")
    return tmp_path / "tree"


def test_generated_stubs_import_from_the_scratch_tree(tree: Path) -> None:
    proc = _import(tree)
    assert proc.returncode == 0, proc.stderr
    assert all(Path(f).is_relative_to(tree) for f in proc.stdout.split()), proc.stdout
    check = _run(tree, "scripts/gen_protos.py", "--check")
    assert check.returncode == 0 and "current" in check.stdout


def test_stale_stub_raises_and_writes_nothing(tree: Path) -> None:
    proto = tree / "protos" / "meshlm" / "v1" / "tokenizer.proto"
    proto.write_text(proto.read_text() + "\n// an edit after the stubs were generated\n")
    before = _snapshot(tree)
    proc = _import(tree)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: meshlm.v1 stubs are out of date"), proc.stderr
    assert "tokenizer_pb2.py is stale" in last and "tokenizer_pb2_grpc.py is stale" in last
    assert "common_pb2" not in last  # only the stubs of the edited .proto are named
    assert f"run `{COMMAND}` in {tree}" in last
    assert _snapshot(tree) == before, "importing meshlm.v1 wrote to the tree"
    check = _run(tree, "scripts/gen_protos.py", "--check")
    assert check.returncode == 1 and "tokenizer_pb2.pyi is stale" in check.stdout
    assert _snapshot(tree) == before, "--check wrote to the tree"


def test_missing_stub_raises(tree: Path) -> None:
    (tree / V1 / "scheduler_pb2_grpc.py").unlink()
    proc = _import(tree)
    assert proc.returncode != 0 and "scheduler_pb2_grpc.py is missing" in proc.stderr


def test_the_script_regenerates_only_what_is_stale(tree: Path) -> None:
    proto = tree / "protos" / "meshlm" / "v1" / "detokenizer.proto"
    proto.write_text(proto.read_text() + "\n// edited\n")
    (tree / V1 / "gone_pb2.py").write_text("# a stub whose .proto was deleted\n")
    proc = _run(tree, "scripts/gen_protos.py")
    assert proc.returncode == 0, proc.stderr
    assert not (tree / V1 / "gone_pb2.py").exists()
    assert _import(tree).returncode == 0
    unchanged = _snapshot(tree)
    again = _run(tree, "scripts/gen_protos.py")
    assert again.returncode == 0 and "current" in again.stdout
    assert _snapshot(tree) == unchanged, "a current tree was rewritten"
