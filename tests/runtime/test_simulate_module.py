"""fsdp_apply / tp_apply on Hugging Face models (tiny GPT-2 and Llama, float64) and
fs.recipes.ModuleModel under fs.simulate against real gloo ranks: FSDP, TP and FSDP x TP
steps (both gradient orders), one build_train_step step and BatchNorm buffers synced by
fsdp_apply (sync_buffers local and mean) give every rank the same loss,
gradient blocks and updated parameters bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.testing import assert_bitwise_equal, run_on_ranks, run_simulated

pytest.importorskip("transformers", reason="pip install fshard[hf]")

from _harness import hf_models  # noqa: E402

PLANS = {"gpt2": fs.parallel.HF_GPT2_TP_PLAN, "llama": fs.parallel.HF_LLAMA_TP_PLAN}
SHAPES = {"fsdp": lambda n: {"fsdp": n}, "tp": lambda n: {"tp": n}, "fsdp_tp": lambda n: {"fsdp": 2, "tp": n // 2}}


def _wrap(kind, mode, apply, params):
    plan, blocks = PLANS[kind], hf_models.BLOCKS[kind]
    if mode == "fsdp":
        return fs.parallel.fsdp_apply(apply, blocks=blocks, axis="fsdp"), fs.parallel.fsdp_specs(params, "fsdp")
    if mode == "tp":
        return fs.parallel.tp_apply(apply, plan, "tp"), fs.parallel.tp_specs(params, plan)
    inner = fs.parallel.tp_apply(apply, plan, "tp")
    return (fs.parallel.fsdp_apply(inner, blocks=blocks, axis="fsdp"),
            fs.parallel.tp_specs(params, plan, fsdp_axis="fsdp"))


def _step(n, kind, mode, order):
    shape = SHAPES[mode](n)
    mesh = fs.make_mesh(shape)
    apply, params, _ = fs.nn.functionalize(hf_models.MODELS[kind]())
    wrapped, specs = _wrap(kind, mode, apply, params)
    data = ("fsdp",) if "fsdp" in shape else ()
    sharded = fs.shard(params, specs, mesh, uneven=True)

    def loss_fn(p, tok, tgt):
        loss = F.cross_entropy(wrapped(p, tok).logits.flatten(0, 1), tgt.flatten())
        return fs.lax.pmean(loss, data) if data else loss

    in_specs = (specs, P(data or None), P(data or None))
    if order == "outside":
        step = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=in_specs, out_specs=P()))
    else:
        step = fs.shard_map(fs.value_and_grad(loss_fn), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs))
    opt = fs.optim.adamw(1e-2, weight_decay=0.1)
    tok, tgt = hf_models.batch(0, 2 * shape.get("fsdp", 1))
    loss, grads = step(sharded, tok, tgt)
    updates, _ = opt.update(grads, opt.init(sharded), sharded)
    new = fs.optim.apply_updates(sharded, updates)
    blocks = fs.tree.tree_map(lambda g: g.to_local().detach().clone(), grads)
    return fs.gather(loss).detach(), blocks, fs.tree.tree_map(lambda x: x.detach(), fs.gather(new))


CASES = [  # (model, mode, ranks, gradient order): FSDP, TP and FSDP x TP on 2 and 4 ranks
    ("gpt2", "fsdp", 2, "outside"), ("llama", "fsdp", 4, "inside"),
    ("gpt2", "tp", 4, "inside"), ("llama", "tp", 2, "outside"),
    ("gpt2", "fsdp_tp", 4, "outside"), ("llama", "fsdp_tp", 4, "inside"),
]


@pytest.mark.parametrize("kind, mode, n, order", CASES)
def test_a_hf_model_step_equals_the_real_ranks(kind, mode, n, order):
    real = run_on_ranks(_step, n, kind, mode, order, world_size=n)
    simulated = run_simulated(_step, n, kind, mode, order, world_size=n)
    for r in range(n):
        assert_bitwise_equal(simulated[r], real[r], what=f"{kind} {mode} {order}, rank {r}")


def _lm_loss(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _recipe(n, kind, mesh_text):
    model = fs.recipes.ModuleModel(hf_models.MODELS[kind](), _lm_loss, blocks=hf_models.BLOCKS[kind],
                                   tp_plan=PLANS[kind], name=kind)
    layout = fs.parallel.Layout.parse(mesh_text, batch=4, dtype="float64")
    init_state, step = fs.recipes.build_train_step(model, layout, fs.optim.sgd(0.2), max_norm=0.5)
    params, state = init_state(0)
    params, state, loss, _, bad = step(params, state, *hf_models.batch(0, 4))
    assert bad is None
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    return loss.detach(), fs.tree.tree_map(lambda x: x.detach(), fs.gather(params))


@pytest.mark.parametrize("kind, mesh_text, n", [("gpt2", "fsdp=2", 2), ("llama", "fsdp=2,tp=2", 4)])
def test_a_module_model_train_step_equals_the_real_ranks(kind, mesh_text, n):
    real = run_on_ranks(_recipe, n, kind, mesh_text, world_size=n)
    simulated = run_simulated(_recipe, n, kind, mesh_text, world_size=n)
    for r in range(n):
        assert_bitwise_equal(simulated[r], real[r], what=f"ModuleModel {kind} {mesh_text}, rank {r}")


def _buffers(n, mode):
    """fsdp_apply's DDP over a BatchNorm net: the running statistics a forward updated
    (rank 0's, or the mean) and the gradients, per-rank batches."""
    from parallel.test_parallel_module_buffers import Net, _batch

    mesh = fs.make_mesh({"dp": n})
    torch.manual_seed(0)
    apply, params, buffers = fs.nn.functionalize(Net().double())
    ddp = fs.parallel.fsdp_apply(apply, blocks="layers", axis=None, replicate_axis="dp", sync_buffers=mode)
    specs, bspecs = fs.parallel.replicate_specs(params), fs.parallel.replicate_specs(buffers)

    def loss_fn(p, b, x, y):
        out, new_b = ddp(p, x, buffers=b, return_buffers=True)
        return fs.lax.pmean(F.cross_entropy(out, y), "dp"), new_b

    step = fs.shard_map(fs.value_and_grad(loss_fn, has_aux=True), mesh=mesh,
                        in_specs=(specs, bspecs, P("dp"), P("dp")), out_specs=((P(), bspecs), specs))
    (loss, b), grads = step(fs.shard(params, specs, mesh), fs.shard(buffers, bspecs, mesh), *_batch(0, n))
    local = lambda t: fs.tree.tree_map(lambda x: x.to_local().detach().clone(), t)  # noqa: E731
    return fs.gather(loss).detach(), local(b), local(grads)


@pytest.mark.parametrize("mode", ["local", "mean"])
def test_fsdp_apply_buffers_equal_the_real_ranks(mode):
    real = run_on_ranks(_buffers, 2, mode, world_size=2)
    simulated = run_simulated(_buffers, 2, mode, world_size=2)
    for r in range(2):
        assert_bitwise_equal(simulated[r], real[r], what=f"sync_buffers={mode!r}, rank {r}")
