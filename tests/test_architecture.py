"""The layout of the code (docs/architecture.md): data flows one way through the stages, a stage
never imports a later one, and no dtcp module is imported inside a function to dodge a cycle."""

from __future__ import annotations

import ast
import os

import dtcp

ROOT = os.path.dirname(os.path.abspath(dtcp.__file__))
# stage of each top-level module or folder; modules may import their own stage and earlier ones
STAGES = {
    "_compat": 0, "_groups": 0, "config": 0, "errors": 0,
    "layouts": 1, "plan": 2, "comm": 3, "kernels": 3, "exec": 4, "ops": 5,
    "api": 6, "frontends": 6, "integrations": 7, "__init__": 8,
}


def _modules():
    for folder, _, files in os.walk(ROOT):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT).replace(os.sep, "/"), ast.parse(open(path).read())


def _dtcp_targets(rel: str, node: ast.ImportFrom) -> list[str]:
    """The top-level dtcp stages a relative import names."""
    if not node.level:
        return []
    here = rel.split("/")[:-1]  # the package of the importing module, relative to dtcp
    base = here[: len(here) - (node.level - 1)]
    parts = base + (node.module.split(".") if node.module else [])
    if parts:
        return [parts[0]]
    return [alias.name for alias in node.names]  # "from . import x" at dtcp's top


def test_every_module_belongs_to_a_stage():
    tops = {rel.split("/")[0].removesuffix(".py") for rel, _ in _modules()}
    assert tops <= set(STAGES), tops - set(STAGES)


def test_no_stage_imports_a_later_one():
    bad = []
    for rel, tree in _modules():
        me = STAGES[rel.split("/")[0].removesuffix(".py")]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for target in _dtcp_targets(rel, node):
                    if target in STAGES and STAGES[target] > me:
                        bad.append(f"{rel} imports {target}")
    assert not bad, bad


def test_no_late_imports_of_dtcp_modules():
    """Imports of dtcp's own modules sit at the top of each module (function-level imports of
    optional third-party packages, in _compat and the integrations, are another matter)."""
    bad = []
    for rel, tree in _modules():
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("dtcp")):
                    bad.append(f"{rel}:{node.lineno} in {func.name}")
    assert not bad, bad


def test_private_torch_apis_only_in_compat():
    """Every private torch API dtcp touches lives in _compat.py (torch._X, torch.ops.aten, c10d's
    internals, the functional collectives, symmetric memory)."""
    needles = ("torch._", "torch.ops.aten", "distributed_c10d", "_functional_collectives", "_symmetric_memory")
    bad = []
    for rel, tree in _modules():
        if rel == "_compat.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                text = ast.unparse(node)
                if any(text.startswith(n) for n in needles):
                    bad.append(f"{rel}:{node.lineno} {text}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                text = ast.unparse(node)
                if any(n in text for n in needles[2:]):
                    bad.append(f"{rel}:{node.lineno} {text}")
    assert not bad, bad
