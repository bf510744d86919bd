"""Prints the conformance mismatches of the programs whose names contain any given substring.

    python tests/conformance/conf_report.py "all_gather/x4" "patterns/fsdp"   # or no argument: all

Shares the JAX disk cache with pytest (``.pytest_cache``), so a rerun only runs fshard.
Programs that differ from JAX by design are compared against their oracle like the others
and shown as such (their tests are in test_conformance_differences.py); only the other
mismatches make the exit status 1.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from conf_oracle import Conformance
    from conf_programs import programs

    subs = argv[1:]
    names = [n for n, p in programs().items()
             if (not subs or any(s in n for s in subs)) and "jax_only" not in p.tags]
    cache = here.parent.parent / ".pytest_cache" / "d" / "fshard-conformance"
    c = Conformance(names, cache if os.environ.get("FSHARD_CONFORMANCE_CACHE", "1") != "0" else None)
    t0 = time.perf_counter()
    bad = by_design = 0
    for n in names:
        problem = c.mismatch(n)
        if problem:
            if c.programs[n].differs:
                by_design += 1
            else:
                bad += 1
            tag = f"  [differs by design: {c.programs[n].differs}]" if c.programs[n].differs else ""
            print(f"--- MISMATCH{tag}\n{problem}\n")
    print(f"{bad} of {len(names)} programs differ from their JAX oracle, and {by_design} more by design "
          f"({time.perf_counter() - t0:.0f} s)")
    if os.environ.get("FSHARD_CONFORMANCE_TIMES"):
        # Where the time goes: seconds per program family, per framework (rank 0; JAX: only
        # for results computed in this run, not those read from the cache).
        fam: dict[str, list[float]] = {}
        for n in names:
            key = "/".join(n.split("/")[:2])
            f = fam.setdefault(key, [0.0, 0.0])
            f[0] += c.fshard(n).get("seconds", 0.0)
            f[1] += c.jax(c.oracle_of(n)).get("seconds", 0.0) if c.oracle_of(n) == n else 0.0
        for key, (t_fs, t_jax) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
            print(f"  {key:40s} fshard {t_fs:7.2f} s   JAX {t_jax:7.2f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
