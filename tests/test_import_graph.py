"""The package's import graph: no cycle, and capture/ is a leaf (nothing from analysis/,
integrations/, report/). Every import counts, including those inside functions: a lazy import
is still a dependency."""
from __future__ import annotations

import ast
import os

from conftest import ROOT

PKG = os.path.join(ROOT, "msmemscope")


def _modules():
    mods = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                if rel.endswith(".__init__"):
                    rel = rel[: -len(".__init__")]
                mods[rel] = path
    return mods


def _resolve(mod, is_pkg, level, name):
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph():
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node.level, node.module) if node.level else (node.module or "")
                # ``from . import x`` names a submodule when one exists
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != mod:
                    deps.add(n)
        graph[mod] = deps
    return graph


def _cycles(graph):
    """Cycles of the graph without the edges from a package to its own submodules: importing
    ``msmemscope.x.y`` always runs ``msmemscope/x/__init__`` first, so a package loading its
    contents (``capture.create`` loading ``capture.session``) is containment, not a dependency;
    every other edge counts."""
    edges = {n: sorted(m for m in deps if not m.startswith(n + ".")) for n, deps in graph.items()}
    seen, stack, on, found = set(), [], set(), []

    def visit(n):
        seen.add(n)
        stack.append(n)
        on.add(n)
        for m in edges.get(n, ()):
            if m in on:
                found.append(stack[stack.index(m):] + [m])
            elif m not in seen:
                visit(m)
        stack.pop()
        on.discard(n)

    for n in sorted(edges):
        if n not in seen:
            visit(n)
    return found


def test_no_import_cycle():
    found = {tuple(sorted(set(c))) for c in _cycles(import_graph())}
    assert not found, "\n".join(" -> ".join(c) for c in sorted(found))


def test_capture_is_a_leaf():
    bad = []
    for mod, deps in import_graph().items():
        if mod == "msmemscope.capture" or mod.startswith("msmemscope.capture."):
            for d in deps:
                if d.split(".")[1:2] and d.split(".")[1] in ("analysis", "integrations", "report", "watcher",
                                                             "describe", "cli"):
                    bad.append(f"{mod} imports {d}")
    assert not bad, "\n".join(sorted(bad))


def test_the_checker_finds_cycles():
    # the checker itself: a known import is found and a made-up cycle is reported
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert _cycles({"p": {"p.x"}, "p.x": {"p"}}) == []
    g = import_graph()
    assert "msmemscope.events" in g["msmemscope.capture.session"]
    assert "msmemscope.io.writers" in g["msmemscope.capture.session"]
