"""fs.lax.ragged_all_to_all on real gloo ranks and under fs.simulate: JAX's docstring example,
values and gradients (both orders) against a single-process global function, the
collectives it issues, and the refusals of bad plans (every rank raises, none hangs).

JAX's own values and transpose rule: tests/conformance/conf_programs_ragged.py.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

MESHES = [({"x": 2}, "x", 1), ({"x": 4}, "x", 1), ({"x": 2}, "x", 2), ({"a": 2, "b": 2}, ("a", "b"), 1),
          ({"a": 2, "b": 2}, ("b", "a"), 2)]


def make_plan(n: int, per: int, seed: int, gaps: bool = True, overlap: bool = False):
    """A random valid plan on ``n`` ranks, ``per`` slices per peer, with empty slices (and
    padding gaps between slices): ``(vectors [n, 4, K], N rows, M rows, src, dst)``, where
    ``src``/``dst`` index the global operand/output rows of every element moved.
    ``overlap``: rank 0's first two slices start at the same row (a row sent twice)."""
    g = torch.Generator().manual_seed(seed)
    k = n * per
    size = torch.randint(0, 4, (n, k), generator=g)  # size[s, i]: rows s sends in its slice i
    size[0, 0] = 0  # an empty slice, and a peer that gets nothing from rank 1
    size[1 % n, :per] = 0
    gap = torch.randint(0, 2 if gaps else 1, (n, k), generator=g)
    io = (size + gap).cumsum(1) - size  # after the gap before each slice
    if overlap:
        size[0, 0] = size[0, 1] = max(int(size[0, 1]), 1)
        io[0, 0] = io[0, 1]
    oo = torch.zeros(n, k, dtype=torch.int64)
    rs = torch.zeros(n, k, dtype=torch.int64)
    m_rows = 0
    for d in range(n):
        at = 0
        for s in range(n):
            for j in range(per):
                i = d * per + j
                at += int(torch.randint(0, 2 if gaps else 1, (1,), generator=g))
                oo[s, i], rs[d, s * per + j] = at, size[s, i]
                at += int(size[s, i])
        m_rows = max(m_rows, at + 1)
    n_rows = int((io + size).max()) + 1
    src, dst = [], []
    for s in range(n):
        for i in range(k):
            d = i // per
            for t in range(int(size[s, i])):
                src.append(s * n_rows + int(io[s, i]) + t)
                dst.append(d * m_rows + int(oo[s, i]) + t)
    vectors = torch.stack([io, size, oo, rs], dim=1)  # (n, 4, K)
    return vectors, n_rows, m_rows, torch.tensor(src), torch.tensor(dst)


def reference(operand, output, src, dst):
    """The global function: every moved row copied from the operand into the output."""
    return output.index_copy(0, dst, operand.index_select(0, src))


def _inputs(n, per, seed, overlap=False):
    vectors, n_rows, m_rows, src, dst = make_plan(n, per, seed, overlap=overlap)
    g = torch.Generator().manual_seed(seed + 1)
    operand = torch.randn(n * n_rows, 3, dtype=torch.float64, generator=g)
    output = torch.randn(n * m_rows, 3, dtype=torch.float64, generator=g)
    w = torch.randn(n * m_rows, 3, dtype=torch.float64, generator=g)
    return operand, output, w, vectors, src, dst


def _mapped(mesh, ax, check):
    def body(a, b, v):
        v = v.reshape(4, -1)
        return fs.lax.ragged_all_to_all(a, b, v[0], v[1], v[2], v[3], axis_name=ax)

    return fs.shard_map(body, mesh=mesh, in_specs=(P(ax), P(ax), P(ax)), out_specs=P(ax), check=check)


