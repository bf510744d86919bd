"""fs.jit's peak memory: the compiled graph holds no more than the captured graph run in
program order (eager's order), counted deterministically from the code's own variables
(``fshard.testing.graph_peak_bytes``; no allocator statistics, no timing, no gloo buffers).

The regression these guard against (``fshard/jit/passes/memory.py``): Inductor's in-place
concatenation allocated a collective's flat buffer (the DDP gradient bucket) where the
first of its inputs was computed, before the backward, instead of where the graph
concatenates; the replicate bench step's peak was 7 % above eager's.
"""

import os

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import graph_peak_bytes, run_on_ranks

F64 = torch.float64
LAYERS, ROWS, DIM = 4, 512, 64  # per rank: the activations (ROWS x DIM per layer) outweigh the gradients


def _bucket_body():
    """A forward that keeps every layer's activation, then a backward-like loop that frees
    them one by one while it computes each layer's gradients: a sum (an Inductor kernel,
    the bias gradient) and a matrix product (an extern kernel, the weight gradient); the
    gradients are concatenated into one flat buffer and all-reduced (fs.parallel's DDP
    bucket). Returns the peak
    bytes of the captured graph in program order, compiled by fs.jit, and compiled with
    Inductor's in-place concatenation, and the compiled results' largest difference from
    eager."""
    n = torch.distributed.get_world_size()
    mesh = fs.make_mesh({"d": n})

    def body(x, ws):
        hs = [x]
        for w in ws:
            hs.append(hs[-1] @ w)
        g, parts = hs[-1], []
        for i in reversed(range(len(ws))):
            parts += [hs[i + 1].sum(0), (hs[i].T @ g).reshape(-1)]
            g = g @ ws[i].T
        return fs.lax.psum(torch.cat(parts), "d")

    f = fs.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P(), check=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS * n, DIM, generator=gen, dtype=F64)
    ws = [torch.randn(DIM, DIM, generator=gen, dtype=F64) / DIM ** 0.5 for _ in range(LAYERS)]
    want = f(x, ws).full_tensor()
    peaks, errs = {}, []
    for name, kw in (("order", dict(backend=None)), ("compiled", {}),
                     ("in place", dict(options={"post_grad_custom_pre_pass": None}))):
        jf = fs.jit(f, **kw)
        jf(x, ws)  # compile outside the count
        with graph_peak_bytes() as p:
            got = jf(x, ws).full_tensor()
        (peaks[name],) = p["fx" if name == "order" else "inductor"]
        errs.append((got - want).abs().max().item())
    return peaks, max(errs)


def test_jit_inductor_allocates_a_collectives_flat_buffer_where_the_graph_concatenates_float64():
    # fs.jit's compile: peak at most the program order's. With the concatenation left to
    # Inductor (LateConcat off), the count sees the bucket held across the backward: the
    # check has the power to catch the regression (if that part fails, Inductor no longer
    # concatenates in place early and LateConcat may be unneeded). Inductor's own ordering
    # for peak memory (reorder_for_peak_memory, on when this was measured; now off with the
    # overlap pass) ended below the program order on this graph even with the bucket held
    # (order 1,999,360 B, fs.jit 1,738,752, in place 1,869,824), so the regression is
    # measured against fs.jit's compile, not against the program order.
    bucket = LAYERS * (DIM * DIM + DIM) * 8
    for peaks, err in run_on_ranks(_bucket_body, world_size=2, timeout_s=600):
        assert err <= 1e-12, err
        assert peaks["compiled"] <= peaks["order"], (f"a buffer lives longer than in eager: {peaks}")
        assert peaks["in place"] >= peaks["compiled"] + bucket // 2, (peaks, bucket)


_INDUCTOR_STEP_SKIP = pytest.mark.skipif(not os.environ.get("FSHARD_TEST_INDUCTOR_STEP"), reason=(
    "Inductor's C++ compilation of a whole forward+backward+AdamW step takes about a minute cold on the "
    "shared 2-core CI machine (several at high load); set FSHARD_TEST_INDUCTOR_STEP=1 to run it. "
    "test_jit_inductor_allocates_a_collectives_flat_buffer_where_the_graph_concatenates_float64 checks the "
    "same mechanism on a small graph."))


def _step_body(mode):
    from fshard.models import TransformerConfig
    from fshard.testing import transformer_train_step

    n = torch.distributed.get_world_size()
    mesh = fs.make_mesh({"d": n})
    cfg = TransformerConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, max_seq_len=16)
    step, params, state = transformer_train_step(mode, cfg, mesh, dtype=torch.float32)
    tok = torch.randint(0, 64, (8 * n, 16), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(tok, -1, 1)
    peaks = {}
    for name, kw in (("order", dict(backend=None)), ("inductor", {})):
        f = fs.jit(step, **kw)
        f(params, state, tok, tgt)
        with graph_peak_bytes() as p:
            f(params, state, tok, tgt)
        peaks[name] = p["fx" if name == "order" else "inductor"]
    return peaks


@_INDUCTOR_STEP_SKIP
@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_jit_inductor_train_step_peak_not_above_program_order(mode):
    # fs.parallel's layer loop + AdamW (bench/jit_memory.py's step, small): the compiled
    # step's peak is at most the captured graph's in program order, up to 1 %: FSDP's is
    # 0.14 % above (1,792 B here; 0.12 MiB of 97 on the bench model) because Inductor
    # recomputes the embedding inside the backward's layer-norm kernels from the gathered
    # root parameters, which it keeps instead of the embedding's output. The DDP bucket
    # allocated before the backward was +7 % (bench/jit_memory.py).
    for peaks in run_on_ranks(_step_body, mode, world_size=2, timeout_s=900):
        (order,), (ind,) = peaks["order"], peaks["inductor"]
        assert ind <= order * 1.01, peaks
