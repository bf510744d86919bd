"""fs.simulate against real gloo ranks: each program runs under ``fs.simulate(n)`` and on
``n`` real ranks, and every rank's values (float64, and float32 where named) must be equal
bit for bit. Plus the misuse a simulation refuses, each with its message."""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.runtime.simulation import RankBranchError
from fshard.testing import assert_bitwise_equal, run_on_ranks, run_simulated


def _mesh(n: int):
    return fs.make_mesh({"a": 2, "b": 2} if n == 4 else {"a": n, "b": 1})


def _data(seed: int, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _shard_gather(n):
    mesh = _mesh(n)
    x = _data(0, 6, 4)
    out = {}
    for name, spec in {"rows": P("a"), "both": P("a", "b"), "minor": P(None, ("b", "a")), "none": P()}.items():
        s = fs.shard(x, spec, mesh)
        out[name] = (s.to_local().clone(), fs.gather(s))
    u = fs.shard(_data(1, 7, 3), P(("a", "b")), mesh, uneven=True)  # torch.chunk blocks: 2, 2, 2, 1
    out["uneven"] = (u.to_local().clone(), fs.gather(u))
    r = fs.reshard(fs.shard(x, P("a"), mesh), P(None, "b"), mesh)
    out["reshard"] = (r.to_local().clone(), fs.gather(r))
    return out


def _init(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g, dtype=torch.float64), "b": torch.zeros(5, dtype=torch.float64)}


def _init_sharded(n):
    mesh = _mesh(n)
    got = fs.init_sharded(_init, {"w": P(("a", "b")), "b": P("a")}, mesh, 3, uneven=True)
    return {k: (v.to_local().clone(), fs.gather(v)) for k, v in got.items()}


def _collectives(n, check):
    mesh = _mesh(n)

    def body(x):
        i = fs.lax.axis_index("a")
        y = x * (i + 1)
        return {
            "psum": fs.lax.psum(y, "a"),
            "psum2": fs.lax.psum(y, ("a", "b")),
            "pmean": fs.lax.pmean(y, ("b", "a")),
            "pmax": fs.lax.pmax(y, "a"),
            "pmin": fs.lax.pmin(y, ("a", "b")),
            "gather": fs.lax.all_gather(y, "a", tiled=True),
            "gather_ba": fs.lax.all_gather(y, ("b", "a"), axis=1),
            "scatter": fs.lax.psum_scatter(y, "a", scatter_dimension=1, tiled=True),
            "a2a": fs.lax.all_to_all(y, "a", 0, 1, tiled=True),
            "perm": fs.lax.ppermute(y, "a", [(j, (j + 1) % mesh.shape["a"]) for j in range(mesh.shape["a"])]),
            "index": (fs.lax.pvary(i.to(y.dtype), "b") + fs.lax.pvary(fs.lax.axis_index("b").to(y.dtype), "a")).reshape(1),
        }

    specs = {
        "psum": P("b"), "psum2": P(), "pmean": P(), "pmax": P("b"), "pmin": P(), "gather": P("b"),
        "gather_ba": P(), "scatter": P("b", "a"), "a2a": P("b", "a"), "perm": P(("a", "b")), "index": P(("a", "b")),
    }
    x = _data(2, 8, 4)
    out = fs.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=specs, check=check)(fs.shard(x, P(("a", "b")), mesh))
    return {k: fs.gather(v) for k, v in out.items()}


def _loss(w, x):
    h = torch.tanh(x @ w["w1"])
    local = (h @ w["w2"]).pow(2).mean()
    return fs.lax.pmean(local, "a")


def _grads(n, order, remat):
    mesh = _mesh(n)
    w = {"w1": _data(4, 4, 8), "w2": _data(5, 8, 2)}
    specs = {"w1": P(None, "b"), "w2": P("b")}
    x = _data(6, 8, 4)
    loss = _loss
    if remat:
        loss = fs.remat(_loss)

    def body(w, x):
        full = {"w1": fs.lax.all_gather(w["w1"], "b", axis=1, tiled=True), "w2": fs.lax.all_gather(w["w2"], "b", tiled=True)}
        return loss(full, x)

    ws, xs = fs.shard(w, specs, mesh), fs.shard(x, P("a"), mesh)
    if order == "outside":
        f = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P("a")), out_specs=P()))
    else:
        f = fs.shard_map(fs.value_and_grad(body), mesh=mesh, in_specs=(specs, P("a")), out_specs=(P(), specs))
    value, g = f(ws, xs)
    return fs.gather(value), fs.gather(g)


def _optim(n, dtype):
    mesh = _mesh(n)
    w = {"w1": _data(4, 4, 8, dtype=dtype), "w2": _data(5, 8, 2, dtype=dtype)}
    specs = {"w1": P(None, "b"), "w2": P("b")}
    ws = fs.shard(w, specs, mesh)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(1e-2, weight_decay=0.1))
    state = opt.init(ws)
    step = fs.value_and_grad(fs.shard_map(
        lambda w, x: _loss({"w1": fs.lax.all_gather(w["w1"], "b", axis=1, tiled=True),
                             "w2": fs.lax.all_gather(w["w2"], "b", tiled=True)}, x),
        mesh=mesh, in_specs=(specs, P("a")), out_specs=P()))
    losses = []
    for k in range(3):
        loss, g = step(ws, fs.shard(_data(10 + k, 8, 4, dtype=dtype), P("a"), mesh))
        updates, state = opt.update(g, state, ws)
        ws = fs.optim.apply_updates(ws, updates)
        losses.append(fs.gather(loss))
    return losses, fs.gather(ws)


