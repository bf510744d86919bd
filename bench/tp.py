"""fshard tensor parallel vs torch's parallelize_module (Colwise/RowwiseParallel), same model, same run.

    python bench/tp.py [--steps 20] [--batch 8]

Model: native_baseline.md's Transformer (vocab 512, dim 256, 4 layers, 4 heads, seq 128,
MLP 4x, untied, fp32), AdamW lr 1e-3, 2 gloo ranks = tp 2, every rank on the same batch of
8 sequences, one thread per rank.

torch: ``TransformerModule`` parallelized with torchtitan's plan: ``tok_embeddings``
RowwiseParallel (vocab-parallel), wq/wk/wv and w1 ColwiseParallel, wo and w2
RowwiseParallel, ``output`` ColwiseParallel with vocab-sharded DTensor logits and
``loss_parallel()`` cross entropy; attention uses the local head count (as torchtitan
sets ``n_heads`` per rank); AdamW (foreach) over DTensor and plain parameters in two groups.

fshard: ``tp_specs(TRANSFORMER_TP_PLAN)``, ``tp_embed`` / ``tp_transformer_block`` /
``tp_logits`` / ``vocab_parallel_cross_entropy`` in an unchecked shard_map (Megatron
style), plus the same with sequence parallelism; ``fs.optim.adamw`` under ``donate()``.

Step time = slowest rank, median of ``--steps`` steps after 3 warm-up steps; the sides
alternate step by step in the same processes, so machine noise hits all alike. Bytes =
input payload of every collective a rank issues (both sides counted by one dispatch mode
that lets DTensor lower its redistributions into plain functional collectives first).

Physical limit (``bench/_limits.py``), measured in the same processes after the timed steps:
compute = :func:`_compute_step` (one rank's sharded shapes, no collective), wire =
:func:`minimal_sent` (Megatron's activation all-reduces) at the link rate of a large
all-reduce on the same gloo group; TP + SP is held to the same limit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import types
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import fshard as fs
from fshard import P
from fshard.models import TransformerConfig, TransformerModule, transformer_init
from fshard.parallel import (TRANSFORMER_TP_PLAN, tp_embed, tp_logits, tp_specs, tp_transformer_block,
                             vocab_parallel_cross_entropy)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_parallel import timed_rounds  # noqa: E402

CFG = dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, max_seq_len=128)
_F = torch.ops._c10d_functional
# fshard's reduce-scatter on gloo is an all_to_all_single of the whole input (fs.comm): the
# same input bytes and (n-1)/n of them sent, so it counts as one.
_KINDS = {_F.all_reduce.default: "all_reduce", _F.all_gather_into_tensor.default: "all_gather",
          _F.reduce_scatter_tensor.default: "reduce_scatter", _F.all_to_all_single.default: "reduce_scatter"}


# Time what a torchrun job runs: run_local's ranks would otherwise agree on every collective's
# header first (FSHARD_CHECK_COLLECTIVES=1, their default). Set it to 1 to time that instead.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "0")


class _Wire(TorchDispatchMode):
    """Counts functional collectives and their input bytes, after DTensor has lowered its ops."""

    def __init__(self) -> None:
        super().__init__()
        self.counts, self.bytes = Counter(), Counter()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if any(t is DTensor for t in types_):
            return NotImplemented  # let DTensor run and issue plain collectives, then count those
        kind = _KINDS.get(func)
        if kind is not None:
            self.counts[kind] += 1
            self.bytes[kind] += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _local_heads_forward(self, x: torch.Tensor) -> torch.Tensor:
    # The module's forward views with the global head count; under TP each rank holds H / tp.
    B, T, _ = x.shape
    hd = self.cfg.head_dim
    q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, T, H/tp * hd) each
    H = q.shape[-1] // hd
    q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, v))  # (B, H/tp, T, hd)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/tp, T, hd)
    return self.wo(y.transpose(1, 2).reshape(B, T, H * hd))  # (B, T, D)


def _torch_step(cfg: TransformerConfig, mesh, compiled: bool = False, backend: str = "inductor"):
    """``compiled``: after ``parallelize_module``, each block ``torch.compile(block,
    fullgraph=True)`` (torchtitan's order: TP, then per-block compile); the embedding, the
    head and ``loss_parallel`` stay eager."""
    model = TransformerModule(cfg, seed=0)
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, layer in enumerate(model.layers):
        layer.attention.forward = types.MethodType(_local_heads_forward, layer.attention)
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh.device_mesh, plan)
    if compiled:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, fullgraph=True, backend=backend)
    params = list(model.parameters())
    # foreach kernels cannot mix DTensors and plain tensors in one list: two groups.
    groups = [{"params": [p for p in params if isinstance(p, DTensor)]},
              {"params": [p for p in params if not isinstance(p, DTensor)]}]
    opt = torch.optim.AdamW(groups, lr=1e-3, foreach=True)

    def step(tok, tgt):
        logits = model(tok)  # DTensor (B, T, V), vocab-sharded
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().full_tensor()

    return step


def _fshard_step(cfg: TransformerConfig, mesh, sp: bool, jit_backend: str | None = None):
    """fshard's TP (``sp``: + sequence parallel) step; ``jit_backend``: the whole step
    (forward, gradient, AdamW) under ``fs.jit`` with that backend, without ``donate()``
    (a jitted step is pure: it cannot update its inputs in place)."""
    params = transformer_init(cfg, 0)
    specs = tp_specs(params, TRANSFORMER_TP_PLAN, "tp")
    sharded = fs.shard(params, specs, mesh)
    opt = fs.optim.adamw(1e-3, weight_decay=0.01)
    state = opt.init(sharded)

    def loss_fn(p, tok, tgt):
        x = tp_embed(p, tok, cfg, "tp", sp)                                  # (B, T, D), SP: (B / tp, T, D)
        for lp in p["layers"]:
            x = tp_transformer_block(lp, x, cfg, "tp", sp)                   # laid out like x
        logits = tp_logits(p, x, cfg, "tp", sp)                              # (B, T, V/tp)
        return vocab_parallel_cross_entropy(logits, tgt, "tp", vocab_size=cfg.vocab_size)

    grad_fn = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=(specs, P(), P()),
                                             out_specs=P(), check=False))

    def update(p, s, tok, tgt):
        loss, grads = grad_fn(p, tok, tgt)
        updates, s = opt.update(grads, s, p)
        return loss, fs.optim.apply_updates(p, updates), s

    pure = update if jit_backend is None else fs.jit(update, backend=jit_backend)
    box = {"p": sharded, "s": state}

    def step(tok, tgt):
        with fs.optim.donate() if jit_backend is None else contextlib.nullcontext():
            loss, box["p"], box["s"] = pure(box["p"], box["s"], tok, tgt)
        return loss.full_tensor()

    return step


def _compute_step(cfg: TransformerConfig, batch: int, tp: int):
    """One rank's TP step without a collective, for the physical limit: a ``TransformerModule``
    whose sharded layers hold this rank's shapes (wq/wk/wv and w1 ``1 / tp`` of their
    outputs, wo and w2 of their inputs, the embedding and the head ``1 / tp`` of the vocab),
    norms and residuals whole, the whole batch (every TP rank sees it), cross entropy over
    the local vocab (the work of the vocab-parallel loss without its reductions), foreach
    AdamW. Under SP the norms run on ``T / tp`` tokens: a few percent less, not taken off."""
    model = TransformerModule(cfg, seed=0)
    D, H, V = cfg.dim, cfg.hidden_dim, cfg.vocab_size // tp
    model.tok_embeddings = torch.nn.Embedding(V, D)
    model.output = torch.nn.Linear(D, V, bias=False)
    for layer in model.layers:
        att, ff = layer.attention, layer.feed_forward
        att.forward = types.MethodType(_local_heads_forward, att)
        att.wq, att.wk, att.wv = (torch.nn.Linear(D, D // tp, bias=False) for _ in range(3))
        att.wo = torch.nn.Linear(D // tp, D, bias=False)
        ff.w1, ff.w2 = torch.nn.Linear(D, H // tp), torch.nn.Linear(H // tp, D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, V, (batch, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, 1)

    def step():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(tok).flatten(0, 1), tgt.flatten()).backward()
        opt.step()

    return step


def minimal_sent(cfg: TransformerConfig, batch: int, tp: int) -> float:
    """Bytes one rank sends in a Megatron TP step at least (ring, fp32): per block two
    activation all-reduces forward and two backward, one after the vocab-parallel embedding,
    one for the head's input gradient, and the loss's three token-sized ones (max, sum of
    exponentials, target logit). Sequence parallelism swaps each all-reduce for a
    reduce-scatter and an all-gather: the same bytes."""
    import _limits

    act = 4 * batch * cfg.max_seq_len * cfg.dim
    return _limits.ring_sent("all_reduce", (4 * cfg.n_layers + 2) * act + 3 * 4 * batch * cfg.max_seq_len, tp)


def physical_limit(cfg: TransformerConfig, batch: int, compute_s: float):
    """This step's :class:`_limits.Limit` at ``compute_s`` seconds of compute (the slowest
    rank's :func:`_compute_step`), measuring the link rate (collective: every rank calls it)."""
    import _limits

    n = dist.get_world_size()
    return _limits.Limit(compute_s, minimal_sent(cfg, batch, n), _limits.link_rate(), n, _limits.cores())


