"""The fuzzing command: ``python -m tests.conformance.fuzz --seeds 0:10000 [--jobs N]``.

Generates the seeds' programs, runs them in JAX and fshard, prints a summary (programs,
agreeing, labelled by docs/jax.md row, mismatches by kind) and, for up to ``--shrink``
mismatches of each kind (the smallest first), a minimal program as two standalone scripts.
Exits 1 when any mismatch is left.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

from .engine import CONF, Engine
from .gen import generate
from .known import known_bug
from .repro import fshard_script, jax_script
from .shrink import shrink, size

CHUNK = 500  # seeds per round trip (JAX's and the ranks' work overlap within one)


def parse_seeds(text: str) -> range:
    lo, _, hi = text.partition(":")
    return range(int(lo), int(hi)) if hi else range(int(lo), int(lo) + 1)


def evaluate(engine: Engine, seeds: range, log=print) -> dict:
    """``{id: (verdict, program)}`` for every seed."""
    out = {}
    for i in range(0, len(seeds), CHUNK):
        progs = [generate(s) for s in seeds[i:i + CHUNK]]
        res = engine.verdicts(progs)
        out.update({p["id"]: (res[p["id"]][0], p) for p in progs})
        log(f"  seeds {seeds[i]}..{seeds[min(i + CHUNK, len(seeds)) - 1]}: done")
    return out


def minimal(engine: Engine, prog: dict, key: str) -> dict:
    def judge(cands):
        return {i: v.key for i, (v, _, _) in engine.verdicts(cands, cached=False).items()}
    return shrink(prog, key, judge)


def signature(prog: dict) -> str:
    """What a minimal program is made of: its ops, gradient wrapping and mode."""
    ops = sorted({op if op not in ("bin", "unary", "reduce", "iop") else f"{op}{a.get('op', a.get('fn', ''))}"
                  for _, op, _, a in prog["ops"]})
    return f"{'checked' if prog['check'] else 'unchecked'} {prog['grad']['mode']}: {' '.join(ops)}"


def report(engine: Engine, verdicts: dict, n_shrink: int, log=print) -> list[dict]:
    counts = collections.Counter(v.kind for v, _ in verdicts.values())
    rows = collections.Counter(v.what for v, _ in verdicts.values() if v.kind == "label")
    bad = collections.defaultdict(list)
    for v, p in verdicts.values():
        if v.kind == "mismatch":
            known = known_bug(p, v)
            bad[f"{v.what} [known bug: {known}]" if known else v.what].append(p)
    log(f"programs {len(verdicts)}: agree {counts['agree']}, labelled {counts['label']}, "
        f"mismatches {counts['mismatch']}")
    for row, n in rows.most_common():
        log(f"  labelled {n:5d}  docs/jax.md row: {row}")
    for what, progs in sorted(bad.items(), key=lambda kv: -len(kv[1])):
        log(f"  mismatch {len(progs):5d}  {what}  (seeds {', '.join(p['id'] for p in progs[:12])}"
            f"{' ...' if len(progs) > 12 else ''})")
    found = []
    for what, progs in bad.items():
        for p in sorted(progs, key=size)[:n_shrink]:
            v = verdicts[p["id"]][0]
            m = minimal(engine, p, v.key)
            mv = engine.verdicts([dict(m, id=m["id"] + "~min")], cached=False)
            detail = next(iter(mv.values()))[0].detail
            found.append({"kind": what, "seed": p["id"], "signature": signature(m), "program": m})
            log(f"\n=== mismatch ({what}), seed {p['id']}, minimal: {signature(m)}\n{detail}\n"
                f"--- JAX ---\n{jax_script(m)}--- fshard ---\n{fshard_script(m)}")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.conformance.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0:200", help="A:B (half-open) or one seed")
    ap.add_argument("--jobs", type=int, default=1, help="JAX worker processes (the ranks are always 4)")
    ap.add_argument("--shrink", type=int, default=2, help="mismatches of each kind to shrink and print")
    ap.add_argument("--no-cache", action="store_true", help="recompute JAX's results")
    args = ap.parse_args(argv)
    cache = None if args.no_cache else CONF.parent.parent / ".pytest_cache" / "d" / "fshard-fuzz"
    engine = Engine(Path(cache) if cache else None, jobs=args.jobs)
    t0 = time.perf_counter()
    try:
        verdicts = evaluate(engine, parse_seeds(args.seeds))
        dt = time.perf_counter() - t0
        print(f"ran {len(verdicts)} programs in {dt:.1f} s ({len(verdicts) / dt:.1f} programs/s)")
        found = report(engine, verdicts, args.shrink)
    finally:
        engine.close()
    return 1 if found or any(v.kind == "mismatch" for v, _ in verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
