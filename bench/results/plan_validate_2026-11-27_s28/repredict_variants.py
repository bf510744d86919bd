"""Re-predicts saved plan_validate results with model variants (base: this checkout's estimate; the old-overlap-formula numbers of docs/plan.md took base at commit 1ffcadf, before 023f908; ovmin: overlap of the shorter; ov0: no overlap; lo0: no per-layer cost) from their saved machines; prints median error and Spearman. Run from the repo root: PYTHONPATH=. python repredict_variants.py ovmin FILE.json (docs/plan.md, 2026-11-27)."""
import json, sys, tempfile, attrs, statistics
sys.path.insert(0,'bench')
import plan_repredict as pr, plan_validate as pv
import fshard as fs
def mach(r):
    p = tempfile.mktemp(suffix='.json'); json.dump(r['machine'], open(p,'w'))
    return fs.plan.get_machine(p)
variant = sys.argv[1]; files = sys.argv[2:]
E = sys.modules['fshard.plan.estimate']
if 'ovmin' in variant:
    def _exposed(machine, layout, c, window):
        t = E.collective_time(machine, layout, c) * c.count
        if c.hide is None: return t
        return max(0.0, t - machine.overlap * min(t, window[c.hide] * c.count))
    E._exposed = _exposed
for f in files:
    d=json.load(open(f))
    by = {}
    for r in d:
        m = mach(r)
        lo = m.layer_overhead_s
        extra = 0.0
        if 'lo0' in variant:
            m = attrs.evolve(m, layer_overhead_s=0.0)
            if 'pp' not in r['layout']: extra = 2*lo
        if 'ov0' in variant: m = attrs.evolve(m, overlap=0.0)
        e = pr.predict(m, r['layout'])
        p = e.step_s + extra
        by.setdefault(r['layout'], []).append((p, r['measured_step_s'], e))
    P=[];M=[];errs=[]
    for k,v in by.items():
        p = statistics.median(x[0] for x in v); mm = statistics.median(x[1] for x in v)
        P.append(p); M.append(mm); errs.append(abs(p/mm-1))
        extra = ''
        if v[0][2].stage_costs: extra = str([tuple(round(x*1e3,1) for x in c) for c in v[0][2].stage_costs])
        print(f"{k:30s} meas {mm:.3f} pred {p:.3f} {p/mm-1:+.0%} {extra}")
    print(f, variant, 'median err %.1f%%' % (100*statistics.median(errs)), 'spearman %.2f' % pv._spearman(P,M))
