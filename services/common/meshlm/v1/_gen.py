"""The meshlm.v1 stubs: generated from protos/meshlm/v1/*.proto by one command, checked on import.

The stubs (`<name>_pb2.py`, `<name>_pb2.pyi`, `<name>_pb2_grpc.py`) are build outputs, never
committed. Only `generate` writes them: `python3 scripts/gen_protos.py` (run by scripts/test.sh
and scripts/serve.sh) and setup.py's build_py, so wheels and images carry them. Each stub ends with
the sha256 of the .proto it was made from. Importing meshlm.v1 calls `check`, which only reads:
a missing stub, or one made from other .proto content than the file now holds, raises ImportError
naming the command that regenerates it.

setup.py and scripts/gen_protos.py load this file by path (importing the package would refuse the
very stubs they are about to fix), so it needs only the standard library until `generate` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parent  # .../meshlm/v1
PROTO_SUBDIR = Path("meshlm") / "v1"  # under a proto root and under the stubs' sys.path entry
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
IMPORTED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")  # what import needs (the .pyi is for type checkers)
STAMP = b"# meshlm: generated from the .proto with sha256 "
STAMP_RE = re.compile(re.escape(STAMP) + rb"([0-9a-f]{64})\n\Z")
COMMAND = "python3 scripts/gen_protos.py"
LOCK_NAME = ".gen.lock"


def proto_root(pkg_dir: Path = PKG_DIR) -> Path | None:
    """The directory holding meshlm/v1/*.proto: the copy a wheel ships inside the package, or the
    checkout's protos/ (when pkg_dir is <repo>/services/common/meshlm/v1); None if neither."""
    candidates = [pkg_dir / "protos"]
    if len(pkg_dir.parents) > 3:
        candidates.append(pkg_dir.parents[3] / "protos")
    return next((root for root in candidates if (root / PROTO_SUBDIR).is_dir()), None)


def _protos(root: Path) -> list[Path]:
    return sorted((root / PROTO_SUBDIR).glob("*.proto"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recorded_sha256(stub: Path) -> str | None:
    match = STAMP_RE.search(stub.read_bytes())
    return match.group(1).decode() if match else None


def stale_stubs(root: Path, pkg_dir: Path = PKG_DIR, suffixes: Sequence[str] = STUB_SUFFIXES) -> list[str]:
    """One line per stub under pkg_dir that is missing or was not generated from the current
    content of its .proto under root (empty: every stub is current)."""
    problems = []
    for proto in _protos(root):
        digest = _sha256(proto)
        for suffix in suffixes:
            stub = pkg_dir / (proto.stem + suffix)
            if not stub.is_file():
                problems.append(f"{stub.name} is missing")
            elif _recorded_sha256(stub) != digest:
                problems.append(f"{stub.name} is stale (not made from this {proto.name})")
    return problems


def check(pkg_dir: Path = PKG_DIR) -> None:
    """Raise ImportError unless every imported stub matches its .proto. Reads only: no protoc,
    no file written (so it also holds on a read-only root file system)."""
    root = proto_root(pkg_dir)
    if root is None:
        return  # no .proto to compare with; a missing stub then fails its own import
    problems = stale_stubs(root, pkg_dir, IMPORTED_SUFFIXES)
    if not problems:
        return
    if root == pkg_dir / "protos":
        fix = "reinstall meshlm (its build generates them)"
    else:
        fix = f"run `{COMMAND}` in {root.parent}"
    raise ImportError(
        f"meshlm.v1 stubs are out of date with {root / PROTO_SUBDIR}: {'; '.join(problems)}. "
        f"Stubs are generated at build time, never on import: {fix}."
    )


def generate(root: Path, pkg_dir: Path = PKG_DIR) -> list[str]:
    """Run protoc on every root/meshlm/v1/*.proto, stamp each stub with its .proto's sha256 and
    move it into pkg_dir, and delete stubs whose .proto is gone. Returns the names written.

    Each file is replaced with os.replace from a scratch directory beside it, so a concurrent
    import reads the old or the new file, never half of one; a lock file serialises generators."""
    import fcntl
    import importlib.resources

    from grpc_tools import protoc  # a build dependency (grpcio-tools)

    protos = _protos(root)
    if not protos:
        raise FileNotFoundError(f"no .proto files under {root / PROTO_SUBDIR}")
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    with open(pkg_dir / LOCK_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with tempfile.TemporaryDirectory(prefix=".gen-", dir=pkg_dir) as scratch:
            args = [
                "grpc_tools.protoc",
                f"-I{root}",
                f"-I{include}",
                f"--python_out={scratch}",
                f"--pyi_out={scratch}",
                f"--grpc_python_out={scratch}",
                *(str(p.relative_to(root)) for p in protos),
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed for {[p.name for p in protos]}")
            written = []
            for proto in protos:
                stamp = STAMP + _sha256(proto).encode() + b"\n"
                for suffix in STUB_SUFFIXES:
                    out = Path(scratch) / PROTO_SUBDIR / (proto.stem + suffix)
                    out.write_bytes(out.read_bytes().rstrip(b"\n") + b"\n" + stamp)
                    os.replace(out, pkg_dir / out.name)
                    written.append(out.name)
        wanted = {p.stem + s for p in protos for s in STUB_SUFFIXES}
        for orphan in pkg_dir.glob("*_pb2*.py*"):
            if orphan.name not in wanted:
                orphan.unlink()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of scripts/gen_protos.py."""
    ap = argparse.ArgumentParser(
        prog="gen_protos.py",
        description="Generate the meshlm.v1 gRPC stubs from protos/meshlm/v1/*.proto.",
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="write nothing; exit 1, naming them, if any stub is missing or stale"
    )
    mode.add_argument("--force", action="store_true", help="regenerate every stub, even the current ones")
    args = ap.parse_args(argv)
    root = proto_root()
    if root is None:
        ap.error(f"no protos/{PROTO_SUBDIR.as_posix()} found for {PKG_DIR}")
    problems = stale_stubs(root)
    if args.check:
        print("\n".join(problems) or "meshlm.v1 stubs are current")
        return 1 if problems else 0
    if not problems and not args.force:
        print("meshlm.v1 stubs are current")
        return 0
    written = generate(root)
    print(f"meshlm.v1: generated {len(written)} stubs in {PKG_DIR} from {root / PROTO_SUBDIR}")
    return 0
