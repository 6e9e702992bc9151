"""The data flow's boundaries, read from the sources (not from what one command happened to import).

`analysis` runs offline: no module under analysis/ imports torch, mpi4py, the launcher or the runtime half of
the harness (profilers, training, models, MPI helpers), neither itself nor through the harness modules it uses.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

FORBIDDEN = ("torch", "mpi4py", "launcher", "harness.profilers", "harness.train", "harness.models",
             "harness.distributed", "harness.profiling", "harness.host_memory", "harness.mpi_errors",
             "harness.commands")
# Function-level imports of the runtime in the harness's pure modules, each used only where the analysis never
# goes (tests/test_analysis_cli.py runs a user model's simulation and checks that torch stays unloaded):
KNOWN_LAZY = {("harness.layers", "harness.models.user")}  # a factory model without its stored description


def _module_file(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import in a file; `from x import y` also yields x.y, which
    is a module where one exists."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")
                base = ".".join(package + ([base] if base else []))
            found.append((base, id(node) in top_level))
            found += [(f"{base}.{alias.name}", id(node) in top_level) for alias in node.names
                      if _module_file(f"{base}.{alias.name}") is not None]
    return found


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_the_analysis_imports_nothing_of_the_runtime():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                     for p in (ROOT / "analysis").rglob("*.py"))
    assert len(modules) > 10
    seen, queue, violations, lazy = set(), [(m, True) for m in modules], [], set()
    while queue:
        module, from_analysis = queue.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        if path is None:
            continue
        for name, top in _imports(path, module):
            if _forbidden(name):
                if from_analysis or top:
                    violations.append(f"{module} imports {name}")
                else:
                    lazy.add((module, name))
            elif name.startswith(("harness", "analysis")):
                # analysis modules: every import counts; harness modules: what loads when they are imported
                if from_analysis or top:
                    queue.append((name, name.startswith("analysis")))
    assert not violations, "\n".join(violations)
    assert lazy <= KNOWN_LAZY, f"new function-level imports of the runtime in pure harness modules: {lazy - KNOWN_LAZY}"
    assert {"harness.spec", "harness.events", "harness.hdf5_io"} <= seen


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """The reader finds imports at any depth, so a lazy `import torch` in an analysis function would fail."""
    source = tmp_path / "m.py"
    source.write_text("import json\n\ndef f():\n    if True:\n        from mpi4py import MPI\n")
    assert ("mpi4py", False) in _imports(source, "m") and ("json", True) in _imports(source, "m")
