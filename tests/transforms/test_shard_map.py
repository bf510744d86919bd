"""shard_map: data- and tensor-parallel gradients vs single-process references, checked vs
unchecked mode, replication promises, spec errors, static args and kwargs, comm counts,
torch.func compatibility and remat."""


import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks


def _mlp_params(d=4, h=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w1": torch.randn(h, d, generator=g, dtype=torch.float64),
            "w2": torch.randn(d, h, generator=g, dtype=torch.float64)}


def _mlp(p, x):
    return torch.relu(x @ p["w1"].T) @ p["w2"].T  # (B, d) -> (B, h) -> (B, d)


def _data(n_rows=8, d=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_rows, d, generator=g, dtype=torch.float64), torch.randn(n_rows, d, generator=g, dtype=torch.float64)


def _value_and_grad(order, loss, mesh, in_specs, grad_specs, check, argnums=0):
    """``loss``'s value and gradients over global arguments, in either composition.

    ``"outside"``: ``value_and_grad(shard_map(loss))``; ``"inside"``: JAX's usual
    ``shard_map(value_and_grad(loss))``, whose gradients come out by ``grad_specs``.
    """
    if order == "outside":
        return fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=in_specs, out_specs=P(), check=check),
                                 argnums=argnums)
    return fs.shard_map(fs.value_and_grad(loss, argnums=argnums), mesh=mesh, in_specs=in_specs,
                        out_specs=(P(), grad_specs), check=check)


ORDERS = ["outside", "inside"]


# --- data parallel: params P(), batch P("dp") -----------------------------------------------

def _dp_loss(p, x, y, explicit_pvary):
    if explicit_pvary:
        p = fs.lax.pvary(p, "dp")
    return fs.lax.pmean(((_mlp(p, x) - y) ** 2).mean(), "dp")


def _dp_body(check, explicit_pvary, order="outside"):
    mesh = fs.make_mesh({"dp": dist.get_world_size()})
    params, (x, y) = _mlp_params(), _data()
    sharded = fs.shard(params, P(), mesh)
    step = _value_and_grad(order, lambda p, a, b: _dp_loss(p, a, b, explicit_pvary), mesh,
                           (P(), P("dp"), P("dp")), P(), check)
    with fs.comm_log() as log:
        loss, grads = step(sharded, x, y)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: ((_mlp(p, x) - y) ** 2).mean())(params)
    grads = fs.gather(grads)
    return (abs(loss.item() - ref_loss.item()),
            max((grads[k] - ref_grads[k]).abs().max().item() for k in params),
            dict(log.by_axis))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_data_parallel_grads_checked_implicit_equal_unchecked_explicit_and_reference(n, order):
    checked = run_on_ranks(_dp_body, True, False, order, world_size=n)
    unchecked = run_on_ranks(_dp_body, False, True, order, world_size=n)
    for (dl, dg, log_c), (dl2, dg2, log_u) in zip(checked, unchecked):
        assert dl < 1e-12 and dg < 1e-12 and dl2 < 1e-12 and dg2 < 1e-12
        if n > 1:
            # forward pmean: 1 psum; backward: one psum per parameter leaf (pvary's transpose).
            assert log_c == log_u == {("psum", ("dp",)): 3}
        else:
            assert log_c == log_u == {}  # size-1 axes issue nothing


@pytest.mark.parametrize("order", ORDERS)
def test_data_parallel_without_pvary_in_unchecked_mode_is_per_rank(order):
    # Megatron semantics: without pvary the gradient is each rank's own contribution.
    dl, dg, _ = run_on_ranks(_dp_body, False, False, order, world_size=2)[0]
    assert dl < 1e-12 and dg > 1e-3


# --- tensor parallel (Megatron MLP): w1 column-split, w2 row-split ----------------------------

def _tp_loss(p, x, y, check):
    if not check:
        x = fs.lax.pvary(x, "tp")  # Megatron "f"
    out = fs.lax.psum(torch.relu(x @ p["w1"].T) @ p["w2"].T, "tp")  # Megatron "g"
    return ((out - y) ** 2).mean()


