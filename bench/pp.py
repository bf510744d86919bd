"""fshard's pipeline_step vs torch.distributed.pipelining, same model, same schedule, same run.

    PYTHONPATH=. python bench/pp.py [--steps 20] [--batch 16] [--microbatches 4 8] [--plot PATH]
        [--compiled [--backend inductor]] [--schedules gpipe 1f1b zb-h1]

The model is native_baseline.md's Transformer (vocab 512, dim 256, 4 layers, 4 heads,
seq 128, MLP 4x, untied head, fp32) cut in 2 stages: stage 0 = embeddings + blocks 0-1,
stage 1 = blocks 2-3 + norm + head, cross-entropy loss; 2 gloo ranks, one thread each,
global batch ``--batch`` split into m microbatches. Each step is forward + backward of
all microbatches (no optimizer): fshard's ``pipeline_step`` on ``fs.sched.gpipe(2, m)``
and ``fs.sched.one_f_one_b(2, m)`` against torch's ``ScheduleGPipe`` and
``Schedule1F1B``, and ZB-H1 (``fs.sched.zero_bubble(2, m)``, backward split into I and
W) against torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank (which
runs the same order), over ``PipelineStage`` modules holding the same weights. Step time =
slowest rank, median of ``--steps`` steps after 3 warm-up steps, all four alternating
in the same processes.

Bubble: "measured" is 1 - busy / step time on each rank (median over steps, mean over
ranks), where busy is the time inside compute: fshard's own per-action timers
(``StepStats.busy_s``), and for torch timers wrapped around its stage's
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` and its
loss (receives are waited outside them in both). "simulated" is ``fs.sched.simulate``
at unit costs (F = I = W = 1, full B = 2) and at the mean F, I and W times fshard
measured (a full B split 1:1).

``--compiled`` (``--backend``, default ``inductor``) adds two sides per schedule, interleaved
with the others: fshard's ``pipeline_step`` under ``fs.jit`` (each rank's whole step one
captured graph; under Inductor the compute between the point-to-point transfers is compiled
region by region and the transfers run eagerly in program order, see ``fshard/jit/p2p.py``),
and torch's schedule over a copy of the stage whose blocks are each ``torch.compile``d
(torchtitan's per-block recipe; not for ZB-H1: torch's zero-bubble schedules refuse a
compiled stage module). Their ratios are medians of per-step ratios against torch's
eager step of the same schedule (each compiled step paired with the eager torch step just
before it), and their first step (trace + compile + run) is reported. fs.jit's gradients are
checked against torch 1F1B's with the others.

Physical limit (``bench/_limits.py``; the table's last two columns), measured in the same
processes, the stage costs in the timed rounds: :func:`physical_limits` (the schedule
simulated at the slowest stage's measured F and B per microbatch, plus the activations sent at the link rate
of a large all-reduce on the same gloo group).
"""

from __future__ import annotations

import argparse
import os
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fshard as fs
from fshard.models import TransformerConfig, TransformerModule, block, embed, head, transformer_init

CFG = dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)
NAMES = ("gpipe", "1f1b", "zb-h1")


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


