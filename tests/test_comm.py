"""fshard.comm's choice of transport: which transfers go through host memory."""

import pytest
import torch
import torch.distributed as dist

from fshard import comm
from fshard.testing import run_on_ranks


def _staging(device_types):
    group = dist.group.WORLD
    return comm.backend_of(group, "cpu"), [comm.via_host(group, torch.device(d)) for d in device_types]


def test_gloo_point_to_point_of_cuda_tensors_goes_through_the_host():
    # gloo's send/recv read the data pointer as host memory: a CUDA tensor must be staged.
    # torch.device("cuda") needs no GPU, so the decision is checked here; the transfer
    # itself runs in bench/gpu_checks (several ranks on one GPU through gloo).
    (result,) = run_on_ranks(_staging, ["cpu", "cuda", "cuda:0"], world_size=1)
    assert result == ("gloo", [False, True, True])


@pytest.mark.parametrize("name, device, backend, via_host", [
    ("cpu:gloo,cuda:nccl", "cuda", "nccl", False),
    ("cpu:gloo,cuda:nccl", "cpu", "gloo", False),
    ("cpu:gloo,cuda:gloo", "cuda", "gloo", True),
    ("nccl", "cuda", "nccl", False),
])
def test_backend_per_device_type(monkeypatch, name, device, backend, via_host):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    assert comm.backend_of(object(), torch.device(device).type) == backend
    assert comm.via_host(object(), torch.device(device)) is via_host


# --- reduce-scatter on gloo: all_to_all_single + local sum (issue 17, item 4) ----------

_F = torch.ops._c10d_functional


