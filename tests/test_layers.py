"""The layering holds: import-linter checks the contracts written in setup.cfg, and no module of cuvil sits on
an import cycle.

Both read every import statement in src/cuvil, those inside functions included, so a cycle or an upward
import cannot hide in a function body.
"""
import os
import subprocess
import sys

import grimp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")

# Cycles that another part of issue 18 is breaking, as the imports that close them ("importer -> imported").
# Each must still close a cycle (a stale entry fails, so the list only shrinks); the lead deletes them at merge.
KNOWN_CYCLE_IMPORTS: set = set()   # none left after the backend and target parts


def test_import_linter_contracts_hold():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()", "--no-cache", "--no-logo", os.path.join(ROOT, "setup.cfg")],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        pytest.fail("import-linter: a layering contract in setup.cfg is broken\n" + run.stdout + run.stderr,
                    pytrace=False)


def _graph() -> grimp.ImportGraph:
    sys.path.insert(0, SRC)   # grimp finds the package through sys.path: this tree's sources, not an install
    try:
        return grimp.build_graph("cuvil", cache_dir=None)
    finally:
        sys.path.remove(SRC)


def _cycles(imports):
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(imports):
        if start in index:
            continue
        work = [(start, iter(sorted(imports[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(imports[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or v in imports[v]:
                    found.append(sorted(component))
    return found


def _one_cycle(imports, component):
    """A shortest path from the component's first module back to itself, inside the component."""
    first, members = component[0], set(component)
    parent, frontier = {}, [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(imports[v]):
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        if first in parent:
            break
        frontier = nxt
    path = [first]
    while True:
        path.append(parent[path[-1]])
        if path[-1] == first:
            return path[::-1]


def _describe(graph, path):
    lines = []
    for importer, imported in zip(path, path[1:]):
        details = graph.get_import_details(importer=importer, imported=imported)
        where = ", ".join(f"line {d['line_number']}: {d['line_contents']}" for d in details)
        lines.append(f"  {importer} -> {imported}   ({where})")
    return "\n".join(lines)


def test_no_import_cycle():
    graph = _graph()
    known = [e.split(" -> ") for e in sorted(KNOWN_CYCLE_IMPORTS)]
    stale = [f"{a} -> {b}" for a, b in known
             if not graph.direct_import_exists(importer=a, imported=b) or graph.find_shortest_chain(b, a) is None]
    assert not stale, f"no longer an import on a cycle, delete from KNOWN_CYCLE_IMPORTS: {stale}"
    for importer, imported in known:
        graph.remove_import(importer=importer, imported=imported)
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    cycles = _cycles(imports)
    report = "\n\n".join(f"cycle through {', '.join(c)}:\n" + _describe(graph, _one_cycle(imports, c)) for c in cycles)
    assert not cycles, "import cycles among cuvil's modules (break each; imports belong at file tops):\n" + report


def test_cycle_finder_reports_a_cycle():
    """The checker itself: a two-module cycle and a self-import are found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _one_cycle({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}}, ["a", "b", "c"]) == ["a", "b", "a"]
