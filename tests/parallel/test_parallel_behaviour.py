"""The layer loop's behaviours observed directly, not only through their results.

Gradient parity holds whether or not a layer's gather was prefetched, whether a block
was recomputed, or whether gathered parameters were freed after forward; so each test
here records what happened and asserts on that, plus parity:

- prefetch: ``comm_log().timeline`` orders, per rank, every all-gather's issue and wait
  and the marks each block makes when its compute starts and ends (forward) and when its
  backward starts and ends (an identity whose backward marks). Layers have different
  hidden widths, so each gather's payload names its layer. With prefetch k the gather of
  layer i + k is issued before layer i's compute ends, and layer i + k + 1's is not;
  likewise for ``forward_prefetch`` / ``backward_prefetch`` lists.
- remat: how often each block runs per step, how many all-gathers run in backward, and
  the bytes autograd saves (``saved_tensors_hooks``).
- reshard after forward: whether the storages of the gathered parameters are alive
  between forward and backward (storage weak references), and the regathers' axes and
  payloads, for True, False, an int and an axis name.
- placement: FSDP on dim 1 and on a dim the axis does not divide, through ``dim=`` and
  ``placement_fn``: the local shard shapes, the gathered payload, and parity.
- offload: on a CPU mesh the copies are no-ops, so what is asserted is what the code
  asks for: the staging buffers handed to the host-to-device copy (size, dtype), the
  device-to-host copies and their one synchronization per backward, and where shards,
  gradients and optimizer state live.
- delays: every functional collective (and point-to-point batch, and c10d all-reduce)
  sleeps a rank-dependent, pseudo-random time before it is issued and before it is
  waited; the results must be bitwise those without delays, with no hang.
"""

from __future__ import annotations

import gc
import math
import random
import time

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import fshard as fs
from fshard import P, comm
from fshard.testing import run_on_ranks

D, N_LAYERS, BATCH_PER_RANK = 8, 4, 2
TOL = 1e-10
# (mesh shape, FSDP axes): one axis of 2 and 4 ranks, and two axes of 2 x 2.
MESHES = [({"x": 2}, "x"), ({"x": 4}, "x"), ({"x": 2, "y": 2}, ("x", "y"))]
MESH_IDS = ["x2", "x4", "x2y2"]


def _hidden(i: int) -> int:
    return 8 * (i + 1)  # a different width per layer: the gather's payload names the layer


def _params(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w1": torch.randn(D, _hidden(i), generator=g, dtype=torch.float64) * 0.3,
             "w2": torch.randn(_hidden(i), D, generator=g, dtype=torch.float64) * 0.3}
            for i in range(N_LAYERS)]


def _layer_of(lp) -> int:
    return lp["w1"].shape[1] // 8 - 1


class _Mark(torch.autograd.Function):
    """Identity whose backward puts ``label`` on the comm timeline."""

    @staticmethod
    def forward(x, label):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.label = inputs[1]

    @staticmethod
    def backward(ctx, g):
        comm.mark(ctx.label)
        return g, None


def _block(lp, h, seen=None):
    """relu(h @ w1) @ w2, marking forward start/end and backward start/end on the timeline."""
    i = _layer_of(lp)
    comm.mark(("fwd_start", i))
    if seen is not None:
        seen.append((i, [StorageWeakRef(t.untyped_storage()) for t in lp.values()]))
    if h.requires_grad:  # layer 0's input is data: nothing flows back through it
        h = _Mark.apply(h, ("bwd_end", i))
    out = _Mark.apply(torch.relu(h @ lp["w1"]) @ lp["w2"], ("bwd_start", i))
    comm.mark(("fwd_end", i))
    return out


def _ref_loss(params, x, y):
    h = x
    for lp in params:
        h = torch.relu(h @ lp["w1"]) @ lp["w2"]
    return ((h - y) ** 2).mean()


def _data(n_rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_rows, D, generator=g, dtype=torch.float64),
            torch.randn(n_rows, D, generator=g, dtype=torch.float64))


def _gather_bytes(n: int) -> dict[int, int]:
    """Each layer's all-gather payload per rank (float64): its flat shard, rows padded to ceil(N / n)."""
    return {i: 8 * (math.ceil(D / n) * _hidden(i) + math.ceil(_hidden(i) / n) * D) for i in range(N_LAYERS)}


