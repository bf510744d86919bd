"""fs.optim on one process: updates equal torch.optim's, schedules, chain, clipping, bad input."""

import contextlib
import doctest
import math

import pytest
import torch

import fshard as fs
import fshard.optim as optim
from fshard import tree as tree_util

DT = torch.float64


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=DT, generator=g)
    return {"w": r(6, 4), "b": r(4), "layers": [{"wq": r(3, 5, 2)}, {"wq": r(7)}]}


def _grads(like, step, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return tree_util.tree_map(lambda x: torch.randn(x.shape, dtype=DT, generator=g), like)


def _clone(tree):
    return tree_util.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


# (id, fs.optim factory, torch.optim class, keyword arguments shared by both)
_OPTIMIZERS_UNDER_TEST = [
    ("sgd", optim.sgd, torch.optim.SGD, dict(lr=0.1)),
    ("sgd_wd", optim.sgd, torch.optim.SGD, dict(lr=0.1, weight_decay=0.05)),
    ("sgd_momentum", optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    ("sgd_momentum_wd", optim.sgd, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.05)),
    ("sgd_nesterov_wd", optim.sgd, torch.optim.SGD,
     dict(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.05)),
    ("adam", optim.adam, torch.optim.Adam, dict(lr=0.01)),
    ("adam_wd", optim.adam, torch.optim.Adam, dict(lr=0.01, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)),
    ("adamw", optim.adamw, torch.optim.AdamW, dict(lr=0.01)),
    ("adamw_wd", optim.adamw, torch.optim.AdamW, dict(lr=0.02, b1=0.85, b2=0.95, weight_decay=0.3)),
]


def _torch_kwargs(kw):
    kw = dict(kw)
    if "b1" in kw or "b2" in kw:
        kw["betas"] = (kw.pop("b1", 0.9), kw.pop("b2", 0.999))
    return kw


def _run_both(fs_opt, torch_opt_fn, steps=10, *, donate=False, lr_fn=None):
    """Steps both optimizers on the same grads; returns the largest param/update differences."""
    params = _params()
    torch_leaves = [x.clone().requires_grad_() for x in tree_util.leaves(params)]
    topt = torch_opt_fn(torch_leaves)
    state = fs_opt.init(params)
    worst_p = worst_u = 0.0
    for step in range(steps):
        grads = _grads(params, step)
        before = [x.detach().clone() for x in torch_leaves]
        for p, g in zip(torch_leaves, tree_util.leaves(grads)):
            p.grad = g.clone()
        if lr_fn is not None:
            for group in topt.param_groups:
                group["lr"] = lr_fn(step)
        topt.step()
        if donate:
            with optim.donate():
                updates, state = fs_opt.update(grads, state, params)
                params = optim.apply_updates(params, updates)
        else:
            updates, state = fs_opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
        for p, t, b, u in zip(tree_util.leaves(params), torch_leaves, before, tree_util.leaves(updates)):
            worst_p = max(worst_p, (p - t.detach()).abs().max().item())
            worst_u = max(worst_u, (u - (t.detach() - b)).abs().max().item())
    return worst_p, worst_u


@pytest.mark.parametrize("name,factory,torch_cls,kw", _OPTIMIZERS_UNDER_TEST,
                         ids=[c[0] for c in _OPTIMIZERS_UNDER_TEST])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_matches_torch_optim_float64(name, factory, torch_cls, kw, donate):
    worst_p, worst_u = _run_both(factory(**kw), lambda ps: torch_cls(ps, **_torch_kwargs(kw)),
                                 donate=donate)
    assert worst_p < 1e-12 and worst_u < 1e-12, (worst_p, worst_u)


def test_adamw_with_schedule_matches_torch_with_lr_set_each_step():
    sched = optim.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=3, decay_steps=10, end_value=0.005)
    worst_p, _ = _run_both(optim.adamw(lr=sched, weight_decay=0.1),
                           lambda ps: torch.optim.AdamW(ps, lr=0.0, weight_decay=0.1), lr_fn=sched)
    assert worst_p < 1e-12


_PURE_CASES = {
    "sgd_nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "sgd_momentum_wd": lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
    "adam": lambda: optim.adam(0.1),
    "adamw": lambda: optim.adamw(0.1),
    "clip": lambda: optim.clip_by_global_norm(0.5),
    "chain": lambda: optim.chain(
        optim.clip_by_global_norm(0.5), optim.sgd(0.1, momentum=0.9, nesterov=True),
        optim.adamw(lr=optim.linear_schedule(0.1, 0.0, 5), weight_decay=0.1)),
}


