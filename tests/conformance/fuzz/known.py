"""Known fshard bugs the fuzzer finds on main, each a small predicate over (program, verdict).

The CI test (``tests/conformance/test_fuzz.py``) lets a mismatch pass only when one of
these claims it, and fails when a listed bug no longer shows up in its seed set (fixed:
delete its entry). The goal is an empty list; every entry names the issue that tracks it.
"""

from __future__ import annotations

from .compare import Verdict


# name -> (issue, predicate)
KNOWN: dict[str, tuple[str, object]] = {}


def known_bug(prog: dict, v: Verdict) -> str | None:
    """The known bug that explains this mismatch, or None."""
    return next((name for name, (_, pred) in KNOWN.items() if pred(prog, v)), None)
