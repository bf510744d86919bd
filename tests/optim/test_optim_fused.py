"""fs.optim.step on torch's fused kernels (fused=True): equal to torch.optim's fused optimizers
bit for bit, to the chain up to rounding, with the chain's state; the chain wherever a kernel
cannot run."""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.optim.fused import fusable
from fshard.testing import assert_bitwise_equal, run_on_ranks

STEPS = 5
SCHEDULE = fs.optim.warmup_cosine_decay_schedule(init_value=1e-3, peak_value=1e-2, warmup_steps=2, decay_steps=STEPS)

# name -> (fs.optim optimizer for `fused`, torch.optim optimizer with fused=True for `params`)
CASES = {
    "adamw": (lambda f, lr: fs.optim.adamw(lr, b1=0.8, b2=0.95, weight_decay=0.1, fused=f),
              lambda p, lr: torch.optim.AdamW(p, lr=lr, betas=(0.8, 0.95), weight_decay=0.1, fused=True)),
    "adam": (lambda f, lr: fs.optim.adam(lr, weight_decay=0.05, fused=f),
             lambda p, lr: torch.optim.Adam(p, lr=lr, weight_decay=0.05, fused=True)),
    "sgd": (lambda f, lr: fs.optim.sgd(lr, weight_decay=0.1, fused=f),
            lambda p, lr: torch.optim.SGD(p, lr=lr, weight_decay=0.1, fused=True)),
    "sgd_momentum": (lambda f, lr: fs.optim.sgd(lr, momentum=0.9, fused=f),
                     lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, fused=True)),
    "sgd_nesterov": (lambda f, lr: fs.optim.sgd(lr, momentum=0.9, nesterov=True, weight_decay=0.01, fused=f),
                     lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                   fused=True)),
}


def _tree(seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g, dtype=dtype), "b": torch.randn(4, generator=g, dtype=dtype)}


def _run(opt, params, grads):
    state = opt.init(params)
    for g in grads:
        params, state = fs.optim.step(opt, g, state, params)
    return params, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_step_is_torchs_fused_optimizer_and_the_chain_up_to_rounding(name, schedule, dtype):
    make, make_torch = CASES[name]
    grads = [_tree(10 + i, dtype) for i in range(STEPS)]
    fused, state = _run(make(True, SCHEDULE if schedule else 1e-2), _tree(0, dtype), grads)
    chain, chain_state = _run(make(False, SCHEDULE if schedule else 1e-2), _tree(0, dtype), grads)

    leaves = [x.clone().requires_grad_() for x in _tree(0, dtype).values()]
    ref = make_torch(leaves, 1e-2)
    for i, g in enumerate(grads):
        if schedule:
            ref.param_groups[0]["lr"] = float(SCHEDULE(i))
        for x, gx in zip(leaves, g.values()):
            x.grad = gx.clone()
        ref.step()
    assert_bitwise_equal([fused["w"], fused["b"]], [x.detach() for x in leaves], what=name)

    tol = {"rtol": 1e-12, "atol": 1e-14} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 1e-6}
    fs.testing.assert_close(fused, chain, what=f"{name}: fused vs chain params", **tol)
    fs.testing.assert_close(state, chain_state, what=f"{name}: fused vs chain state", **tol)


def test_fused_and_chain_steps_mix_and_adamws_mask_holds():
    mask = {"w": True, "b": False}
    opt, chain = fs.optim.adamw(1e-2, weight_decay=0.5, mask=mask, fused=True), fs.optim.adamw(
        1e-2, weight_decay=0.5, mask=mask)
    grads = [_tree(10 + i, torch.float64) for i in range(4)]
    params, state = _tree(0, torch.float64), None
    state = opt.init(params)
    for i, g in enumerate(grads):  # fused, chain, fused, chain on one state
        params, state = fs.optim.step(opt if i % 2 == 0 else chain, g, state, params)
    want, want_state = _run(chain, _tree(0, torch.float64), grads)
    fs.testing.assert_close((params, state), (want, want_state), rtol=1e-12, atol=1e-14)


def test_the_kernel_runs_once_per_dtype_and_decay(monkeypatch):
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda params, *a, **k: (calls.append((len(params), k["weight_decay"])),
                                                                        kernel(params, *a, **k)))
    params = {**_tree(0, torch.float32), "h": torch.ones(3, dtype=torch.float64)}
    grads = {**_tree(1, torch.float32), "h": torch.ones(3, dtype=torch.float64)}
    opt = fs.optim.adamw(1e-2, weight_decay=0.1, mask={"w": True, "b": False, "h": True}, fused=True)
    fs.optim.step(opt, grads, opt.init(params), params)
    assert sorted(calls) == [(1, 0.0), (1, 0.1), (1, 0.1)]


def _chain_ran(monkeypatch) -> list[int]:
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(1), kernel(*a, **k)))
    return calls


def test_where_no_kernel_runs_the_chain_runs_and_says_why(monkeypatch):
    calls = _chain_ran(monkeypatch)
    params, grads = _tree(0, torch.bfloat16), _tree(1, torch.float32)
    opt = fs.optim.adamw(1e-2, fused=True)
    assert "a parameter of torch.bfloat16 on cpu with a gradient of torch.float32" in fusable(
        opt, grads, opt.init(params), params)
    assert "not made with fused=True" in fusable(fs.optim.adamw(1e-2), grads, opt.init(params), params)
    params, grads = _tree(0, torch.float64), [_tree(1, torch.float64)]
    want, want_state = _run(fs.optim.adamw(1e-2), _tree(0, torch.float64), grads)
    with fs.simulate(2):
        assert "fs.simulate runs the chain" in fusable(opt, grads[0], opt.init(params), params)
        got, state = _run(opt, params, grads)
    assert_bitwise_equal((got, state), (want, want_state))  # the chain, exactly
    assert calls == []


def _sharded(fused: bool):
    mesh = fs.make_mesh({"fsdp": 2})
    specs = {"w": P("fsdp"), "b": P()}
    opt = fs.optim.adamw(SCHEDULE, weight_decay=0.1, fused=fused)
    params = fs.shard(_tree(0, torch.float64), specs, mesh)
    state = opt.init(params)
    assert fusable(opt, fs.shard(_tree(1, torch.float64), specs, mesh), state, params) is None or not fused
    for i in range(3):
        params, state = fs.optim.step(opt, fs.shard(_tree(10 + i, torch.float64), specs, mesh), state, params)
    return fs.gather(params), fs.gather(state)


def test_fused_step_on_fsdp_shards_equals_one_process_bit_for_bit():
    fused = run_on_ranks(_sharded, True, world_size=2)
    one, _ = _run(fs.optim.adamw(SCHEDULE, weight_decay=0.1, fused=True), _tree(0, torch.float64),
                  [_tree(10 + i, torch.float64) for i in range(3)])
    for params, state in fused:
        assert_bitwise_equal(params, one)  # an elementwise kernel: each shard's elements computed alike
        assert int(state[0].count) == 3