@pytest.mark.parametrize("case", list(_PURE_CASES))
def test_update_is_pure(case):
    params = _params()
    opt = _PURE_CASES[case]()
    state = opt.init(params)
    for step in range(3):
        grads = _grads(params, step)
        snap = _clone((params, grads, state))
        updates, new_state = opt.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        tree_util.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0),
                           (params, grads, state), snap)
        state, params = new_state, new_params


def test_donate_overwrites_state_and_params_in_place():
    params = _params()
    opt = optim.adamw(lr=0.1)
    state = opt.init(params)
    grads = _grads(params, 0)
    with optim.donate():
        updates, new_state = opt.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
    assert new_params["w"] is params["w"]
    assert new_state[0].mu["w"].data_ptr() == state[0].mu["w"].data_ptr()
    assert torch.count_nonzero(state[0].mu["w"]) > 0  # the old state was overwritten


def test_state_layout_and_count():
    params = _params()
    state = optim.adam(lr=0.1).init(params)
    adam_state = state[1]
    assert isinstance(adam_state, optim.ScaleByAdamState)
    assert adam_state.count.shape == () and adam_state.count.dtype == torch.int64
    assert tree_util.structure(adam_state.mu) == tree_util.structure(params)
    for m, p in zip(tree_util.leaves(adam_state.nu), tree_util.leaves(params)):
        assert m.shape == p.shape and m.dtype == p.dtype and not m.any()
    _, state = optim.adam(lr=0.1).update(_grads(params, 0), state, params)
    assert int(state[1].count) == 1


def test_apply_updates_keeps_requires_grad_and_dtype():
    params = {"w": torch.ones(3, requires_grad=True), "h": torch.ones(2, dtype=torch.bfloat16)}
    new = optim.apply_updates(params, {"w": torch.full((3,), 0.5), "h": torch.full((2,), 0.25)})
    assert new["w"].requires_grad and new["w"].is_leaf
    assert new["h"].dtype == torch.bfloat16 and not new["h"].requires_grad
    torch.testing.assert_close(new["w"], torch.full((3,), 1.5), rtol=0, atol=0)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_apply_updates_wider_updates_round_once(donate):
    # bfloat16 params + float32 updates: the sum is taken in float32 and rounded once, as
    # torch's p.add_(u) and optax.apply_updates do. Casting u to bfloat16 first rounded
    # twice and was 1 ulp off on ~0.25% of elements (this draw: several hundred).
    g = torch.Generator().manual_seed(0)
    p = torch.randn(100_000, generator=g).bfloat16()
    u = 1e-3 * torch.randn(100_000, generator=g)
    expect = (p.float() + u).bfloat16()
    assert not torch.equal(p + u.bfloat16(), expect)  # the double rounding this test guards against
    with optim.donate() if donate else contextlib.nullcontext():
        new = optim.apply_updates({"p": p.clone()}, {"p": u})["p"]
    assert new.dtype == torch.bfloat16
    assert torch.equal(new, expect)


# --- schedules -----------------------------------------------------------------------


def test_schedule_values():
    assert optim.constant_schedule(0.3)(0) == 0.3 and optim.constant_schedule(0.3)(10**6) == 0.3
    lin = optim.linear_schedule(1.0, 0.0, transition_steps=4, transition_begin=2)
    assert [lin(t) for t in range(8)] == [1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    cos = optim.cosine_decay_schedule(2.0, decay_steps=8, alpha=0.1)
    for t in range(12):
        expect = 2.0 * (0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 8) / 8)) + 0.1)
        assert cos(t) == pytest.approx(expect, abs=1e-15)
    assert cos(0) == 2.0 and cos(4) == pytest.approx(1.1) and cos(100) == pytest.approx(0.2)
    sq = optim.cosine_decay_schedule(1.0, decay_steps=4, exponent=2.0)
    assert sq(2) == 0.25
    wc = optim.warmup_cosine_decay_schedule(0.1, 1.0, warmup_steps=4, decay_steps=14, end_value=0.2)
    assert [wc(t) for t in (0, 2, 4)] == [0.1, pytest.approx(0.55), 1.0]
    assert wc(9) == pytest.approx(0.6) and wc(14) == pytest.approx(0.2) and wc(50) == pytest.approx(0.2)
    assert optim.warmup_cosine_decay_schedule(0.0, 1.0, 0, 10)(0) == 1.0
    joined = optim.join_schedules([optim.constant_schedule(1.0), lin], [3])
    assert [joined(t) for t in (0, 2, 3, 5, 6, 20)] == [1.0, 1.0, 1.0, 1.0, 0.75, 0.0]