def _comm_log(n):
    mesh = _mesh(n)
    with fs.comm_log() as log:
        _collectives_body_for_log(mesh)
    return list(log.events), dict(log.wire), [(e.what, e.kind, e.axes, e.nbytes, e.wire) for e in log.timeline]


def _collectives_body_for_log(mesh):
    def body(x):
        return fs.lax.psum_scatter(fs.lax.all_gather(x, "a", tiled=True), "a", tiled=True)

    fs.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a"))(fs.shard(_data(7, 8, 2), P("a"), mesh))


PROGRAMS = {
    "shard_gather_reshard": (_shard_gather, ()),
    "init_sharded": (_init_sharded, ()),
    "collectives_checked": (_collectives, (True,)),
    "collectives_unchecked": (_collectives, (False,)),
    "grad_outside": (_grads, ("outside", False)),
    "grad_inside": (_grads, ("inside", False)),
    "grad_remat_outside": (_grads, ("outside", True)),
    "grad_remat_inside": (_grads, ("inside", True)),
    "optim_float64": (_optim, (torch.float64,)),
    "optim_float32": (_optim, (torch.float32,)),
    "comm_log": (_comm_log, ()),
}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_simulated_program_equals_the_real_ranks_bit_for_bit(name, n):
    fn, args = PROGRAMS[name]
    real = run_on_ranks(fn, n, *args, world_size=n)
    simulated = run_simulated(fn, n, *args, world_size=n)
    assert len(simulated) == n
    for r in range(n):
        assert_bitwise_equal(simulated[r], real[r], what=f"{name}, rank {r}")


def test_a_branch_on_the_rank_is_an_error_naming_the_line():
    with fs.simulate(2):
        mesh = fs.make_mesh({"a": 2})

        def body(x):
            if int(fs.lax.axis_index("a")) == 0:  # the line the message names
                return x
            return -x

        with pytest.raises(RankBranchError, match=r"test_simulate\.py:\d+: if int\(fs\.lax\.axis_index"):
            fs.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a"))(fs.shard(torch.ones(2), P("a"), mesh))


def test_a_branch_on_a_per_rank_tensor_is_an_error_naming_the_line():
    with fs.simulate(2):
        mesh = fs.make_mesh({"a": 2})

        def body(x):
            if fs.lax.axis_index("a") == 0:  # the line the message names
                return x
            return -x

        def same(x):  # a host value that every rank agrees on is fine
            return x * float(fs.lax.psum(fs.lax.axis_index("a"), "a"))

        x = fs.shard(torch.ones(2), P("a"), mesh)
        with pytest.raises(RankBranchError, match=r"test_simulate\.py:\d+: if fs\.lax\.axis_index\(\"a\"\) == 0"):
            fs.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a"))(x)
        assert torch.equal(fs.gather(fs.shard_map(same, mesh=mesh, in_specs=P("a"), out_specs=P("a"))(x)),
                           torch.ones(2))


def test_a_collective_whose_blocks_differ_within_a_group_is_an_error():
    with fs.simulate(2):
        mesh = fs.make_mesh({"a": 2})
        uneven = fs.shard(torch.arange(3.0), P("a"), mesh, uneven=True)  # blocks of 2 and 1
        gather = fs.shard_map(lambda x: fs.lax.all_gather(x, "a", tiled=True), mesh=mesh, in_specs=P("a"),
                              out_specs=P(), check=False)
        with pytest.raises(RuntimeError, match=r"differ between the ranks of one group \(rank 0: \(2,\).*rank 1: \(1,\)"):
            gather(uneven)


def test_dist_get_rank_is_the_per_rank_int_a_branch_on_it_is_an_error():
    import torch.distributed as dist

    with fs.simulate(2):
        rows = torch.arange(4.0).reshape(2, 2).select(0, dist.get_rank())  # a per-rank index works
        assert [rows._local_tensors[r].tolist() for r in (0, 1)] == [[0.0, 1.0], [2.0, 3.0]]
        with pytest.raises(RankBranchError, match=r"test_simulate\.py:\d+: if dist\.get_rank\(\) == 0"):
            if dist.get_rank() == 0:
                pass
        with pytest.raises(RankBranchError, match=r"int\("):
            int(dist.get_rank())


def _nested():
    with fs.simulate(2):
        pass


def test_simulate_inside_real_ranks_and_nested_is_refused():
    with pytest.raises(RuntimeError, match="inside a real process group"):
        run_on_ranks(_nested, world_size=2)
    with fs.simulate(2), pytest.raises(RuntimeError, match="do not nest"):
        fs.simulate(2).__enter__()


def test_a_notebook_can_enter_and_leave_and_enter_again():
    sim = fs.simulate(4).__enter__()
    try:
        mesh = fs.make_mesh({"a": 4})
        x = fs.shard(torch.arange(8.0), P("a"), mesh)
        assert torch.equal(fs.gather(x), torch.arange(8.0))
    finally:
        sim.__exit__(None, None, None)
    with fs.simulate(2):
        assert fs.make_mesh({"a": 2}).size == 2
