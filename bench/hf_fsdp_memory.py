"""Peak memory of per-block FSDP (``fs.parallel.fsdp_apply``) vs a whole-model gather, on a
Hugging Face Llama built from a random config.

    python bench/hf_fsdp_memory.py [--layers 8] [--dim 256] [--world-size 2] [--compiled [--backend inductor]]

Both sides train the same ``transformers.LlamaForCausalLM`` through ``fs.nn.functionalize``
on the same fsdp mesh, fp32, AdamW: ``whole`` gathers every parameter with one
``fs.parallel.gather_params`` before the forward (what FSDP over a module was before
``fsdp_apply``), ``per-block`` wraps the apply with ``fsdp_apply(blocks="model.layers")``
(one group per decoder layer, prefetch 1, reshard after forward). Each side runs alone in
fresh processes under ``torch.profiler`` with ``profile_memory=True`` (the method of
``bench/data_parallel.py``, with a ``gc.collect()`` before each step); reported per rank:
live CPU tensor bytes before the first step (parameter shards, optimizer state, and the
module's own full-size tensors, which ``functionalize`` leaves in place) + the smallest
increase from a step's start to its peak over ``--steps`` steps = the peak (see
:func:`summary` for why the smallest). gloo's buffers and Python objects are not counted.

The profiler's running total misses some frees done on gloo's threads, so its numbers
vary by whole buffers from run to run. The first table comes from :class:`LiveTensorBytes`
instead (a dispatch mode that counts each storage an op creates until its last tensor
dies): the peak of the tensors created during the gradient step alone, and during the
whole step with the update; it is exact and repeatable, and it is what
``tests/parallel/test_parallel_module.py`` checks.

``--compiled`` adds both sides under ``fs.jit`` (``whole jit``, ``per-block jit``: the
gradient step and the AdamW update in one captured graph, compiled by ``--backend``) to the
profiler table, with their last loss, which must equal the eager side's. Not to the first
table: Inductor's generated code allocates its buffers outside the dispatcher, where a
dispatch mode cannot see them. The module's buffers (the rotary ``inv_freq``) go into the
jitted step as an argument (``apply(..., buffers=)``): fs.jit cannot capture a real tensor
that the function closes over. There is no native side (no torch FSDP of this model here).
"""

from __future__ import annotations

import argparse
import os
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.plan.probe import StorageWatch


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


def _model(layers: int, dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=dim, intermediate_size=int(2.75 * dim), num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg)


SIDES = ("whole", "per-block", "whole jit", "per-block jit")


