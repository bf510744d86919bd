"""fshard.meta: a body value's metadata (varying axes, global shape, spec) survives every
transform and torch entry point a body uses, and gradients inside a checked shard_map
are JAX's (autograd entry points are never rewritten). Values against single-process
references on 2 gloo ranks; JAX itself is the oracle in tests/conformance/."""

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import P
from fshard.meta import meta_of
from fshard.testing import run_on_ranks


def _w_x(rows=5):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(rows, 3, generator=g, dtype=torch.float64),   # 5 rows: uneven over 2 ranks
            torch.randn(4, 3, generator=g, dtype=torch.float64))


def _ref_grad(w, x):
    return fs.grad(lambda w: torch.tanh(x @ w.T).pow(2).mean())(w)


def _fsdp_loss(w, x):
    full = fs.parallel.gather_params(w, axis="d")                     # (5, 3) from (3 | 2, 3)
    return fs.lax.pmean(torch.tanh(x @ full.T).pow(2).mean(), "d")


def _lax_loss(w, x):
    full = fs.lax.all_gather(w, "d", tiled=True)                       # (6, 3) from (3, 3)
    return fs.lax.pmean(torch.tanh(x @ full.T).pow(2).mean(), "d")


# torch.autograd.grad called directly, and Tensor.backward on a fresh leaf
def _by_autograd(w, x):
    w = w.detach().requires_grad_()
    return torch.autograd.grad(_fsdp_loss(w, x), w)[0]


def _by_backward(w, x):
    w = w.detach().requires_grad_()
    _fsdp_loss(w, x).backward()
    return w.grad


def _by_remat(w, x):  # fs.remat's recomputation replays the body; fs.grad's fresh leaves keep metadata
    return fs.grad(fs.remat(_fsdp_loss))(w, x)


def _by_aliases(w, x):  # user-made aliases (detach, .data, a full slice) of an input keep its layout
    return fs.grad(lambda v: _fsdp_loss(v, x))(w.detach().data[:])


def _by_func_grad(w, x):  # torch.func.grad: the wrapper finds the metadata of what it wraps
    return torch.func.grad(_lax_loss)(w, x)


def _by_func_grad_fsdp(w, x):
    return torch.func.grad(_fsdp_loss)(w, x)


def _survival():
    n = dist.get_world_size()
    mesh = fs.make_mesh({"d": n})
    out = {}
    for check in (True, False):
        cases = [("autograd", _by_autograd), ("backward", _by_backward), ("remat", _by_remat),
                 ("aliases", _by_aliases), ("func_grad", _by_func_grad)]
        for name, body in cases:
            # An uneven shard's gradient needs its metadata to come back whole: fs.value_and_grad
            # always gives it; raw autograd results get it from checked mode's tracking only, so
            # unchecked mode runs those on an even split (and torch.func's all_gather needs one).
            rows = 6 if name == "func_grad" or (not check and name in ("autograd", "backward")) else 5
            w, x = _w_x(rows)
            g = fs.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"), check=check)(
                fs.shard(w, P("d"), mesh, uneven=True), x)
            out[name, check] = (rows, tuple(g.shape), (fs.gather(g) - _ref_grad(w, x)).abs().max().item())
        w, x = _w_x()
        try:
            fs.shard_map(_by_func_grad_fsdp, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"),
                         check=check)(fs.shard(w, P("d"), mesh, uneven=True), x)
        except RuntimeError as e:
            out["func_grad_fsdp", check] = str(e)
    w, x = _w_x()
    sw = fs.shard(w, P("d"), mesh, uneven=True)
    ref = _ref_grad(w, x)

    def metas(w, x):
        m = meta_of
        got = {
            "input": m(w), "detach": m(w.detach()), "data": m(w.data), "slice": m(w[:]),
            "clone": m(w.clone()), "double": m(w.double()), "requires_grad": m(w.detach().requires_grad_()),
        }
        y = w.clone()
        y.mul_(2)
        got["inplace"] = m(y)
        got["view"] = m(w.view(-1))                      # another shape: no layout, still varying
        got["sum"] = m(w.sum())
        got["closure"] = m(ref)                          # made outside the body: invariant
        got["psum"] = m(fs.lax.psum(w.sum(), "d"))
        return {k: (sorted(v.vma), v.global_shape, str(v.spec)) for k, v in got.items()}, torch.zeros(())

    for check in (True, False):
        out["metas", check] = fs.shard_map(metas, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=(None, P()),
                                           check=check)(sw, x)[0]
    return out


def test_metadata_and_fsdp_gradients_survive_every_entry_point():
    out = run_on_ranks(_survival, world_size=2)[0]
    for check in (True, False):
        for name in ("autograd", "backward", "func_grad", "remat", "aliases"):
            rows, shape, err = out[name, check]
            assert err < 1e-12 and shape == (rows, 3), (name, check, out[name, check])
        assert "torch.func transform" in out["func_grad_fsdp", check] and "fs.value_and_grad" in out["func_grad_fsdp", check]
    layout = (["d"], (5, 3), "P('d')")
    checked, unchecked = out["metas", True], out["metas", False]
    for k in ("input", "detach", "data", "slice", "clone", "double", "requires_grad", "inplace"):
        assert checked[k] == layout, (k, checked[k])
    assert checked["view"] == checked["sum"] == (["d"], None, "None")
    assert checked["closure"] == ([], None, "None") and checked["psum"] == ([], None, "None")
    # Unchecked mode watches no op: aliases of an input (same memory, same geometry) still
    # find its metadata through the body's table; new values (clone, results) have none.
    for k in ("input", "detach", "data", "slice", "requires_grad"):
        assert unchecked[k] == layout, (k, unchecked[k])
    assert unchecked["clone"] == unchecked["closure"] == ([], None, "None")