def _flat(timeline, layer_of_bytes):
    """Timeline -> [(what, name)] with name ("gather", layer), a mark's label, or (kind,)."""
    out = []
    for e in timeline:
        if e.what == "mark":
            out.append(("mark", e.label))
        elif e.kind == "all_gather" and e.nbytes in layer_of_bytes:
            out.append((e.what, ("gather", layer_of_bytes[e.nbytes])))
        else:
            out.append((e.what, (e.kind, e.axes, e.nbytes)))
    return out


def _step_timeline(shape, axis, cfg):
    """One FSDP step of the 4-layer MLP with ``scan_layers(config=ScanConfig(**cfg))``.

    Returns (flat timeline, loss error, max grad error, per-layer forward block runs,
    bytes autograd saved outside scan_layers' own hooks).
    """
    mesh = fs.make_mesh(shape)
    n = mesh.axis_size(axis)
    params = _params()
    specs = fs.parallel.fsdp_specs(params, axis)
    sharded = fs.shard(params, specs, mesh)
    x, y = _data(BATCH_PER_RANK * n)
    runs = [0] * N_LAYERS

    def block(lp, h):
        runs[_layer_of(lp)] += 1
        return _block(lp, h)

    def body(p, a, b):
        h = fs.parallel.scan_layers(block, p, a, axis=axis, config=fs.parallel.ScanConfig(**cfg))
        return fs.lax.pmean(((h - b) ** 2).mean(), axis)

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=P()))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with fs.comm_log() as log, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, grads = step(sharded, x, y)
    ref_loss, ref_grads = fs.value_and_grad(_ref_loss)(params, x, y)
    grad_err = max((fs.gather(a) - b).abs().max().item()
                   for a, b in zip(fs.tree.leaves(grads), fs.tree.leaves(ref_grads)))
    layer_of_bytes = {v: k for k, v in _gather_bytes(n).items()}
    return (_flat(log.timeline, layer_of_bytes), abs(loss.item() - ref_loss.item()), grad_err, runs,
            sum(saved.values()))


def _pos(flat, what, name):
    """Positions of every (what, name) on the flat timeline."""
    return [k for k, (w, nm) in enumerate(flat) if w == what and nm == name]


def _one(flat, what, name):
    hits = _pos(flat, what, name)
    assert len(hits) == 1, (what, name, hits, flat)
    return hits[0]


def _first_backward(flat):
    return min(k for k, (w, nm) in enumerate(flat) if w == "mark" and nm[0] == "bwd_start")


# --- prefetch ------------------------------------------------------------------------------

def _forward_expected(fwd_lists):
    """Layers whose gather must be issued before layer i's compute ends: layers 0..i and
    every list of layers 0..i (each list starts when its layer starts)."""
    out, issued = [], set()
    for i in range(N_LAYERS):
        issued |= {i} | {j for j in fwd_lists[i] if 0 <= j < N_LAYERS}
        out.append(set(issued))
    return out


def _backward_expected(bwd_lists):
    """Layers whose regather must be issued before layer i's backward ends, walking
    backward from the last layer: each layer's own regather, and its list."""
    out, issued = {}, set()
    for i in range(N_LAYERS - 1, -1, -1):
        issued |= {i} | {j for j in bwd_lists[i] if 0 <= j < N_LAYERS}
        out[i] = set(issued)
    return out