def make_step(side: str, layers: int, dim: int, rows: int, seq: int, dtype: torch.dtype = torch.float32,
              backend: str = "inductor"):
    """Two closures for one training step of ``side`` (one of :data:`SIDES`) on this rank:
    ``grad_step() -> (loss, grads)`` (forward, backward and the gradient reductions) and
    ``update(grads)`` (the AdamW update of the sharded parameters). A ``jit`` side's
    ``grad_step`` runs the whole step, update included, as one ``fs.jit`` call compiled by
    ``backend``, and returns ``(loss, None)``; its ``update`` does nothing."""
    mesh = fs.make_mesh({"fsdp": dist.get_world_size()})
    apply, params, buffers = fs.nn.functionalize(_model(layers, dim).to(dtype))
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    if side.startswith("per-block"):
        per_block = fs.parallel.fsdp_apply(apply, blocks="model.layers", axis="fsdp")

        def wrapped(p, b, tok):
            return per_block(p, tok, buffers=b)
    else:
        def wrapped(p, b, tok):
            return apply(fs.parallel.gather_params(p, axis="fsdp"), tok, buffers=b)

    def loss_fn(p, b, tok):
        logits = wrapped(p, b, tok[:, :-1]).logits
        return fs.lax.pmean(F.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten()), "fsdp")

    # The eager sides leave the buffers in the module (buffers=None); the jit sides pass them.
    step = fs.shard_map(fs.value_and_grad(lambda p, tok: loss_fn(p, None, tok)), mesh=mesh,
                        in_specs=(specs, P("fsdp")), out_specs=(P(), specs))
    opt = fs.optim.adamw(1e-3)
    box = {"p": fs.shard(params, specs, mesh, uneven=True)}
    box["s"] = opt.init(box["p"])
    n = rows * dist.get_world_size()
    tok = torch.randint(0, 512, (n, seq + 1), generator=torch.Generator().manual_seed(0))
    if side.endswith(" jit"):
        grad_fn = fs.shard_map(fs.value_and_grad(loss_fn), mesh=mesh, in_specs=(specs, P(), P("fsdp")),
                               out_specs=(P(), specs))

        def whole_step(p, s, b, tok):
            loss, grads = grad_fn(p, b, tok)
            updates, s = opt.update(grads, s, p)
            return loss, fs.optim.apply_updates(p, updates), s

        jitted = fs.jit(whole_step, backend=backend)
        # A captured graph has no autograd of its own: its inputs are plain (detached) tensors.
        box["p"] = fs.tree.tree_map(lambda x: x.detach(), box["p"])

        def jit_step():
            loss, box["p"], box["s"] = jitted(box["p"], box["s"], buffers, tok)
            return loss, None

        return jit_step, lambda grads: None

    def grad_step():
        return step(box["p"], tok)

    def update(grads) -> None:
        updates, box["s"] = opt.update(grads, box["s"], box["p"])
        box["p"] = fs.optim.apply_updates(box["p"], updates)

    return grad_step, update


