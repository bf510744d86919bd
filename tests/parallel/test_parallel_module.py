"""fsdp_apply on Hugging Face GPT-2 and Llama: DDP, per-block FSDP and HSDP, against a
one-process torch reference (the same module, torch.optim.AdamW) in the same test.

Float64, each rank gets different rows of the global batch, 2 AdamW steps (every
step's loss and collective counts compared, the params after the last); the loss is
computed from the logits in float64 here (HF's built-in loss upcasts to float32). Both
gradient orders: value_and_grad(shard_map(f)) and shard_map(value_and_grad(f)).
"""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _harness import hf_models
from _harness.optional import requires

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

BENCH = Path(__file__).resolve().parents[2] / "bench"
pytestmark = requires("transformers")  # GPT-2 and Llama from tests/_harness/hf_models.py
STEPS, LR, WD = 2, 1e-2, 0.1  # the second step's AdamW update reads the first one's moments
PLANS = {"gpt2": fs.parallel.HF_GPT2_TP_PLAN, "llama": fs.parallel.HF_LLAMA_TP_PLAN}


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


def _wrap(kind, mode, apply, params, raf=True, loss_parallel=False):
    """The wrapped apply and the specs for ``mode``: ddp, fsdp, hsdp, tp or fsdp_tp."""
    plan = PLANS[kind]
    if mode == "tp":
        return fs.parallel.tp_apply(apply, plan, "tp", loss_parallel=loss_parallel), fs.parallel.tp_specs(params, plan)
    if mode == "fsdp_tp":
        inner = fs.parallel.tp_apply(apply, plan, "tp", loss_parallel=loss_parallel)
        return (fs.parallel.fsdp_apply(inner, blocks=hf_models.BLOCKS[kind], axis="fsdp", reshard_after_forward=raf),
                fs.parallel.tp_specs(params, plan, fsdp_axis="fsdp"))
    wrapped = fs.parallel.fsdp_apply(apply, blocks=hf_models.BLOCKS[kind], reshard_after_forward=raf, **_axes(mode))
    return wrapped, _specs(params, mode)


def _train(kind, shape, mode, order, raf=True, steps=STEPS, check=True, loss_parallel=False):
    mesh = fs.make_mesh(shape)
    model = hf_models.MODELS[kind]()
    ref = copy.deepcopy(model)
    apply, params, _ = fs.nn.functionalize(model)
    wrapped, specs = _wrap(kind, mode, apply, params, raf, loss_parallel)
    data_axes = tuple(a for a in ("dp", "fsdp") if a in shape)
    n_data = math.prod(shape[a] for a in data_axes)
    sharded = fs.shard(params, specs, mesh, uneven=True)
    opt = fs.optim.adamw(LR, weight_decay=WD)
    state = opt.init(sharded)

    def loss_fn(p, tok, tgt):
        logits = wrapped(p, tok).logits
        if loss_parallel:
            loss = fs.parallel.vocab_parallel_cross_entropy(logits, tgt, "tp")
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
        return fs.lax.pmean(loss, data_axes) if data_axes else loss

    in_specs = (specs, P(data_axes or None), P(data_axes or None))
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
        counts.append(dict(log.counts) if mode not in ("tp", "fsdp_tp") else dict(log.by_axis))
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


def _tp_counts(kind, mode, loss_parallel=False):
    """comm_log.by_axis of one step. TP per block: GPT-2 (attention replicated) psums after
    c_proj in forward and at c_fc's pvary in backward; Llama twice that (attention and MLP).
    Plus the embedding's psum and the head's pvary (backward psum); the full logits' gather,
    or with loss parallel the loss's pmax and psum."""
    per_block = 2 if kind == "gpt2" else 4
    c = {("psum", ("tp",)): 2 + per_block * N_BLOCKS}
    if loss_parallel:
        c[("psum", ("tp",))] += 1
        c[("pmax", ("tp",))] = 1
    else:
        c[("all_gather", ("tp",))] = 1
    if mode == "fsdp_tp":
        c.update({("all_gather", ("fsdp",)): 1 + 2 * N_BLOCKS, ("psum_scatter", ("fsdp",)): 1 + N_BLOCKS,
                  ("psum", ("fsdp",)): 1})
    return c


