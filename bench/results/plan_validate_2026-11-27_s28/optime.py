"""Times train_lm.py's gradient call and its update (apply_gradients) per step on each rank; run: PYTHONPATH=. torchrun --nproc-per-node 4 optime.py --dim 256 --layers 4 --heads 4 --seq-len 128 --batch-size 16 --mesh fsdp=4 --steps 10 --quiet (docs/plan.md, 2026-11-27)."""
import os, sys, time, statistics, torch
sys.path.insert(0, "examples")
import train_lm
torch.set_num_threads(1)
ts = {"apply": [], "grads": []}
orig_apply = train_lm.apply_gradients
def timed_apply(*a, **k):
    t0 = time.perf_counter(); r = orig_apply(*a, **k); ts["apply"].append(time.perf_counter() - t0); return r
train_lm.apply_gradients = timed_apply
orig_mg = train_lm.microbatch_grads
def timed_mg(*a, **k):
    t0 = time.perf_counter(); r = orig_mg(*a, **k); ts["grads"].append(time.perf_counter() - t0); return r
train_lm.microbatch_grads = timed_mg
recs = train_lm.main(sys.argv[1:])
st = [r["step_time_s"] for r in recs[3:]]
print(f"RANK {os.environ['RANK']} step {statistics.median(st)*1e3:.1f} grads {statistics.median(ts['grads'][3:])*1e3:.1f} apply {statistics.median(ts['apply'][3:])*1e3:.1f} ms", flush=True)