def test_schedules_take_a_tensor_step_as_fs_jit_passes_it_and_give_the_same_values():
    # Under fs.jit the step is the optimizer's count, a 0-dim int64 tensor; the value must be
    # computed with tensor ops (no Python branch on the step) and equal the int path's.
    lin = optim.linear_schedule(1.0, 0.0, transition_steps=4, transition_begin=2)
    schedules = [
        optim.constant_schedule(0.3), lin, optim.cosine_decay_schedule(2.0, decay_steps=8, alpha=0.1),
        optim.cosine_decay_schedule(1.0, decay_steps=4, exponent=2.0),
        optim.warmup_cosine_decay_schedule(0.1, 1.0, warmup_steps=4, decay_steps=14, end_value=0.2),
        optim.warmup_cosine_decay_schedule(0.0, 1.0, 0, 10),
        optim.join_schedules([optim.constant_schedule(1.0), lin], [3]),
        optim.join_schedules([optim.constant_schedule(1.0), optim.constant_schedule(2.0),
                              optim.constant_schedule(3.0)], [2, 5]),
    ]
    for i, sched in enumerate(schedules):
        for t in range(-1, 20):
            got = sched(torch.tensor(t))
            assert float(got) == sched(t), (i, t, got, sched(t))
            if isinstance(got, torch.Tensor):
                assert got.dtype == torch.float64 and got.shape == ()


def test_scale_by_schedule_passes_the_count_tensor_when_traced():
    from torch.fx.experimental.proxy_tensor import make_fx

    opt = optim.adamw(optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6))
    params = {"w": torch.ones(3, dtype=torch.float64)}

    def step(p, g, state):
        updates, state = opt.update({"w": g}, state, p)
        return optim.apply_updates(p, updates)["w"], state

    traced = make_fx(step, tracing_mode="fake")(params, torch.ones(3, dtype=torch.float64), opt.init(params))
    # One graph for every step: the learning rate is computed from the count inside it.
    state = e_state = opt.init(params)
    p = e = params
    for i in range(4):
        g = torch.full((3,), float(i + 1), dtype=torch.float64)
        w, state = traced(p, g, state)
        ew, e_state = step(e, g, e_state)
        p, e = {"w": w}, {"w": ew}
        assert torch.equal(w, ew), (i, w, ew)
    assert torch.equal(e["w"], params["w"]) is False


def test_scale_by_schedule_counts_steps():
    opt = optim.scale_by_schedule(lambda step: float(step + 1))
    state = opt.init({"x": torch.ones(2)})
    seen = []
    for _ in range(3):
        u, state = opt.update({"x": torch.ones(2)}, state)
        seen.append(u["x"][0].item())
    assert seen == [1.0, 2.0, 3.0] and isinstance(state, optim.ScaleByScheduleState)


# --- chain and clipping --------------------------------------------------------------


def test_chain_of_parts_equals_alias_and_nests():
    parts = optim.chain(optim.scale_by_adam(0.9, 0.999, 1e-8), optim.add_decayed_weights(0.1),
                        optim.scale_by_learning_rate(0.01))
    nested = optim.chain(optim.chain(optim.scale_by_adam()), optim.identity(),
                         optim.chain(optim.add_decayed_weights(0.1), optim.scale(-0.01)))
    for opt in (parts, nested):
        worst_p, _ = _run_both(opt, lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1))
        assert worst_p < 1e-12


