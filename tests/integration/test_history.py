"""The code states rules; measurements and their history live in bench/README.md and docs/.

Two checks keep it so (issue 30, item 7):

- ``bench/results/`` holds data only: no ``*.py`` or ``*.sh``. A timing worth rerunning is a
  bench script (``bench/``, with a docstring and argparse); a one-off is described where its
  figures are reported, with the commit that had it.
- No docstring or comment in ``fshard/`` carries a measurement's history: a date, a
  before/after ("was 119.3"), a figure of MiB or of milliseconds or microseconds, "Nx
  faster". A docstring may say why a choice was made and point to the measurement
  ("bench/README.md, 'Host costs behind the code'"). Defaults and fixed sizes (``default 25
  MiB``) are rules, not measurements, and do not match. Every module is checked,
  ``fshard/plan/`` included (its calibration's figures are in docs/plan.md, "Figures behind
  the planner's rules").
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FSHARD = ROOT / "fshard"

# Each pattern, with what it catches. Measurement history, not rules: a default or a fixed
# size is not matched ("default 25 MiB", "5 GiB per file"), nor a rate of a cost model's
# constants ("10 GB/s"), nor a count of things.
HISTORY = {
    r"\b20\d\d-\d\d-\d\d\b": "a date",
    r"\bwas ~?\d": "a before/after figure ('was 119.3')",
    r"(?<!default )(?<![\w.])~?\d+(\.\d+)? ?(MiB|GiB|MB|GB)\b(?!/| per file)": "a memory figure (not a rate)",
    r"(?<![\w.])~?\d+(\.\d+)? ?(ms|us)\b": "a time figure",
    r"\d(\.\d+)?x (cheaper|faster|slower)\b": "a speed-up",
    r"\bmeasured\b[^.]*\d": "a measured figure",
    r"\b(before|after) this (change|session|commit)\b|\bthis session\b": "narration of a change",
    r"\buntil 20\d\d\b|\(issue \d+": "an issue's or a day's history",
}
# Lines that match a pattern but state a rule, with the reason.
ALLOWED = {
    ("fshard/runtime/teardown.py", "wakes every 10 ms"): "gloo's transport thread's poll period: why idle "
    "groups cost CPU, a property of gloo",
    ("fshard/testing.py", "10 ms for as long as it lives"): "the same poll period of gloo",
}

def _texts(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every docstring line in ``path``."""
    src = path.read_text()
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                out += [(doc.lineno + i, line) for i, line in enumerate(doc.value.value.splitlines())]
    return out


def _history(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        for line, text in _texts(path):
            for pattern, what in HISTORY.items():
                if re.search(pattern, text) and not any(f == rel and s in text for f, s in ALLOWED):
                    found.append(f"{rel}:{line}: {what}: {text.strip()}")
    return found


def _checked() -> list[Path]:
    return sorted(FSHARD.rglob("*.py"))


def test_bench_results_hold_data_only():
    scripts = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "bench" / "results").rglob("*") if p.suffix in (".py", ".sh")
    )
    assert not scripts, (
        f"bench/results/ keeps data only; move a reusable script to bench/ (docstring, "
        f"argparse) or tools/, or delete a one-off and say in its README which commit had it: "
        f"{scripts}"
    )


def test_no_measurement_history_in_fshard_docstrings_or_comments():
    found = _history(_checked())
    assert not found, (
        "measurement history in fshard/'s docstrings or comments: move the figure to "
        "bench/README.md or docs/ (with its date and conditions) and leave the rule, or a pointer, "
        "in the code:\n" + "\n".join(found)
    )


def test_allowed_lines_still_exist():
    texts = {rel: " ".join(t for _, t in _texts(ROOT / rel)) for rel, _ in ALLOWED}
    for rel, snippet in ALLOWED:
        assert snippet in texts[rel], f"ALLOWED names {snippet!r} in {rel}, which no longer has it: drop the entry"


@pytest.mark.parametrize(
    "text, matches",
    [
        ("was 119.3 before the fix", True),
        ("measured 5.8 ms vs 0.35 ms", True),
        ("(2026-11-27 05:12 UTC)", True),
        ("12 MiB of the bench model's 13.2 MiB", True),
        ("about 2.5x cheaper", True),
        ("(issue 36, row 12)", True),
        ("all-reduce up to this size (default 25 MiB, as DDP)", False),
        ("bytes per file before starting the next (default 5 GiB)", False),
        ("a page fault per 4 KiB page on first write", False),
        ("Roughly one CPU core: 100 GFLOP/s, 10 GB/s.", False),
        ("timeout_s: limit for the whole call (default 300 s)", False),
        ("what was accumulated to its own gradient", False),
    ],
)
def test_patterns_catch_history_not_rules(text, matches):
    assert any(re.search(p, text) for p in HISTORY) == matches, text


def test_checked_mode_bench_runs():
    # bench/checked_mode.py replaced a results-folder script (checked_mode_2026-11-28): keep it running.
    import runpy

    mod = runpy.run_path(str(ROOT / "bench" / "checked_mode.py"))
    q = mod["main"](["--layers", "2", "--dim", "8", "--batch", "4", "--steps", "3"])
    assert set(q) == {True, False} and all(t > 0 for t in q.values())
