"""Golden planner estimates: lock fs.plan's predictions before the planner is regrouped by
parallelism (issue 30), so that moving code cannot change a number unnoticed.

    PYTHONPATH=. python tools/golden_estimates.py            # rewrite tests/plan/golden_estimates.json
    PYTHONPATH=. python tools/golden_estimates.py --check    # compare, exit 1 on a difference

Cases: the layouts of bench/plan_validate.py (its train_lm model) on the shipped ``h100`` and
``a100`` machines, and the published runs of bench/plan_paper.py with and without remat, plus
one small search. Recorded per case: step time, peak bytes, tokens/s, MFU, bubble fraction,
the breakdown and memory by kind, and whether it fits. Regenerate only when a change of the
cost model is intended, and say so in the commit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import attrs

import fshard.plan as plan
from fshard.models.transformer import TransformerConfig

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "plan" / "golden_estimates.json"
GIB = 2**30
RTOL = 1e-9

# bench/plan_validate.py's model and layouts (its train_lm flags, written as Layout fields).
VALIDATE_MODEL = {"vocab_size": 128, "dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 128}
VALIDATE_BATCH = 16
VALIDATE_LAYOUTS = [
    ("fsdp=4", {"fsdp": 4}, {}),
    ("fsdp=4 remat", {"fsdp": 4}, {"remat": True}),
    ("dp=2,fsdp=2", {"dp": 2, "fsdp": 2}, {}),
    ("fsdp=2,tp=2", {"fsdp": 2, "tp": 2}, {}),
    ("fsdp=2,tp=2 sp", {"fsdp": 2, "tp": 2}, {"sequence_parallel": True}),
    ("pp=2,fsdp=2 1f1b m=4", {"pp": 2, "fsdp": 2}, {"schedule": "1f1b", "microbatches": 4}),
    ("pp=2,tp=2 zb m=8", {"pp": 2, "tp": 2}, {"schedule": "zb", "microbatches": 8}),
    ("pp=2,fsdp=2 interleaved m=4", {"pp": 2, "fsdp": 2}, {"schedule": "interleaved", "microbatches": 4}),
    ("pp=2,fsdp=2 gpipe m=4", {"pp": 2, "fsdp": 2}, {"schedule": "gpipe", "microbatches": 4}),
    ("pp=2,tp=2 1f1b m=8 remat", {"pp": 2, "tp": 2}, {"schedule": "1f1b", "microbatches": 8, "remat": True}),
    ("dp=4", {"dp": 4}, {}),
    ("pp=2,tp=2 1f1b m=8", {"pp": 2, "tp": 2}, {"schedule": "1f1b", "microbatches": 8}),
]

# bench/plan_paper.py's published runs: (name, model, machine, GiB per GPU, mesh, batch, microbatches, schedule).
PAPER_RUNS = [
    ("8B 8xH100 fsdp", "llama3-8b", "h100", 96, {"fsdp": 8}, 16, 1, "1f1b"),
    ("8B 128xH100 fsdp", "llama3-8b", "h100", 96, {"fsdp": 128}, 256, 1, "1f1b"),
    ("70B 256xH100 fsdp32 tp8", "llama3-70b", "h100", 96, {"fsdp": 32, "tp": 8}, 512, 1, "1f1b"),
    ("405B 512xH100 pp8 fsdp8 tp8 1f1b", "llama3-405b", "h100", 96, {"pp": 8, "fsdp": 8, "tp": 8}, 256, 32, "1f1b"),
    ("405B 512xH100 pp8 fsdp8 tp8 interleaved", "llama3-405b", "h100", 96, {"pp": 8, "fsdp": 8, "tp": 8}, 256, 32,
     "interleaved"),
    ("8B 64xA100 fsdp", "llama3-8b", "a100", 80, {"fsdp": 64}, 64, 1, "1f1b"),
]


def _record(est: plan.Estimate) -> dict[str, Any]:
    return {"step_s": est.step_s, "peak_bytes": est.peak_bytes, "tokens_per_s": est.tokens_per_s,
            "mfu": est.mfu, "bubble_fraction": est.bubble_fraction, "fits": est.fits,
            "breakdown": dict(est.breakdown), "memory": dict(est.memory)}


def _validate_cases() -> dict[str, dict[str, Any]]:
    model = plan.describe_transformer(TransformerConfig(**VALIDATE_MODEL), seq_len=128, dtype="float32")
    out = {}
    for mach in ("h100", "a100"):
        machine = plan.get_machine(mach)
        for name, mesh, kw in VALIDATE_LAYOUTS:
            layout = plan.Layout(mesh, batch=VALIDATE_BATCH, **kw)
            out[f"validate {name} on {mach}"] = _record(plan.estimate(model, machine, layout))
    return out


def _paper_cases() -> dict[str, dict[str, Any]]:
    out = {}
    for name, mdl, mach, mem, mesh, batch, m, sched in PAPER_RUNS:
        model = plan.get_model(mdl, seq_len=8192)
        machine = attrs.evolve(plan.get_machine(mach), memory_bytes=mem * GIB)
        for remat in (False, True):
            layout = plan.Layout(mesh, batch=batch, microbatches=m, schedule=sched, remat=remat, dtype="bfloat16",
                                 sequence_parallel="tp" in mesh)
            out[f"paper {name} remat={remat}"] = _record(plan.estimate(model, machine, layout))
    return out


def _search_cases() -> dict[str, dict[str, Any]]:
    model = plan.get_model("llama3-8b", seq_len=8192)
    machine = attrs.evolve(plan.get_machine("h100"), memory_bytes=80 * GIB)
    cfg = plan.SearchConfig(schedules=("1f1b", "interleaved"), max_microbatch_choices=3, top=3)
    res = plan.search(model, machine, 16, 64, config=cfg)
    cases = {f"search 8B 16xH100 #{i}": dict(_record(e), label=e.layout.label()) for i, e in enumerate(res.ranked)}
    cases["search 8B 16xH100 summary"] = {"considered": res.considered, "rejected": dict(res.rejected)}
    return cases


def compute() -> dict[str, dict[str, Any]]:
    return {**_validate_cases(), **_paper_cases(), **_search_cases()}


def _diff(path: str, want: Any, got: Any, out: list[str]) -> None:
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in want or k not in got:
                out.append(f"{path}.{k}: only in {'golden' if k in want else 'now'}")
            else:
                _diff(f"{path}.{k}", want[k], got[k], out)
    elif isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        if not math.isclose(want, got, rel_tol=RTOL, abs_tol=0.0):
            out.append(f"{path}: golden {want!r}, now {got!r}")
    elif want != got:
        out.append(f"{path}: golden {want!r}, now {got!r}")


def differences(now: dict[str, Any], golden: dict[str, Any]) -> list[str]:
    out: list[str] = []
    _diff("", golden, json.loads(json.dumps(now)), out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the golden file instead of writing it")
    args = ap.parse_args(argv)
    now = compute()
    if args.check:
        diffs = differences(now, json.loads(GOLDEN.read_text()))
        print("\n".join(diffs) or f"{len(now)} cases match {GOLDEN.name}")
        return 1 if diffs else 0
    GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(now)} cases to {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
