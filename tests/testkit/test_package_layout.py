"""The package's shape: the testkit knows no kernel, its public surface is what the README names, its modules
import without cycles, and our kernels reach the suite through the entry-point group like anyone's."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import sparse_mqa_testkit

SRC = Path(sparse_mqa_testkit.__file__).parent
KERNELS = "sparse_mqa_kernels"


def _modules(package) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
            if not m.name.endswith("__main__")]


def test_the_testkit_imports_no_kernel():
    """Every testkit module imported, and the suite run on reference, in a fresh interpreter: the kernels'
    package never enters sys.modules."""
    code = f"""
import importlib, json, pkgutil, sys
import sparse_mqa_testkit as t
for m in pkgutil.walk_packages(t.__path__, "sparse_mqa_testkit."):
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
from sparse_mqa_testkit import Case, check_backward_tolerance, get_backend
check_backward_tolerance(get_backend("reference"), Case()).raise_if_failed()
print(json.dumps(sorted(k for k in sys.modules if k.startswith("{KERNELS}"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_no_testkit_source_names_the_kernels():
    named = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if KERNELS in p.read_text()]
    # the contract's docstring says who imports it; nothing imports or loads the kernels by name
    assert named == ["contract.py"], named
    for p in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.startswith(KERNELS) for n in names), f"{p} imports {names}"


def test_our_kernels_come_in_through_the_entry_point_group():
    from sparse_mqa_testkit.backends import ENTRY_POINT_GROUP, available_backends

    ours = ("tilelang", "tilelang-model", "cudnn")
    eps = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name in ours}
    if not eps:
        pytest.skip("the distribution is not installed (its entry points are not registered)")
    assert set(ours) == set(eps)  # other packages may register their own backends beside ours
    assert all(v.startswith(KERNELS + ".") for v in eps.values())
    assert {"reference", "tilelang", "tilelang-model", "cudnn"} <= set(available_backends())


def test_the_public_surface_is_what_the_readme_names():
    for name in ("Case", "backend_cases", "cases_for", "CHECKS", "CheckResult", "CheckFailure",
                 "check_backward_tolerance", "check_forward_tolerance", "check_determinism", "check_rejection",
                 "check_guards", "Backend", "BackendBase", "MissingDependency", "get_backend", "forward",
                 "backward"):
        assert name in sparse_mqa_testkit.__all__, name
        assert getattr(sparse_mqa_testkit, name) is not None
    from sparse_mqa_testkit import checks

    assert "poison_allocator" not in checks.__all__ and "FLOORS" not in checks.__all__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        sparse_mqa_testkit.nothing  # noqa: B018


def _imports_of(module: str) -> set[str]:
    """The package-internal modules ``module`` imports, at its top level or inside a function (what an import
    cycle is made of)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text())
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if importlib.util.find_spec(base) and _is_module(full) else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith(("sparse_mqa_testkit", KERNELS))}


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.parametrize("package", ["sparse_mqa_testkit", KERNELS])
def test_no_import_cycles(package):
    pkg = importlib.import_module(package)
    graph = {m: _imports_of(m) for m in _modules(pkg)}
    graph[package] = _imports_of(package)

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(m for m in graph if m in reach(m) and m != package)
    assert not cycles, f"modules in an import cycle: {cycles}"


def test_private_hypothesis_apis_only_in_the_compat_module():
    compat = SRC / "harness" / "hypothesis_compat.py"
    for p in SRC.rglob("*.py"):
        if p == compat:
            continue
        text = p.read_text()
        for private in ("hypothesis.internal", "hypothesis.extra._patching", "_hypothesis_internal_", "._wrapped"):
            assert private not in text, f"{p.relative_to(SRC)} uses {private}: only harness/hypothesis_compat.py may"


def test_the_plugin_is_small_and_the_root_holds_only_the_core():
    assert len((SRC / "plugin.py").read_text().splitlines()) < 300
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert root == ["__init__.py", "__main__.py", "calls.py", "contract.py", "convert.py", "lazy.py", "plugin.py"]


# each folder of the testkit imports only from its own layer and those below it
LAYERS = {"contract": 0, "calls": 0, "convert": 0, "lazy": 0, "oracle": 0, "backends": 0, "paddle": 1, "cases": 1,
          "compare": 2, "checks": 3, "harness": 4, "plugin": 4, "property_tests": 5, "tools": 5, "__main__": 6}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else -1  # the package itself: its lazy exports point anywhere


def test_each_layer_imports_only_from_below():
    pkg = importlib.import_module("sparse_mqa_testkit")
    upward = sorted(f"{m} -> {dep}" for m in _modules(pkg) for dep in _imports_of(m)
                    if dep.startswith("sparse_mqa_testkit.") and _layer(dep) > _layer(m))
    assert not upward, f"imports from a higher layer: {upward}"
