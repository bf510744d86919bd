"""fs.lax collectives on real gloo ranks: values and gradients against global single-process functions.

Each case: a global input X (identical on every rank, seeded), a shard_map body that
applies one collective, and the global function the mapped computation must equal.
Gradients: loss = sum(Y * W) for a fixed global W; X.grad (through shard_map's
differentiable plain-tensor path) must equal the gradient of the global function.
"""

import math

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

MESHES = [({"x": 2}, "x"), ({"x": 4}, "x"), ({"a": 2, "b": 2}, ("a", "b")), ({"a": 2, "b": 2}, ("b", "a"))]


def _cases(n):
    """name -> (global X shape, in_spec, body(local, axes), out_spec, global fn of X)."""
    m, k = 3, 2
    return {
        "psum": ((n * m, k), "S", lambda x, ax: fs.lax.psum(x, ax), "R",
                 lambda X: X.reshape(n, m, k).sum(0)),
        "pmean": ((n * m, k), "S", lambda x, ax: fs.lax.pmean(x * x, ax), "R",
                  lambda X: (X * X).reshape(n, m, k).mean(0)),
        "all_gather": ((n * m, k), "S", lambda x, ax: fs.lax.all_gather(x, ax), "R",
                       lambda X: X.reshape(n, m, k)),
        "all_gather_axis1_tiled": ((n * m, k), "S", lambda x, ax: fs.lax.all_gather(x, ax, axis=1, tiled=True), "R",
                                   lambda X: torch.cat(list(X.reshape(n, m, k)), dim=1)),
        # Each rank returns its identical copy as a block: the global value holds n copies.
        "all_gather_copies": ((n * m, k), "S", lambda x, ax: fs.lax.all_gather(x, ax, tiled=True), "S",
                              lambda X: torch.cat([X] * n)),
        "psum_scatter_tiled": ((n * n * m, k), "S", lambda x, ax: fs.lax.psum_scatter(x, ax, tiled=True), "S",
                               lambda X: X.reshape(n, n * m, k).sum(0)),
        "psum_scatter_untiled": ((n * n, k), "S", lambda x, ax: fs.lax.psum_scatter(x, ax, scatter_dimension=0), "S",
                                 lambda X: X.reshape(n, n, k).sum(0).reshape(n * k)),
        "ppermute_shift": ((n * m, k), "S", lambda x, ax: fs.lax.ppermute(x * 2, ax, [(i, (i + 1) % n) for i in range(n)]), "S",
                           lambda X: torch.roll(X * 2, shifts=m, dims=0)),
        "ppermute_partial": ((n * m, k), "S", lambda x, ax: fs.lax.ppermute(x, ax, [(0, n - 1)]), "S",
                             lambda X: torch.cat([torch.zeros((n - 1) * m, k, dtype=X.dtype), X[:m]])),
        "all_to_all_tiled": ((n * m, n * k), "S", lambda x, ax: fs.lax.all_to_all(x, ax, 1, 0, tiled=True), "S1",
                             lambda X: X),
        # rank i receives row i of every source j and stacks them on the new dim 1: out_i[c, j] = X[j*n + i, c]
        "all_to_all_untiled": ((n * n, k), "S", lambda x, ax: fs.lax.all_to_all(x, ax, 0, 1), "S",
                               lambda X: X.reshape(n, n, k).permute(1, 2, 0).reshape(n * k, n)),
        "axis_index": ((n * m, k), "S", lambda x, ax: x * (fs.lax.axis_index(ax) + 1), "S",
                       lambda X: X * torch.arange(1, n + 1, dtype=X.dtype).repeat_interleave(m)[:, None]),
        # Invariant result, so P() takes it in both modes; its backward is a slice.
        "all_gather_invarying": ((n * m, k), "S", lambda x, ax: fs.lax.all_gather(x, ax, to="invarying"), "R",
                                 lambda X: X.reshape(n, m, k)),
        "all_gather_invarying_tiled": ((n * m, k), "S",
                                       lambda x, ax: fs.lax.all_gather(x, ax, axis=-1, tiled=True, to="invarying"),
                                       "R", lambda X: torch.cat(list(X.reshape(n, m, k)), dim=-1)),
        "pbroadcast": ((n * m, k), "S", lambda x, ax: fs.lax.pbroadcast(x * 2, ax, n - 1), "S",
                       lambda X: (X[(n - 1) * m:] * 2).repeat(n, 1)),
        "pshuffle": ((n * m, k), "S", lambda x, ax: fs.lax.pshuffle(x, ax, [(i + 1) % n for i in range(n)]), "S",
                     lambda X: torch.roll(X, shifts=-m, dims=0)),
        # out_i[j] = block j's row i
        "pswapaxes": ((n * n, k), "S", lambda x, ax: fs.lax.pswapaxes(x, ax, 0), "S",
                      lambda X: X.reshape(n, n, k).transpose(0, 1).reshape(n * n, k)),
        "pcast": ((m, k), "R", lambda x, ax: fs.lax.pcast(x, ax, to="varying") * (fs.lax.axis_index(ax) + 1), "S",
                  lambda X: torch.cat([X * (i + 1) for i in range(n)])),
    }