def _parity(shape, ax, per, check, overlap=False):
    mesh = fs.make_mesh(shape)
    n = mesh.axis_size(ax)
    operand, output, w, vectors, src, dst = _inputs(n, per, 7 + per, overlap)
    flat = vectors.reshape(-1)
    a, b = operand.clone().requires_grad_(), output.clone().requires_grad_()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # differentiable
    y = full(_mapped(mesh, ax, check)(a, b, flat))
    (y * w).sum().backward()  # grad(shard_map(f))
    a_ref, b_ref = operand.clone().requires_grad_(), output.clone().requires_grad_()
    y_ref = reference(a_ref, b_ref, src, dst)
    (y_ref * w).sum().backward()

    def inside(a, b, v, w):  # shard_map(grad(f)): the local loss's gradient, per rank
        v = v.reshape(4, -1)
        f = lambda a, b: (fs.lax.ragged_all_to_all(a, b, v[0], v[1], v[2], v[3], axis_name=ax) * w).sum()
        return fs.grad(f, argnums=(0, 1))(a, b)

    ga, gb = fs.shard_map(inside, mesh=mesh, in_specs=(P(ax),) * 4, out_specs=(P(ax), P(ax)), check=check)(
        operand, output, flat, w)
    return [(y.detach(), y_ref.detach()), (a.grad, a_ref.grad), (b.grad, b_ref.grad),
            (full(ga), a_ref.grad), (full(gb), b_ref.grad)]


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("shape,ax,per", MESHES, ids=[f"{s}-{a}-per{p}" for s, a, p in MESHES])
def test_values_and_gradients_equal_the_global_function(shape, ax, per, check):
    world = 1
    for v in shape.values():
        world *= v
    for pairs in run_on_ranks(_parity, shape, ax, per, check, world_size=world):
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_row_sent_twice_gets_both_cotangents():
    """Overlapping input slices: the operand's gradient sums (JAX 0.10.2's transpose keeps one)."""
    for pairs in run_on_ranks(_parity, {"x": 2}, "x", 2, True, True, world_size=2):
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_simulated_is_bit_identical_to_real_ranks():
    real = run_on_ranks(_parity, {"a": 2, "b": 2}, ("b", "a"), 2, True, world_size=4)[0]
    with fs.simulate(4):
        simulated = _parity({"a": 2, "b": 2}, ("b", "a"), 2, True)
        simulated = [tuple(fs.gather(t) if hasattr(t, "full_tensor") else _one(t) for t in pair) for pair in simulated]
    for (got, _), (want, _) in zip(simulated, real):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _one(t):
    from torch.distributed._local_tensor import LocalTensor

    return t._local_tensors[0].clone() if isinstance(t, LocalTensor) else t


def _docstring_example():
    mesh = fs.make_mesh({"i": 2})
    operand = torch.tensor([1.0, 2, 2, 3, 4, 0])
    plan = torch.tensor([[0, 1, 1, 2, 0, 0, 1, 1], [0, 1, 1, 1, 1, 2, 2, 1]]).reshape(-1)  # per rank: io, ss, oo, rs

    def body(a, v):
        v = v.reshape(4, 2)
        return fs.lax.ragged_all_to_all(a, torch.zeros(4), v[0], v[1], v[2], v[3], axis_name="i")

    with fs.comm_log() as log:
        y = fs.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i"))(operand, plan)
    return fs.gather(y) if hasattr(y, "full_tensor") else y, dict(log.counts)


def test_jax_docstring_example():
    for y, counts in run_on_ranks(_docstring_example, world_size=2):
        assert y.tolist() == [1, 3, 0, 0, 2, 2, 4, 0]
        assert counts == {"all_gather": 1, "ragged_all_to_all": 1}


def _bad(case):
    mesh = fs.make_mesh({"x": 2})
    ok = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1] * 2)  # each rank: io [0,1], ss [1,1], oo [0,1], rs [1,1]
    plans = {
        "recv_mismatch": torch.tensor([0, 1, 1, 1, 0, 1, 1, 2] + [0, 1, 1, 1, 0, 1, 1, 1]),
        "overlap": torch.tensor([0, 1, 1, 1, 0, 0, 1, 1] * 2),
        "outside_operand": torch.tensor([0, 2, 1, 2, 0, 1, 1, 2] + [0, 2, 1, 2, 0, 1, 1, 2]),
        "outside_output": torch.tensor([0, 1, 1, 1, 0, 4, 1, 1] + [0, 1, 1, 1, 1, 0, 1, 1]),
        "length": ok,
    }

    def body(a, v):
        v = v.reshape(4, -1)
        if case == "length":
            v = torch.cat([v, v[:, :1]], dim=1)
        return fs.lax.ragged_all_to_all(a, torch.zeros(4), v[0], v[1], v[2], v[3], axis_name="x")

    try:
        fs.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))(torch.arange(4.0), plans[case])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case,says", [
    ("recv_mismatch", "axis index 1 sends send_sizes[0]=1 rows to axis index 0, which expects recv_sizes[1]=2"),
    ("overlap", "overlap"),
    ("outside_operand", "of an operand of 2 rows"),
    ("outside_output", "whose output has 4 rows"),
    ("length", "the vectors have lengths (input_offsets: 3"),
])
def test_bad_plans_raise_on_every_rank(case, says):
    for msg in run_on_ranks(_bad, case, world_size=2):
        assert msg is not None and msg.startswith("fs.lax.ragged_all_to_all over 'x' (size 2): "), msg
        assert says in msg and "Fix: " in msg, msg