FORWARD_CASES = {
    "prefetch0": (dict(prefetch=0), [[] for _ in range(N_LAYERS)]),
    "prefetch1": (dict(prefetch=1), [[i + 1] for i in range(N_LAYERS)]),
    "prefetch2": (dict(prefetch=2), [[i + 1, i + 2] for i in range(N_LAYERS)]),
    # layer i + 1 is not in layer i's list: it is gathered only when it starts
    "list_skip_one": (dict(forward_prefetch=[[i + 2] for i in range(N_LAYERS)]), [[i + 2] for i in range(N_LAYERS)]),
    "list_next_two": (dict(forward_prefetch=[[i + 1, i + 2] for i in range(N_LAYERS)]),
                      [[i + 1, i + 2] for i in range(N_LAYERS)]),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
@pytest.mark.parametrize("shape, axis", MESHES, ids=MESH_IDS)
def test_forward_prefetch_issues_gathers_ahead_of_compute(shape, axis, case):
    cfg, lists = FORWARD_CASES[case]
    expected = _forward_expected(lists)
    for flat, loss_err, grad_err, runs, _ in run_on_ranks(_step_timeline, shape, axis, cfg,
                                                          world_size=math.prod(shape.values())):
        assert loss_err < TOL and grad_err < TOL
        assert runs == [1] * N_LAYERS
        fwd = flat[:_first_backward(flat)]
        for i in range(N_LAYERS):
            start, end = _one(fwd, "mark", ("fwd_start", i)), _one(fwd, "mark", ("fwd_end", i))
            issue, wait = _one(fwd, "issue", ("gather", i)), _one(fwd, "wait", ("gather", i))
            assert issue < wait < start < end, (case, i, fwd)
            before_end = {j for j in range(N_LAYERS) if _one(fwd, "issue", ("gather", j)) < end}
            assert before_end == expected[i], (case, i, before_end, expected[i], fwd)


BACKWARD_CASES = {
    "default": (dict(), [[i - 1] if i else [] for i in range(N_LAYERS)]),
    "none": (dict(backward_prefetch=[[] for _ in range(N_LAYERS)]), [[] for _ in range(N_LAYERS)]),
    "list_skip_one": (dict(backward_prefetch=[[i - 2] if i > 1 else [] for i in range(N_LAYERS)]),
                      [[i - 2] if i > 1 else [] for i in range(N_LAYERS)]),
}


@pytest.mark.parametrize("case", list(BACKWARD_CASES))
@pytest.mark.parametrize("shape, axis", MESHES, ids=MESH_IDS)
def test_backward_prefetch_issues_regathers_ahead_of_backward(shape, axis, case):
    cfg, lists = BACKWARD_CASES[case]
    expected = _backward_expected(lists)
    for flat, loss_err, grad_err, runs, _ in run_on_ranks(_step_timeline, shape, axis, dict(cfg, prefetch=0),
                                                          world_size=math.prod(shape.values())):
        assert loss_err < TOL and grad_err < TOL
        first = _first_backward(flat)
        bwd = flat[first:]
        for i in range(N_LAYERS):
            start = _one(bwd, "mark", ("bwd_start", i))
            issue = _one(bwd, "issue", ("gather", i))  # one regather per layer: reshard_after_forward
            wait = _one(bwd, "wait", ("gather", i))
            assert issue < wait, (case, i, bwd)
            if i not in {j for k in range(i + 1, N_LAYERS) for j in lists[k]}:
                assert start < issue, (case, i, bwd)  # not prefetched: issued by its own backward
            # A prefetched regather may be waited before its layer's backward starts: on gloo
            # the next collective on the group completes it first (comm.one_at_a_time).
            if i == 0:
                continue  # layer 0's input needs no gradient: no end mark
            end = _one(bwd, "mark", ("bwd_end", i))
            assert wait < end
            before_end = {j for j in range(N_LAYERS) if _one(bwd, "issue", ("gather", j)) < end}
            assert before_end == expected[i], (case, i, before_end, expected[i], bwd)


# --- remat ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, axis", [MESHES[0], MESHES[2]], ids=["x2", "x2y2"])
@pytest.mark.parametrize("remat, raf, policy, runs, bwd_gathers", [
    (False, True, None, 1, 1),                  # reshard: regather, no recompute
    (False, False, None, 1, 0),                 # kept: neither
    (True, True, None, 2, 1),                   # recompute, its gather redone inside it
    (True, False, None, 2, 1),                  # remat frees the parameters whatever reshard says
    (True, True, "save_collectives", 2, 0),     # the gather's result saved: no regather
    (True, True, "dots_saveable", 2, 0),        # saves collectives too
    (True, True, "nothing_saveable", 2, 1),     # the gather redone inside the recomputation
])
def test_remat_recomputes_each_block_once_in_backward(shape, axis, remat, raf, policy, runs, bwd_gathers):
    cfg = dict(remat=remat, reshard_after_forward=raf, remat_policy=policy)
    for flat, loss_err, grad_err, got_runs, _ in run_on_ranks(_step_timeline, shape, axis, cfg,
                                                              world_size=math.prod(shape.values())):
        assert loss_err < TOL and grad_err < TOL
        assert got_runs == [runs] * N_LAYERS
        fwd, bwd = flat[:_first_backward(flat)], flat[_first_backward(flat):]
        for i in range(N_LAYERS):
            assert len(_pos(fwd, "issue", ("gather", i))) == 1
            assert len(_pos(bwd, "issue", ("gather", i))) == bwd_gathers, (i, bwd)
            # a recomputation runs inside the layer's backward, after its start mark
            recomputed = _pos(bwd, "mark", ("fwd_start", i))
            assert len(recomputed) == runs - 1
            assert all(k > _one(bwd, "mark", ("bwd_start", i)) for k in recomputed)


def test_remat_saves_fewer_activation_bytes():
    # Without reshard, scan_layers installs no saved-tensor hooks of its own, so an outer
    # hook sees every tensor autograd keeps for backward.
    shape, axis = MESHES[0]
    (_, _, _, _, plain), _ = run_on_ranks(_step_timeline, shape, axis, dict(reshard_after_forward=False),
                                          world_size=2)
    (_, _, _, _, rematted), _ = run_on_ranks(_step_timeline, shape, axis,
                                             dict(reshard_after_forward=False, remat=True), world_size=2)
    # per layer the activations (B x H) plus the kept gathered layer: far more than the
    # layer inputs remat keeps
    assert plain > 4 * rematted, (plain, rematted)


# --- reshard after forward -----------------------------------------------------------------

class _GatheredBuffers(TorchDispatchMode):
    """Weak references to the storage of every all-gather's result (the flat gathered buffers)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.refs.append(StorageWeakRef(out.untyped_storage()))
        return out


def _reshard_body(shape, axis, raf):
    """Forward, then (between forward and backward) which gathered storages are alive:
    the parameters each block saw, and the flat buffers the all-gathers filled (of which
    the parameters may be views or copies); then backward, with the regathers logged."""
    mesh = fs.make_mesh(shape)
    n = mesh.axis_size(axis)
    params = _params()
    specs = fs.parallel.fsdp_specs(params, axis)
    sharded = fs.shard(params, specs, mesh)
    for leaf in fs.tree.leaves(sharded):
        leaf.requires_grad_(True)
    x, y = _data(BATCH_PER_RANK * n)
    seen = []

    def body(p, a, b):
        h = fs.parallel.scan_layers(lambda lp, z: _block(lp, z, seen), p, a, axis=axis,
                                    config=fs.parallel.ScanConfig(reshard_after_forward=raf))
        return fs.lax.pmean(((h - b) ** 2).mean(), axis)

    f = fs.shard_map(body, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=P())
    with fs.comm_log() as fwd_log, _GatheredBuffers() as buffers:
        loss = f(sharded, x, y)
    gc.collect()
    alive_after_forward = sorted({i for i, refs in seen for r in refs if not r.expired()})
    buffers_alive = sum(not r.expired() for r in buffers.refs)
    with fs.comm_log() as bwd_log:
        (loss.to_local() if hasattr(loss, "to_local") else loss).backward()
    gc.collect()
    alive_after_backward = sorted({i for i, refs in seen for r in refs if not r.expired()})
    _, ref_grads = fs.value_and_grad(_ref_loss)(params, x, y)
    grad_err = max((fs.gather(a.grad) - b).abs().max().item()
                   for a, b in zip(fs.tree.leaves(sharded), fs.tree.leaves(ref_grads)))
    gathers = lambda log: [(e.axes, e.nbytes) for e in log.timeline if e.what == "issue" and e.kind == "all_gather"]  # noqa: E731
    return alive_after_forward, buffers_alive, alive_after_backward, gathers(fwd_log), gathers(bwd_log), grad_err


@pytest.mark.parametrize("shape, axis, raf, keep", [
    ({"x": 2}, "x", True, None),
    ({"x": 2}, "x", False, "all"),
    ({"x": 2, "y": 2}, ("x", "y"), True, None),
    ({"x": 2, "y": 2}, ("x", "y"), 4, None),             # the whole group: True
    ({"x": 2, "y": 2}, ("x", "y"), False, "all"),
    ({"x": 2, "y": 2}, ("x", "y"), 1, "all"),            # groups of one rank: False
    ({"x": 2, "y": 2}, ("x", "y"), 2, ("y",)),           # the trailing axis of size 2
    ({"x": 2, "y": 2}, ("x", "y"), "y", ("y",)),
    ({"x": 2, "y": 2}, ("x", "y"), "x", ("x",)),
], ids=["x2-True", "x2-False", "x2y2-True", "x2y2-4", "x2y2-False", "x2y2-1", "x2y2-2", "x2y2-y", "x2y2-x"])
def test_reshard_after_forward_frees_gathered_storage_and_regathers(shape, axis, raf, keep):
    n = math.prod(shape.values())
    full_axes = (axis,) if isinstance(axis, str) else axis
    shard_bytes = _gather_bytes(n)
    results = run_on_ranks(_reshard_body, shape, axis, raf, world_size=n)
    for alive_fwd, buffers_alive, alive_bwd, fwd_gathers, bwd_gathers, grad_err in results:
        assert grad_err < TOL
        assert fwd_gathers == [(full_axes, shard_bytes[i]) for i in range(N_LAYERS)]
        assert alive_bwd == []
        if keep == "all":
            # every layer's gathered buffer is saved for backward (w2 at least), no regather
            assert alive_fwd == list(range(N_LAYERS)) and bwd_gathers == []
            continue
        # nothing gathered outlives forward: no parameter, no gathered buffer (a kept 1/k
        # slice must be a copy: a view would keep the whole buffer alive)
        assert alive_fwd == [] and buffers_alive == 0
        if keep is None:  # regathered from the shards, over every axis
            want = [(full_axes, shard_bytes[i]) for i in reversed(range(N_LAYERS))]
        else:  # from the kept 1/k slice, over the post-forward axes only
            k = math.prod(shape[a] for a in keep)
            want = [(keep, shard_bytes[i] * n // k) for i in reversed(range(N_LAYERS))]
        assert sorted(bwd_gathers) == sorted(want), (bwd_gathers, want)


# --- placement -----------------------------------------------------------------------------

def _expected_local_shape(shape, d, mesh, axes):
    """torch.chunk per axis, major to minor (how fs.shard cuts a dim split over several axes)."""
    out = list(shape)
    lo, size = 0, shape[d]
    for a in axes:
        c = -(-size // mesh.shape[a])
        start = min(mesh.axis_index(a) * c, size)
        lo, size = lo + start, min(start + c, size) - start
    out[d] = size
    return tuple(out)


def _placement_body(shape, axis, how, hidden):
    mesh = fs.make_mesh(shape)
    n = mesh.axis_size(axis)
    axes = (axis,) if isinstance(axis, str) else axis
    g = torch.Generator().manual_seed(0)
    params = [{"w1": torch.randn(D, hidden, generator=g, dtype=torch.float64) * 0.3,
               "w2": torch.randn(hidden, D, generator=g, dtype=torch.float64) * 0.3} for _ in range(2)]
    if how == "dim1":
        specs, scan_dim = fs.parallel.fsdp_specs(params, axis, dim=1), None   # scan_layers infers the dim
    elif how == "dim1_explicit":
        specs, scan_dim = fs.parallel.fsdp_specs(params, axis, dim=1), 1
    else:  # the largest dim: w1 (D, hidden) on dim 1, w2 (hidden, D) on dim 0
        largest = lambda path, x: int(torch.tensor(x.shape).argmax())  # noqa: E731
        specs, scan_dim = fs.parallel.fsdp_specs(params, axis, placement_fn=largest), None
    dims = [[next(k for k in range(2) if s[k] is not None) for s in (lp["w1"], lp["w2"])] for lp in specs]
    sharded = fs.shard(params, specs, mesh, uneven=True)
    local_ok = all(tuple(sharded[i][k].to_local().shape) == _expected_local_shape(params[i][k].shape, d, mesh, axes)
                   for i in range(2) for k, d in zip(("w1", "w2"), dims[i]))

    def body(p, a, b):
        h = fs.parallel.scan_layers(lambda lp, z: torch.relu(z @ lp["w1"]) @ lp["w2"], p, a, axis=axis,
                                    config=fs.parallel.ScanConfig(dim=scan_dim))
        return fs.lax.pmean(((h - b) ** 2).mean(), axis)

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=P()))
    opt, ref_opt = fs.optim.adam(1e-2), fs.optim.adam(1e-2)
    state, ref, ref_state = opt.init(sharded), params, ref_opt.init(params)
    worst, grad_shapes_ok, payloads = 0.0, True, []
    for s in range(3):
        x, y = _data(BATCH_PER_RANK * n, seed=10 + s)
        with fs.comm_log() as log:
            loss, grads = step(sharded, x, y)
        payloads.append([e[2] for e in log.events if e[0] == "all_gather"])
        grad_shapes_ok &= all(a.to_local().shape == b.to_local().shape and a.placements == b.placements
                              for a, b in zip(fs.tree.leaves(grads), fs.tree.leaves(sharded)))
        up, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, up)
        ref_l, ref_g = fs.value_and_grad(_ref_loss)(ref, x, y)
        up, ref_state = ref_opt.update(ref_g, ref_state, ref)
        ref = fs.optim.apply_updates(ref, up)
        worst = max(worst, abs(loss.item() - ref_l.item()),
                    max((fs.gather(a) - b).abs().max().item() for a, b in zip(fs.tree.leaves(grads), fs.tree.leaves(ref_g))),
                    max((fs.gather(a) - b).abs().max().item() for a, b in zip(fs.tree.leaves(sharded), fs.tree.leaves(ref))))
    # the flat shard per layer: each leaf's sharded dim padded to ceil(N / n) rows
    rows = lambda size: math.ceil(size / n)  # noqa: E731
    want = 0
    for k, d in zip(("w1", "w2"), dims[0]):
        full = params[0][k].shape
        want += rows(full[d]) * (full[1 - d])
    return dims, local_ok, grad_shapes_ok, worst, payloads, 8 * want


@pytest.mark.parametrize("how, hidden, dims", [
    ("dim1", 8, [1, 1]),
    ("dim1", 6, [1, 1]),              # 6 columns of w1 over 4 ranks: 2, 2, 2, 0
    ("dim1_explicit", 10, [1, 1]),    # and 10: 3, 3, 3, 1
    ("largest", 10, [1, 0]),          # w1 (8, 10) on dim 1, w2 (10, 8) on dim 0
])
@pytest.mark.parametrize("shape, axis", MESHES, ids=MESH_IDS)
def test_fsdp_on_dim_1_and_uneven_dims(shape, axis, how, hidden, dims):
    for got_dims, local_ok, grad_shapes_ok, worst, payloads, want in run_on_ranks(
            _placement_body, shape, axis, how, hidden, world_size=math.prod(shape.values())):
        assert got_dims == [dims, dims]
        assert local_ok and grad_shapes_ok
        assert worst < TOL
        # forward gather and backward regather of both layers, each the padded flat shard
        assert payloads == [[want] * 4] * 3, (payloads, want)


# --- offload -------------------------------------------------------------------------------

def _offload_body(shape, axis, offload, policy_dtype):
    from fshard.parallel import groups as groups_mod
    from fshard.parallel import flat as layout_mod

    mesh = fs.make_mesh(shape)
    n = mesh.axis_size(axis)
    g = torch.Generator().manual_seed(0)
    params = {"root": {"w": torch.randn(D, D, generator=g, dtype=torch.float64) * 0.3}, "layers": _params()}
    specs = fs.parallel.fsdp_specs(params, axis)
    sharded = fs.shard(params, specs, mesh)
    if offload:
        sharded = fs.parallel.scan.offload_shards(sharded)
    policy = fs.Policy(param_dtype=policy_dtype) if policy_dtype is not None else None

    def body(p, a, b):
        root = fs.parallel.gather_params(p["root"], axis=axis, offload=offload, policy=policy)
        h = a.to(policy_dtype or a.dtype) @ root["w"]
        h = fs.parallel.scan_layers(lambda lp, z: torch.relu(z @ lp["w1"]) @ lp["w2"], p["layers"], h,
                                    axis=axis, config=fs.parallel.ScanConfig(offload=offload, policy=policy))
        return fs.lax.pmean(((h.double() - b) ** 2).mean(), axis)

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=P()))
    calls = {"to_compute": [], "to_host": [], "sync": 0}
    originals = (layout_mod.to_compute, layout_mod.to_host, groups_mod._wait_host_copies)

    def to_compute(flat, device):
        calls["to_compute"].append((flat.numel(), flat.dtype, flat.device.type, device.type))
        return originals[0](flat, device)

    def to_host(flat):
        calls["to_host"].append((flat.numel(), flat.dtype))
        return originals[1](flat)

    def sync(device):
        calls["sync"] += 1
        return originals[2](device)

    layout_mod.to_compute, layout_mod.to_host, groups_mod._wait_host_copies = to_compute, to_host, sync
    opt = fs.optim.adam(1e-2)
    state = opt.init(sharded)
    losses = []
    try:
        for s in range(2):
            x, y = _data(BATCH_PER_RANK * n, seed=20 + s)
            loss, grads = step(sharded, x, y)
            losses.append(loss.item())
            up, state = opt.update(grads, state, sharded)
            sharded = fs.optim.apply_updates(sharded, up)
    finally:
        layout_mod.to_compute, layout_mod.to_host, groups_mod._wait_host_copies = originals
    # shards, their gradients and the optimizer's moments (its step counts are plain CPU tensors)
    where = {t.to_local().device.type for t in fs.tree.leaves((sharded, grads, state)) if hasattr(t, "to_local")}
    return losses, calls, where, _gather_bytes(n)


@pytest.mark.parametrize("shape, axis", [MESHES[0], MESHES[2]], ids=["x2", "x2y2"])
@pytest.mark.parametrize("policy_dtype", [None, torch.float32], ids=["f64", "gather_f32"])
def test_offload_stages_each_gather_and_syncs_once_per_backward(shape, axis, policy_dtype):
    n = math.prod(shape.values())
    on = run_on_ranks(_offload_body, shape, axis, True, policy_dtype, world_size=n)
    off = run_on_ranks(_offload_body, shape, axis, False, policy_dtype, world_size=n)
    dt = policy_dtype or torch.float64
    root_numel = math.ceil(D / n) * D
    for (losses, calls, where, layer_bytes), (base_losses, base_calls, _, _) in zip(on, off):
        assert losses == base_losses  # bitwise: on a CPU mesh offload changes no value
        assert base_calls == {"to_compute": [], "to_host": [], "sync": 0}
        assert where == {"cpu"}
        # Staging: per step, the root group's flat shard, each layer's for its forward
        # gather and again for its backward regather, cast to param_dtype on the host
        # (the copy moves param_dtype bytes), all asked to go to the mesh's device.
        layer_numel = [layer_bytes[i] // 8 for i in range(N_LAYERS)]
        per_step = [root_numel] + layer_numel + layer_numel[::-1]
        assert [c[0] for c in calls["to_compute"]] == per_step * 2
        assert all(c[1:] == (dt, "cpu", "cpu") for c in calls["to_compute"])
        # Back to the host: each group's reduced flat shard gradient, in reduce dtype, and
        # one synchronization per backward for all groups of one call (root, layers).
        assert sorted(c[0] for c in calls["to_host"]) == sorted(([root_numel] + layer_numel) * 2)
        assert all(c[1] == dt for c in calls["to_host"])
        assert calls["sync"] == 2 * 2


# --- delays --------------------------------------------------------------------------------

_FUNCOL = torch.ops._c10d_functional
_ISSUE = {_FUNCOL.all_gather_into_tensor.default, _FUNCOL.reduce_scatter_tensor.default,
          _FUNCOL.all_reduce.default, _FUNCOL.all_reduce_.default, _FUNCOL.all_to_all_single.default}


class _Skew(TorchDispatchMode):
    """Sleeps before issuing and before waiting on every functional collective, a
    pseudo-random time that differs per rank (rank r: up to (r + 1) * max_s)."""

    def __init__(self, rank: int, max_s: float):
        super().__init__()
        self.rng, self.max_s, self.slept = random.Random(1234 + rank), max_s * (rank + 1), 0

    def nap(self):
        time.sleep(self.rng.uniform(0, self.max_s))
        self.slept += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ISSUE or func is _FUNCOL.wait_tensor.default:
            self.nap()
        return func(*args, **(kwargs or {}))


def _with_skew(fn, max_s, *args):
    """``fn(*args)`` with every collective path of this rank delayed: functional
    collectives (dispatch mode), point-to-point batches and c10d all-reduces."""
    if max_s == 0:
        return fn(*args), 0
    skew = _Skew(dist.get_rank(), max_s)
    originals = dist.batch_isend_irecv, dist.all_reduce, dist.broadcast

    def delayed(f):
        def g(*a, **k):
            skew.nap()
            return f(*a, **k)
        return g

    dist.batch_isend_irecv, dist.all_reduce, dist.broadcast = map(delayed, originals)
    try:
        with skew:
            return fn(*args), skew.slept
    finally:
        dist.batch_isend_irecv, dist.all_reduce, dist.broadcast = originals


def _fsdp_run(shape, axis, replicate):
    """2 steps of root + 4 layers, reshard after forward, prefetch 2, HSDP when ``replicate``."""
    mesh = fs.make_mesh(shape)
    data = (replicate, axis) if replicate else axis
    n = mesh.axis_size(data)
    params = {"root": {"w": torch.randn(D, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)},
              "layers": _params()}
    specs = fs.parallel.fsdp_specs(params, axis)
    sharded = fs.shard(params, specs, mesh)

    def body(p, a, b):
        root = fs.parallel.gather_params(p["root"], axis=axis, replicate_axis=replicate)
        h = fs.parallel.scan_layers(lambda lp, z: torch.relu(z @ lp["w1"]) @ lp["w2"], p["layers"], a @ root["w"],
                                    axis=axis, replicate_axis=replicate, config=fs.parallel.ScanConfig(prefetch=2))
        return fs.lax.pmean(((h - b) ** 2).mean(), data)

    step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=(specs, P(data), P(data)), out_specs=P()))
    opt = fs.optim.adamw(1e-2)
    state, out = opt.init(sharded), []
    for s in range(2):
        x, y = _data(BATCH_PER_RANK * n, seed=30 + s)
        loss, grads = step(sharded, x, y)
        up, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, up)
        out.append(loss.item())
    return out, [t.clone() for t in fs.tree.leaves(fs.gather(sharded))]


def _pipeline_run():
    """1F1B over pp=2 with dp=2: point-to-point sends, the dp gradient all-reduce, the loss broadcast."""
    mesh = fs.make_mesh({"dp": 2, "pp": 2})
    rank = mesh.axis_index("pp")
    g = torch.Generator().manual_seed(5)
    layers = [{"w": torch.randn(D, D, generator=g, dtype=torch.float64) * 0.4} for _ in range(4)]
    sch = fs.sched.one_f_one_b(2, 4)
    stage_params = [layers[2 * s:2 * s + 2] if sch.rank_of(s) == rank else None for s in range(sch.n_stages)]

    def stage_fn(p, x, stage):
        for lp in p:
            x = torch.tanh(x @ lp["w"])
        return x

    x, y = _data(16, seed=40)
    loss, grads = fs.sched.pipeline_step(stage_fn, lambda o, t: ((o - t) ** 2).mean(), stage_params, (x, y),
                                         schedule=sch, mesh=mesh, data_axes="dp")
    return [loss.item()], [t.clone() for e in grads if e is not None for t in fs.tree.leaves(e)]


def _skew_body(which, args, max_s):
    fn = {"fsdp": _fsdp_run, "pipeline": _pipeline_run}[which]
    fast, _ = _with_skew(fn, 0, *args)
    slow, naps = _with_skew(fn, max_s, *args)
    same = fast[0] == slow[0] and all(torch.equal(a, b) for a, b in zip(fast[1], slow[1]))
    return same, naps, fast[0]


@pytest.mark.parametrize("which, args, n", [
    ("fsdp", ({"x": 2}, "x", None), 2),
    ("fsdp", ({"x": 4}, "x", None), 4),
    ("fsdp", ({"r": 2, "x": 2}, "x", "r"), 4),   # HSDP: reduce-scatter then all-reduce
    ("pipeline", (), 4),
], ids=["fsdp-x2", "fsdp-x4", "hsdp-r2x2", "pp2-dp2"])
def test_rank_skew_in_the_collective_path_changes_no_bit_and_does_not_hang(which, args, n):
    # A hang fails through the harness timeout, with every rank's stack.
    results = run_on_ranks(_skew_body, which, args, 0.004, world_size=n, timeout_s=90)
    for same, naps, losses in results:
        assert same and naps > 10, (same, naps)
    assert all(r[2] == results[0][2] for r in results)  # every rank reports the same losses
