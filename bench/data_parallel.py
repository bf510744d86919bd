"""fshard FSDP / DDP vs torch's fully_shard / DistributedDataParallel, same model, same run.

    python bench/fsdp.py      # fshard FSDP vs fully_shard
    python bench/ddp.py       # fshard replicate vs DistributedDataParallel
    python bench/fsdp.py --compiled [--backend inductor]   # and compiled against compiled

The model is native_baseline.md's: decoder-only Transformer, vocab 512, dim 256, 4
layers, 4 heads, seq 128, MLP 4x, learned positions, untied head, fp32, AdamW lr 1e-3,
2 gloo ranks x batch 8, one thread per rank. Step time = slowest rank, median of
``--steps`` steps after 3 warm-up steps, each side measured alternately in the same
processes so that machine noise hits both alike; the ratio is the median of the per-step
ratios fshard / torch (each pair measured back to back), with its quartiles.

Peak memory per rank: each side is built alone in fresh processes under
``torch.profiler`` with ``profile_memory=True`` (so every CPU tensor allocation and free is
recorded from before the model exists), runs 3 steps, and the peak of the profiler's
running total of live CPU tensor bytes during the third step is reported, with the total
at that step's start (parameters, optimizer state and whatever a library keeps between
steps). This counts tensor storage from torch's CPU allocator only: gloo's own transport
buffers and Python objects are not included (on either side). tracemalloc cannot see
tensor memory, and ``ru_maxrss`` counts memory malloc keeps after ``free`` and cannot
tell two sides of one process apart.

``--compiled`` adds two sides, interleaved with the others (compiled against compiled):
fshard's step under ``fs.jit`` (forward, gradient and AdamW in one graph; the pure step of
``fshard.testing.transformer_train_step``, the same model and layer loop), and torch
compiled: for FSDP each block ``torch.compile(block, fullgraph=True)`` before
``fully_shard`` (torchtitan's recipe), for DDP the module compiled and then wrapped in DDP
(torch's advice: compile what DDP wraps, not the wrapper). Both keep their eager foreach
AdamW. The first step's time (trace + compile) is reported for both. ``--backend`` picks
the ``torch.compile`` backend (``aot_eager``: no code generation, a quick check).

Physical limit (``bench/_limits.py``), measured in the same processes after the timed steps:
compute = :func:`_compute_step` (the module's forward and backward on the rank's rows and
AdamW over its parameters or FSDP shard, no collective), wire = :func:`minimal_bytes` sent
by ring algorithms at the link rate of a large all-reduce on the same gloo group.
"""

from __future__ import annotations

import argparse
import os
import functools
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.models import TransformerConfig, TransformerModule, block, embed, head, transformer_init

CFG = dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def _native_step(mode: str, cfg: TransformerConfig, *, compiled: bool = False, backend: str = "inductor",
                 device_mesh=None):
    """torch's step: ``fully_shard`` per block and on the root (``mode="fsdp"``) or DDP, then
    ``loss.backward()`` and ``AdamW(foreach=True)`` (weight decay 0.01, as fshard's side).

    ``compiled``: fsdp compiles each block with ``torch.compile(block, fullgraph=True)``
    before ``fully_shard`` (torchtitan's order); DDP compiles the inner module and wraps
    the compiled module (torch's "where to apply torch.compile": compile what DDP wraps,
    not the wrapper; Dynamo's DDPOptimizer then cuts the graph at DDP's bucket bounds so
    that each bucket's all-reduce still starts during backward). The optimizer stays the
    eager foreach AdamW on both (torchtitan's recipe), built over the original parameters,
    which the compiled modules share.

    ``device_mesh``: a 1-D mesh to shard / all-reduce over instead of the world
    (``bench/gloo_workers.py``).
    """
    model = TransformerModule(cfg, seed=0)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for i, layer in enumerate(model.layers):
            if compiled:
                layer = model.layers[i] = torch.compile(layer, fullgraph=True, backend=backend)
            fully_shard(layer, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
        module = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        if compiled:
            model.compile(backend=backend)
        group = device_mesh.get_group() if device_mesh is not None else None
        module = DistributedDataParallel(model, process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)

    def step(tok, tgt):
        loss = F.cross_entropy(module(tok).flatten(0, 1), tgt.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _fshard_step(mode: str, cfg: TransformerConfig, mesh, bucket_mb: float = 25.0, check: bool = False):
    params = transformer_init(cfg, 0)
    if mode == "fsdp":
        specs, axes = fs.parallel.fsdp_specs(params, "d"), dict(axis="d")
    else:
        specs, axes = fs.parallel.replicate_specs(params), dict(axis=None, replicate_axis="d")
    loop_kw = dict(axes, config=fs.parallel.ScanConfig(bucket_bytes=int(bucket_mb * 2**20))) if mode != "fsdp" else axes
    sharded = fs.shard(params, specs, mesh, uneven=True)
    opt = fs.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(sharded)

    def loss_fn(p, tok, tgt):
        root = fs.parallel.gather_params({k: v for k, v in p.items() if k != "layers"}, **axes)
        x = embed(root, tok, cfg)                                            # (b, T, D)
        x = fs.parallel.scan_layers(lambda lp, h: block(lp, h, cfg), p["layers"], x, **loop_kw)
        logits = head(root, x, cfg)                                          # (b, T, V)
        return fs.lax.pmean(F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), "d")

    grad_fn = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=(specs, P("d"), P("d")),
                                             out_specs=P(), check=check))
    box = {"p": sharded, "s": state}

    def step(tok, tgt):
        loss, grads = grad_fn(box["p"], tok, tgt)
        with fs.optim.donate():
            updates, box["s"] = opt.update(grads, box["s"], box["p"])
            box["p"] = fs.optim.apply_updates(box["p"], updates)
        return loss

    return step


