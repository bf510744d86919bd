"""Without JAX, optax or transformers (``pip install -e ".[test-core]"``) the suite skips, never fails (issue 35).

A second venv is too costly to build in CI, so this checks the suite statically (``ast``): every
test module that reaches an optional package (:data:`_harness.optional.OPTIONAL`) guards it.

A module *reaches* a package when it, or a file of the suite or an example it uses, imports it
anywhere: at module level or inside a function. "Uses" follows imports of the suite's own
modules (``from _harness import hf_models``, ``import conf_oracle``), string constants that name
one of its files (``HERE / "conf_jax_worker.py"``, a subprocess's script), ``example("name")``
(``examples/name.py``) and the notebook (``notebook.ipynb``'s code cells). A module *guards* a
package with, at module level, ``pytest.importorskip("pkg")`` or ``pytestmark = requires("pkg")``;
or with ``importorskip`` / ``skip_without("pkg")`` inside the function (or as its decorator,
``@requires("pkg")``, ``@pytest.mark.skipif(...)`` naming the package) that imports it (for a
helper function, such as a rank's body: in at least one test of the module); or a ``conftest.py`` above it
that declares ``REQUIRES = ("pkg", ...)`` for its directory. A module that reaches a package only
through another file must guard it at module level or in at least one test (the check cannot
follow calls). Documentation commands that need a package are in ``_harness.optional.DOC_COMMAND_NEEDS``
(tests/integration/test_docs_commands.py skips them).
"""

from __future__ import annotations

import ast
import json
import re
from functools import lru_cache
from pathlib import Path

from _harness.optional import OPTIONAL

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
EXAMPLES = ROOT / "examples"
BENCH = ROOT / "bench"
NOTEBOOK = EXAMPLES / "notebook.ipynb"
# A package whose install brings another (its requirement): guarding it guards both.
IMPLIES = {"transformers": {"safetensors"}, "optax": {"jax"}}
# Calls that load a script as a module: example("train_lm") (tests/_harness/_examples.py), _bench("simulate").
LOADERS = {"example": EXAMPLES, "_bench": BENCH}


def _top(name: str) -> str:
    return name.split(".")[0]


def _module_index() -> dict[str, Path]:
    """Dotted names of the suite's files: relative to tests/ and to each file's own directory."""
    index: dict[str, Path] = {}
    for path in TESTS.rglob("*.py"):
        rel = path.relative_to(TESTS).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        index.setdefault(".".join(parts), path)
    return index


INDEX = _module_index()
BY_NAME = {p.name: p for p in TESTS.rglob("*.py") if p.name not in ("conftest.py", "__init__.py")}


def _resolve(name: str, importer: Path) -> Path | None:
    """The suite's file that ``import name`` means in ``importer`` (its directory first), or None."""
    here = importer.parent.relative_to(TESTS).parts
    for i in range(len(here), -1, -1):
        key = ".".join((*here[:i], name)) if name else ".".join(here[:i])
        if key in INDEX:
            return INDEX[key]
    return None


def _imported_names(node: ast.AST, importer: Path) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:  # relative: within importer's package
        base = importer.parent
        for _ in range(node.level - 1):
            base = base.parent
        prefix = ".".join(base.relative_to(TESTS).parts)
        mod = ".".join(filter(None, [prefix, node.module or ""]))
        return [f"{mod}.{a.name}" for a in node.names] + [mod]
    return [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]


def _notebook_imports() -> set[str]:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    src = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return {_top(m) for m in re.findall(r"^\s*(?:import|from)\s+([\w.]+)", src, flags=re.M)}


@lru_cache(maxsize=None)
def _direct(path: Path) -> tuple[frozenset[str], frozenset[Path]]:
    """(optional packages ``path`` imports anywhere, files of the suite or examples it uses)."""
    if path == NOTEBOOK:
        return frozenset(_notebook_imports() & set(OPTIONAL)), frozenset()
    tree = ast.parse(path.read_text(), filename=str(path))
    pkgs, uses = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in _imported_names(node, path):
                if not getattr(node, "level", 0) and _top(name) in OPTIONAL:
                    pkgs.add(_top(name))
                if path.is_relative_to(TESTS):
                    hit = INDEX.get(name) if getattr(node, "level", 0) else _resolve(name, path)
                    if hit is not None and hit != path:
                        uses.add(hit)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            base = node.value.rsplit("/", 1)[-1]
            if base in BY_NAME and BY_NAME[base] != path:
                uses.add(BY_NAME[base])
            elif base == NOTEBOOK.name:
                uses.add(NOTEBOOK)
            elif base.endswith(".py") and (EXAMPLES / base).is_file() and "examples/" in node.value:
                uses.add(EXAMPLES / base)
            elif base.endswith(".py") and (BENCH / base).is_file() and "bench/" in node.value:
                uses.add(BENCH / base)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in LOADERS
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            uses.add(LOADERS[node.func.id] / f"{node.args[0].value}.py")
    return frozenset(pkgs), frozenset(uses)


def reaches(path: Path) -> set[str]:
    """Every optional package ``path`` reaches through the files it uses."""
    seen, todo, out = {path}, [path], set()
    while todo:
        pkgs, uses = _direct(todo.pop())
        out |= pkgs
        for u in uses - seen:
            seen.add(u)
            todo.append(u)
    return out


