"""Re-predict the layouts of saved ``bench/plan_validate.py`` results with another machine file.

    PYTHONPATH=. python bench/plan_repredict.py --machine MACHINE.json RESULTS.json [RESULTS.json ...]

The measurements stay those of the results files; only the predictions are made again, with
this checkout's ``fs.plan.estimate`` and ``--machine`` (the model and layouts are
``plan_validate.py``'s, built by ``examples/train_lm.py``'s own functions). Printed: per
pipeline layout and file, the predicted minus the measured bubble in points, then per file
Spearman's rank correlation of the predicted step times with the measured ones (every
layout of the file). ``--latency S`` replaces the machine's point-to-point latency (the
``ppermute`` fit and the links) to show how the bubble depends on it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import plan_validate  # noqa: E402
import fshard as fs  # noqa: E402


def predict(machine: fs.plan.Machine, name: str) -> fs.plan.Estimate:
    """The estimate train_lm.py makes for plan_validate's layout ``name`` on ``machine``."""
    from _examples import example

    train_lm = example("train_lm")

    flags = dict(plan_validate.LAYOUTS)[name]
    args = train_lm.parse_args(plan_validate.MODEL + flags)
    cfg = train_lm.model_config(args, train_lm.CharCorpus.load(args.data))
    shape = train_lm.parse_mesh(args.mesh, 4)
    m = args.microbatches or (2 * shape["pp"] if "pp" in shape else 1)
    model = fs.plan.describe_transformer(cfg, seq_len=args.seq_len, dtype=args.dtype)
    return fs.plan.estimate(model, machine, train_lm.plan_layout(args, shape, m))


def with_latency(machine: fs.plan.Machine, latency: float) -> fs.plan.Machine:
    links = {k: attrs.evolve(v, latency=latency) for k, v in machine.links.items()}
    colls = {k: dict(v) for k, v in machine.collectives.items()}
    colls["ppermute"] = {k: attrs.evolve(v, latency=latency) for k, v in colls.get("ppermute", links).items()}
    return attrs.evolve(machine, links=links, collectives=colls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--machine", required=True, help="machine file (JSON) or shipped name")
    ap.add_argument("--latency", type=float, default=None, help="point-to-point latency in seconds")
    ap.add_argument("results", nargs="+", help="plan_validate.py --out files")
    args = ap.parse_args()
    machine = fs.plan.get_machine(args.machine)
    if args.latency is not None:
        machine = with_latency(machine, args.latency)
    runs = [json.loads(Path(p).read_text()) for p in args.results]
    names = [r["layout"] for r in runs[0]]
    est = {n: predict(machine, n) for n in names}
    print("| layout | " + " | ".join(f"bubble error, {Path(p).stem}" for p in args.results) + " |")
    print("|---|" + "---|" * len(runs))
    for n in names:
        rows = [[r for r in run if r["layout"] == n and r.get("measured_bubble") is not None] for run in runs]
        if not any(rows):
            continue
        cells = [f"{100 * (est[n].bubble_fraction - r[0]['measured_bubble']):+.1f}" if r else "-" for r in rows]
        print(f"| {n} | " + " | ".join(cells) + " |")
    for p, run in zip(args.results, runs):
        done = [r for r in run if r.get("measured_step_s")]
        rho = plan_validate._spearman([est[r["layout"]].step_s for r in done], [r["measured_step_s"] for r in done])
        print(f"{Path(p).stem}: Spearman {rho:.2f} over {len(done)} layouts")


if __name__ == "__main__":
    main()