def step_memory(side: str, layers: int, dim: int, rows: int, seq: int, steps: int = 5,
                dtype: torch.dtype = torch.float32, backend: str = "inductor") -> tuple[list[tuple[int, int]], float]:
    """Per step, ``(live bytes at its start, peak live bytes during it)`` on this rank, and
    the last loss. Live bytes: the profiler's running total of CPU tensor storage."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grad_step, update = make_step(side, layers, dim, rows, seq, dtype, backend)
        for i in range(steps):
            gc.collect()  # garbage from the previous step (reference cycles) would count as live
            dist.barrier()
            with record_function(f"bench_step_{i}"):
                loss, grads = grad_step()
                update(grads)
                loss = loss.item()
                del grads
    stack, events = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        e = stack.pop()
        events.append(e)
        stack.extend(e.children)
    allocs = sorted((e for e in events if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    out = []
    for i in range(steps):
        mark = next(e for e in events if e.name == f"bench_step_{i}")
        before = [e.extra_fields.total_allocated for e in allocs if e.start_time_ns < mark.start_time_ns]
        during = [e.extra_fields.total_allocated for e in allocs
                  if mark.start_time_ns <= e.start_time_ns <= mark.end_time_ns]
        start = before[-1] if before else 0
        out.append((start, max(during, default=start)))
    return out, loss


class LiveTensorBytes(StorageWatch):
    """Live bytes of the tensor storage that ops create while the mode is on, and their peak.

    Each new storage an op returns is counted until the last tensor on it dies
    (:class:`fshard.plan.probe.StorageWatch`: on whichever thread releases it). Tensors
    that existed before the mode are not counted (nor views of them, nor in-place
    results), nor what a tensor subclass (DTensor) computes inside its own dispatch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, tensors on it]
        self.total = self.peak = 0

    def born(self, t: torch.Tensor, key: int, args: tuple, kwargs: dict) -> bool:
        entry = self.live.get(key)
        if entry is None:
            inputs = {x.untyped_storage().data_ptr() for x in torch.utils._pytree.tree_leaves((args, kwargs))
                      if type(x) is torch.Tensor}
            if key in inputs:
                return False  # a view (or in-place result) of memory that existed before the mode
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
        entry[1] += 1
        return True

    def died(self, key: int, now_ns: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.total -= entry[0]


def step_peak(side: str, layers: int, dim: int, rows: int, seq: int, steps: int = 3,
              dtype: torch.dtype = torch.float32) -> list[tuple[int, int]]:
    """Per step on this rank, ``(gradient peak, step peak)``: the peak bytes of tensors
    created during the gradient step (forward, backward, gradient reductions), and during
    the whole step (the same, then the optimizer update while the gradients are held).
    Deterministic (no profiler, no thread races): the numbers the test checks. Eager sides
    only (a compiled graph's buffers are invisible to the dispatch mode)."""
    if side.endswith(" jit"):
        raise ValueError(f"step_peak: side {side!r}: the dispatch mode cannot see a compiled step's allocations; "
                         "use step_memory")
    torch.set_num_threads(1)
    grad_step, update = make_step(side, layers, dim, rows, seq, dtype)
    peaks = []
    for _ in range(steps):
        gc.collect()
        dist.barrier()
        mode = LiveTensorBytes()
        with mode:
            _, grads = grad_step()
            grad_peak = mode.peak
            update(grads)
            del grads
        peaks.append((grad_peak, mode.peak))
    return peaks


def summary(per_step: list[tuple[int, int]]) -> tuple[int, int]:
    """``(live bytes before the first step, smallest step increment peak - start)``.

    The running total misses frees that happen on gloo's threads (an async collective's
    buffer whose last reference the worker drops), so it drifts up by whole flat buffers
    from step to step, at random (the tensors Python can reach stay constant: checked).
    A missed free only ever inflates a number, so the first step's start (no collective
    has run yet) and the smallest per-step increment are the least biased.
    """
    return per_step[0][0], min(p - s for s, p in per_step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--rows", type=int, default=2, help="rows per rank")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--compiled", action="store_true",
                    help="also both sides under fs.jit (whole step in one graph), in the profiler table")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    args = ap.parse_args()
    import transformers  # noqa: F401  (imported once here; the forked ranks inherit it)

    n_params = sum(p.numel() for p in _model(args.layers, args.dim).parameters())
    print(f"Llama {args.layers} layers, dim {args.dim}: {n_params:,} params ({4 * n_params / 2**20:.1f} MiB fp32), "
          f"{args.world_size} ranks x {args.rows} rows x {args.seq} tokens")
    mib = lambda b: f"{b / 2**20:.2f}"
    print("tensors created during a step (TorchDispatchMode), per rank, max over steps: gradient step / whole step "
          "with the AdamW update, MiB")
    for side in ("whole", "per-block"):
        res = fs.run_local(step_peak, side, args.layers, args.dim, args.rows, args.seq, args.steps,
                           world_size=args.world_size, timeout_s=3000)
        print(f"  {side:<10} " + "  ".join(f"rank {r}: {mib(max(g for g, _ in p))} / {mib(max(t for _, t in p))}"
                                             for r, p in enumerate(res)))
    print("torch.profiler live CPU tensor bytes, per rank: before the first step + smallest step increment = peak, MiB")
    losses = {}
    for side in SIDES if args.compiled else SIDES[:2]:
        res = fs.run_local(step_memory, side, args.layers, args.dim, args.rows, args.seq, args.steps,
                           torch.float32, args.backend, world_size=args.world_size, timeout_s=3000)
        losses[side] = res[0][1]
        cells = []
        for r, (per_step, _) in enumerate(res):
            base, inc = summary(per_step)
            cells.append(f"rank {r}: {mib(base)} + {mib(inc)} = {mib(base + inc)}")
        print(f"  {side:<13} loss {res[0][1]:.6f}  " + "  ".join(cells))
    for side in SIDES[2:] if args.compiled else ():
        eager = side.removesuffix(" jit")
        if abs(losses[side] - losses[eager]) > 1e-4 * abs(losses[eager]):
            raise SystemExit(f"{side}: last loss {losses[side]} differs from {eager}'s {losses[eager]}")


if __name__ == "__main__":
    main()
