"""(docs/plan.md, 2026-11-27; run from the repo root) Re-predict saved plan_validate results with variants. PYTHONPATH=. python repred.py FILE..."""
import json, sys, tempfile, attrs, statistics
sys.path.insert(0, 'bench')
import plan_repredict as pr, plan_validate as pv
import fshard as fs
E = sys.modules['fshard.plan.estimate']
def mach(r):
    p = tempfile.mktemp(suffix='.json'); json.dump(r['machine'], open(p, 'w'))
    return fs.plan.get_machine(p)
variants = {
    "as-is": lambda m, lay: m,
    "sync-flat-only": lambda m, lay: attrs.evolve(m, sync_overhead_s=0.0) if lay.startswith("pp") else m,
    "sync0": lambda m, lay: attrs.evolve(m, sync_overhead_s=0.0),
    "sync0-opt1": lambda m, lay: attrs.evolve(m, sync_overhead_s=0.0, optimizer_mem_efficiency=1.0),
}
for f in sys.argv[1:]:
    d = json.load(open(f))
    for vname, fn in variants.items():
        by = {}
        for r in d:
            m = mach(r)
            if not hasattr(m, "sync_overhead_s"):
                continue
            e = pr.predict(fn(m, r['layout']), r['layout'])
            by.setdefault(r['layout'], []).append((e.step_s, r['measured_step_s'], e.bubble_fraction, r.get('measured_bubble')))
        P, M, errs, berr = [], [], [], []
        line = []
        for k, v in by.items():
            p = statistics.median(x[0] for x in v); mm = statistics.median(x[1] for x in v)
            P.append(p); M.append(mm); errs.append(abs(p / mm - 1))
            line.append(f"{k[:18]} {p / mm - 1:+.0%}")
            if v[0][3] is not None:
                berr.append(100 * (statistics.median(x[2] for x in v) - statistics.median(x[3] for x in v)))
        print(f.split('/')[-1], f"{vname:16s}", 'median err %.1f%%' % (100 * statistics.median(errs)),
              'spearman %.2f' % pv._spearman(P, M), 'bubble', [round(b, 1) for b in berr])
        print("    ", "; ".join(line))

# The bubble simulated from each saved run's measured F, I, W with this checkout's transfer rule.
import train_lm  # noqa: E402  (plan_validate put examples/ on sys.path)
for f in sys.argv[1:]:
    d = json.load(open(f))
    by = {}
    for r in d:
        if 'measured_costs' not in r:
            continue
        m = mach(r)
        e = pr.predict(m, r['layout'])
        targs = train_lm.parse_args(pv.MODEL + dict(pv.LAYOUTS)[r['layout']])
        model = fs.plan.describe_transformer(train_lm.model_config(targs, train_lm.CharCorpus.load(targs.data)),
                                             seq_len=targs.seq_len)
        sim = pv.simulated_bubble(m, e.layout, model, [tuple(c) for c in r['measured_costs']], e)
        by.setdefault(r['layout'], []).append((e.bubble_fraction, sim, r['measured_bubble']))
    print(f.split('/')[-1], "bubble points: predicted - measured, simulated from measured F/I/W - measured")
    for k, v in by.items():
        med = lambda j: statistics.median(x[j] for x in v)  # noqa: E731
        print(f"    {k:30s} {100 * (med(0) - med(2)):+.1f} {100 * (med(1) - med(2)):+.1f}")
