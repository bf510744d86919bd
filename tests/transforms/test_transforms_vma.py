"""Checked mode's type rule (fshard/transforms/vma.py): every op typed by the union of its
operands' varying axes, in-place ops known from their schema, and replication promises
verified at run time wherever the types stop proving them.

Each program runs on 4 gloo ranks in both compositions (``shard_map(grad(f))`` and
``grad(shard_map(f))``) against a single-process reference of the same global computation:
the sum over ranks of each rank's local loss, differentiated by plain torch.
"""

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks
from fshard.transforms.vma import written_arguments

N = 4


def _ref_grad(local_loss, w, xs):
    """d/dw of sum_r local_loss(w, x_r, r): one process, plain torch."""
    w = w.detach().clone().requires_grad_(True)
    total = sum(local_loss(w, x, r) for r, x in enumerate(xs))
    return torch.autograd.grad(total, w)[0]


def _per_rank(local_loss, order, w, x):
    mesh = fs.make_mesh({"x": N})

    def body(w, x):
        return local_loss(w, x, fs.lax.axis_index("x"))

    if order == "inside":
        step = fs.shard_map(fs.grad(body), mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    else:
        step = fs.grad(fs.shard_map(lambda w, x: fs.lax.psum(body(w, x), "x"), mesh=mesh,
                                    in_specs=(P(), P("x")), out_specs=P()))
    g = step(w, x)
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _embed_by_indexing(e, u, r):  # a data-parallel embedding written by indexing
    return e[(u > 0).long()].sum()


def _inplace_add(w, x, r):  # y = w * 1.0; y += x: JAX's y = y + x sums w's gradient
    y = w * 1.0
    y += x
    return (y * y).sum()


def _inplace_setitem(w, x, r):  # y[0] = x[0]: the rest of y keeps w's (summed) gradient
    y = w * 2.0
    y[0] = x[0] * w[1]
    return (y * x).sum()


def _reversed_ops(w, x, r):  # __rsub__, __rtruediv__, __rpow__ of a replicated w with data
    return ((1.0 - w) * x).sum() + (2.0 / (w + 3.0) * x).sum() + (2.0 ** w * x).sum()


def _where_and_index_put(w, x, r):
    y = torch.where(x > 0, w, -w)
    return (y * x).sum() + w.index_put((torch.tensor([0]),), x[:1]).pow(2).sum()


def _relu_inplace(w, x, r):  # F.relu(inplace=True) on a replicated value made varying
    y = w * 1.0
    y = y + x
    torch.nn.functional.relu(y, inplace=True)
    return y.sum()


def _slice_by_varying_bound(w, x, r):  # w[r:r + 1] differs per rank: typed varying
    r = torch.as_tensor(r)
    return (w[r:r + 1] * x[:1]).sum()


PROGRAMS = [_embed_by_indexing, _inplace_add, _inplace_setitem, _reversed_ops, _where_and_index_put,
            _relu_inplace, _slice_by_varying_bound]


def _inputs(prog):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, generator=g, dtype=torch.float64)
    x = torch.randn(N * 4, generator=g, dtype=torch.float64)
    return w, x


@pytest.mark.parametrize("order", ["inside", "outside"])
def test_replicated_operands_get_summed_gradients(order):
    results = run_on_ranks(_run_programs, order, world_size=N)
    for prog in PROGRAMS:
        w, x = _inputs(prog)
        ref = _ref_grad(prog, w, x.chunk(N))
        for rank, got in enumerate(results):
            torch.testing.assert_close(got[prog.__name__], ref, rtol=1e-12, atol=1e-12,
                                       msg=lambda m, p=prog, r=rank: f"{p.__name__} rank {r}: {m}")


def _run_programs(order):
    out = {}
    for prog in PROGRAMS:
        w, x = _inputs(prog)
        out[prog.__name__] = _per_rank(prog, order, w, x)
    return out


def test_written_arguments_come_from_the_schema():
    assert written_arguments(torch.Tensor.add_) == (0,)
    assert written_arguments(torch.Tensor.__setitem__) == (0,)
    assert written_arguments(torch.Tensor.__getitem__) == ()
    assert written_arguments(torch.Tensor.__rsub__) == ()
    assert written_arguments(torch.add) == ("out",)
    assert written_arguments(torch.nn.functional.relu) == ("out", ("inplace", 1))


