"""Exact resume: 6 training steps equal 3 steps + save (on fsdp=2) + load on another world
size (1 and 4) + 3 steps, in float64: losses to 1e-12, parameters and AdamW state included.

The batches come from torch's global RNG and the step from a data-loader position, so
the RNG state and the position must round-trip too. The save is asynchronous and the
next 3 steps run while it writes, with donated (in-place) updates, so the checkpoint
must hold the values of the moment of the save.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
import fshard.checkpoint as ckpt
from fshard import P
from fshard import tree as tree_util
from fshard.testing import run_on_ranks

DT = torch.float64
_CFG = fs.models.TransformerConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, max_seq_len=8)


def _loss(params, tokens):
    # Gathering inside the loss is differentiable: the gradients come back sharded like params.
    logits = fs.models.transformer_apply(fs.gather(params), tokens[:, :-1], _CFG)
    return F.cross_entropy(logits.reshape(-1, _CFG.vocab_size), tokens[:, 1:].reshape(-1))


def _opt():
    return fs.optim.adamw(1e-2, weight_decay=0.1)


def _steps(params, state, data, n, *, donate=False):
    opt, losses = _opt(), []
    for _ in range(n):
        tokens = torch.randint(0, _CFG.vocab_size, (4, 8))  # the global RNG: same on every rank
        loss, grads = fs.value_and_grad(_loss)(params, tokens)
        if donate:
            with fs.optim.donate():
                updates, state = opt.update(grads, state, params)
                params = fs.optim.apply_updates(params, updates)
        else:
            updates, state = opt.update(grads, state, params)
            params = fs.optim.apply_updates(params, updates)
        data = {**data, "index": data["index"] + tokens.shape[0]}
        losses.append(loss.item())
    return params, state, data, losses


def _summary(params, state, data, losses):
    full = fs.gather({"params": params, "opt": state})
    return {"losses": losses, "data": data, "leaves": [x.clone() for x in tree_util.leaves(full)],
            "paths": tree_util.zip_with_path(full)[0]}


def _train_and_save(path: str) -> dict:
    mesh = fs.make_mesh({"fsdp": 2})
    params = fs.shard(fs.models.transformer_init(_CFG, 0, dtype=DT), P("fsdp"), mesh)
    state = _opt().init(params)
    torch.manual_seed(1234)
    data = {"epoch": 0, "index": 0}
    params, state, data, first = _steps(params, state, data, 3)
    handle = ckpt.save(path, {"params": params, "opt": state, "data": data, "step": 3,
                              "rng": torch.get_rng_state()}, blocking=False)
    # The reference goes on while the save writes, overwriting its tensors in place.
    params, state, data, rest = _steps(params, state, data, 3, donate=True)
    handle.wait()
    return _summary(params, state, data, first + rest)


def _resume(path: str, n: int) -> dict:
    mesh = fs.make_mesh({"fsdp": n})
    params = fs.shard(fs.models.transformer_init(_CFG, 99, dtype=DT), P("fsdp"), mesh)  # other values
    like = {"params": params, "opt": _opt().init(params), "data": {"epoch": -1, "index": -1}, "step": 0,
            "rng": torch.get_rng_state()}
    restored = ckpt.load(path, like=like)
    torch.set_rng_state(restored["rng"])
    assert restored["step"] == 3
    params, state, data, losses = _steps(restored["params"], restored["opt"], restored["data"], 3)
    return _summary(params, state, data, losses)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("resume") / "step_3")
    return path, run_on_ranks(_train_and_save, path, world_size=2)[0]


@pytest.mark.parametrize("n", [1, 4])
def test_resume_on_another_world_size_matches_uninterrupted_training(reference, n):
    path, ref = reference
    for out in run_on_ranks(_resume, path, n, world_size=n):
        assert out["data"] == ref["data"] == {"epoch": 0, "index": 24}
        for a, b in zip(out["losses"], ref["losses"][3:]):
            assert abs(a - b) <= 1e-12, (out["losses"], ref["losses"][3:])
        assert out["paths"] == ref["paths"]
        assert sum(p.startswith("opt.") for p in out["paths"]) > 2 * sum(p.startswith("params.") for p in out["paths"])
        for p, a, b in zip(out["paths"], out["leaves"], ref["leaves"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=lambda m, p=p: f"{p}: {m}")
