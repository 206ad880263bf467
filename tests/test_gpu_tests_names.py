"""The GPU tests (tests/gpu, skipped here) reach into dtcp's and the benchmarks' modules by name.
Every dotted name they take from a module they import (`import bench_split as B` ... `B.Timer.x`,
`from dtcp.exec import merge as M` ... `M.merge_into_`) must exist, so that a rename on CPU
cannot break a test that only the GPU machines run: the thirteenth session moved
`bench_split.Timer._cycles_per_ms` to `bench_split.sleep_cycles_per_ms`, and six GPU cases failed
with AttributeError until the next GPU run."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_TESTS = sorted(os.path.join(HERE, "gpu", f) for f in os.listdir(os.path.join(HERE, "gpu")) if f.endswith(".py"))


def _aliases(tree: ast.AST) -> dict:
    """{alias: module name} of every `import m as a` and `from p import m as a` that names a module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if importlib.util.find_spec(node.module) is not None and _is_module(full):
                    out[a.asname or a.name] = full
    return out


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _chains(tree: ast.AST, aliases: dict):
    """(alias, (attr, attr, ...), line) of every attribute chain rooted at a module alias."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in aliases:
                yield cur.id, tuple(reversed(parts)), node.lineno


@pytest.mark.parametrize("path", GPU_TESTS, ids=os.path.basename)
def test_gpu_tests_take_names_that_exist(path, monkeypatch):
    for folder in (os.path.join(os.path.dirname(HERE), "benchmarks"), HERE):
        monkeypatch.syspath_prepend(folder)
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):  # (so that _chains sees only the longest chains)
        for child in ast.iter_child_nodes(node):
            child.parent = node
    aliases = _aliases(tree)
    missing, checked = [], 0
    for alias, parts, line in _chains(tree, aliases):
        if aliases[alias] in ("torch", "pytest", "dist", "os", "sys", "random", "math"):
            continue  # (third-party and standard modules: their own business)
        obj = importlib.import_module(aliases[alias])
        for i, part in enumerate(parts):
            if not hasattr(obj, part):
                missing.append(f"{os.path.basename(path)}:{line} {aliases[alias]}.{'.'.join(parts[:i + 1])}")
                break
            obj = getattr(obj, part)
            if not (isinstance(obj, type) or type(obj).__name__ == "module"):
                break  # (an instance or a function: what it returns is not checked)
        checked += 1
    assert not missing, missing
    assert checked > 0 or "bench_split" not in open(path).read()
