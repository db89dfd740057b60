"""The package's import graph has no cycle: every `import` of a longstride module, at module level or
inside a function (an import inside a function hides a cycle from Python, not from the design)."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"longstride": "longstride", "recipes": "longstride.recipes", "model": "longstride.model",
            "data": "longstride.data", "parallel": "longstride.parallel", "eval": "longstride.eval",
            "configs": "longstride.configs"}


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for folder, package in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    out[prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"] = os.path.join(dirpath, f)
    return out


def imports_of(path: str, name: str, known: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in it (`from pkg import module` counts the module)."""
    found = set()
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # a name inside a module: the module itself
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def graph_of() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # a package's __init__ importing its own submodules is how packages work, not a cycle between modules
    return {m: {t for t in imports_of(p, m, known) if not (m.startswith(t + ".") and mods[t].endswith("__init__.py"))}
            for m, p in mods.items()}


def test_the_package_has_no_import_cycle():
    found = cycles(graph_of())
    assert not found, f"import cycles: {found}"


def test_the_check_finds_a_cycle_hidden_in_a_function():
    graph = graph_of()
    graph["longstride.data.files"] = graph["longstride.data.files"] | {"longstride.data.synthetic"}
    assert ["longstride.data.files", "longstride.data.synthetic"] in cycles(graph)
    tree_import = imports_of(os.path.join(ROOT, "eval", "ruler", "compare.py"), "longstride.eval.ruler.compare",
                             set(modules()))
    assert "longstride.eval.ruler.run" in tree_import and "longstride.model.model_dir" in tree_import


if __name__ == "__main__":
    pytest.main([__file__])
