"""Differential fuzzing against JAX, CI's fixed-seed set: 500 random programs (seeds 0-499,
tests/conformance/fuzz/) in JAX and on 4 gloo ranks; every one must agree, be labelled by a
docs/jax.md row, or be claimed by a known bug (fuzz/known.py, each naming its issue).

Budget: about 60 s on the 2-core CI machine with no cache (JAX ~3 programs per XLA
compile of 24, the ranks ~0.03 s per program, both at once); JAX's results are cached
like the conformance suite's (``FSHARD_CONFORMANCE_CACHE=0`` turns that off). Any number
of seeds: ``python -m tests.conformance.fuzz --seeds 0:10000``.
"""

import collections
import os
import re
from pathlib import Path

import pytest
from fuzz.engine import Engine
from fuzz import labels
from fuzz.known import KNOWN, known_bug
from fuzz.repro import fshard_script, jax_script
from fuzz.run import evaluate, minimal
from fuzz.shrink import size

SEEDS = range(500)
BUDGET_S = 300  # the timeout: 5x the measured cold run, for a loaded machine


@pytest.fixture(scope="module")
def fuzz_verdicts(request):
    cache = None
    if os.environ.get("FSHARD_CONFORMANCE_CACHE", "1") != "0" and getattr(request.config, "cache", None):
        cache = request.config.cache.mkdir("fshard-fuzz")
    engine = Engine(cache)
    try:
        yield engine, evaluate(engine, SEEDS, log=lambda *a: None)
    finally:
        engine.close()


@pytest.mark.timeout(BUDGET_S)
def test_fuzz_fixed_seeds(fuzz_verdicts):
    engine, verdicts = fuzz_verdicts
    unknown, seen = [], collections.Counter()
    for v, p in verdicts.values():
        if v.kind == "mismatch":
            bug = known_bug(p, v)
            if bug:
                seen[bug] += 1
            else:
                unknown.append((v, p))
    if unknown:
        seeds = ", ".join(p["id"] for _, p in unknown[:20])
        lines = [f"{len(unknown)} of {len(verdicts)} fuzzed programs differ from JAX (seeds {seeds})"]
        for v, p in sorted(unknown, key=lambda vp: size(vp[1]))[:2]:  # the two smallest, shrunk
            m = minimal(engine, p, v.key)
            lines.append(f"--- seed {p['id']}: {v.what}\n{v.detail[:800]}\n# JAX\n{jax_script(m)}\n# fshard\n"
                         f"{fshard_script(m)}")
        pytest.fail("\n".join(lines), pytrace=False)
    fixed = [f"{name} ({issue})" for name, (issue, _) in KNOWN.items() if not seen[name]]
    assert not fixed, f"known fuzz bugs no longer found in seeds 0-499, delete them from fuzz/known.py: {fixed}"


def _label_rows() -> set[str]:
    return {v for k, v in vars(labels).items() if k.isupper() and isinstance(v, str)} | \
        {row for row, _ in labels.UNCHECKED_ROWS}


def test_every_label_is_a_docs_row():
    """Each row the fuzzer may label a difference with is a row of docs/jax.md (its topic,
    up to the parenthetical), so that every labelled difference is documented and pinned."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "jax.md").read_text()
    topics = {re.sub(r" \(differs from .*\)$", "", line.split(" | ")[0].lstrip("| ").strip())
              for line in doc.splitlines() if line.startswith("| ")}
    missing = sorted(row for row in _label_rows() if row not in topics)
    assert not missing, f"fuzz labels without a docs/jax.md row: {missing}"


def test_the_command_runs_a_few_seeds(capsys):
    """docs/jax.md's command in short form: a summary, exit 0 (no mismatch)."""
    from fuzz.run import main

    assert main(["--seeds", "0:4", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "ran 4 programs" in out and "mismatches 0" in out