def _unprovable(kind):
    mesh = fs.make_mesh({"x": N})

    def body(w, x):
        if kind == "item":     # a varying value leaves the types through .item()
            return w * x.sum().item()
        if kind == "alias":    # written through a view: the base and its other aliases
            y = torch.zeros(2, dtype=x.dtype)
            alias = y.view(2)
            y[:1] += x[:1]     # y's storage now holds varying values; `alias` was typed before
            return alias
        return w * 1.0         # nothing unproven: the types prove P()

    return fs.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())(
        torch.ones(2, dtype=torch.float64), torch.arange(N * 2, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["item", "alias"])
def test_values_that_leave_the_types_are_verified_at_run_time(kind):
    with pytest.raises(Exception, match="differs across them"):
        run_on_ranks(_unprovable, kind, world_size=N)


def test_proven_promise_needs_no_run_time_check():
    out = run_on_ranks(_unprovable, "proven", world_size=N)
    assert all(torch.equal(o.full_tensor(), torch.ones(2, dtype=torch.float64)) for o in out)


def _escaped_then_reduced(order):
    """A body that reads a varying value on the host (``.item()``, ``.tolist()``: a log line,
    split sizes) and returns a psum: the run-time check verifies P(), and the gradient is the
    program's without the read (the psum's result keeps the whole cotangent on every rank)."""
    mesh = fs.make_mesh({"x": N})

    def body(w, x, read):
        if read:
            x.sum().item(), x.tolist()
        return fs.lax.psum((w * x).sum(), "x")

    out = []
    for read in (True, False):
        w, x = torch.arange(2.0, dtype=torch.float64), torch.arange(N * 2.0, dtype=torch.float64)
        if order == "outside":
            sm = fs.shard_map(lambda w, x: body(w, x, read), mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
            out.append(fs.grad(sm, argnums=(0, 1))(w, x))
        else:
            g = fs.grad(lambda w, x: body(w, x, read), argnums=(0, 1))
            sm = fs.shard_map(g, mesh=mesh, in_specs=(P(), P("x")), out_specs=(P(), P("x")))
            out.append(tuple(t.full_tensor() if hasattr(t, "full_tensor") else t for t in sm(w, x)))
    return out


@pytest.mark.parametrize("order", ["outside", "inside"])
def test_a_host_read_does_not_split_an_invariant_outputs_cotangent(order):
    for (gw, gx), (rw, rx) in run_on_ranks(_escaped_then_reduced, order, world_size=N):
        gw = gw.full_tensor() if hasattr(gw, "full_tensor") else gw
        rw = rw.full_tensor() if hasattr(rw, "full_tensor") else rw
        torch.testing.assert_close(gw, rw, rtol=0, atol=0)
        torch.testing.assert_close(gx, rx, rtol=0, atol=0)
        torch.testing.assert_close(gw, torch.arange(N * 2.0, dtype=torch.float64).view(N, 2).sum(0))


def _inplace_on_a_leaf(w, x):
    mesh = fs.make_mesh({"x": N})
    step = fs.shard_map(fs.grad(lambda w, x: w.add_(x).sum()), mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    step(w, x)


def test_inplace_write_that_cannot_be_summed_names_the_op_and_the_fix():
    with pytest.raises(RuntimeError, match=r"add_ writes in place .*\(y = y \+ x"):
        run_on_ranks(_inplace_on_a_leaf, torch.ones(2), torch.ones(N * 2), world_size=N)


def _weakened(order):
    """A replicated value typed varying on purpose (pvary of a psum): the promise of P() is
    verified by value, and the gradient is the unweakened program's."""
    mesh = fs.make_mesh({"x": N})

    def weak(w, x):
        return fs.lax.pvary(fs.lax.psum((w * x).sum(), "x"), "x")

    def strong(w, x):
        return fs.lax.psum((w * x).sum(), "x")

    out = []
    for body in (weak, strong):
        sm = fs.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
        w, x = torch.arange(2.0, dtype=torch.float64), torch.arange(N * 2.0, dtype=torch.float64)
        out.append(fs.grad(sm)(w, x))
    return out


def test_weakened_types_are_verified_by_value_with_the_same_gradients():
    for weak, strong in run_on_ranks(_weakened, "outside", world_size=N):
        torch.testing.assert_close(weak, strong, rtol=0, atol=0)


def _under_inference_mode():
    mesh = fs.make_mesh({"x": N})

    def body(w, x):
        with torch.inference_mode():
            y = w * 1.0
            y += x       # an invariant value written with a varying one: retyped varying
            return y

    return fs.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x"))(
        torch.ones(2, dtype=torch.float64), torch.arange(N * 2, dtype=torch.float64)).full_tensor()


def test_mixed_types_under_inference_mode():
    for got in run_on_ranks(_under_inference_mode, world_size=N):
        torch.testing.assert_close(got, 1.0 + torch.arange(N * 2, dtype=torch.float64))


def _broken_in_one_group_only():
    """x=2, y=2: the value differs across y only where x = 1, so the promise of P("x") over y
    holds in one y-group and breaks in the other: every rank must raise (none may go on to
    wait in a collective for ranks that raised)."""
    mesh = fs.make_mesh({"x": 2, "y": 2})
    f = fs.shard_map(lambda a: fs.lax.axis_index("x") * a, mesh=mesh, in_specs=P(("x", "y")), out_specs=P("x"))
    try:
        f(torch.arange(4.0, dtype=torch.float64))
    except ValueError as e:
        return str(e)
    return None


def test_broken_promise_raises_on_every_rank():
    for err in run_on_ranks(_broken_in_one_group_only, world_size=N, timeout_s=60):
        assert err is not None and "differs across them" in err
