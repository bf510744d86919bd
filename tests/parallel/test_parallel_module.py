"""fsdp_apply on Hugging Face GPT-2 and Llama: DDP, per-block FSDP and HSDP, against a
one-process torch reference (the same module, torch.optim.AdamW) in the same test.

Float64, each rank gets different rows of the global batch, 5 AdamW steps; the loss is
computed from the logits in float64 here (HF's built-in loss upcasts to float32). Both
gradient orders: value_and_grad(shard_map(f)) and shard_map(value_and_grad(f)).
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

import hf_models

STEPS, LR, WD = 5, 1e-2, 0.1


def _specs(params, mode):
    if mode == "ddp":
        return fs.parallel.replicate_specs(params)
    return fs.parallel.fsdp_specs(params, "fsdp")


def _axes(mode):
    return {"ddp": dict(axis=None, replicate_axis="dp"), "fsdp": dict(axis="fsdp"),
            "hsdp": dict(axis="fsdp", replicate_axis="dp")}[mode]


def _ref_step(ref, opt, tok, tgt):
    opt.zero_grad()
    loss = F.cross_entropy(ref(tok).logits.flatten(0, 1), tgt.flatten())
    loss.backward()
    opt.step()
    return loss.item()


def _train(kind, shape, mode, order, raf=True, steps=STEPS, check=True):
    mesh = fs.make_mesh(shape)
    model = hf_models.MODELS[kind]()
    ref = copy.deepcopy(model)
    apply, params, _ = fs.nn.functionalize(model)
    wrapped = fs.parallel.fsdp_apply(apply, blocks=hf_models.BLOCKS[kind], reshard_after_forward=raf,
                                     **_axes(mode))
    specs = _specs(params, mode)
    data_axes = tuple(a for a in ("dp", "fsdp") if a in shape)
    n_data = math.prod(shape[a] for a in data_axes)
    sharded = fs.shard(params, specs, mesh, uneven=True)
    opt = fs.optim.adamw(LR, weight_decay=WD)
    state = opt.init(sharded)

    def loss_fn(p, tok, tgt):
        logits = wrapped(p, tok).logits
        return fs.lax.pmean(F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), data_axes)

    in_specs = (specs, P(data_axes), P(data_axes))
    if order == "outside":
        step = fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check=check))
    else:
        step = fs.shard_map(fs.value_and_grad(loss_fn), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs),
                            check=check)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    losses, counts = [], []
    for s in range(steps):
        tok, tgt = hf_models.batch(s, 2 * n_data)
        with fs.comm_log() as log:
            loss, grads = step(sharded, tok, tgt)
        counts.append(dict(log.counts))
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)
        losses.append((loss.item(), _ref_step(ref, ref_opt, tok, tgt)))
    full = fs.gather(sharded)
    want = fs.nn.functionalize(ref)[1]
    worst = max((a - b).abs().max().item() for a, b in zip(fs.tree.leaves(full), fs.tree.leaves(want)))
    return losses, counts, worst


def _assert_parity(results, tol=1e-10):
    for losses, _, worst in results:
        for got, want in losses:
            assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)
        assert worst < tol, worst


ORDERS = ["outside", "inside"]
N_BLOCKS = 2


CASES = [  # (mode, mesh, order): every strategy on 2 and 4 ranks, both gradient orders
    ("fsdp", {"fsdp": 2}, "outside"), ("fsdp", {"fsdp": 2}, "inside"), ("fsdp", {"fsdp": 4}, "inside"),
    ("ddp", {"dp": 2}, "inside"), ("ddp", {"dp": 4}, "outside"),
    ("hsdp", {"dp": 2, "fsdp": 1}, "outside"), ("hsdp", {"dp": 2, "fsdp": 2}, "inside"),
]


def _expected_counts(mode, shape, raf=True):
    g = 1 + N_BLOCKS  # the root group and one per block
    if mode == "ddp" or shape.get("fsdp") == 1:
        return {"psum": 1 + 1}  # the loss, and one bucket holding every group's gradients
    gathers = 1 + (2 if raf else 1) * N_BLOCKS
    if mode == "fsdp":
        return {"all_gather": gathers, "psum_scatter": g, "psum": 1}
    return {"all_gather": gathers, "psum_scatter": g, "psum": 1 + g}  # hsdp: + an all-reduce per group


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("mode, shape, order", CASES, ids=lambda v: "x".join(map(str, v.values()))
                         if isinstance(v, dict) else str(v))
def test_parity_and_comm_counts(kind, mode, shape, order):
    n = math.prod(shape.values())
    results = run_on_ranks(_train, kind, shape, mode, order, world_size=n)
    _assert_parity(results)
    for _, counts, _ in results:
        for c in counts:
            assert c == _expected_counts(mode, shape), c


def test_fsdp_without_reshard_gathers_each_block_once():
    results = run_on_ranks(_train, "gpt2", {"fsdp": 2}, "fsdp", "outside", False, 2, world_size=2)
    _assert_parity(results)
    for _, counts, _ in results:
        assert all(c == _expected_counts("fsdp", {"fsdp": 2}, raf=False) for c in counts), counts


def _untouched(kind):
    """One step through blocks given as a pattern; then a forward that raises inside block 1.
    The module keeps its own parameters and no hook survives either call."""
    mesh = fs.make_mesh({"fsdp": 2})
    model = hf_models.MODELS[kind]()
    own = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in own.items()}
    apply, params, _ = fs.nn.functionalize(model)
    wrapped = fs.parallel.fsdp_apply(apply, blocks=[hf_models.BLOCKS[kind] + ".*"])
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    tok, tgt = hf_models.batch(0, 4)

    def loss_fn(p, tok, tgt):
        return fs.lax.pmean(F.cross_entropy(wrapped(p, tok).logits.flatten(0, 1), tgt.flatten()), "fsdp")

    step = fs.shard_map(fs.value_and_grad(loss_fn), mesh=mesh, in_specs=(specs, P("fsdp"), P("fsdp")),
                        out_specs=(P(), specs))
    with fs.comm_log() as log:
        step(sharded, tok, tgt)
    blocks = model.get_submodule(hf_models.BLOCKS[kind])

    def boom(module, args):
        raise RuntimeError("boom in block 1")

    handle = blocks[1].register_forward_pre_hook(boom)
    try:
        step(sharded, tok, tgt)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    finally:
        handle.remove()
    hooks_left = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    same = all(model.get_parameter(n) is p and torch.equal(p, before[n]) for n, p in own.items())
    # A plain forward/backward afterwards: no saved-tensor hooks or rebinding left behind.
    model(tok).logits.sum().backward()
    return dict(log.counts), raised, hooks_left, same


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_module_untouched_and_cleanup_after_error(kind):
    for counts, raised, hooks_left, same in run_on_ranks(_untouched, kind, world_size=2):
        assert counts == _expected_counts("fsdp", {"fsdp": 2}), counts
        assert raised is not None and "boom in block 1" in raised
        assert hooks_left == 0 and same


@pytest.mark.parametrize("blocks, match", [
    ("model.layerz", r"'model.layerz' does not exist in LlamaForCausalLM: 'model' \(LlamaModel\) has no child "
                     r"'layerz'; its children: embed_tokens, layers, norm, rotary_emb"),
    ("model.norm", r"blocks='model.norm' is a LlamaRMSNorm, not an nn.ModuleList"),
    (["model.blocks.*"], r"blocks pattern 'model.blocks.\*' matches no submodule of LlamaForCausalLM"),
    (["model.layers", "model.layers.0.mlp"], r"block 'model.layers.0.mlp' lies inside block 'model.layers.0'"),
    (["model.rotary_emb"], r"block\(s\) \['model.rotary_emb'\] hold no parameters"),
])
def test_bad_blocks_name_the_path(blocks, match):
    apply, _, _ = fs.nn.functionalize(hf_models.llama())
    with pytest.raises(ValueError, match=match):
        fs.parallel.fsdp_apply(apply, blocks=blocks)


def test_not_an_apply():
    with pytest.raises(TypeError, match="fs.nn.functionalize"):
        fs.parallel.fsdp_apply(lambda p, x: x, blocks="layers")