def _guard_names(node: ast.AST) -> set[str]:
    """Optional packages that ``node`` (a call, a mark or a decorator) guards."""
    text = ast.unparse(node)
    if not re.search(r"\b(importorskip|requires|skip_without|skipif)\b", text):
        return set()
    found = set(re.findall(r"""["']([\w.]+)["']""", text)) | set(re.findall(r"\b(\w+)\b", text))
    out = {_top(f) for f in found} & set(OPTIONAL)
    return out.union(*(IMPLIES.get(p, ()) for p in out))


def _module_guards(tree: ast.Module) -> set[str]:
    out = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign)):
            out |= _guard_names(stmt)
    return out


def _function_guards(func: ast.AST) -> set[str]:
    out = set()
    for dec in getattr(func, "decorator_list", []):
        out |= _guard_names(dec)
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and re.search(
            r"\b(importorskip|requires|skip_without)\b", ast.unparse(node.func)
        ):
            out |= _guard_names(node)
    return out


def _directory_guards(path: Path) -> set[str]:
    out = set()
    for parent in path.parents:
        conftest = parent / "conftest.py"
        if conftest.exists():
            for stmt in ast.parse(conftest.read_text()).body:
                if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "REQUIRES" for t in stmt.targets):
                    out |= set(ast.literal_eval(stmt.value)) & set(OPTIONAL)
        if parent == TESTS:
            break
    return out


def problems(path: Path) -> list[str]:
    """Why ``path`` (a test module) could fail rather than skip without an optional package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_guards(tree) | _directory_guards(path)
    some_function = set()
    out = []
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for f in funcs:
        some_function |= _function_guards(f)
    # Direct imports: guarded at module level, or in the function (or class) that holds them.
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(node, "level", 0):
            continue
        for pkg in {_top(n) for n in _imported_names(node, path)} & set(OPTIONAL):
            guards, p, in_test = set(module), parents.get(node), False
            while p is not None:
                if isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    guards |= _function_guards(p)
                    in_test = in_test or p.name.startswith(("test", "Test"))
                p = parents.get(p)
            if not in_test:  # a helper (a rank's body): the tests that call it hold the guard
                guards |= some_function
            if pkg not in guards:
                out.append(
                    f"line {node.lineno}: imports {pkg} without pytest.importorskip({pkg!r}) or "
                    f"requires({pkg!r}) before it (module level, or in that function)"
                )
    # Through other files: guarded at module level, or by at least one test.
    direct = _direct(path)[0]
    for pkg in sorted(reaches(path) - direct - module - some_function):
        via = sorted(str(u.relative_to(ROOT)) for u in _direct(path)[1] if pkg in reaches(u))
        out.append(
            f"reaches {pkg} through {', '.join(via)} without a guard (pytestmark = requires({pkg!r}), "
            f"or @requires({pkg!r}) on the tests that need it)"
        )
    return out


def test_every_test_module_that_needs_an_optional_package_skips_without_it():
    bad = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__).resolve():  # its strings name the files it checks
            continue
        found = problems(path)
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, "modules that would fail instead of skipping under .[test-core]:\n" + "\n".join(
        f"  {p}: {msg}" for p, msgs in bad.items() for msg in msgs
    )


def test_the_check_sees_each_kind_of_use_and_guard(tmp_path, monkeypatch):
    """The scanner on known cases: an unguarded import is found at any depth; each guard form clears it."""
    cases = {
        "import jax\n": ["line 1: imports jax"],
        "def test():\n    import transformers\n": ["line 2: imports transformers"],
        "import pytest\npytest.importorskip('jax')\nimport jax\n": [],
        "from _harness.optional import requires\npytestmark = requires('optax')\nimport optax\n": [],
        "import pytest\ndef test():\n    pytest.importorskip('transformers')\n    import transformers\n": [],
        "from _harness.optional import requires\n@requires('safetensors')\ndef test():\n    import safetensors\n": [],
        "def test():\n    import numpy\n": [],
        "import pytest\npytest.importorskip('transformers')\ndef test():\n    import safetensors\n": [],
    }
    for i, (src, want) in enumerate(cases.items()):
        f = TESTS / "integration" / f"test_x{i}.py"  # problems() reads the directory's conftests
        monkeypatch.setattr(
            Path, "read_text", lambda self, _src=src, _f=f, _read=Path.read_text: _src if self == _f else _read(self)
        )
        got = problems(f)
        assert [g[: len(w)] for g, w in zip(got, want)] == want and len(got) == len(want), (src, got)
    # Reached through the suite's own files, not imported: hf_models imports transformers in functions.
    assert "transformers" in reaches(TESTS / "parallel" / "test_parallel_module.py")
    assert "jax" in reaches(TESTS / "conformance" / "conf_oracle.py")  # its subprocess: conf_jax_worker.py
    assert "transformers" in reaches(TESTS / "integration" / "test_notebook.py")  # the notebook's GPT-2 cells
    assert {"jax", "optax"} <= _directory_guards(TESTS / "conformance" / "test_conformance_lax.py")