def _inputs(rank, n, integer):
    g = torch.Generator().manual_seed(1000 + rank)
    shape = (4 * n, 3, 5)
    if integer:  # exactly representable sums: any summation order gives the same bits
        return torch.randint(-1000, 1000, shape, generator=g).to(torch.float64)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _reduce_scatter_body(n, integer):
    import fshard as fs

    mesh = fs.make_mesh({"x": n})
    group, me = mesh.group("x"), dist.get_rank()
    x = _inputs(me, n, integer)
    reference = sum(_inputs(r, n, integer) for r in range(n)).chunk(n)[me]
    with comm.comm_log() as log:
        handle = comm.reduce_scatter_async(x, group, n, axes=("x",))
        new = handle.wait()
    with comm.comm_log() as old_log:  # gloo's own reduce-scatter, the path this replaces
        old = _F.wait_tensor(_F.reduce_scatter_tensor(x, "sum", n, group.group_name))
    ops = {op: comm.reduce_scatter_async(x, group, n, op, axes=("x",)).wait() for op in ("avg", "max", "min")}
    stack = torch.stack([_inputs(r, n, integer).chunk(n)[me] for r in range(n)])
    op_err = max((ops["avg"] - stack.mean(0)).abs().max().item(),
                 (ops["max"] - stack.amax(0)).abs().max().item(),
                 (ops["min"] - stack.amin(0)).abs().max().item())
    return {
        "shape": tuple(new.shape), "x_unchanged": torch.equal(x, _inputs(me, n, integer)),
        "ref_err": (new - reference).abs().max().item(), "old_err": (new - old).abs().max().item(),
        "op_err": op_err,
        "counts": dict(log.counts), "bytes": dict(log.bytes), "wire": dict(log.wire),
        "wire_by_axis": dict(log.wire_by_axis), "old_wire": dict(old_log.wire),
        "nbytes": x.numel() * x.element_size(),
        "timeline": [(e.what, e.kind) for e in log.timeline],
    }


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("integer", [True, False], ids=["integers", "random"])
def test_gloo_reduce_scatter_is_an_all_to_all_and_sums_exactly(n, integer):
    for r in run_on_ranks(_reduce_scatter_body, n, integer, world_size=n):
        assert r["shape"] == (4, 3, 5) and r["x_unchanged"]
        if integer:
            assert r["ref_err"] == 0.0 and r["old_err"] == 0.0 and r["op_err"] == 0.0, r
        else:  # float64: the old path (ring all-reduce) adds in another order
            assert r["ref_err"] < 1e-12 and r["old_err"] < 1e-12 and r["op_err"] < 1e-12, r
        nb = r["nbytes"]
        # Logged as the collective the caller asked for, not as its lowering.
        assert r["counts"] == {"psum_scatter": 1} and r["bytes"] == {"psum_scatter": nb}
        assert r["timeline"] == [("issue", "psum_scatter"), ("wait", "psum_scatter")]
        # On the wire: (n-1)/n of the input, half of what gloo's all-reduce + slice sends.
        assert r["wire"] == {"psum_scatter": nb * (n - 1) // n}
        assert r["wire_by_axis"] == {("psum_scatter", ("x",)): nb * (n - 1) // n}
        assert r["old_wire"] == {"psum_scatter": 2 * nb * (n - 1) // n}


def test_reduce_scatter_rejects_an_unknown_op():
    with pytest.raises(ValueError, match="op='prod'"):
        comm._LocalReduce(2, "prod")


# --- host staging (ranks sharing a GPU through gloo) -------------------------------------
# The device half runs in bench/gpu_checks (check_gloo_cuda, offload); here every
# collective is forced through the staging path on CPU tensors, so the plumbing (copy
# out, post-processing, copy back, in place) is checked against the unstaged result.

def _staged_collectives(force):
    import fshard as fs

    if force:
        comm.via_host = lambda group, device: True  # the rank's own module copy; the pool process is reused,
    mesh = fs.make_mesh({"x": 2})                    # so it is restored below
    try:
        group, me = mesh.group("x"), dist.get_rank()
        x = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (me + 1)
        inplace = x.clone()
        comm.all_reduce_async(inplace, group, "sum", axes=("x",), inplace=True).wait()
        return {"all_reduce": comm.all_reduce(x, group, "max", axes=("x",)),
                "inplace": inplace,
                "all_gather": comm.all_gather(x, group, 2, axes=("x",)),
                "reduce_scatter": comm.reduce_scatter_async(x, group, 2, "avg", axes=("x",)).wait(),
                "all_to_all": comm.all_to_all(x, group, 2, axes=("x",)),
                "ppermute": comm.permute(x, group, [(0, 1), (1, 0)], me, axes=("x",))}
    finally:
        comm.via_host = _VIA_HOST


_VIA_HOST = comm.via_host


def test_staged_collectives_equal_unstaged():
    plain = run_on_ranks(_staged_collectives, False, world_size=2)
    staged = run_on_ranks(_staged_collectives, True, world_size=2)
    for rank in range(2):
        assert plain[rank].keys() == staged[rank].keys()
        for k in plain[rank]:
            assert torch.equal(plain[rank][k], staged[rank][k]), (rank, k)
    x0 = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    assert torch.equal(plain[0]["inplace"], 3 * x0)  # 1x + 2x: the in-place result was copied back
    assert torch.equal(plain[1]["reduce_scatter"], 1.5 * x0[2:])


# --- permute: an all_to_all_single with per-peer split sizes -------------------------------
_RAW_PERMS = [
    [(i, (i + 1) % 4) for i in range(4)],  # a ring
    [(0, 2), (2, 3), (1, 1)],              # 0 receives zeros, 3 sends nothing, 1 keeps a copy
    [(1, 1)],                              # no pair between two ranks: nothing is issued
    [],                                    # every rank receives zeros
]


def _raw_permute(dtype):
    import fshard as fs

    mesh = fs.make_mesh({"x": 4})
    group, me = mesh.group("x"), dist.get_rank()
    x = (torch.arange(6).reshape(2, 3) + 10 * (me + 1)).to(dtype)
    out = []
    for sends in _RAW_PERMS:
        with comm.comm_log() as log:
            got = comm.permute(x, group, sends, me, axes=("x",))
        out.append((got, dict(log.counts), dict(log.wire), dict(log.bytes),
                    [(e.what, e.kind) for e in log.timeline]))
    # A 0-d tensor (flattened to one element) and a non-contiguous one keep their shapes.
    out.append((comm.permute(x[0, 0], group, _RAW_PERMS[0], me, axes=("x",)),
                comm.permute(x.t(), group, _RAW_PERMS[0], me, axes=("x",))))
    try:
        comm.permute(x, group, [(0, 1), (0, 2)], me, axes=("x",))
    except ValueError as e:
        out.append(str(e))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool])
def test_permute_values_zeros_and_log_on_4_ranks(dtype):
    results = run_on_ranks(_raw_permute, dtype, world_size=4)
    xs = [(torch.arange(6).reshape(2, 3) + 10 * (r + 1)).to(dtype) for r in range(4)]
    for me, res in enumerate(results):
        assert "unique sources" in res[-1] and "(0, 2)" in res[-1]
        scalar, transposed = res[-2]
        assert torch.equal(scalar, xs[(me - 1) % 4][0, 0]) and scalar.shape == ()
        assert torch.equal(transposed, xs[(me - 1) % 4].t())
        for sends, (got, counts, wire, nbytes, timeline) in zip(_RAW_PERMS, res[:-2]):
            src = [s for s, d in sends if d == me]
            want = xs[src[0]] if src else torch.zeros_like(xs[me])
            assert got.dtype == dtype and torch.equal(got, want), (sends, me, got)
            sent = xs[me].numel() * xs[me].element_size() * any(s == me != d for s, d in sends)
            assert counts == {"ppermute": 1} and wire == nbytes == {"ppermute": sent}, (sends, me, wire)
            # One all_to_all issued and waited by every rank (all take part, also with zero
            # splits), unless no pair joins two ranks.
            crossing = any(s != d for s, d in sends)
            assert timeline == [("issue", "ppermute")] + [("wait", "ppermute")] * crossing, (sends, timeline)