def _spec(code, axes):
    return {"S": P(axes), "S1": P(None, axes), "R": P()}[code]


def _run_case(shape, axes, name, check):
    mesh = fs.make_mesh(shape)
    n = mesh.axis_size(axes)
    xshape, ins, body, outs, ref_fn = _cases(n)[name]
    torch.manual_seed(1)
    X = torch.randn(*xshape, dtype=torch.float64)
    W = torch.randn(ref_fn(X).shape, dtype=torch.float64)
    Xg = X.clone().requires_grad_()
    f = fs.shard_map(lambda x: body(x, axes), mesh=mesh, in_specs=_spec(ins, axes),
                     out_specs=_spec(outs, axes), check=check)
    with fs.comm_log() as log:
        Y = f(Xg)
        Yfull = Y.full_tensor()
        (Yfull * W).sum().backward()
    Xr = X.clone().requires_grad_()
    (ref_fn(Xr) * W).sum().backward()
    return (Yfull.shape == ref_fn(X).shape and torch.allclose(Yfull, ref_fn(X), rtol=1e-12, atol=1e-12),
            torch.allclose(Xg.grad, Xr.grad, rtol=1e-12, atol=1e-12),
            (Yfull - ref_fn(X)).abs().max().item(), (Xg.grad - Xr.grad).abs().max().item(), dict(log.counts))


# The body's own collectives per case: forward and its transpose in backward (psum's
# backward is the identity, Megatron's "g"; axis_index issues none).
_OWN = {"psum": {"psum": 1}, "pmean": {"psum": 1}, "all_gather": {"all_gather": 1, "psum_scatter": 1},
        "psum_scatter": {"psum_scatter": 1, "all_gather": 1}, "ppermute": {"ppermute": 2},
        "all_to_all": {"all_to_all": 2}, "axis_index": {}, "all_gather_invarying": {"all_gather": 1},
        "pbroadcast": {"all_gather": 1, "psum_scatter": 1}, "pshuffle": {"ppermute": 2},
        "pswapaxes": {"all_to_all": 2}, "pcast": {"psum": 1}}