def _tp_body(check, order="outside"):
    mesh = fs.make_mesh({"tp": dist.get_world_size()})
    params, (x, y) = _mlp_params(), _data()
    specs = {"w1": P("tp", None), "w2": P(None, "tp")}
    sharded = fs.shard(params, specs, mesh)
    step = _value_and_grad(order, lambda p, a, b: _tp_loss(p, a, b, check), mesh, (specs, P(), P()),
                           (specs, P()), check, argnums=(0, 1))
    with fs.comm_log() as log:
        loss, (grads, gx) = step(sharded, x, y)
    ref_loss, (ref_grads, ref_gx) = fs.value_and_grad(lambda p, a: ((_mlp(p, a) - y) ** 2).mean(), argnums=(0, 1))(params, x)
    grads = fs.gather(grads)
    return (abs(loss.item() - ref_loss.item()),
            max((grads[k] - ref_grads[k]).abs().max().item() for k in params),
            (fs.gather(gx) - ref_gx).abs().max().item(), fs.spec_of(fs.shard(grads, specs, mesh)), dict(log.counts))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_grads_checked_equal_unchecked_and_reference(n, order):
    for check in (True, False):
        for dl, dg, dx, _, counts in run_on_ranks(_tp_body, check, order, world_size=n):
            assert dl < 1e-12 and dg < 1e-12 and dx < 1e-12, (check, dl, dg, dx)
            assert counts == {"psum": 2}  # forward g, backward f (for the input's gradient)


# --- out_specs promises ---------------------------------------------------------------------

def _promise(kind):
    mesh = fs.make_mesh({"dp": 2})
    x = torch.arange(4.0).reshape(4, 1)
    bodies = {
        "broken": lambda t: t * 2,            # varies over dp, promised replicated
        "reduced": lambda t: fs.lax.psum(t, "dp"),
        "gathered": lambda t: fs.lax.all_gather(t, "dp", tiled=True),  # typed varying, values equal
    }
    f = fs.shard_map(bodies[kind], mesh=mesh, in_specs=P("dp"), out_specs=P(), check=True)
    try:
        return f(x).to_local().flatten().tolist()
    except ValueError as e:
        return str(e)


def test_replication_promise_is_checked():
    broken = run_on_ranks(_promise, "broken", world_size=2)[0]
    assert "output has spec P()" in broken and "axes ('dp',)" in broken and "max difference 4" in broken
    assert run_on_ranks(_promise, "reduced", world_size=2)[0] == [2.0, 4.0]
    assert run_on_ranks(_promise, "gathered", world_size=2)[0] == [0.0, 1.0, 2.0, 3.0]


# --- specs, DTensor inputs, static args, kwargs ---------------------------------------------

def _structure_and_layouts():
    mesh = fs.make_mesh({"a": 2, "b": 2})
    params = {"w": torch.arange(16.0).reshape(4, 4), "layers": [torch.ones(4), torch.ones(4)]}
    sharded = fs.shard(params, {"w": P("a", "b"), "layers": P()}, mesh)
    results = {}

    def body(p, scale, *, bias):
        return {"w": p["w"] * scale + bias, "n": len(p["layers"])}, p["layers"][1].sum()

    f = fs.shard_map(body, mesh=mesh, in_specs=({"w": P("a", "b"), "layers": P()}, None),
                     out_specs=({"w": P("a", "b"), "n": P()}, P()))
    out, s = f(sharded, 3.0, bias=1.0)
    results["values"] = torch.equal(fs.gather(out["w"]), params["w"] * 3 + 1) and out["n"] == 2 and s.item() == 4.0
    for key, call in {
        "in_structure": lambda: fs.shard_map(body, mesh=mesh, in_specs=({"w": P()}, None), out_specs=P())(sharded, 1.0, bias=0.0),
        "out_structure": lambda: fs.shard_map(body, mesh=mesh, in_specs=({"w": P("a", "b"), "layers": P()}, None),
                                              out_specs=[P(), P(), P()])(sharded, 1.0, bias=0.0),
        "layout": lambda: fs.shard_map(body, mesh=mesh, in_specs=({"w": P("b", "a"), "layers": P()}, None),
                                       out_specs=({"w": P("b", "a"), "n": P()}, P()))(sharded, 1.0, bias=0.0),
    }.items():
        try:
            call()
        except ValueError as e:
            results[key] = str(e)
    g = fs.shard_map(body, mesh=mesh, in_specs=({"w": P("b", "a"), "layers": P()}, None),
                     out_specs=({"w": P("b", "a"), "n": P()}, P()), reshard=True)
    out2, _ = g(sharded, 1.0, bias=0.0)
    results["reshard"] = torch.equal(fs.gather(out2["w"]), params["w"])
    return results


