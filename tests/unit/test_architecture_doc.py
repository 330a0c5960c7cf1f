"""The docs name code that exists.

docs/architecture.md (and docs/ring.md) name code as `path/to/file.py:Name` or
`path/to/file.py:Class.method` (paths relative to the repository root) and, in ring.md, as dotted
module paths (`meshlm.common.finish.FinishReason`). Every such reference must name a file that
exists and a function, class, method or module-level name defined there, found with `ast` (no
module is imported). Repository paths in backticks (`services/...`, `protos/...`, ...) and every
path of the README's code map must exist.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TypeAlias

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/architecture.md", "docs/ring.md")
TOP_DIRS = ("services/", "protos/", "tests/", "docs/", "scripts/", "deploy/", "bench/")
CODE_MAP_PREFIX = ("…/scheduler/", "services/scheduler/meshlm/scheduler/")

# `file.py:Name[.attr...]`, the file path relative to the repository root.
FILE_REF = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
# `meshlm.pkg.module.Name[.attr]` (dotted), as ring.md writes them.
DOTTED_REF = re.compile(r"(?<![\w.])meshlm(?:\.[A-Za-z_]\w*)+")
BACKTICKED = re.compile(r"`([^`\n]+)`")

Scope: TypeAlias = ast.Module | ast.ClassDef


def _read(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _defined(scope: Scope, name: str) -> ast.AST | None:
    """The statement of `scope`'s body that defines `name` (def, class or assignment)."""
    for node in scope.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            continue
        if name in names:
            return node
    return None


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def resolve(path: Path, names: list[str]) -> str | None:
    """None when `path` defines names[0] (and names[0] defines names[1], ...), else why not."""
    if not path.is_file():
        return f"{_shown(path)} does not exist"
    scope: Scope = _parse(path)
    for i, name in enumerate(names):
        node = _defined(scope, name)
        if node is None:
            where = ".".join(names[:i]) or "the module"
            return f"{name!r} is not defined in {where} of {_shown(path)}"
        if i + 1 < len(names):
            if not isinstance(node, ast.ClassDef):
                return f"{'.'.join(names[: i + 1])} in {_shown(path)} is not a class"
            scope = node
    return None


def check_file_ref(ref: str) -> str | None:
    """`path.py:Name[.attr]` -> None if it exists, else the reason."""
    match = FILE_REF.fullmatch(ref)
    if match is None:
        return f"{ref!r} is not of the form path.py:Name[.attr]"
    return resolve(ROOT / match.group(1), match.group(2).split("."))


def _module_file(parts: list[str]) -> Path | None:
    """The source of module meshlm.<parts...> (a namespace package under services/*/)."""
    for base in sorted((ROOT / "services").glob("*/meshlm")):
        target = base.joinpath(*parts)
        if target.with_suffix(".py").is_file():
            return target.with_suffix(".py")
        if (target / "__init__.py").is_file():
            return target / "__init__.py"
    return None


def check_dotted_ref(ref: str) -> str | None:
    """`meshlm.a.b.Name[.attr]`: the longest module prefix, then names defined in it."""
    parts = ref.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is not None:
            return resolve(module, parts[cut:]) if parts[cut:] else None
    return f"no module meshlm.{parts[0]} under services/*/meshlm"


def file_refs(text: str) -> Iterator[str]:
    for match in FILE_REF.finditer(text):
        yield match.group(0)


def path_refs(text: str) -> Iterator[str]:
    """Backticked repository paths (a `:Name` suffix dropped)."""
    for match in BACKTICKED.finditer(text):
        token = match.group(1).strip().split(":")[0]
        if token.startswith(TOP_DIRS) and not any(c in token for c in " *<>"):
            yield token


def code_map_paths(readme: str) -> list[str]:
    """The paths in the first column of the README's code map, `…/scheduler/` expanded; a bare
    name after a path in the same cell is a sibling of that path unless it is at the root."""
    section = readme.split("## Code map", 1)[1].split("\n## ", 1)[0]
    paths = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        prev_dir = ""
        for token in BACKTICKED.findall(line.split(" | ")[0]):
            token = token.replace(*CODE_MAP_PREFIX)
            bare = "/" not in token.rstrip("/")
            if bare and prev_dir and not (ROOT / token).exists():
                token = prev_dir + token
            paths.append(token)
            prev_dir = token[: token.rstrip("/").rfind("/") + 1]
    return paths