def _expected_counts(name, in_code, out_code, n_dims):
    """The body's collectives plus DTensor's: Y.full_tensor() of a sharded output and the
    assembly of X.grad from the shards' gradients (of a sharded input), one all_gather per
    mesh dim each."""
    counts = dict(_OWN[max((k for k in _OWN if name == k or name.startswith(k + "_")), key=len)])
    counts["all_gather"] = counts.get("all_gather", 0) + n_dims * ((in_code != "R") + (out_code != "R"))
    return counts


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("shape, axes", MESHES)
def test_collective_values_and_grads_equal_global_functions(shape, axes, check):
    failures = []
    for name in _cases(2):
        if name.startswith("all_gather") and name != "all_gather_copies" and "invarying" not in name and not check:
            # out_spec P() of an all_gather result: its cotangent is split over the identical
            # copies only in checked mode; unchecked (Megatron) mode leaves that to the user.
            continue
        want = _expected_counts(name, _cases(2)[name][1], _cases(2)[name][3], len(shape))
        for rank, (ok_val, ok_grad, dv, dg, counts) in enumerate(
                run_on_ranks(_run_case, shape, axes, name, check, world_size=math.prod(shape.values()))):
            if not (ok_val and ok_grad):
                failures.append(f"{name} rank {rank}: value diff {dv:.3g}, grad diff {dg:.3g}")
            if counts != want:
                failures.append(f"{name} rank {rank}: collectives {counts}, expected {want}")
    assert not failures, "\n".join(failures)


def _pmax_body():
    mesh = fs.make_mesh({"x": 2})
    r = torch.distributed.get_rank()
    x = torch.tensor([1.0 + r, 5.0 - r], requires_grad=True)
    f = fs.shard_map(lambda t: (fs.lax.pmax(t, "x"), fs.lax.pmin(t, "x")), mesh=mesh,
                     in_specs=P(), out_specs=P(), check=False)
    hi, lo = f(fs.shard(x.detach(), P(), mesh))
    g = fs.shard_map(lambda t: fs.lax.pmax(t * 1.0, "x").sum(), mesh=mesh, in_specs=P(), out_specs=P(), check=False)
    try:
        g(x).backward()
        err = None
    except RuntimeError as e:
        err = str(e)
    return hi.to_local().tolist(), lo.to_local().tolist(), err


def test_pmax_pmin_values_and_no_gradient():
    for hi, lo, err in run_on_ranks(_pmax_body, world_size=2):
        assert hi == [2.0, 5.0] and lo == [1.0, 4.0]
        assert "pmax has no gradient" in err and "x.detach()" in err


