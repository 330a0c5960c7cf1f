"""Generate the gRPC stubs of meshlm.v1 from protos/meshlm/v1/*.proto, never leaving them stale.

The stubs are build outputs (not committed). They are generated
  * at build time (setup.py's build_py), so wheels and images carry them, and
  * at import time in a source checkout whenever a .proto is newer than its stub,
under a file lock so concurrent processes do not read half-written files.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Optional

PKG_DIR = Path(__file__).resolve().parent  # .../meshlm/v1
OUT_ROOT = PKG_DIR.parent.parent  # the directory holding meshlm/


def proto_root() -> Optional[Path]:
    """Directory holding meshlm/v1/*.proto: the repo's protos/ or the copy inside a wheel."""
    for root in (PKG_DIR.parents[3] / "protos" if len(PKG_DIR.parents) > 3 else None, PKG_DIR / "protos"):
        if root is not None and (root / "meshlm" / "v1").is_dir():
            return root
    return None


def _stale(root: Path) -> bool:
    for proto in (root / "meshlm" / "v1").glob("*.proto"):
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            stub = PKG_DIR / (proto.stem + suffix)
            if not stub.exists() or stub.stat().st_mtime < proto.stat().st_mtime:
                return True
    return False


def generate(root: Path) -> None:
    from grpc_tools import protoc  # build-time dependency (grpcio-tools)
    import importlib.resources

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    protos = sorted(str(p.relative_to(root)) for p in (root / "meshlm" / "v1").glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"-I{include}",
        f"--python_out={OUT_ROOT}",
        f"--pyi_out={OUT_ROOT}",
        f"--grpc_python_out={OUT_ROOT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {protos}")


def ensure_generated() -> None:
    """Regenerate the stubs if any is missing or older than its .proto (no-op in a wheel)."""
    root = proto_root()
    if root is None or not _stale(root):
        return
    with open(PKG_DIR / ".gen.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stale(root):
            generate(root)