def _batches(cfg: TransformerConfig, batch: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per side, the step's arguments: native gets this rank's rows, fshard the global batch."""
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch * n, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, 1)
    rows = slice(r * batch, (r + 1) * batch)
    return {k: (tok[rows], tgt[rows]) if k.startswith("torch") else (tok, tgt) for k in SIDES}


def _jit_step(mode: str, cfg: TransformerConfig, mesh, backend: str):
    """fshard's step under ``fs.jit``: forward, gradient and AdamW in one compiled graph.

    ``fs.jit`` needs a pure step (no ``donate()``, no state in a closure): this is
    ``fshard.testing.transformer_train_step``'s, the one the fs.jit tests check against
    eager; the same model, layer loop and AdamW as :func:`_fshard_step`.
    """
    from fshard.testing import transformer_train_step

    step, params, state = transformer_train_step("fsdp" if mode == "fsdp" else "replicate", cfg, mesh, axis="d")
    jitted = fs.jit(step, backend=backend)
    box = {"p": params, "s": state}

    def call(tok, tgt):
        loss, box["p"], box["s"] = jitted(box["p"], box["s"], tok, tgt)
        return loss

    return call


# Every side's name: torch's steps (eager, compiled) get this rank's rows, fshard's the
# global batch. fshard_checked runs with --checked only, the compiled ones with --compiled.
SIDES = ("torch", "fshard", "fshard_checked", "torch_compiled", "fshard_jit")


def _make_step(side: str, mode: str, cfg: TransformerConfig, bucket_mb: float, backend: str = "inductor"):
    mesh = fs.make_mesh({"d": dist.get_world_size()})
    if side.startswith("torch"):
        return _native_step(mode, cfg, compiled=side == "torch_compiled", backend=backend)
    if side == "fshard_jit":
        return _jit_step(mode, cfg, mesh, backend)
    return _fshard_step(mode, cfg, mesh, bucket_mb, check=side == "fshard_checked")


def _compute_step(mode: str, cfg: TransformerConfig, batch: int):
    """The per-rank step without a collective, for the physical limit: the module's forward
    and backward on this rank's ``batch`` rows with every parameter whole (as both sides
    compute, after FSDP's gathers), then foreach AdamW over this rank's parameters: all of
    them (DDP) or a dim-0 ``1 / n`` slice of each (FSDP's shard), whose gradients are views
    of the whole gradients (a reduce-scatter's output stands in for no copy here)."""
    n, r = dist.get_world_size(), dist.get_rank()
    model = TransformerModule(cfg, seed=0)
    params = list(model.parameters())
    shards = [p.detach().tensor_split(n)[r].clone() for p in params] if mode == "fsdp" else params
    opt = torch.optim.AdamW(shards, lr=1e-3, weight_decay=0.01, foreach=True)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, 1)

    def step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(tok).flatten(0, 1), tgt.flatten()).backward()
        if mode == "fsdp":
            for s, p in zip(shards, params):
                s.grad = p.grad.tensor_split(n)[r]
        opt.step()

    return step


def minimal_bytes(mode: str, n: int, n_params: int, n_block: int) -> dict[str, int]:
    """Per rank, the input payload of the collectives one step needs at least (fp32)."""
    if mode == "fsdp":
        # per rank: the root group's shard is gathered once (kept for backward), each block's
        # twice (reshard after forward); the reduce-scatter takes the full gradient once.
        return {"all_gather": 4 * (n_params + n_block) // n, "psum_scatter": 4 * n_params}
    return {"psum": 4 * n_params}


def physical_limit(mode: str, cfg: TransformerConfig, compute_s: float):
    """This step's :class:`_limits.Limit` at ``compute_s`` seconds of compute (the slowest
    rank's :func:`_compute_step`), measuring the link rate (collective: every rank calls it)."""
    import _limits

    n = dist.get_world_size()
    init = transformer_init(cfg, 0)
    n_params = sum(x.numel() for x in fs.tree.leaves(init))
    n_block = sum(x.numel() for x in fs.tree.leaves(init["layers"]))
    sent = sum(_limits.ring_sent(k, v, n) for k, v in minimal_bytes(mode, n, n_params, n_block).items())
    return _limits.Limit(compute_s, sent, _limits.link_rate(), n, _limits.cores())


def timed_rounds(sides: dict[str, Callable[[], Any]], steps: int,
                 warmup: int = 3) -> tuple[dict[str, list[float]], dict[str, float], dict[str, list[Any]]]:
    """Runs every side once per round, in order, for ``warmup + steps`` rounds (collective:
    every rank calls it with the same sides).

    Args:
      sides: name -> a step without arguments that returns its loss.

    Returns:
      ``(times, first, losses)``: per side the step times of the rounds after the warm-up
      and of the first round (for a compiled side: trace + compile + one step), in seconds
      of the slowest rank, and what the step returned in every round.
    """
    times: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, list[Any]] = {k: [] for k in sides}
    first: dict[str, float] = {}
    for i in range(warmup + steps):
        for k, step in sides.items():
            dist.barrier()
            t0 = time.perf_counter()
            losses[k].append(step())
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            if i == 0:
                first[k] = dt.item()
            if i >= warmup:
                times[k].append(dt.item())
    return times, first, losses


def per_rank(mode: str, steps: int, batch: int, bucket_mb: float = 25.0, checked: bool = False,
             compiled: bool = False, backend: str = "inductor", cfg: dict | None = None):
    """Times every side, interleaved; returns ``(times, losses, bytes, counts, first, limit)``:
    per side the step times after warm-up and every step's global mean loss, fshard's
    collective bytes and counts of one step, per side the first step's time (for the
    compiled sides: trace + compile + one step), and the step's :func:`physical_limit`."""
    torch.set_num_threads(1)
    cfg = TransformerConfig(**(cfg or CFG))
    names = ["torch", "fshard"] + ["fshard_checked"] * checked + ["torch_compiled", "fshard_jit"] * compiled
    sides = {k: _make_step(k, mode, cfg, bucket_mb, backend) for k in names}
    args = _batches(cfg, batch)
    # The limit's compute runs as one more side in the same rounds: noise hits it alike.
    timed = {k: functools.partial(step, *args[k]) for k, step in sides.items()}
    times, first, raw = timed_rounds({**timed, "compute": _compute_step(mode, cfg, batch)}, steps)
    compute_s = statistics.median(times.pop("compute"))
    first.pop("compute"), raw.pop("compute")
    losses = {}
    for k, values in raw.items():
        if k.startswith("torch"):  # the native loss is this rank's; report the global mean like fshard
            values = [v.clone() for v in values]
            for v in values:
                dist.all_reduce(v)
            values = [v / dist.get_world_size() for v in values]
        losses[k] = [float(v.full_tensor() if hasattr(v, "full_tensor") else v) for v in values]
    with fs.comm_log() as log:
        sides["fshard"](*args["fshard"])
    return times, losses, dict(log.bytes), dict(log.counts), first, physical_limit(mode, cfg, compute_s)


def _tree_events(roots):
    stack = list(roots)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.children)