class _Stage(nn.Module):
    """Blocks [lo, hi) of a TransformerModule, with embeddings (first) or head (last)."""

    def __init__(self, model: TransformerModule, lo: int, hi: int, first: bool) -> None:
        super().__init__()
        self.first = first
        self.layers = nn.ModuleList(model.layers[lo:hi])
        if first:
            self.tok_embeddings, self.pos_embeddings = model.tok_embeddings, model.pos_embeddings
        else:
            self.norm, self.output = model.norm, model.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # (b, T) tokens -> (b, T, D)
            x = self.tok_embeddings(x) + self.pos_embeddings(torch.arange(x.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return x if self.first else self.output(self.norm(x))  # (b, T, D) or (b, T, V)


def _loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def per_rank(steps: int, batch: int, microbatches: list[int], compiled: bool = False, backend: str = "inductor",
             cfg: dict | None = None, schedules: tuple[str, ...] = NAMES):
    """Times every side, interleaved. Returns per side (``(kind, schedule, m)``, kind one of
    ``torch``, ``fshard``, and with ``compiled`` ``torch_compiled``, ``fshard_jit``): median
    s/step, median bubble, fshard's last StepStats, first loss, the schedules, gradient errors
    against torch 1F1B, every timed step's seconds (for per-step ratios: the sides take turns
    within each round), the first step's seconds (compiled sides), and per ``(schedule, m)``
    the step's :func:`physical_limits`."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleavedZeroBubble)

    torch.set_num_threads(1)
    mesh = fs.make_mesh({"pp": 2})
    rank = mesh.axis_index("pp")
    cfg = TransformerConfig(**(cfg or CFG))
    half = cfg.n_layers // 2
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, 1)

    params = transformer_init(cfg, 0)
    mine = range(0, half) if rank == 0 else range(half, cfg.n_layers)
    entry = {"layers": {str(i): params["layers"][i] for i in mine}}
    entry.update({k: params[k] for k in (("tok_embeddings", "pos_embeddings") if rank == 0
                                          else ("norm", "output"))})
    stage_params = [entry, None] if rank == 0 else [None, entry]

    def stage_fn(p, x, s):
        x = embed(p, x, cfg) if s == 0 else x                      # (b, T, D)
        for key in sorted(p["layers"], key=int):
            x = block(p["layers"][key], x, cfg)
        return head(p, x, cfg) if s == 1 else x                    # (b, T, V) or (b, T, D)

    module = _Stage(TransformerModule(cfg, seed=0), mine.start, mine.stop, rank == 0)
    modules = {"torch": module}
    if compiled:  # torchtitan's recipe: each block compiled, on a copy with the same weights
        modules["torch_compiled"] = _Stage(TransformerModule(cfg, seed=0), mine.start, mine.stop, rank == 0)
        for i, layer in enumerate(modules["torch_compiled"].layers):
            modules["torch_compiled"].layers[i] = torch.compile(layer, fullgraph=True, backend=backend)
    torch_busy = [0.0]
    sides, sched_of = {}, {}
    for m in microbatches:
        zb_h1 = lambda st, m, **kw: ScheduleInterleavedZeroBubble([st], m, **kw)  # noqa: E731
        for name, ours, theirs in (("gpipe", fs.sched.gpipe, ScheduleGPipe),
                                   ("1f1b", fs.sched.one_f_one_b, Schedule1F1B),
                                   ("zb-h1", fs.sched.zero_bubble, zb_h1)):
            if name not in schedules:
                continue
            sch = ours(2, m)
            sched_of[(name, m)] = sch
            for kind, mod in modules.items():
                if kind == "torch_compiled" and name == "zb-h1":
                    continue  # torch: "not supported with stage modules that have used torch.compile"
                stage = PipelineStage(mod, rank, 2, torch.device("cpu"), group=mesh.group("pp"))
                native = theirs(stage, m, loss_fn=_loss)
                # torch's compute: its stage's forward/backward chunks and the loss (the
                # schedule waits for receives outside them), timed like fshard's actions.
                for obj, attr in ((stage, "forward_one_chunk"), (stage, "backward_one_chunk"),
                                  (stage, "backward_weight_one_chunk"),
                                  (native, "_maybe_compute_loss")):
                    setattr(obj, attr, _timed(getattr(obj, attr), torch_busy))

                def torch_step(native=native, mod=mod):
                    torch_busy[0] = 0.0
                    mod.zero_grad(set_to_none=True)
                    if rank == 0:
                        native.step(tok)
                        return None
                    losses: list[torch.Tensor] = []
                    native.step(target=tgt, losses=losses)
                    return torch.stack(losses).mean()

                sides[(kind, name, m)] = torch_step

            def fshard_step(sch=sch):
                return fs.sched.pipeline_step(stage_fn, _loss, stage_params, (tok, tgt),
                                              schedule=sch, mesh=mesh, return_stats=True)

            sides[("fshard", name, m)] = fshard_step
            if compiled:
                def pp_step(sp, tok, tgt, sch=sch):
                    return fs.sched.pipeline_step(stage_fn, _loss, sp, (tok, tgt), schedule=sch, mesh=mesh)

                sides[("fshard_jit", name, m)] = functools.partial(fs.jit(pp_step, backend=backend),
                                                                   stage_params, tok, tgt)

    times = {k: [] for k in sides}
    bubble = {k: [] for k in sides if k[0] != "fshard_jit"}  # a captured step has no timers
    stats = {}
    first_loss = {}
    first = {}
    samples = {m: [] for m in microbatches}  # the limit's stage costs, one per round: noise hits them alike
    for i in range(steps + 3):
        for m in microbatches:
            sample = _stage_sample(module, rank == 0, cfg, tok, tgt, m)
            if i >= 3:
                samples[m].append(sample)
        module.zero_grad(set_to_none=True)
        for k, step in sides.items():
            dist.barrier()
            t0 = time.perf_counter()
            out = step()
            dt = torch.tensor([time.perf_counter() - t0])
            busy = out[2].busy_s if k[0] == "fshard" else torch_busy[0]
            if i >= 3 and k in bubble:
                bubble[k].append(1 - busy / dt.item())  # this rank's idle share of its step
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            if i == 0 and k[0] in ("fshard_jit", "torch_compiled"):
                first[k] = dt.item()
            if i >= 3:
                times[k].append(dt.item())
            if k[0] in ("fshard", "fshard_jit"):
                if k[0] == "fshard":
                    stats[k[1:]] = out[2]
                first_loss.setdefault(k, float(out[0]))
            elif out is not None:
                first_loss.setdefault(k, float(out.detach()))

    # Same gradients everywhere: torch 1F1B's .grad (scaled by 1/m) vs every fshard schedule.
    grad_err = {}
    for m in microbatches:
        sides[("torch", "1f1b", m)]()
        ref = {_global_name(n, mine.start): p.grad for n, p in module.named_parameters()}
        for name in schedules:
            for kind in ("fshard", "fshard_jit") if compiled else ("fshard",):
                grads = sides[(kind, name, m)]()[1]
                got = dict(fs.tree.leaves_with_path(grads[rank]))
                label = name if kind == "fshard" else f"{name} jit"
                grad_err[(label, m)] = max((got[k] - g).abs().max().item() for k, g in ref.items())
    module.zero_grad(set_to_none=True)
    limits = physical_limits(samples, sched_of, 4 * batch * cfg.max_seq_len * cfg.dim)
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: statistics.median(v) for k, v in bubble.items()}, stats, first_loss, sched_of,
            grad_err, times, first, limits)


def _stage_sample(module: nn.Module, first: bool, cfg: TransformerConfig, tok: torch.Tensor, tgt: torch.Tensor,
                  m: int) -> tuple[float, float]:
    """This rank's stage, forward and full backward of one of ``m`` microbatches, without a
    transfer: seconds of each, once (stage 0 backpropagates a fixed output gradient, stage 1
    its loss from a fixed input). Gradients accumulate into the module's ``.grad``: the
    caller clears them."""
    b = tok.shape[0] // m
    x = tok[:b] if first else torch.randn(b, cfg.max_seq_len, cfg.dim, requires_grad=True)
    t0 = time.perf_counter()
    y = module(x)
    out = y if first else _loss(y, tgt[:b])
    t1 = time.perf_counter()
    out.backward(torch.randn(b, cfg.max_seq_len, cfg.dim) if first else None)
    return t1 - t0, time.perf_counter() - t1


def physical_limits(samples: dict[int, list[tuple[float, float]]], sched_of: dict, sent: int) -> dict:
    """Per ``(schedule, m)``, the step's :class:`_limits.Limit` (collective: every rank calls it).

    Compute: ``fs.sched.simulate``'s makespan of the schedule at the slowest stage's median F
    and B per microbatch (``samples[m]``: :func:`_stage_sample`'s, one per timed round; a full
    B split 1:1 into I and W), that is the stage's work times m plus the schedule's own
    bubble, with free transfers. Taking the slowest stage for both counts the faster one's
    work at the slower's cost: the limit of a pipeline balanced to its slowest stage. Wire:
    ``sent`` bytes per rank (one activation or its gradient per microbatch).
    """
    import _limits

    costs = {m: tuple(_limits.slowest(statistics.median(x[j] for x in v)) for j in (0, 1))
             for m, v in samples.items()}
    rate = _limits.link_rate()
    out = {}
    for (name, m), sch in sched_of.items():
        f, b = costs[m]
        compute = float(fs.sched.simulate(sch, f=f, b=b / 2, w=b / 2).makespan)
        out[(name, m)] = _limits.Limit(compute, sent, rate, 2, _limits.cores())
    return out


def _global_name(name: str, start: int) -> str:
    parts = name.split(".")
    if parts[0] == "layers":
        parts[1] = str(int(parts[1]) + start)
    return ".".join(parts)


def _timed(fn, acc: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter() - t0
    return wrapper


def _kind_means(spans) -> tuple[float, float, float]:
    """Mean F, I and W seconds (a full B counts as I + W, split in the unit ratio 1:1)."""
    t = {k: [e - s for a, s, e in spans if a.kind.value == k] for k in "FBIW"}
    i = t["I"] + [x / 2 for x in t["B"]]
    w = t["W"] + [x / 2 for x in t["B"]]
    return statistics.mean(t["F"]), statistics.mean(i), statistics.mean(w)


def _plot(path: str, results: list, microbatches: list[int], m: int) -> None:
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: a small SVG
        _draw(path, results, m, Figure, Patch)


def _draw(path: str, results: list, m: int, Figure, Patch) -> None:

    colors = {"F": "#4C72B0", "B": "#8172B2", "I": "#55A868", "W": "#DD8452"}
    names = [n for n in NAMES if (n, m) in results[0][2]]
    fig = Figure(figsize=(10, 1.8 * len(names)))
    for row, name in enumerate(names):
        ax = fig.add_subplot(len(names), 1, row + 1)
        for rank, res in enumerate(results):
            st = res[2][(name, m)]
            for a, s, e in st.spans:
                ax.barh(rank, e - s, left=s, height=0.8, color=colors[a.kind.value],
                        edgecolor="white", linewidth=0.5)
                ax.text((s + e) / 2, rank, str(a.microbatch), ha="center", va="center",
                        fontsize=7, color="white")
        sim = fs.sched.simulate(results[0][4][(name, m)])
        ax.set_yticks([0, 1], ["rank 0", "rank 1"])
        ax.set_ylim(1.5, -0.5)
        ax.set_title(f"fshard {name}, p=2, m={m}: measured timeline (last step); simulated "
                     f"bubble at F=I=W=1: {float(sim.bubble_fraction):.0%}", fontsize=9)
    ax.set_xlabel("seconds from the start of the action loop")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper right",
               fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--plot", default="", help="write the measured timelines (.svg or .png)")
    ap.add_argument("--compiled", action="store_true",
                    help="add fshard under fs.jit and torch with per-block torch.compile")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    ap.add_argument("--schedules", nargs="+", choices=NAMES, default=list(NAMES))
    args = ap.parse_args()
    results = fs.run_local(per_rank, args.steps, args.batch, args.microbatches, args.compiled, args.backend,
                           None, tuple(args.schedules), world_size=2, timeout_s=3000)
    times, _, _, _, schedules, _, raw, first, limits = results[0]
    print(f"pipeline: 2 gloo ranks, global batch {args.batch}, median of {args.steps} steps "
          f"(forward + backward, no optimizer)")
    print("| schedule | m | torch s/step | fshard s/step | ratio | measured bubble torch / fshard "
          "| simulated bubble (F=I=W=1 / measured F,I,W) | limit s: no overlap / overlap "
          "| torch / fshard of the limit (no overlap) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.microbatches:
        for name in args.schedules:
            tt, tf = times[("torch", name, m)], times[("fshard", name, m)]
            bub_t = statistics.mean(r[1][("torch", name, m)] for r in results)
            bub_f = statistics.mean(r[1][("fshard", name, m)] for r in results)
            costs = [round(statistics.mean(x[k] for x in (_kind_means(r[2][(name, m)].spans)
                                                          for r in results)) * 1e4)
                     for k in range(3)]  # integer 0.1 ms units
            sch = schedules[(name, m)]
            sim_unit = float(fs.sched.simulate(sch).bubble_fraction)
            sim_meas = float(fs.sched.simulate(sch, f=costs[0], b=costs[1], w=costs[2])
                             .bubble_fraction)
            lim = limits[(name, m)]
            print(f"| {name} | {m} | {tt:.3f} | {tf:.3f} | {tf / tt:.2f} | {bub_t:.0%} / "
                  f"{bub_f:.0%} | {sim_unit:.0%} / {sim_meas:.0%} | {lim.serial_s:.3f} / {lim.overlap_s:.3f} "
                  f"| {tt / lim.serial_s:.2f} / {tf / lim.serial_s:.2f} |")
    if args.compiled:
        print(f"\ncompiled ({args.backend}): median of per-step ratios against torch eager's step of the "
              f"same schedule; first step = trace + compile + one step")
        print("| schedule | m | torch eager s/step | torch compiled s/step | fshard eager s/step | fs.jit s/step "
              "| fs.jit / torch eager | fs.jit / torch compiled | fs.jit / fshard eager | torch compiled / torch "
              "eager | first step: fs.jit / torch compiled |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for m in args.microbatches:
            for name in args.schedules:
                def r(a, b, name=name, m=m):  # median of per-step ratios, a's step / b's in the same round
                    if (a, name, m) not in raw or (b, name, m) not in raw:
                        return "n/a"  # torch's ZB schedules refuse compiled stage modules
                    return f"{statistics.median(x / y for x, y in zip(raw[(a, name, m)], raw[(b, name, m)])):.3f}"

                def t(kind, name=name, m=m):
                    return f"{times[(kind, name, m)]:.3f}" if (kind, name, m) in times else "n/a"

                def f(kind, name=name, m=m):
                    return f"{first[(kind, name, m)]:.1f}" if (kind, name, m) in first else "n/a"
                print(f"| {name} | {m} | {t('torch')} | {t('torch_compiled')} | {t('fshard')} | {t('fshard_jit')} | "
                      f"**{r('fshard_jit', 'torch')}** | {r('fshard_jit', 'torch_compiled')} | "
                      f"{r('fshard_jit', 'fshard')} | {r('torch_compiled', 'torch')} | "
                      f"{f('fshard_jit')} / {f('torch_compiled')} s |")
    m0, name0 = args.microbatches[0], args.schedules[0]
    print(limits[(name0, m0)].line({f"torch {name0} m={m0}": times[("torch", name0, m0)],
                                    f"fshard {name0} m={m0}": times[("fshard", name0, m0)]})
          + " (compute: the schedule simulated at the slowest stage's measured F and B; other rows: the table)")
    losses = results[1][3]
    print("max |grad - torch 1F1B grad| over both ranks:",
          {f"{k[0]} m={k[1]}": f"{max(r[5][k] for r in results):.1e}" for k in results[0][5]})
    print("first losses (rank 1):",
          {f"{k[0]} {k[1]} m={k[2]}": round(v, 6) for k, v in losses.items()})
    if args.plot:
        _plot(args.plot, results, args.microbatches, args.microbatches[0])
        print("wrote", args.plot)


if __name__ == "__main__":
    main()