def _jax_cases():
    """The three programs of issue 13, whose JAX values are known in closed form."""
    n = dist.get_world_size()
    mesh = fs.make_mesh({"x": n})
    c = torch.arange(1.0, 4.0, dtype=torch.float64)
    out = {}
    for check in (True, False):
        # x varying, c invariant: d/dx sum(psum(x) * c) = c (psum's transpose is the identity
        # on an invariant cotangent); the old checked mode gave n * c.
        g1 = fs.shard_map(fs.grad(lambda x: (fs.lax.psum(x, "x") * c).sum()), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x"), check=check)(torch.ones(n * 3, dtype=torch.float64))
        # x invariant: d/dx sum(pvary(x) * c) = psum(c) = n * c; the old checked mode gave 0.
        g2 = fs.shard_map(fs.grad(lambda x: (fs.lax.pvary(x, "x") * c).sum()), mesh=mesh, in_specs=P(),
                          out_specs=P(), check=check)(torch.ones(3, dtype=torch.float64))
        out[check] = (fs.gather(g1).tolist(), fs.gather(g2).tolist())
    return out


def test_issue_examples_give_jax_values_in_both_modes():
    out = run_on_ranks(_jax_cases, world_size=2)[0]
    for check in (True, False):
        g1, g2 = out[check]
        assert g1 == [1.0, 2.0, 3.0] * 2 and g2 == [2.0, 4.0, 6.0], (check, g1, g2)


def _bad_inputs():
    mesh = fs.make_mesh({"x": 2})
    msgs = {}
    cases = {
        "int_leaf": (lambda p: fs.grad(lambda q: q["w"].sum() * 1.0)(p), ({"w": torch.ones(2), "idx": torch.arange(2)},)),
        "argnums": (lambda a: fs.grad(lambda a: a.sum(), argnums=(0, 3))(a), (torch.ones(2),)),
        "non_scalar": (lambda a: fs.grad(lambda a: a * 2)(a), (torch.ones(2),)),
    }
    for name, (body, args) in cases.items():
        try:
            fs.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(*args)
        except TypeError as e:
            msgs[name] = str(e)
    return msgs


def test_bad_gradient_requests_inside_a_body_name_the_argument():
    msgs = run_on_ranks(_bad_inputs, world_size=2)[0]
    assert "args[0].idx" in msgs["int_leaf"] and "torch.int64" in msgs["int_leaf"]
    assert "argnums=(0, 3)" in msgs["argnums"] and "argument 3" in msgs["argnums"]
    assert "scalar tensor" in msgs["non_scalar"] and "(2,)" in msgs["non_scalar"]


def test_value_and_grad_outside_any_body_keeps_static_leaves_and_rejects_integer_tensors():
    g = fs.grad(lambda p: p["w"].sum())({"w": torch.ones(2), "name": "layer", "n": 3})
    assert g["name"] is None and g["n"] is None and torch.equal(g["w"], torch.ones(2))
    with pytest.raises(TypeError, match=r"args\[0\] has dtype torch.int64"):
        fs.grad(lambda a: a.sum())(torch.arange(3))


def _closure_from_an_earlier_body():
    # A value made by one shard_map call and closed over by the next is invariant there (JAX's
    # rule for closed-over values), whatever axes it varied over where it was made.
    mesh = fs.make_mesh({"x": 2})
    made = fs.shard_map(lambda a: a * 1.0, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(
        torch.arange(4.0, dtype=torch.float64))
    inner = made.to_local()                                    # tagged varying over x in the first body
    seen = fs.shard_map(lambda a: (sorted(meta_of(inner).vma), sorted(meta_of(a).vma)), mesh=mesh,
                        in_specs=P("x"), out_specs=None)(torch.ones(2, dtype=torch.float64))
    c = torch.arange(2.0, dtype=torch.float64)
    # d/dw of sum(pvary(w) * c) for an invariant w is psum(c); an invariant closure adds no pvary
    g = fs.shard_map(fs.grad(lambda w: (w * c * inner.detach()).sum()), mesh=mesh, in_specs=P(),
                     out_specs=P())(torch.ones(2, dtype=torch.float64))
    return seen, fs.gather(g).tolist(), inner.tolist()


def test_values_from_an_earlier_body_are_invariant_closures():
    for r, (seen, g, inner) in enumerate(run_on_ranks(_closure_from_an_earlier_body, world_size=2)):
        assert seen == ([], ["x"])
        # w is invariant and so is the closure: no psum, each rank's own c * inner
        assert g == [c * v for c, v in zip([0.0, 1.0], inner)], (r, g, inner)