def _pmax_size_one_grad(op):
    mesh = fs.make_mesh({"a": 1, "x": 2})
    f = fs.shard_map(lambda t: getattr(fs.lax, op)(t * 1.0, "a"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    try:
        fs.grad(lambda t: f(t).sum())(torch.ones(4))
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_pmax_pmin_over_size_one_axes_have_no_gradient_either(op):
    """JAX refuses to differentiate pmax/pmin whatever the axis size (found by the fuzzer:
    fshard's size-1 shortcut was the identity, and differentiable)."""
    for err in run_on_ranks(_pmax_size_one_grad, op, world_size=2):
        assert err is not None and f"{op} has no gradient" in err


# --- bad input ----------------------------------------------------------------------------

def test_collective_outside_shard_map_is_an_error():
    with pytest.raises(RuntimeError, match=r"fs.lax.psum was called outside a shard_map body"):
        fs.lax.psum(torch.ones(2), "x")


def _bad_inputs():
    mesh = fs.make_mesh({"x": 2})
    errors = {}

    def attempt(key, body, arg_shape=(4, 2)):
        f = fs.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check=False)
        try:
            f(torch.ones(*arg_shape))
        except (ValueError, RuntimeError) as e:
            errors[key] = str(e)

    attempt("axis", lambda x: fs.lax.psum(x, "tp"))
    attempt("scatter", lambda x: fs.lax.psum_scatter(x, "x", tiled=True), (3, 2))
    attempt("a2a", lambda x: fs.lax.all_to_all(x, "x", 0, 1), (3, 2))
    attempt("perm", lambda x: fs.lax.ppermute(x, "x", [(0, 1), (1, 1)]))
    attempt("perm_range", lambda x: fs.lax.ppermute(x, "x", [(0, 2)]))
    return errors


def test_collective_bad_input_messages():
    errors = run_on_ranks(_bad_inputs, world_size=2)[0]
    assert "'tp'" in errors["axis"] and "mesh axes are ['x']" in errors["axis"]
    assert "size 3" in errors["scatter"] and "divisible by 2" in errors["scatter"]
    assert "equal to 2" in errors["a2a"]
    assert "unique" in errors["perm"] and "duplicates" in errors["perm"]
    assert "out of range: [2]" in errors["perm_range"]


# --- axis_index: a 0-d tensor typed varying, as JAX's ------------------------------------

def _axis_index_body():
    mesh = fs.make_mesh({"x": 4})
    w = torch.tensor(2.0, dtype=torch.float64)
    out = {}

    def sub(w):  # JAX: d/dw of the sum over ranks of (i - w) = -4
        return (fs.lax.axis_index("x") - w).sum()

    def scaled(w):  # JAX: 0 + .25 + .5 + .75 = 1.5 on every rank
        return (w * (fs.lax.axis_index("x") / 4)).sum()

    for name, f in (("sub", sub), ("scaled", scaled)):
        inside = fs.shard_map(fs.grad(f), mesh=mesh, in_specs=P(), out_specs=P())
        outside = fs.grad(fs.shard_map(lambda w, f=f: fs.lax.psum(f(w), "x"), mesh=mesh, in_specs=P(),
                                       out_specs=P()))
        out[name] = (inside(w).to_local().item(), outside(w).item())

    def uses(x):
        i, n = fs.lax.axis_index("x"), fs.lax.axis_size("x")
        kind = (i.dim(), i.dtype, i.device.type, fs.lax.vma(i), fs.lax.vma(x[i * 2:(i + 1) * 2] * i))
        y = x[i * 2:(i + 1) * 2].sum() + x[i] + len(range(i)) + int(i)  # 7 i + 1 for x = arange
        z = fs.lax.ppermute(x[:1] + i, "x", [(j, (j + 1) % n) for j in range(n)])  # the previous index
        out["kind"] = kind
        return torch.stack([y, z[0], torch.where(i > 1, x[0], x[1])]).unsqueeze(0)

    got = fs.shard_map(uses, mesh=mesh, in_specs=P(), out_specs=P("x"))(torch.arange(8, dtype=torch.float64))
    out["uses"] = got.full_tensor().tolist()
    return out


def test_axis_index_is_a_varying_0d_tensor():
    for out in run_on_ranks(_axis_index_body, world_size=4):
        assert out["sub"] == (-4.0, -4.0) and out["scaled"] == (1.5, 1.5), out
        assert out["kind"] == (0, torch.int64, "cpu", frozenset({"x"}), frozenset({"x"}))
        assert out["uses"] == [[7.0 * r + 1, float((r - 1) % 4), float(r <= 1)] for r in range(4)]


# --- mixed states: JAX 0.10.2's all-or-none rule (tests/conformance/conf_programs_mixed.py) ---

def _mixed_body():
    mesh = fs.make_mesh({"a": 2, "b": 2})
    errors, ok = {}, {}
    for check in (True, False):
        for what in ("psum", "pmean", "psum_scatter", "pvary", "pmax", "all_gather"):
            f = fs.shard_map(lambda x, what=what: getattr(fs.lax, what)(x, ("b", "a")), mesh=mesh,
                             in_specs=P("a"), out_specs=P(("a", "b")), check=check)
            try:
                f(torch.ones(8, 2))
                ok[(what, check)] = True
            except ValueError as e:
                errors[(what, check)] = str(e)
    # pvary of a value varying over all its axes: returned as it is (JAX refuses; docs/jax.md)
    same = fs.shard_map(lambda x: fs.lax.pvary(x, "a") is x, mesh=mesh, in_specs=P("a"), out_specs=P())
    return errors, ok, same(torch.ones(4, 2))


def test_mixed_state_collectives_refuse_as_jax_does():
    errors, ok, same = run_on_ranks(_mixed_body, world_size=4)[0]
    assert set(errors) == {("psum", True), ("pmean", True), ("psum_scatter", True), ("pvary", True)}, errors
    assert len(ok) == 8 and same is True
    msg = errors[("psum", True)]
    assert msg.startswith("fs.lax.psum over ('b', 'a'): the value varies over 'a' but not over 'b'"), msg
    assert "fs.lax.psum(fs.lax.pvary(x, 'b'), ('b', 'a'))" in msg
    assert errors[("pvary", True)].endswith("Fix: pvary over the axes it does not vary over yet: fs.lax.pvary(x, 'b').")


# --- JAX 0.10.2's newer surface: pcast, all_gather(to=), pbroadcast, pshuffle, pswapaxes ---

def _new_surface_body():
    mesh = fs.make_mesh({"a": 2, "b": 2})
    errors, out = {}, {}

    def call(key, fn, spec=P("a"), check=True):
        f = fs.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P(("a", "b")), check=check)
        try:
            out[key] = f(torch.arange(8.0).reshape(8, 1)).full_tensor().flatten().tolist()
        except (ValueError, TypeError, NotImplementedError) as e:
            errors[key] = f"{type(e).__name__}: {e}"

    call("pcast_reduced", lambda x: fs.lax.pcast(x, "b", to="reduced"))
    call("pcast_unreduced", lambda x: fs.lax.pcast(x, ("a", "b"), to="unreduced"))
    call("pcast_bogus", lambda x: fs.lax.pcast(x, "b", to="invariant"))
    call("pcast_set", lambda x: fs.lax.pcast(x, {"b"}, to="varying"))
    call("pcast_empty", lambda x: fs.lax.pvary(fs.lax.pcast(x, (), to="varying"), "b"))
    call("ag_reduced", lambda x: fs.lax.all_gather(x, "b", to="reduced")[0])
    call("ag_bogus", lambda x: fs.lax.all_gather(x, "b", to="invariant")[0])
    call("swap_groups", lambda x: fs.lax.pswapaxes(x, "b", 0, axis_index_groups=[[0, 1]]))
    call("shuffle_bad", lambda x: fs.lax.pshuffle(x, "b", [0, 0]))
    call("pb_source", lambda x: fs.lax.pbroadcast(x, "a", 2))
    # pbroadcast has no implicit pvary in JAX: an invariant value is refused in checked mode...
    call("pb_invariant", lambda x: fs.lax.pbroadcast(x, ("a", "b"), 1))
    # ...and taken in unchecked mode (rank (a, b) = (0, 1) holds x's block 0: [0, 1, 2, 3])
    call("pb_unchecked", lambda x: fs.lax.pbroadcast(x, ("a", "b"), 1)[:1], check=False)
    return errors, out