def test_chain_clip_then_sgd_matches_torch_clip_grad_norm():
    params = _params()
    torch_leaves = [x.clone().requires_grad_() for x in tree_util.leaves(params)]
    topt = torch.optim.SGD(torch_leaves, lr=0.1, momentum=0.9)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9))
    state = opt.init(params)
    for step in range(5):
        grads = _grads(params, step)
        for p, g in zip(torch_leaves, tree_util.leaves(grads)):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(torch_leaves, 1.0)
        topt.step()
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    for p, t in zip(tree_util.leaves(params), torch_leaves):
        torch.testing.assert_close(p, t.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_by_global_norm_matches_torch(max_norm):
    grads = _grads(_params(), 0)
    ref = [x.clone() for x in tree_util.leaves(grads)]
    params = [torch.zeros_like(x, requires_grad=True) for x in ref]
    for p, g in zip(params, ref):
        p.grad = g
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    torch.testing.assert_close(optim.global_norm(grads), norm, rtol=1e-14, atol=0)
    clipped, _ = optim.clip_by_global_norm(max_norm).update(grads, optim.EmptyState())
    for c, p in zip(tree_util.leaves(clipped), params):
        torch.testing.assert_close(c, p.grad, rtol=1e-14, atol=0)
    if max_norm > 1e3:
        for c, g in zip(tree_util.leaves(clipped), tree_util.leaves(grads)):
            assert torch.equal(c, g)


def test_add_decayed_weights_mask():
    params = {"w": torch.ones(2), "bias": torch.ones(2)}
    zeros = tree_util.tree_map(torch.zeros_like, params)
    only_w = optim.add_decayed_weights(0.5, mask=lambda p: {k: k != "bias" for k in p})
    u, _ = only_w.update(zeros, only_w.init(params), params)
    assert u["w"].tolist() == [0.5, 0.5] and u["bias"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="mask must have the params' structure"):
        optim.add_decayed_weights(0.5, mask={"w": True}).update(zeros, (), params)


# --- bad input -----------------------------------------------------------------------


def test_grads_with_other_structure_name_the_path():
    params = _params()
    opt = optim.adamw(lr=0.1)
    state = opt.init(params)
    missing = _grads(params, 0)
    del missing["layers"][1]
    with pytest.raises(ValueError, match=r"grads does not have the pytree structure.*'layers\.1\.wq'"):
        opt.update(missing, state, params)
    extra = _grads(params, 0)
    extra["extra"] = torch.zeros(2, dtype=DT)
    with pytest.raises(ValueError, match=r"'extra', which only grads has"):
        opt.update(extra, state, params)
    as_tuple = _grads(params, 0)
    as_tuple["layers"] = tuple(as_tuple["layers"])
    with pytest.raises(ValueError, match="different containers"):
        opt.update(as_tuple, state, params)


def test_grads_with_other_shape_or_kind_name_the_path():
    params = _params()
    for opt in (optim.sgd(0.1, momentum=0.9), optim.adam(0.1), optim.adamw(0.1)):
        state = opt.init(params)
        bad = _grads(params, 0)
        bad["layers"][0]["wq"] = torch.zeros(3, 5, dtype=DT)
        with pytest.raises(ValueError, match=r"\* layers\.0\.wq: .*shape \(3, 5, 2\).*shape \(3, 5\)"):
            opt.update(bad, state, params)
    bad = _grads(params, 0)
    bad["b"] = 1.0
    with pytest.raises(TypeError, match=r"b: float"):
        optim.adam(0.1).update(bad, optim.adam(0.1).init(params), params)
    with pytest.raises(ValueError, match=r"apply_updates: .*'layers\.1\.wq'"):
        optim.apply_updates(params, {"w": params["w"], "b": params["b"], "layers": [params["layers"][0]]})


def test_bad_hyperparameters_and_misuse():
    with pytest.raises(ValueError, match="learning_rate=-0.1"):
        optim.sgd(-0.1)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match=r"b1=1.0 must be a number in \[0.0, 1.0\)"):
        optim.adam(0.1, b1=1.0)
    with pytest.raises(ValueError, match="weight_decay=-1"):
        optim.adamw(0.1, weight_decay=-1)
    with pytest.raises(ValueError, match="max_norm=0"):
        optim.clip_by_global_norm(0)
    with pytest.raises(ValueError, match="decay_steps=5 must exceed warmup_steps=5"):
        optim.warmup_cosine_decay_schedule(0.0, 1.0, 5, 5)
    with pytest.raises(ValueError, match="transition_steps=0"):
        optim.linear_schedule(1.0, 0.0, 0)
    with pytest.raises(ValueError, match="2 schedules need 1 boundaries"):
        optim.join_schedules([optim.constant_schedule(1.0)] * 2, [])
    with pytest.raises(TypeError, match="not a GradientTransformation"):
        optim.chain(optim.scale(1.0), "adam")
    params = _params()
    opt = optim.adamw(0.1)
    with pytest.raises(ValueError, match="Make sure you pass the state that this chain's init returned"):
        opt.update(_grads(params, 0), opt.init(params)[:2], params)
    with pytest.raises(ValueError, match="needs the params"):
        opt.update(_grads(params, 0), opt.init(params))


def test_public_names():
    assert sorted(optim.__all__) == sorted([
        "EmptyState", "GradientTransformation", "OptState", "Params", "ScalarOrSchedule",
        "ScaleByAdamState", "ScaleByScheduleState", "Schedule", "TraceState", "Updates", "adam",
        "adamw", "add_decayed_weights", "apply_updates", "chain", "clip_by_global_norm",
        "constant_schedule", "cosine_decay_schedule", "donate", "global_norm", "identity",
        "join_schedules", "linear_schedule", "scale", "scale_by_adam", "scale_by_learning_rate",
        "scale_by_schedule", "sgd", "step", "trace", "warmup_cosine_decay_schedule",
    ])
    for name in optim.__all__:
        assert getattr(optim, name) is not None


@pytest.mark.parametrize("module", ["alias", "schedules"])
def test_docstring_examples(module):
    import importlib

    mod = importlib.import_module(f"fshard.optim.{module}")
    result = doctest.testmod(mod, extraglobs={"fs": fs}, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