def per_rank(steps: int, batch: int, compiled: bool = False, backend: str = "inductor", cfg: dict | None = None):
    """Times every side, interleaved; returns ``(median s/step, losses, wire, first)`` per side
    (``first``: the first step's time, for the compiled sides trace + compile + one step) and
    the step's :func:`physical_limit`."""
    torch.set_num_threads(1)
    mesh = fs.make_mesh({"tp": dist.get_world_size()})
    cfg = TransformerConfig(**(cfg or CFG))
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g)
    tgt = torch.roll(tok, -1, 1)
    sides = {"torch": _torch_step(cfg, mesh), "fshard": _fshard_step(cfg, mesh, False),
             "fshard_sp": _fshard_step(cfg, mesh, True)}
    if compiled:
        sides.update(torch_compiled=_torch_step(cfg, mesh, True, backend),
                     fshard_jit=_fshard_step(cfg, mesh, False, backend),
                     fshard_sp_jit=_fshard_step(cfg, mesh, True, backend))
    # The limit's compute runs as one more side in the same rounds: noise hits it alike.
    timed = {k: functools.partial(step, tok, tgt) for k, step in sides.items()}
    times, first, raw = timed_rounds({**timed, "compute": _compute_step(cfg, batch, dist.get_world_size())}, steps)
    compute_s = statistics.median(times.pop("compute"))
    first.pop("compute"), raw.pop("compute")
    losses = {k: [float(v) for v in values] for k, values in raw.items()}
    wire = {}
    for k, step in sides.items():
        if k.endswith(("_jit", "_compiled")):
            continue  # a compiled graph's collectives do not pass through a dispatch mode
        with _Wire() as w:
            step(tok, tgt)
        wire[k] = (dict(w.counts), dict(w.bytes))
    return ({k: statistics.median(v) for k, v in times.items()}, losses, wire, first,
            physical_limit(cfg, batch, compute_s))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--compiled", action="store_true",
                    help="also time fshard (TP, TP + SP) under fs.jit and torch with per-block torch.compile")
    ap.add_argument("--backend", default="inductor", help="the torch.compile backend of --compiled's sides")
    args = ap.parse_args()
    times, losses, wire, first, limit = fs.run_local(per_rank, args.steps, args.batch, args.compiled, args.backend,
                                              world_size=2, timeout_s=3000)[0]
    print(f"tp=2, 2 gloo ranks x the same batch {args.batch}, median of {args.steps} steps")
    for k in times:
        if k not in wire:  # a compiled side
            vs_compiled = "" if k == "torch_compiled" else \
                f"  ratio/torch_compiled {times[k] / times['torch_compiled']:.2f}"
            print(f"  {k:<14} {times[k]:.3f} s/step  ratio/torch {times[k] / times['torch']:.2f}{vs_compiled}  "
                  f"first step (trace + compile, {args.backend}) {first[k]:.1f} s")
            continue
        counts, nbytes = wire[k]
        # Ring algorithms on n = 2 ranks send per rank: all_reduce its payload, all_gather its
        # input (the shard), reduce_scatter half its input.
        sent = nbytes.get("all_reduce", 0) + nbytes.get("all_gather", 0) + nbytes.get("reduce_scatter", 0) // 2
        print(f"  {k:<10} {times[k]:.3f} s/step  ratio/torch {times[k] / times['torch']:.2f}  "
              f"collectives {counts}  payload {nbytes}  sent per rank {sent:,} B")
    worst = max(abs(a - b) for a, b in zip(losses["torch"], losses["fshard"]))
    print("  " + limit.line(times))
    print(f"  first losses: torch {losses['torch'][:3]}  fshard {losses['fshard'][:3]}  "
          f"max |diff| over all steps {worst:.2e}")


if __name__ == "__main__":
    main()