def test_new_surface_refusals_name_the_axis_and_the_fix():
    errors, out = run_on_ranks(_new_surface_body, world_size=4)[0]
    assert set(out) == {"pcast_empty", "pb_unchecked"}, (out, errors)
    assert out["pb_unchecked"] == [0.0, 0.0, 0.0, 0.0], out
    for key in ("pcast_reduced", "pcast_unreduced", "ag_reduced"):
        assert errors[key].startswith("NotImplementedError: fs.lax.") and "not built yet" in errors[key], errors[key]
        assert "issue 34" in errors[key], errors[key]
    assert "'b', to='reduced'" in errors["pcast_reduced"] and "('a', 'b')" in errors["pcast_unreduced"]
    assert errors["pcast_bogus"].startswith("ValueError: fs.lax.pcast over 'b': to='invariant'")
    assert errors["pcast_set"].startswith("TypeError: fs.lax.pcast: axis_name={'b'}")
    assert "'invarying' is JAX's spelling" in errors["ag_bogus"], errors["ag_bogus"]
    assert errors["swap_groups"].startswith("NotImplementedError: fs.lax.pswapaxes over 'b': axis_index_groups")
    assert "is not a permutation" in errors["shuffle_bad"]
    assert "source=2 must be in [0, 2)" in errors["pb_source"]
    msg = errors["pb_invariant"]
    assert msg.startswith("ValueError: fs.lax.pbroadcast over ('a', 'b'): the value (shape (4, 1)) is invariant over 'b'")
    assert "fs.lax.pvary(x, 'b') first" in msg
