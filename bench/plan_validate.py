"""fs.plan's predictions against measured runs of examples/train_lm.py on this machine.

    PYTHONPATH=. python bench/plan_validate.py [--repeats 2] [--steps 12] [--out plan_validate.json]
    PYTHONPATH=. python bench/plan_validate.py --report plan_validate.json   # the table again
    PYTHONPATH=. python bench/plan_validate.py --memory-only --only "fsdp=4;fsdp=4 remat" --out plan_validate.json

For each repeat: calibrate this machine on 4 ranks (``fs.plan.calibrate``, all ranks at
once; with ``--calibrate each``, a quick calibration right before each layout instead, with
``--calibrate each-full`` a full one),
then run ``examples/train_lm.py`` on 4 ranks for each layout below with
``--log-json`` and ``--machine`` set to that calibration, so its last record carries
``predicted_step_s``, ``measured_step_s`` (median after the warm-up),
``predicted_peak_mib`` and ``measured_peak_mib`` (one profiled step, the largest rank).
Pipeline runs also record every step's ``fs.sched.StepStats`` (``pipeline_step`` is
wrapped to ask for them): the measured bubble is ``1 - busy / wall`` per rank, mean over
ranks, median over the steps after the warm-up. Next to it: the planner's predicted
bubble, and the simulator fed with the F / I / W times the run measured (the stage
spans) and the calibrated point-to-point cost (on the edges, and per posted transfer on
the rank, as the planner charges it). ``measured_host_share``: the share of the step a
pipeline rank spent neither computing nor waiting on a transfer (mean over ranks). Each
result keeps the machine its prediction used (``machine``).

``--memory-only`` measures and predicts only the peak memory, which does not depend on the
machine's speed or load: no calibration (the prediction uses the shipped ``h100`` file
with gloo's staging buffers, ``comm_temporaries = 1``, the only machine figure the memory
estimate reads), 6 steps, no bubble. With ``--out`` naming an existing results file, the
memory fields of the layouts measured replace theirs there (``memory_measured_at`` says
when); every other field is kept.

Reported: per layout the predictions and measurements; the median absolute relative
error of the step time, Spearman's rank correlation between predicted and measured step
times, the peak memory errors, the bubble errors in points; the load average before
and after each repeat (the machine is shared: read the step times with that in mind).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import fshard as fs  # noqa: E402
import fshard.plan as plan  # noqa: E402
from fshard.plan.comm import p2p_counts  # noqa: E402
from fshard.plan.estimate import pipeline_transfer, simulate_pipeline  # noqa: E402
from fshard.recipes.sinks import read_log  # noqa: E402

MODEL = ["--dim", "256", "--layers", "4", "--heads", "4", "--seq-len", "128", "--batch-size", "16"]

# (name, flags): fsdp, dp x fsdp, fsdp x tp with and without SP, pp x fsdp and pp x tp with
# several schedules, remat on and off, cp (ring attention) with and without fsdp. The first 8 already cover every kind (--budget-s cuts
# from the end).
LAYOUTS = [
    ("fsdp=4", ["--mesh", "fsdp=4"]),
    ("fsdp=4 remat", ["--mesh", "fsdp=4", "--remat"]),
    ("dp=2,fsdp=2", ["--mesh", "dp=2,fsdp=2"]),
    ("fsdp=2,tp=2", ["--mesh", "fsdp=2,tp=2"]),
    ("fsdp=2,tp=2 sp", ["--mesh", "fsdp=2,tp=2", "--sequence-parallel"]),
    ("pp=2,fsdp=2 1f1b m=4", ["--mesh", "pp=2,fsdp=2", "--schedule", "1f1b", "--microbatches", "4"]),
    ("pp=2,tp=2 zb m=8", ["--mesh", "pp=2,tp=2", "--schedule", "zb", "--microbatches", "8"]),
    ("pp=2,fsdp=2 interleaved m=4", ["--mesh", "pp=2,fsdp=2", "--schedule", "interleaved", "--microbatches", "4"]),
    ("pp=2,fsdp=2 gpipe m=4", ["--mesh", "pp=2,fsdp=2", "--schedule", "gpipe", "--microbatches", "4"]),
    ("pp=2,tp=2 1f1b m=8 remat", ["--mesh", "pp=2,tp=2", "--schedule", "1f1b", "--microbatches", "8", "--remat"]),
    ("dp=4", ["--mesh", "dp=4"]),
    ("pp=2,tp=2 1f1b m=8", ["--mesh", "pp=2,tp=2", "--schedule", "1f1b", "--microbatches", "8"]),
    ("cp=2,fsdp=2", ["--mesh", "cp=2,fsdp=2"]),
    ("cp=4", ["--mesh", "cp=4"]),
]


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def simulated_bubble(machine: plan.Machine, layout: plan.Layout, model: plan.ModelDesc,
                     costs: list[tuple[float, float, float]], est: plan.Estimate) -> float:
    """The bubble the simulator gives with the F, I, W per microbatch each pp rank measured
    (``costs``) and the planner's own transfer costs: the dependency edge's and, on CPU
    nodes, each posted send and receive's host time on its rank, half with F and half with
    I (:func:`fshard.plan.estimate.pipeline_transfer`); the time outside the schedule as
    the planner predicts it."""
    p2p, post = pipeline_transfer(machine, layout, model)
    ops = p2p_counts(plan.layout_schedule(layout))
    host = [(ops[r][0] + ops[r][1]) * post / layout.microbatches for r in range(layout.pp)]
    with_host = [(f + h / 2, i + h / 2, w) for (f, i, w), h in zip(costs, host)]
    makespan, _ = simulate_pipeline(layout, with_host, p2p)
    outside = est.step_s - est.breakdown["optimizer"] - (est.breakdown["compute"] + est.breakdown["bubble"])
    wall = makespan + outside
    return statistics.mean(1 - layout.microbatches * sum(c) / wall for c in costs)


def _calibrate(path: str, quick: bool) -> None:
    plan.calibrate(fs.make_mesh({"ranks": 4}), path=path, quick=quick)


def memory_machine() -> plan.Machine:
    """The machine the memory-only mode predicts with: what the memory estimate reads
    (gloo's staging buffers) is what a calibration here sets; speeds do not matter."""
    import attrs

    return attrs.evolve(plan.get_machine("h100"), name="memory-only", comm_temporaries=1.0,
                        notes="memory-only validation: speeds are h100's, comm_temporaries as gloo")


def _run(argv: list[str]) -> dict:
    """One train_lm run on this rank; pipeline steps' StepStats recorded."""
    from _examples import example

    train_lm = example("train_lm")

    stats: list = []
    original = fs.sched.pipeline_step

    def recording(*args, **kwargs):
        loss, grads, st = original(*args, **{**kwargs, "return_stats": True})
        stats.append((st.busy_s, st.wall_s, [(a.kind.value, a.stage, e - s) for a, s, e in st.spans], st.wait_s))
        return loss, grads

    fs.sched.pipeline_step = recording
    try:
        records = train_lm.main(argv)
    finally:
        fs.sched.pipeline_step = original
    return {"records": records, "stats": stats}


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def _measured_costs(stats_by_rank: list[list], warmup: int, layout: plan.Layout, mesh_pp_rank: list[int]):
    """Per pp rank, (F, I, W) seconds per microbatch over its stages, from the stage spans;
    and the measured bubble (mean over ranks of the median over steps of 1 - busy / wall)."""
    sch = plan.layout_schedule(layout)
    v = sch.n_virtual
    per_pp: dict[int, list[tuple[float, float, float]]] = {}
    bubbles = []
    others = []
    for rank_stats, pr in zip(stats_by_rank, mesh_pp_rank):
        steps = rank_stats[warmup:] or rank_stats
        bubbles.append(statistics.median(1 - busy / wall for busy, wall, *_ in steps))
        # Neither computing nor waiting on a transfer: the runtime's own host time (posting
        # sends and receives, hooks), which the planner charges per posted transfer.
        others.append(statistics.median((wall - busy - wait) / wall for busy, wall, _, wait in steps))
        spans = [sp for _, _, spans, _ in steps for sp in spans]
        mean = {k: statistics.mean([d for kind, _, d in spans if kind == k]) if any(kind == k for kind, _, _ in spans)
                else 0.0 for k in "FBIW"}
        f = v * mean["F"]
        i = v * (mean["I"] if mean["I"] else mean["B"])
        w = v * mean["W"]
        per_pp.setdefault(pr, []).append((f, i, w))
    costs = [tuple(statistics.mean(c[j] for c in per_pp[r]) for j in range(3)) for r in sorted(per_pp)]
    return costs, statistics.mean(bubbles), statistics.mean(others)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--calibrate", choices=("once", "each", "each-full"), default="once",
                    help="once per repeat (full), or right before each layout, quick (each) or full "
                         "(each-full): the machine's speed moves between layouts")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new layout after this many seconds (the rest are listed as skipped)")
    ap.add_argument("--memory-only", action="store_true",
                    help="peak memory only: no calibration, no step times or bubbles (see the module doc)")
    ap.add_argument("--only", default=None, help="layout names separated by semicolons")
    ap.add_argument("--out", default=None, help="write all results as JSON")
    ap.add_argument("--report", default=None, metavar="JSON", help="only print the table of a saved --out file")
    args = ap.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return
    layouts = [x for x in LAYOUTS if args.only is None or x[0] in args.only.split(";")]
    if args.memory_only:
        memory_only(layouts, args.steps if args.steps != ap.get_default("steps") else 6, args.out)
        return
    results = []
    start = time.time()
    for rep in range(args.repeats):
        load0 = os.getloadavg()
        machine_path = Path(tempfile.mkdtemp()) / "machine.json"
        if args.calibrate == "once":
            fs.run_local(_calibrate, str(machine_path), False, world_size=4, timeout_s=900)
            machine = plan.load_machine(machine_path)
            print(f"repeat {rep}: calibrated ({machine.notes}; matmul {machine.flops}, "
                  f"kernel {machine.op_overhead_s * 1e6:.0f} us, memory {machine.mem_bandwidth / 1e9:.1f} GB/s, "
                  f"overlap {machine.overlap:.2f})", flush=True)
        for name, flags in layouts:
            if args.budget_s is not None and time.time() - start > args.budget_s:
                print(f"repeat {rep}: {name}: skipped (--budget-s {args.budget_s:.0f} spent)", flush=True)
                continue
            if args.calibrate != "once":  # the machine as it is now: its speed moves between layouts
                fs.run_local(_calibrate, str(machine_path), args.calibrate == "each", world_size=4, timeout_s=900)
                machine = plan.load_machine(machine_path)
            log = Path(tempfile.mkdtemp()) / "log.json"
            argv = MODEL + flags + ["--steps", str(args.steps), "--quiet", "--sample-chars", "0",
                                    "--log-json", str(log), "--machine", str(machine_path)]
            t0 = time.time()
            out = fs.run_local(_run, argv, world_size=4, timeout_s=1800)
            records = read_log(log)  # the step records (JSON lines)
            last = read_log(log, "summary")[-1]  # with the prediction
            # The spread of the step times the median is taken over (warm-up and profiled step out):
            # on a shared machine this is the noise the prediction is judged against.
            warm = min(2, args.steps // 3)
            times = sorted(r["step_time_s"] for i, r in enumerate(records) if i >= warm and i != warm)
            q1, q3 = (statistics.quantiles(times, n=4)[::2] if len(times) >= 2 else (times[0], times[0]))
            row = {"layout": name, "repeat": rep, "load": os.getloadavg()[0], "wall_s": time.time() - t0,
                   "measured_q1_s": q1, "measured_q3_s": q3, "calibrated_fp32_flops": machine.flops.get("float32"),
                   "machine": machine.to_dict(),  # what the prediction used: the runs can be predicted again
                   **{k: last[k] for k in ("predicted_step_s", "measured_step_s", "predicted_peak_mib",
                                            "measured_peak_mib", "predicted_breakdown_s")}}
            if "--mesh" in flags and flags[flags.index("--mesh") + 1].startswith("pp="):
                from _examples import example

                train_lm = example("train_lm")

                targs = train_lm.parse_args(argv)
                shape = train_lm.parse_mesh(targs.mesh, 4)
                layout = train_lm.plan_layout(targs, shape, targs.microbatches)
                corpus = train_lm.CharCorpus.load(targs.data)
                model = plan.describe_transformer(train_lm.model_config(targs, corpus), seq_len=targs.seq_len)
                est = plan.estimate(model, machine, layout)
                pp_of_rank = [r // (4 // layout.pp) for r in range(4)]  # pp is the outermost axis
                costs, measured_bubble, other = _measured_costs([o["stats"] for o in out], warm, layout, pp_of_rank)
                sim_measured = simulated_bubble(machine, layout, model, costs, est)
                row.update(predicted_bubble=est.bubble_fraction, measured_bubble=measured_bubble,
                           simulated_bubble_measured_costs=sim_measured, measured_costs=costs,
                           measured_host_share=other)
            results.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                              if k not in ("predicted_breakdown_s", "measured_costs", "machine")}), flush=True)
        print(f"repeat {rep}: load average {load0[0]:.1f} before, {os.getloadavg()[0]:.1f} after", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    report(results)


def memory_only(layouts: list[tuple[str, list[str]]], steps: int, out: str | None) -> None:
    """Predicted and measured peak memory per layout; merged into ``out`` when it exists."""
    machine_path = Path(tempfile.mkdtemp()) / "machine.json"
    plan.save_machine(memory_machine(), machine_path)
    rows = []
    for name, flags in layouts:
        log = Path(tempfile.mkdtemp()) / "log.json"
        argv = MODEL + flags + ["--steps", str(steps), "--quiet", "--sample-chars", "0",
                                "--log-json", str(log), "--machine", str(machine_path)]
        fs.run_local(_run, argv, world_size=4, timeout_s=1800)
        last = read_log(log, "summary")[-1]
        row = {"layout": name, "predicted_peak_mib": last["predicted_peak_mib"],
               "measured_peak_mib": last["measured_peak_mib"],
               "memory_measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        rows.append(row)
        pm, mm = row["predicted_peak_mib"], row["measured_peak_mib"]
        print(f"{name}: predicted {pm:.1f} MiB, measured {mm:.1f} MiB, error {(pm - mm) / mm:+.1%}", flush=True)
    if out is None:
        return
    path = Path(out)
    results = json.loads(path.read_text()) if path.exists() else []
    for row in rows:
        hits = [r for r in results if r["layout"] == row["layout"]]
        for r in hits:
            r.update(row)
        if not hits:
            results.append(row)
    path.write_text(json.dumps(results, indent=1))


def report(results: list[dict]) -> None:
    names = list(dict.fromkeys(r["layout"] for r in results))
    print("\n| layout | predicted s/step | measured s/step: median (quartiles) | error | load | predicted peak MiB | "
          "measured peak MiB | error | bubble predicted / simulated from measured F,I,W / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    pred, meas, errs, mem_errs, bub = [], [], [], [], []
    for n in names:
        rs = [r for r in results if r["layout"] == n]
        p = statistics.median(r["predicted_step_s"] for r in rs)
        m = statistics.median(r["measured_step_s"] for r in rs)
        q1 = min(r["measured_q1_s"] for r in rs)
        q3 = max(r["measured_q3_s"] for r in rs)
        load = statistics.mean(r["load"] for r in rs)
        pm = statistics.median(r["predicted_peak_mib"] for r in rs)
        mm = statistics.median(r["measured_peak_mib"] for r in rs)
        pred.append(p)
        meas.append(m)
        errs.append(abs(p - m) / m)
        mem_errs.append(abs(pm - mm) / mm)
        cell = ""
        if "measured_bubble" in rs[0]:
            pb = statistics.median(r["predicted_bubble"] for r in rs)
            sb = statistics.median(r["simulated_bubble_measured_costs"] for r in rs)
            mb = statistics.median(r["measured_bubble"] for r in rs)
            bub.append((pb - mb, sb - mb))
            cell = f"{pb:.0%} / {sb:.0%} / {mb:.0%}"
        print(f"| {n} | {p:.3f} | {m:.3f} ({q1:.3f}-{q3:.3f}) | {(p - m) / m:+.0%} | {load:.0f} | {pm:.1f} | {mm:.1f} | "
              f"{(pm - mm) / mm:+.0%} | {cell} |")
    print(f"\nstep time: median |error| {statistics.median(errs):.1%}, Spearman {_spearman(pred, meas):.2f}; "
          f"peak memory: median |error| {statistics.median(mem_errs):.1%}, max {max(mem_errs):.1%}")
    if bub:
        print(f"bubble: predicted - measured {', '.join(f'{a * 100:+.1f}' for a, _ in bub)} points; "
              f"simulated from measured F/I/W - measured {', '.join(f'{b * 100:+.1f}' for _, b in bub)} points")
    loads = [r["load"] for r in results]
    print(f"load average during the runs: {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
