"""The data flow's boundaries, read from the sources (not from what one command happened to import).

Rules, each checked at any depth (module level or inside a function) in the package's own modules, and at
module level in the project modules it imports, followed on:
- `analysis` runs offline: it never imports torch, mpi4py, the launcher or the runtime half of the harness
  (profilers, training, models, MPI helpers, commands);
- `harness` never imports `analysis` (the data flows harness -> analysis);
- `launcher` uses harness's events and other pure harness modules, never the runtime half nor `analysis`.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

HARNESS_RUNTIME = ("harness.profilers", "harness.train", "harness.models", "harness.distributed", "harness.profiling",
                   "harness.host_memory", "harness.mpi_errors", "harness.commands")
FORBIDDEN = {"analysis": ("torch", "mpi4py", "launcher", *HARNESS_RUNTIME),
             "harness": ("analysis",),
             "launcher": ("analysis", *HARNESS_RUNTIME)}
PROJECT_PACKAGES = ("harness", "analysis", "launcher")
# Function-level imports of the runtime in the harness's pure modules, each used only where the analysis never
# goes (tests/test_analysis_cli.py runs a user model's simulation and checks that torch stays unloaded):
KNOWN_LAZY = {("harness.layers", "harness.models.user")}  # a factory model without its stored description


def _module_file(name: str, root: Path) -> Path | None:
    path = root.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path, module: str, root: Path = ROOT) -> list[tuple[str, bool]]:
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
                      if _module_file(f"{base}.{alias.name}", root) is not None]
    return found


def _matches(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _package_modules(package: str, root: Path) -> list[str]:
    return sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                  for p in (root / package).rglob("*.py"))


def crossings(package: str, root: Path = ROOT) -> tuple[list[str], set[tuple[str, str]], set[str]]:
    """What `package` imports against its rule (FORBIDDEN): (violations, lazy, modules seen). Every import of the
    package's own modules counts; of the project modules they import, what loads with them (module level), and a
    forbidden import inside one of their functions is `lazy` (module, name) instead."""
    forbidden = FORBIDDEN[package]
    seen, violations, lazy = set(), [], set()
    queue = [(m, True) for m in _package_modules(package, root)]
    while queue:
        module, own = queue.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module, root)
        if path is None:
            continue
        for name, top in _imports(path, module, root):
            if _matches(name, forbidden):
                if own or top:
                    violations.append(f"{module} imports {name}")
                else:
                    lazy.add((module, name))
            elif _matches(name, PROJECT_PACKAGES) and (own or top):
                queue.append((name, _matches(name, (package,))))
    return violations, lazy, seen


def test_the_analysis_imports_nothing_of_the_runtime():
    violations, lazy, seen = crossings("analysis")
    assert not violations, "\n".join(violations)
    assert lazy <= KNOWN_LAZY, f"new function-level imports of the runtime in pure harness modules: {lazy - KNOWN_LAZY}"
    assert len([m for m in seen if m.startswith("analysis.")]) > 10
    assert {"harness.spec", "harness.events", "harness.hdf5_io", "harness.profile_reader"} <= seen


def test_the_harness_never_imports_the_analysis():
    violations, lazy, seen = crossings("harness")
    assert not violations, "\n".join(violations)
    assert not lazy
    assert {"harness.commands.show", "harness.commands.collectives", "harness.profilers.compute"} <= seen


def test_the_launcher_uses_only_pure_harness_modules():
    violations, lazy, seen = crossings("launcher")
    assert not violations, "\n".join(violations)
    assert lazy <= KNOWN_LAZY, f"new function-level imports of the runtime in pure harness modules: {lazy - KNOWN_LAZY}"
    assert {"launcher.placement", "launcher.topology", "harness.events"} <= seen


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """The reader finds imports at any depth, so a lazy `import torch` in an analysis function would fail."""
    source = tmp_path / "m.py"
    source.write_text("import json\n\ndef f():\n    if True:\n        from mpi4py import MPI\n")
    assert ("mpi4py", False) in _imports(source, "m") and ("json", True) in _imports(source, "m")


def test_the_check_flags_planted_imports(tmp_path):
    """A small copy of the three packages with forbidden imports planted in each: every one is reported, those
    inside functions too, and nothing once they are gone."""
    files = {"harness/__init__.py": "",
             "harness/events.py": "import json\n",
             "harness/report.py": "def show():\n    from analysis.costs import Costs\n",
             "harness/profiling.py": "import torch\n",
             "analysis/__init__.py": "",
             "analysis/costs.py": "from harness import events\n\ndef f():\n    from launcher import topology\n",
             "launcher/__init__.py": "",
             "launcher/topology.py": "from harness.events import json\n\ndef g():\n    import harness.profiling\n",
             "launcher/placement.py": "from analysis import costs\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert crossings("harness", tmp_path)[0] == ["harness.report imports analysis.costs"]
    assert sorted(crossings("analysis", tmp_path)[0]) == ["analysis.costs imports launcher",
                                                          "analysis.costs imports launcher.topology"]
    assert sorted(crossings("launcher", tmp_path)[0]) == ["launcher.placement imports analysis",
                                                          "launcher.placement imports analysis.costs",
                                                          "launcher.topology imports harness.profiling"]
    (tmp_path / "harness/report.py").write_text("def show():\n    return 0\n")
    assert crossings("harness", tmp_path) == ([], set(), {"harness", "harness.events", "harness.report",
                                                          "harness.profiling"})
