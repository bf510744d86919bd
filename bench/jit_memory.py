"""Peak memory per rank of fshard's data-parallel step: eager against ``fs.jit`` variants.

    PYTHONPATH=. python bench/jit_memory.py [--mode fsdp|replicate] [--sides eager,jit,...] [--backend inductor]

The model and step of ``bench/jit_step.py`` (Transformer vocab 512, dim 256, 4 layers, seq
128, fp32, AdamW, 2 gloo ranks x batch 8). Each side runs 3 steps in its own processes
under ``torch.profiler(profile_memory=True)`` (``bench/data_parallel.py``'s
``step_peak_memory``): live CPU tensor bytes at the start of the third step and the peak
during it. Sides:

  eager           ``bench/data_parallel.py``'s eager fshard step (``fs.optim.donate()``)
  eager pure      the pure step that fs.jit compiles, run eagerly (no donation)
  jit             ``fs.jit`` (Inductor, fshard's settings)
  jit donated     ``fs.jit(donate_argnums=(0, 1))``
  jit no overlap  ``fs.jit`` without fshard's overlap scheduling (``fshard/jit/passes/overlap.py``)
  jit locality    ``fs.jit`` with Inductor's ``reorder_for_locality`` back on (its default)
  jit cat in place  ``fs.jit`` without ``fshard.jit.passes.memory.LateConcat``: Inductor writes
                  the producers of a collective's flat buffer into it in place (its default)
  jit aot_eager   ``fs.jit(backend="aot_eager")``: the captured graph in program order
  native          torch's eager step (``bench/data_parallel.py``'s ``_native_step``:
                  ``fully_shard`` per block and root, or DDP; foreach AdamW)
  native compiled the same compiled by ``--backend`` (FSDP: each block
                  ``torch.compile(block, fullgraph=True)`` before ``fully_shard``,
                  torchtitan's recipe; DDP: the module compiled, then wrapped)

Issue 17's target: the jit's peak not higher than eager fshard's. The native sides put
both next to torch's, eager and compiled (compiled against compiled). ``--backend`` is the
backend of ``native compiled`` and of the ``jit`` sides that do not name their own.

``--count thread`` counts, in the same profile, only the tensors that the step's own thread
allocates (wherever they are freed): gloo's temporaries (allocated on its threads) left out.
``--count graph`` counts instead what the captured graph's own code holds
(``fshard.testing.graph_peak_bytes``: the distinct tensor storages of its variables, its
inputs throughout), in one process per rank, for the captured graph run in program order
(``fs.jit(backend=None)``: eager's order, eager's peak) and for each ``fs.jit`` side with
Inductor: deterministic, and without gloo's internal buffers (its all-gather allocates a
temporary of the gathered size while it runs, on its own thread; the profiler counts it
where it overlaps the peak, which depends on timing).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist

import fshard as fs
from fshard.jit.passes.bucket import without_collective_passes
from fshard.models import TransformerConfig
from fshard.testing import transformer_train_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_parallel import CFG, _batches, _fshard_step, _native_step, profiled_steps, step_peak_memory  # noqa: E402

_JIT = {"jit": {}, "jit donated": dict(donate_argnums=(0, 1)),
        "jit no overlap": dict(options=without_collective_passes(bucketing=True)),
        "jit locality": dict(options={"reorder_for_locality": True}),
        "jit cat in place": dict(options={"post_grad_custom_pre_pass": None}), "jit aot_eager": dict(backend="aot_eager")}
NATIVE = ("native", "native compiled")
SIDES = ("eager", "eager pure", *_JIT, *NATIVE)


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def _make(side: str, mode: str, backend: str = "inductor", cfg: dict | None = None):
    cfg = TransformerConfig(**(cfg or CFG))
    mesh = fs.make_mesh({"d": dist.get_world_size()})
    if side in NATIVE:  # this rank's rows of the same global batch
        return _native_step(mode, cfg, compiled=side == "native compiled", backend=backend), _batches(cfg, 8)["torch"]
    args = _batches(cfg, 8)["fshard"]
    if side == "eager":
        return _fshard_step(mode, cfg, mesh), args
    step, params, state = transformer_train_step(mode, cfg, mesh, axis="d")
    f = step if side == "eager pure" else fs.jit(step, **{"backend": backend, **_JIT[side]})
    box = [params, state]

    def call(tok, tgt):
        loss, box[0], box[1] = f(box[0], box[1], tok, tgt)
        return loss

    return call, args


def _peak(side: str, mode: str, backend: str = "inductor", cfg: dict | None = None) -> tuple[int, int]:
    return step_peak_memory(lambda: _make(side, mode, backend, cfg))


def _thread_peak(side: str, mode: str, backend: str = "inductor") -> tuple[int, int]:
    """``--count thread``: as :func:`step_peak_memory`, counting only the tensors that the
    step's own thread allocates (wherever they are freed): not gloo's temporaries."""

    mark, allocs = profiled_steps(lambda: _make(side, mode, backend))
    ours, live, start, peak = {}, 0, None, 0
    for e in allocs:
        f = e.extra_fields
        if start is None and e.start_time_ns >= mark.start_time_ns:
            start = peak = live
        if f.alloc_size > 0 and e.start_tid == mark.start_tid:
            ours[f.ptr] = f.alloc_size
            live += f.alloc_size
        elif f.alloc_size < 0 and f.ptr in ours:
            live -= ours.pop(f.ptr)
        if start is not None and e.start_time_ns <= mark.end_time_ns:
            peak = max(peak, live)
    return start, peak


def _graph_peaks(sides: list[str], mode: str) -> dict[str, int]:
    """Per side, the peak bytes of the third step's graph code (``--count graph``)."""
    from fshard.testing import graph_peak_bytes

    out = {}
    for side in ["program order", *sides]:
        _JIT["program order"] = dict(backend=None)
        step, args = _make(side, mode)
        step(*args), step(*args)
        with graph_peak_bytes() as peaks:
            step(*args)
        counted = peaks["fx"] if side == "program order" else peaks["inductor"]
        if len(counted) != 1:
            raise RuntimeError(f"{side}: expected one run of the graph's code, found {peaks}")
        out[side] = counted[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="fsdp", choices=["fsdp", "replicate"])
    ap.add_argument("--sides", default="eager,jit,jit donated", help=f"comma-separated, of: {', '.join(SIDES)}")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--count", default="profiler", choices=["profiler", "thread", "graph"])
    ap.add_argument("--backend", default="inductor",
                    help="the torch.compile backend of 'native compiled' and of the jit sides without their own")
    args = ap.parse_args()
    sides = args.sides.split(",")
    bad = [s for s in sides if s not in SIDES]
    if bad:
        ap.error(f"--sides: unknown {bad}; use {', '.join(SIDES)}")
    if args.count == "graph":
        sides = [s for s in sides if s in _JIT and "backend" not in _JIT[s]]
        print(f"{args.mode}: {args.world_size} gloo ranks; peak MiB of the graph code's tensors per rank")
        per_rank = fs.run_local(_graph_peaks, sides, args.mode, world_size=args.world_size, timeout_s=3000)
        for side in per_rank[0]:
            cells = "  ".join(f"rank {r}: {p[side] / 2**20:.2f}" for r, p in enumerate(per_rank))
            print(f"  {side:<16} {cells}", flush=True)
        return
    which = "" if args.count == "profiler" else " (the step's thread's allocations)"
    print(f"{args.mode}: {args.world_size} gloo ranks; live CPU tensor MiB per rank{which}, start of step 3 -> "
          f"peak during it")
    for side in sides:
        per_rank = fs.run_local(_peak if args.count == "profiler" else _thread_peak, side, args.mode, args.backend,
                                world_size=args.world_size, timeout_s=3000)
        cells = "  ".join(f"rank {r}: {s / 2**20:.1f} -> {p / 2**20:.1f}" for r, (s, p) in enumerate(per_rank))
        print(f"  {side:<16} {cells}", flush=True)


if __name__ == "__main__":
    main()
