"""fshard's import graph, computed from the source (every ``import``, module level or inside a
function): no new import cycle and no new import of ``fshard.parallel`` from ``fshard.optim``
(DESIGN.md's layer rules). The cycles and the optim -> parallel import that exist today are
listed as known debts that issue 30 removes; the test fails when a new one appears and when a
listed one is gone (so the list only shrinks)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "fshard"

KNOWN_CYCLES = {
    frozenset({"fshard.sched._text", "fshard.sched.ir"}),  # tolerated by DESIGN.md
}
KNOWN_OPTIM_TO_PARALLEL: set[tuple[str, str]] = set()  # parallel registers its checks with optim instead


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for a in node.names:  # `from pkg import mod` imports the module, else the package
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.add(frozenset(comp))
    return out


def test_no_new_import_cycle():
    cycles = _cycles(_graph())
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not new, f"new import cycle(s): {new}; import lazily or move the shared code down a layer"
    assert not gone, f"known cycle(s) gone, remove them from KNOWN_CYCLES: {gone}"


def test_optim_imports_no_parallel():
    graph = _graph()
    found = {(m, t) for m, ts in graph.items() if m.startswith("fshard.optim") for t in ts
             if t.startswith("fshard.parallel")}
    assert found <= KNOWN_OPTIM_TO_PARALLEL, f"optim must not import parallel: {sorted(found - KNOWN_OPTIM_TO_PARALLEL)}"
    assert found == KNOWN_OPTIM_TO_PARALLEL, f"gone, remove from the known list: {sorted(KNOWN_OPTIM_TO_PARALLEL - found)}"


def test_the_cycle_finder_finds_a_cycle_and_ignores_a_chain():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}
    assert _cycles({"a": {"b"}, "b": set()}) == set()


def test_no_module_reaches_into_another_through_sys_modules():
    """DESIGN.md: group owners register with fshard.runtime.teardown instead."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in PKG.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if "sys.modules" in line]
    assert not found, found


def test_every_group_owner_registers_with_the_runtime():
    import fshard  # noqa: F401 - imports every owner
    from fshard.runtime import teardown

    names = {o.name for o in teardown.group_owners()}
    assert {"fshard.mesh", "fshard.comm", "fshard.checkpoint", "fshard.mesh.host_meshes"} <= names, names
    assert not [m for m in _graph()["fshard.runtime.teardown"] if m.startswith("fshard")]


def test_nothing_imports_the_examples_or_puts_them_on_sys_path():
    """Issue 30: the main job is a library call; tests and bench load an example from its file
    (tests/_harness/_examples.py, bench/_examples.py), never as a module on sys.path."""
    found = []
    for folder in ("fshard", "tests", "bench", "tools"):
        for p in (ROOT / folder).rglob("*.py"):
            if "results" in p.parts or p == Path(__file__).resolve():  # bench/results: old one-off scripts
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if ("sys.path" in line and "examples" in line) or line.strip().startswith(("import train_lm",
                                                                                          "from train_lm")):
                    found.append(f"{p.relative_to(ROOT)}:{i}")
    assert not found, found
