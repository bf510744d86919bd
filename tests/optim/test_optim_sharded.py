"""fs.optim on sharded params (fsdp=2, tp=2, dp x tp = 2x2): same numbers as torch.optim on
the full tensors, state sharded like the params, a global norm with one all-reduce, and the
same steps on local tensors inside shard_map."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

import fshard as fs
import fshard.optim as optim
from fshard import P
from fshard import tree as tree_util
from fshard.testing import run_on_ranks

DT = torch.float64

_SHAPES = [{"fsdp": 2}, {"tp": 2}, {"dp": 2, "tp": 2}]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=DT, generator=g)
    return {"w": r(8, 12), "v": r(16, 4), "b": r(6), "layers": [{"wq": r(4, 8, 2)}, {"wq": r(8, 4)}]}


def _grads(like, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return tree_util.tree_map(lambda x: scale * torch.randn(x.shape, dtype=DT, generator=g), like)


def _specs(shape):
    if len(shape) == 1:
        (a,) = shape
        return {"w": P(a), "v": P(None, a), "b": P(), "layers": [{"wq": P(a)}, {"wq": P()}]}
    dp, tp = shape
    return {"w": P(dp, tp), "v": P((dp, tp)), "b": P(),
            "layers": [{"wq": P(None, tp)}, {"wq": P((tp, dp))}]}  # the last one: _StridedShard


_OPTIMIZERS = [
    ("sgd_momentum_wd", optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.05)),
    ("sgd_nesterov", optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.8, nesterov=True)),
    ("adam_wd", optim.adam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1)),
    ("adamw_wd", optim.adamw, torch.optim.AdamW, dict(lr=0.02, weight_decay=0.3)),
]


def _max_diff(sharded, full_leaves):
    return max((a - b).abs().max().item() for a, b in zip(tree_util.leaves(fs.gather(sharded)), full_leaves))


def _optimizer_checks(mesh, specs, cases, donate):
    out = {}
    for name, factory, torch_cls, kw in cases:
        full = _params()
        torch_leaves = [x.clone().requires_grad_() for x in tree_util.leaves(full)]
        topt = torch_cls(torch_leaves, **kw)
        params = fs.shard(full, specs, mesh)
        opt = factory(**kw)
        state = opt.init(params)
        (inner,) = [s for s in state if isinstance(s, (optim.ScaleByAdamState, optim.TraceState))]
        moments = inner.mu if isinstance(inner, optim.ScaleByAdamState) else inner.trace
        out[f"{name}/state_specs"] = fs.spec_of(moments) == fs.spec_of(params)
        for step in range(10):
            grads_full = _grads(full, step)
            for p, g in zip(torch_leaves, tree_util.leaves(grads_full)):
                p.grad = g.clone()
            topt.step()
            grads = fs.shard(grads_full, specs, mesh)
            if donate:
                with optim.donate():
                    updates, state = opt.update(grads, state, params)
                    params = optim.apply_updates(params, updates)
            else:
                updates, state = opt.update(grads, state, params)
                params = optim.apply_updates(params, updates)
        # Compared once, after 10 steps: gathers are the slow part here, and a step that
        # went wrong would not come back to 1e-12 later.
        out[f"{name}/max_diff"] = _max_diff(params, [t.detach() for t in torch_leaves])
        out[f"{name}/param_specs"] = fs.spec_of(params) == specs
    return out


def _count_all_reduces(fn):
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        result = fn()
    finally:
        dist.all_reduce = real
    return result, len(calls)


def _clip_checks(mesh, specs):
    out = {}
    for max_norm in (1.0, 1e6):
        grads_full = _grads(_params(), 0, scale=0.5)
        grads = fs.shard(grads_full, specs, mesh)
        norm, n_calls = _count_all_reduces(lambda: optim.global_norm(grads))
        expect = torch.linalg.vector_norm(torch.cat([x.flatten() for x in tree_util.leaves(grads_full)]))
        out["norm_diff"] = abs(norm.item() - expect.item())
        out["norm_all_reduces"] = n_calls
        clipped, _ = optim.clip_by_global_norm(max_norm).update(grads, optim.EmptyState())
        ref = [x.clone().requires_grad_() for x in tree_util.leaves(grads_full)]
        for r, g in zip(ref, tree_util.leaves(grads_full)):
            r.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(ref, max_norm)
        out[f"clip_{max_norm:g}_diff"] = _max_diff(clipped, [r.grad for r in ref])
        out[f"clip_{max_norm:g}_specs"] = fs.spec_of(clipped) == specs
    replicated = fs.shard(grads_full, P(), mesh)
    norm, out["replicated_all_reduces"] = _count_all_reduces(lambda: optim.global_norm(replicated))
    out["replicated_norm_diff"] = abs(norm.item() - expect.item())
    return out


def _bad_input_messages(mesh, specs):
    out = {}
    params = fs.shard(_params(), specs, mesh)
    opt = optim.adamw(lr=0.1)
    state = opt.init(params)
    other = dict(specs, w=P())  # grads for 'w' replicated while the param is sharded
    grads = fs.shard(_grads(_params(), 0), other, mesh)
    try:
        opt.update(grads, state, params)
    except ValueError as e:
        out["placements"] = str(e)
    plain = dict(_grads(_params(), 0))  # plain tensors where the params are DTensors
    plain = fs.shard(plain, specs, mesh)
    plain["layers"][1]["wq"] = plain["layers"][1]["wq"].full_tensor()
    try:
        opt.update(plain, state, params)
    except ValueError as e:
        out["kind"] = str(e)
    local = torch.ones(4, dtype=DT)
    pending = {"p": DTensor.from_local(local, mesh.device_mesh, [Partial()] * len(mesh.shape), run_check=False)}
    try:
        optim.global_norm(pending)
    except ValueError as e:
        out["partial"] = str(e)
    return out


def _in_shard_map(mesh, specs):
    """The same steps on local tensors inside shard_map (vma-checked) and on DTensors."""
    opt = optim.chain(optim.sgd(0.1, momentum=0.9, nesterov=True), optim.adamw(lr=0.02, weight_decay=0.3))
    empty = optim.EmptyState()
    state_specs = ((empty, optim.TraceState(specs), empty),
                   (optim.ScaleByAdamState(P(), specs, specs), empty, empty))

    def step(params, grads, state):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    mapped = fs.shard_map(step, mesh=mesh, in_specs=(specs, specs, state_specs),
                          out_specs=(specs, state_specs), check=True)
    full = _params()
    inside = fs.shard(full, specs, mesh)
    outside = fs.shard(full, specs, mesh)
    s_in, s_out = opt.init(inside), opt.init(outside)
    for step_no in range(3):
        grads = fs.shard(_grads(full, step_no), specs, mesh)
        inside, s_in = mapped(inside, grads, s_in)
        updates, s_out = opt.update(grads, s_out, outside)
        outside = optim.apply_updates(outside, updates)
    return _max_diff(inside, tree_util.leaves(fs.gather(outside)))


def _body(shape, run_optimizers):
    mesh = fs.make_mesh(shape)
    specs = _specs(tuple(shape))
    out = _clip_checks(mesh, specs)
    out.update(_bad_input_messages(mesh, specs))
    if run_optimizers:
        out["shard_map_diff"] = _in_shard_map(mesh, specs)
        out.update(_optimizer_checks(mesh, specs, _OPTIMIZERS, donate=False))
        donated = _optimizer_checks(mesh, specs, _OPTIMIZERS[-1:], donate=True)
        out.update({f"donated/{k}": v for k, v in donated.items()})
    return out


@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_sharded_optimizers_clipping_and_errors(shape):
    run_optimizers = shape != {"tp": 2}  # the issue asks for fsdp=2 and 2x2; tp=2 checks clipping
    results = run_on_ranks(_body, shape, run_optimizers, world_size=math.prod(shape.values()))
    for rank, r in enumerate(results):
        where = f"rank {rank} on {shape}"
        assert r["norm_diff"] < 1e-12, where
        assert r["norm_all_reduces"] == 1, (where, r["norm_all_reduces"])  # one for every leaf
        assert r["replicated_all_reduces"] == 0 and r["replicated_norm_diff"] < 1e-12, where
        for max_norm in ("1", "1e+06"):
            assert r[f"clip_{max_norm}_diff"] < 1e-12 and r[f"clip_{max_norm}_specs"], (where, max_norm)
        assert "* w: " in r["placements"] and "spec P()" in r["placements"], r["placements"]
        assert "* layers.1.wq: " in r["kind"] and "plain tensor" in r["kind"], r["kind"]
        assert "p has a Partial placement" in r["partial"], r["partial"]
        if run_optimizers:
            for name, *_ in _OPTIMIZERS:
                assert r[f"{name}/max_diff"] < 1e-12, (where, name, r[f"{name}/max_diff"])
                assert r[f"{name}/state_specs"] and r[f"{name}/param_specs"], (where, name)
            assert r["donated/adamw_wd/max_diff"] < 1e-12, where
            assert r["shard_map_diff"] == 0.0, (where, r["shard_map_diff"])


def _pipeline_norm_body():
    # Pipeline grads: pp rank r holds stage r (fsdp-sharded), None for the other stage.
    mesh = fs.make_mesh({"pp": 2, "fsdp": 2})
    r = mesh.axis_index("pp")
    full = _grads(_params(), 0)
    stages = [{"w": full["w"], "b": full["b"]}, {"v": full["v"], "layers": full["layers"]}]
    grads = [None, None]
    grads[r] = fs.shard(stages[r], fs.parallel.fsdp_specs(stages[r], "fsdp"), mesh, uneven=True)
    want = math.sqrt(sum(x.double().square().sum().item() for x in tree_util.leaves(full)))
    local = optim.global_norm(grads).item()  # this pp rank's stages only
    with mesh:
        total = optim.global_norm(grads, sum_over="pp").item()
    outside = optim.global_norm(grads, sum_over="pp").item()  # mesh found from the DTensors
    clip = optim.clip_by_global_norm(want / 2, sum_over="pp")
    clipped, _ = clip.update(grads, clip.init(grads))
    ratio = max(abs(fs.gather(c).double().norm().item() / fs.gather(g).double().norm().item() - 0.5)
                for c, g in zip(tree_util.leaves(clipped[r]), tree_util.leaves(grads[r])))
    return want, local, total, outside, ratio


def test_global_norm_sums_over_pipeline_ranks_holding_different_stages():
    for want, local, total, outside, ratio in run_on_ranks(_pipeline_norm_body, world_size=4):
        assert local < want - 1e-3  # one stage's norm only: the sum over pp is needed
        assert abs(total - want) < 1e-10 and abs(outside - want) < 1e-10
        assert ratio < 1e-6  # every leaf scaled by max_norm / norm = 1/2