@pytest.mark.parametrize("kind, mode, shape, order, loss_parallel", [
    ("gpt2", "tp", {"tp": 2}, "outside", False), ("llama", "tp", {"tp": 2}, "inside", False),
    ("llama", "tp", {"tp": 2}, "outside", True),
    ("gpt2", "fsdp_tp", {"fsdp": 2, "tp": 2}, "inside", False),
    ("llama", "fsdp_tp", {"fsdp": 2, "tp": 2}, "outside", False),
])
def test_tp_and_fsdp_x_tp(kind, mode, shape, order, loss_parallel):
    results = run_on_ranks(_train, kind, shape, mode, order, loss_parallel=loss_parallel,
                           world_size=math.prod(shape.values()))
    _assert_parity(results)
    for _, counts, _ in results:
        for c in counts:
            assert c == _tp_counts(kind, mode, loss_parallel), c


def _tp_call_errors():
    """Errors that need the mesh: a split dim the tp size does not divide, and shards of
    the wrong shape (a Conv1D sharded as if it were a Linear)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = fs.make_mesh({"tp": 2})
    torch.manual_seed(0)
    odd = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=25, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2)).double()
    gpt = hf_models.gpt2()
    out = []
    for model, plan, bad_spec in ((odd, fs.parallel.HF_LLAMA_TP_PLAN, None),
                                  (gpt, fs.parallel.HF_GPT2_TP_PLAN, "transformer.h.0.mlp.c_fc.weight")):
        apply, params, _ = fs.nn.functionalize(model)
        tp = fs.parallel.tp_apply(apply, plan)
        specs = fs.parallel.tp_specs(params, plan, module=model)
        if bad_spec:  # Linear's orientation on a Conv1D [in, out]
            flat = fs.nn.to_state_dict(specs)
            flat[bad_spec] = P("tp", None)
            specs = fs.nn.from_state_dict(flat)
        tok = torch.zeros(2, 4, dtype=torch.long)
        try:
            fs.shard_map(lambda p, t: tp(p, t).logits, mesh=mesh, in_specs=(specs, P()), out_specs=P())(
                fs.shard(params, specs, mesh, uneven=True), tok)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_tp_errors_at_call_name_the_path():
    for odd, wrong in run_on_ranks(_tp_call_errors, world_size=2):
        assert odd.startswith("tp_apply: model.layers.0.mlp.gate_proj.weight has shape (25, 16); the colwise split "
                              "puts dim 0 (size 25) over axis 'tp' of size 2, which does not divide it."), odd
        assert wrong.startswith("tp_apply: transformer.h.0.mlp.c_fc.weight is (8, 64) on this rank, but the colwise "
                                "split of its (16, 64) over axis 'tp' (size 2) is (16, 32)."), wrong


@pytest.mark.parametrize("plan, match", [
    ({"model.layerz.*.mlp.up_proj": "colwise"}, r"plan pattern 'model.layerz.\*.mlp.up_proj' matches no module of "
                                                r"LlamaForCausalLM"),
    ({"model.layers.*.mlp": "colwise"}, r"module 'model.layers.0.mlp' is a LlamaMLP; style 'colwise' applies to "
                                        r"nn.Linear, transformers' Conv1D"),
    ({"model.layers.*.mlp.up_proj": "column"}, r"plan entry 'model.layers.\*.mlp.up_proj' has style 'column'"),
    ({"model.embed_tokens": "colwise"}, r"module 'model.embed_tokens' is an Embedding; give it style 'vocab'"),
])
def test_bad_plans_name_the_pattern(plan, match):
    apply, params, _ = fs.nn.functionalize(hf_models.llama())
    with pytest.raises(ValueError, match=match):
        fs.parallel.tp_apply(apply, plan)
    with pytest.raises(ValueError, match=match.replace("tp_apply", "tp_specs")):
        fs.parallel.tp_specs(params, plan, module=apply)


def test_tied_tensor_planned_two_ways():
    apply, _, _ = fs.nn.functionalize(hf_models.gpt2())
    plan = {k: v for k, v in fs.parallel.HF_GPT2_TP_PLAN.items() if k != "lm_head"}
    with pytest.raises(ValueError, match=r"'lm_head.weight' is tied to 'transformer.wte.weight', but the plan splits "
                                         r"them differently"):
        fs.parallel.tp_apply(apply, plan)


def test_specs_without_the_module_read_conv1d_orientation_from_the_bias():
    model = hf_models.gpt2()
    _, params, _ = fs.nn.functionalize(model)
    plan = fs.parallel.HF_GPT2_TP_PLAN
    assert fs.parallel.tp_specs(params, plan) == fs.parallel.tp_specs(params, plan, module=model)
    square = {"transformer.h.*.attn.c_proj": "rowwise"}  # [D, D] with a bias [D]: needs the module
    with pytest.raises(ValueError, match=r"'transformer.h.0.attn.c_proj.weight' is \(16, 16\) with a bias of 16.*"
                                         r"Pass module="):
        fs.parallel.tp_specs(params, square)
    assert fs.tree.leaves(fs.parallel.tp_specs(params, square, module=model))  # fine with it


LAYERS, DIM = 4, 64  # bench/hf_fsdp_memory.py's Llama: FFN 2.75 * DIM, vocab 512


def _peak_memory():
    sys.path.insert(0, str(BENCH))
    import hf_fsdp_memory

    return {side: hf_fsdp_memory.step_peak(side, layers=LAYERS, dim=DIM, rows=1, seq=8, steps=1)
            for side in ("whole", "per-block")}


def test_per_block_peak_memory_is_below_whole_model_gather():
    # Peak bytes of the tensors the gradient step (forward, backward, reductions) creates on
    # each rank (bench/hf_fsdp_memory.py, a dispatch mode: exact and repeatable; the
    # profiler's numbers are in bench/README.md). The whole-model gather holds every
    # gathered parameter and every full gradient at once; per block holds the root, the
    # gathered blocks in use and the full gradients of the blocks still being reduced.
    block_bytes = 4 * (4 * DIM * DIM + 3 * DIM * int(2.75 * DIM))  # one layer's Linear weights, fp32
    model_bytes = LAYERS * block_bytes + 4 * 2 * 512 * DIM  # the blocks, the embedding and the head
    for peaks in run_on_ranks(_peak_memory, world_size=2):
        for (whole, _), (per_block, _) in zip(peaks["whole"], peaks["per-block"]):
            assert whole >= 2 * model_bytes, whole  # the whole gather holds the model and its gradients
            assert per_block < whole - 2 * block_bytes, (whole, per_block)


def _prefetch_and_policy():
    """Forward only, 4 Llama layers on fsdp=2: for each ``prefetch``, the most all-gathers in
    flight at once (issued, not yet waited) and the logits' distance to the module's; then
    ``policy=Policy(param_dtype=float32)``: the gathered bytes and the logits' distance."""
    mesh = fs.make_mesh({"fsdp": 2})
    model = hf_models.llama(n_layer=4)
    apply, params, _ = fs.nn.functionalize(model)
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    tok, _ = hf_models.batch(0, 2)
    want = model(tok).logits.detach()
    out = {}
    for key, kw in [(0, {}), (1, {}), (2, {}), ("f32", {"policy": fs.Policy(param_dtype=torch.float32)})]:
        wrapped = fs.parallel.fsdp_apply(apply, blocks="model.layers", prefetch=key if key != "f32" else 1, **kw)
        fwd = fs.shard_map(lambda p, t: wrapped(p, t).logits, mesh=mesh, in_specs=(specs, P()), out_specs=P())
        # What is measured is fsdp_apply's issue order: without gloo's one-in-flight rule
        # (comm.one_at_a_time, tested in tests/test_comm_one_at_a_time.py), which would
        # complete each prefetched gather as soon as the next one is issued.
        real = fs.comm.one_at_a_time
        fs.comm.one_at_a_time = lambda group: None
        try:
            with torch.no_grad(), fs.comm_log() as log:
                logits = fwd(sharded, tok)
        finally:
            fs.comm.one_at_a_time = real
        inflight = peak = 0
        for e in log.timeline:
            if e.kind == "all_gather":
                inflight += 1 if e.what == "issue" else -1
                peak = max(peak, inflight)
        out[key] = (peak, log.bytes["all_gather"], (fs.gather(logits).double() - want).abs().max().item())
    return out


def test_prefetch_depth_and_mixed_precision_gathers():
    for out in run_on_ranks(_prefetch_and_policy, world_size=2):
        for depth in (0, 1, 2):
            peak, _, err = out[depth]
            assert peak == 1 + depth, (depth, peak)  # this block's gather and `depth` blocks ahead
            assert err < 1e-12, err
        peak, nbytes, err = out["f32"]
        assert peak == 2 and nbytes * 2 == out[1][1], (nbytes, out[1][1])  # gathered in float32: half the bytes
        assert 1e-9 < err < 1e-4, err  # float32 compute: close, and not the float64 result