def test_specs_dtensor_layouts_static_args_and_kwargs():
    r = run_on_ranks(_structure_and_layouts, world_size=4)[0]
    assert r["values"] and r["reshard"]
    assert "in_specs is not a pytree prefix of args" in r["in_structure"] and "keys differ" in r["in_structure"]
    assert "out_specs is not a pytree prefix of outputs" in r["out_structure"]
    assert "args[0].w" in r["layout"] and "laid out as P('a', 'b')" in r["layout"] and "reshard=True" in r["layout"]


# --- torch.func inside a body, and remat ------------------------------------------------------

def _func_and_remat(policy, order="outside", check=False):
    mesh = fs.make_mesh({"tp": 2})
    params, (x, y) = _mlp_params(), _data()
    specs = {"w1": P("tp", None), "w2": P(None, "tp")}
    sharded = fs.shard(params, specs, mesh)

    def local_loss(p, a):
        return ((fs.lax.psum(torch.relu(a @ p["w1"].T) @ p["w2"].T, "tp") - y) ** 2).mean()

    def body_func(p, a):  # torch.func.grad of a body with collectives
        return torch.func.grad(local_loss)(p, a)

    g_func = fs.gather(fs.shard_map(body_func, mesh=mesh, in_specs=(specs, P()), out_specs=specs, check=False)(sharded, x))
    body = fs.remat(local_loss, policy=policy)
    with fs.comm_log() as log:
        _, g_remat = _value_and_grad(order, body, mesh, (specs, P()), specs, check)(sharded, x)
    ref = fs.grad(lambda p: ((_mlp(p, x) - y) ** 2).mean())(params)
    g_remat = fs.gather(g_remat)
    return (max((g_func[k] - ref[k]).abs().max().item() for k in ref),
            max((g_remat[k] - ref[k]).abs().max().item() for k in ref), log.counts["psum"])


@pytest.mark.parametrize("order, check", [("outside", False), ("inside", False), ("inside", True)])
@pytest.mark.parametrize("policy, psums", [(None, 2), ("nothing_saveable", 2), ("save_collectives", 1), ("dots_saveable", 1)])
def test_torch_func_grad_in_body_and_remat_policies(policy, psums, order, check):
    d_func, d_remat, n_psum = run_on_ranks(_func_and_remat, policy, order, check, world_size=2)[0]
    assert d_func < 1e-12 and d_remat < 1e-12
    assert n_psum == psums  # recomputing the block re-issues its psum unless the policy saves it


def test_remat_unknown_policy():
    with pytest.raises(ValueError, match="save_collectives"):
        fs.remat(lambda x: x, policy="everything")


def test_value_and_grad_has_aux_and_errors():
    f = fs.value_and_grad(lambda p, s: ((p["w"] * s).sum(), {"n": 1}), has_aux=True)
    (v, aux), g = f({"w": torch.ones(3), "k": 2}, 2.0)
    assert v.item() == 6.0 and aux == {"n": 1} and torch.equal(g["w"], torch.full((3,), 2.0)) and g["k"] is None
    with pytest.raises(TypeError, match="scalar tensor"):
        fs.grad(lambda p: p * 2)(torch.ones(3))
    assert torch.equal(fs.grad(lambda a, b: (a * 0).sum())(torch.ones(2), torch.ones(2)), torch.zeros(2))


