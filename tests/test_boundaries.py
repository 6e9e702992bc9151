"""The data flow's boundaries, by package, read from the sources (not from what one command happened to import).

Each stage is a package; DEPENDS says which packages each may import, at any depth (module level or inside a
function), and HEAVY which third-party runtimes it must never import. The table is a one-way graph (checked), so
no two packages import each other, and `analysis` runs offline: it reaches only the pure and storage halves of
the harness, never torch, mpi4py or the launcher.
"""
from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from tests.conftest import ROOT

HARNESS_BASE = ("harness.common",)
DEPENDS = {
    "harness.common": (),
    "harness.plan": ("harness.common",),
    "harness.store": ("harness.common", "harness.plan"),
    "launcher": ("harness.common", "harness.plan"),
    "harness.models": ("harness.common", "harness.plan"),
    "harness.runtime": ("harness.common", "launcher"),
    "harness.profile": ("harness.common", "harness.plan", "harness.store", "harness.runtime", "harness.models",
                        "launcher"),
    "harness.train": ("harness.common", "harness.plan", "harness.store", "harness.runtime", "harness.models",
                      "harness.profile", "launcher"),
    "harness.commands": ("harness.common", "harness.plan", "harness.store", "harness.runtime", "harness.models",
                         "harness.profile", "harness.train", "launcher"),
    "harness": ("harness.commands",),  # the package's own __init__ and __main__
    "analysis": ("harness.common", "harness.plan", "harness.store"),
}
HEAVY = {"harness.common": ("torch", "mpi4py", "h5py"),
         "harness.plan": ("torch", "mpi4py", "h5py"),
         "harness.store": ("torch", "mpi4py"),
         "launcher": ("torch",),
         "analysis": ("torch", "mpi4py")}
PROJECT = ("harness", "analysis", "launcher")


def _module_file(name: str, root: Path) -> Path | None:
    path = root.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _imports(path: Path, module: str, root: Path = ROOT) -> list[str]:
    """Every module a file imports, at any depth; `from x import y` also yields x.y where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                package = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")
                base = ".".join(package + ([base] if base else []))
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names
                      if _module_file(f"{base}.{alias.name}", root) is not None]
    return found


def package_of(module: str) -> str:
    """The stage package a project module belongs to: the longest DEPENDS key that contains it."""
    return max((p for p in DEPENDS if module == p or module.startswith(p + ".")), key=len)


def _modules(root: Path) -> list[str]:
    return sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                  for package in PROJECT for p in (root / package).rglob("*.py"))


def crossings(root: Path = ROOT) -> tuple[list[str], dict[str, set[str]]]:
    """(imports against DEPENDS or HEAVY, the package graph the sources draw)."""
    violations, graph = [], {p: set() for p in DEPENDS}
    for module in _modules(root):
        own = package_of(module)
        for name in _imports(_module_file(module, root), module, root):
            top = name.split(".")[0]
            if top in HEAVY.get(own, ()):
                violations.append(f"{module} imports {name}")
            if top not in PROJECT:
                continue
            other = package_of(name)
            if other == own:
                continue
            graph[own].add(other)
            if other not in DEPENDS[own]:
                violations.append(f"{module} imports {name} ({own} may use {', '.join(DEPENDS[own]) or 'nothing'})")
    return violations, graph


def test_every_import_follows_the_flow():
    violations, graph = crossings()
    assert not violations, "\n".join(violations)
    assert "harness.store" in graph["analysis"] and "harness.plan" in graph["launcher"]


def test_the_packages_import_one_way():
    list(TopologicalSorter({p: set(d) for p, d in DEPENDS.items()}).static_order())  # raises on a cycle
    _, graph = crossings()
    list(TopologicalSorter(graph).static_order())


def test_every_module_lies_in_a_stage_package():
    """A new module of the harness goes in a stage package, not beside them."""
    loose = [m for m in _modules(ROOT) if package_of(m) == "harness" and m not in ("harness", "harness.__main__")]
    assert not loose, loose


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """The reader finds imports at any depth, so a lazy `import torch` in an analysis function would fail."""
    source = tmp_path / "m.py"
    source.write_text("import json\n\ndef f():\n    if True:\n        from mpi4py import MPI\n")
    assert {"mpi4py", "json"} <= set(_imports(source, "m"))


def test_the_check_flags_planted_imports(tmp_path):
    """A small tree with forbidden imports planted: every one is reported, those inside functions too, a cycle is
    found, and nothing is reported once they are gone."""
    files = {"harness/__init__.py": "",
             "harness/plan/__init__.py": "",
             "harness/plan/events.py": "import json\n\ndef f():\n    import torch\n",
             "harness/store/__init__.py": "",
             "harness/store/report.py": "def show():\n    from analysis.costs import Costs\n",
             "harness/profile/__init__.py": "",
             "harness/profile/run.py": "import torch\nfrom harness.plan import events\n",
             "analysis/__init__.py": "",
             "analysis/costs.py": "from harness.plan import events\n\ndef f():\n    from launcher import topology\n",
             "launcher/__init__.py": "",
             "launcher/topology.py":
                 "from harness.plan.events import json\n\ndef g():\n    import harness.profile.run\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    violations, graph = crossings(tmp_path)
    assert sorted(v.split(" (")[0] for v in violations) == [
        "analysis.costs imports launcher", "analysis.costs imports launcher.topology",
        "harness.plan.events imports torch", "harness.store.report imports analysis.costs",
        "launcher.topology imports harness.profile.run"]
    graph["harness.plan"].add("harness.store")  # store -> plan is drawn nowhere here; plant the cycle by hand
    graph["harness.store"].add("harness.plan")
    try:
        list(TopologicalSorter(graph).static_order())
        raise AssertionError("a cycle went unseen")
    except CycleError:
        pass
    for name, text in {"harness/plan/events.py": "import json\n", "harness/store/report.py": "",
                       "analysis/costs.py": "from harness.plan import events\n",
                       "launcher/topology.py": "from harness.plan.events import json\n"}.items():
        (tmp_path / name).write_text(text)
    assert crossings(tmp_path)[0] == []