def peak_memory(side: str, mode: str, batch: int, bucket_mb: float = 25.0, backend: str = "inductor",
                cfg: dict | None = None) -> tuple[int, int]:
    """``(live bytes at the start of the third step, peak live bytes during it)`` of one side
    (:func:`step_peak_memory` of :func:`_make_step`'s step)."""
    def make():
        c = TransformerConfig(**(cfg or CFG))
        return _make_step(side, mode, c, bucket_mb, backend), _batches(c, batch)[side]

    return step_peak_memory(make)


def profiled_steps(make: Callable[[], tuple[Callable[..., Any], tuple]]) -> tuple[Any, list]:
    """Three steps of ``make()``'s step under the profiler (CPU memory on; collective: every
    rank calls it): the third step's profiler event and every CPU allocation event, by time."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step, args = make()
        for i in range(3):
            dist.barrier()
            with record_function(f"bench_step_{i}"):
                step(*args)
    events = list(_tree_events(prof.profiler.kineto_results.experimental_event_tree()))
    mark = next(e for e in events if e.name == "bench_step_2")
    return mark, sorted((e for e in events if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)


def step_peak_memory(make: Callable[[], tuple[Callable[..., Any], tuple]]) -> tuple[int, int]:
    """``(live bytes at the start of the third step, peak live bytes during it)`` of the step
    that ``make()`` returns with its arguments (collective: every rank calls it).

    Live bytes: the profiler's running total of CPU tensor storage allocated since it
    started (before ``make`` built the model) and not yet freed.
    """
    mark, allocs = profiled_steps(make)
    before = [e.extra_fields.total_allocated for e in allocs if e.start_time_ns < mark.start_time_ns]
    during = [e.extra_fields.total_allocated for e in allocs
              if mark.start_time_ns <= e.start_time_ns <= mark.end_time_ns]
    start = before[-1] if before else 0
    return start, max(during, default=start)


def _ratio(times: dict[str, list[float]], a: str, b: str) -> str:
    """``a / b``: the median of the per-step ratios (each pair measured back to back), quartiles, range."""
    r = sorted(x / y for x, y in zip(times[a], times[b]))
    q = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
    return f"{statistics.median(r):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, range {r[0]:.3f}-{r[-1]:.3f})"


def main(mode: str) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="replicate: gradient bucket size")
    ap.add_argument("--checked", action="store_true",
                    help="also time fshard in checked mode (shard_map(check=True)), interleaved with the others")
    ap.add_argument("--compiled", action="store_true",
                    help="also time fshard under fs.jit and torch compiled (fsdp: per-block torch.compile before "
                         "fully_shard; ddp: the module compiled, then DDP), interleaved with the others")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    args = ap.parse_args()
    times, losses, nbytes, counts, first, limit = fs.run_local(
        per_rank, mode, args.steps, args.batch, args.bucket_mb, args.checked, args.compiled, args.backend,
        world_size=args.world_size, timeout_s=3000)[0]
    mem_sides = ("torch", "fshard") + (("torch_compiled", "fshard_jit") if args.compiled else ())
    memory = {side: fs.run_local(peak_memory, side, mode, args.batch, args.bucket_mb, args.backend,
                                 world_size=args.world_size, timeout_s=3000) for side in mem_sides}
    cfg = TransformerConfig(**CFG)
    init = transformer_init(cfg, 0)
    n_params = sum(x.numel() for x in fs.tree.leaves(init))
    n_block = sum(x.numel() for x in fs.tree.leaves(init["layers"]))
    native = "fully_shard" if mode == "fsdp" else "DistributedDataParallel"
    names = {"torch": native, "fshard": f"fshard {mode}", "fshard_checked": f"fshard {mode} checked",
             "torch_compiled": f"{native} compiled", "fshard_jit": f"fshard {mode} fs.jit"}
    print(f"{mode}: {args.world_size} gloo ranks x batch {args.batch}, {n_params:,} params, median of {args.steps} steps")
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"  {native:<24} {med['torch']:.3f} s/step")
    print(f"  fshard {mode:<17} {med['fshard']:.3f} s/step   ratio fshard/torch: median of per-step ratios "
          f"{_ratio(times, 'fshard', 'torch')}")
    if args.checked:
        print(f"  fshard {mode} checked {med['fshard_checked']:.3f} s/step   ratio checked/torch: median "
              f"{_ratio(times, 'fshard_checked', 'torch')}; checked/unchecked "
              f"{statistics.median(c / u for c, u in zip(times['fshard_checked'], times['fshard'])):.3f}")
    if args.compiled:
        print(f"  {names['torch_compiled']:<24} {med['torch_compiled']:.3f} s/step   ratio to {native}: "
              f"{_ratio(times, 'torch_compiled', 'torch')}")
        print(f"  {names['fshard_jit']:<24} {med['fshard_jit']:.3f} s/step   ratio fs.jit/torch compiled: "
              f"{_ratio(times, 'fshard_jit', 'torch_compiled')}; fs.jit/torch: {_ratio(times, 'fshard_jit', 'torch')}")
        print(f"  first step (trace + compile, backend {args.backend}): torch compiled "
              f"{first['torch_compiled']:.1f} s, fs.jit {first['fshard_jit']:.1f} s")
    print("  first losses  " + "  ".join(f"{k} {v[:3]}" for k, v in losses.items()))
    minimum = minimal_bytes(mode, args.world_size, n_params, n_block)
    print(f"  fshard collectives per step: {counts}")
    print(f"  bytes per rank (input payload): {nbytes}  theoretical minimum: {minimum}")
    print("  " + limit.line({names[k]: statistics.median(v) for k, v in times.items()}))
    print("  peak live CPU tensor memory per rank (torch profiler; start of step -> peak during step):")
    for side in mem_sides:
        cells = "  ".join(f"rank {r}: {s / 2**20:.1f} -> {p / 2**20:.1f} MiB" for r, (s, p) in enumerate(memory[side]))
        print(f"    {names[side]:<24} {cells}")