def _size_one_axis_body(order="outside"):
    # x varies over dp; s over tp (size 1): checked mode makes the product vary over both,
    # and the implicit pvary over tp must not issue a psum over one rank in backward.
    mesh = fs.make_mesh({"dp": 2, "tp": 1})
    params, (x, y) = _mlp_params(), _data()
    s = torch.ones(1, dtype=torch.float64)

    def loss(p, a, b, scale):
        return fs.lax.pmean(((_mlp(p, a) * scale - b) ** 2).mean(), ("dp", "tp"))

    step = _value_and_grad(order, loss, mesh, (P(), P("dp"), P("dp"), P("tp")), P(), True)
    with fs.comm_log() as log:
        value, grads = step(fs.shard(params, P(), mesh), x, y, s)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: ((_mlp(p, x) - y) ** 2).mean())(params)
    grads = fs.gather(grads)
    return (abs(value.item() - ref_loss.item()),
            max((grads[k] - ref_grads[k]).abs().max().item() for k in params), dict(log.by_axis))


@pytest.mark.parametrize("order", ORDERS)
def test_implicit_pvary_over_a_size_one_axis_issues_nothing(order):
    for dl, dg, by_axis in run_on_ranks(_size_one_axis_body, order, world_size=2):
        assert dl < 1e-12 and dg < 1e-12
        assert not any("tp" in axes and axes != ("dp", "tp") for _, axes in by_axis), by_axis


@pytest.mark.parametrize("policy, saves", [(None, False), ("nothing_saveable", False), ("save_collectives", True),
                                           ("dots_saveable", True), (lambda op: False, False)])
def test_remat_policy_saves_gathers(policy, saves):
    from fshard.transforms.remat import saves_gathers

    assert saves_gathers(policy) is saves



def _local_cotangents():
    # shard_map's one autograd node for all DTensor inputs (_Locals) must give the same
    # gradient DTensors as DTensor.to_local()'s own backward: contiguous and strided
    # cotangents, a strided primal, a buffer that does not require grad.
    from fshard.transforms.shard_map import _Locals

    mesh = fs.make_mesh({"d": 2})
    g = torch.Generator().manual_seed(0)
    full = torch.randn(4, 6, generator=g, dtype=torch.float64)
    cases = {"rows": fs.shard(full, P("d"), mesh), "cols": fs.shard(full, P(None, "d"), mesh),
             "strided": fs.shard(full, P("d"), mesh).transpose(0, 1)}
    out = {}
    for name, x in cases.items():
        for cot in ("contiguous", "strided"):
            mine, ref = (x.detach().requires_grad_(True) for _ in range(2))
            (lm,), lr = _Locals.apply(mine), ref.to_local()
            c = torch.randn(lm.shape[::-1], generator=g, dtype=torch.float64).t() if cot == "strided" else \
                torch.randn(lm.shape, generator=g, dtype=torch.float64)
            (gm,), (gr,) = torch.autograd.grad(lm, mine, c), torch.autograd.grad(lr, ref, c)
            out[(name, cot)] = (type(gm).__name__, gm.placements == gr.placements, gm.shape == gr.shape,
                                gm.stride() == gr.stride(), torch.equal(gm.to_local(), gr.to_local()))
    buf = fs.shard(full, P("d"), mesh)
    w = fs.shard(full, P("d"), mesh).requires_grad_(True)
    lb, lw = _Locals.apply(buf, w)
    out["buffer"] = (lb.requires_grad, lw.requires_grad)
    return out


def test_local_blocks_node_matches_to_local_backward():
    for rank_out in run_on_ranks(_local_cotangents, world_size=2):
        for key, val in rank_out.items():
            if key == "buffer":
                assert val == (False, True)
            else:
                assert val == ("DTensor", True, True, True, True), key