# ---- the docs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS)
def test_every_file_reference_exists(doc: str) -> None:
    bad = [f"{ref}: {why}" for ref in sorted(set(file_refs(_read(doc)))) if (why := check_file_ref(ref)) is not None]
    assert not bad, f"{doc} names code that does not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS)
def test_every_dotted_reference_exists(doc: str) -> None:
    bad = [
        f"{ref}: {why}"
        for ref in sorted(set(DOTTED_REF.findall(_read(doc))))
        if (why := check_dotted_ref(ref)) is not None
    ]
    assert not bad, f"{doc} names modules or names that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS + ("README.md",))
def test_every_backticked_path_exists(doc: str) -> None:
    bad = sorted({p for p in path_refs(_read(doc)) if not (ROOT / p).exists()})
    assert not bad, f"{doc} names paths that do not exist: {bad}"


def test_readme_code_map_paths_exist() -> None:
    paths = code_map_paths(_read("README.md"))
    assert len(paths) > 20, f"the code map parser found only {paths}"
    bad = [p for p in paths if not (ROOT / p).exists()]
    assert not bad, f"README.md's code map names paths that do not exist: {bad}"


def test_architecture_maps_the_seed_functions() -> None:
    """The seed's flow is mapped: each hop of the loop names where it lives."""
    text = _read("docs/architecture.md")
    refs = set(file_refs(text))
    assert len(refs) > 60, f"only {len(refs)} references found: is the parser broken?"
    for seed in (
        "TokenizerManager.generate_request",
        "Scheduler.event_loop_normal",
        "get_next_batch_to_run",
        "run_batch",
        "process_batch_result",
        "TpModelWorker.forward_batch_generation",
        "ModelRunner.forward",
        "DetokenizerManager.event_loop",
        "handle_batch_token_id_out",
        "RadixCache.match_prefix",
        "PrefillAdder.add_one_req",
        "stream_output",
    ):
        assert f"`{seed}`" in text, f"docs/architecture.md does not map {seed}"
    for ref in (
        "services/scheduler/meshlm/scheduler/managers/scheduler.py:Scheduler.event_loop_normal",
        "services/scheduler/meshlm/scheduler/model_executor/model_runner.py:ModelRunner.forward",
        "services/tokenizer/meshlm/tokenizer/manager.py:TokenizerManager.generate",
    ):
        assert ref in refs


def test_readme_and_ring_point_at_the_architecture() -> None:
    for doc in ("README.md", "docs/ring.md"):
        assert "architecture.md" in _read(doc), f"{doc} does not link docs/architecture.md"


# ---- the checker itself can fail ----------------------------------------------------------------
@pytest.mark.parametrize(
    "ref",
    [
        "services/scheduler/meshlm/scheduler/managers/scheduler.py:Scheduler.no_such_method",
        "services/scheduler/meshlm/scheduler/managers/scheduler.py:NoSuchClass",
        "services/scheduler/meshlm/scheduler/managers/no_such_file.py:Scheduler",
        "services/scheduler/meshlm/scheduler/managers/scheduler.py:Scheduler.run_batch.inner",
    ],
)
def test_a_wrong_file_reference_is_reported(ref: str) -> None:
    assert check_file_ref(ref) is not None


@pytest.mark.parametrize(
    "ref",
    [
        "meshlm.common.finish.NoSuchName",
        "meshlm.no_such_package.X",
        "meshlm.common.finish.FinishReason.no_such_method",
    ],
)
def test_a_wrong_dotted_reference_is_reported(ref: str) -> None:
    assert check_dotted_ref(ref) is not None


def test_methods_nested_and_assigned_names_resolve(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "X: int = 1\nclass A:\n    class B:\n        async def f(self): ...\n    def g(self): ...\n    h = g\n"
    )
    assert resolve(src, ["X"]) is None
    assert resolve(src, ["A", "B", "f"]) is None
    assert resolve(src, ["A", "h"]) is None
    assert resolve(src, ["A", "f"]) is not None
    assert resolve(src, ["A", "g", "x"]) is not None
