"""Expert parallelism (MoE) composed with FSDP, HSDP and TP: seed_tests.md scenario 21.

Scenario 21 trains a Transformer with 8 experts per MoE layer on ep=2 x tp {1,2} x
dp_replicate {1,2}, expert leaves FSDP-sharded over ``efsdp`` and everything else over
the data axes, against a reference whose expert grads are summed over ep and averaged
over efsdp and dp_replicate. Here (at most 4 ranks) the meshes are ep=2, ep=4,
dp=2 x ep=2 (dp_replicate), efsdp=2 x ep=2 and ep=2 x tp=2. The reference is the
single-process model on the global batch with the mean loss, all experts local and
computed densely on every token: the gradient of the global mean *is* "sum over ep,
average over the data axes", so every step's loss and gradient must match (float64).
Capacity is per dispatch group (one rank's tokens), so the reference routes in the same
groups; the capacity factor is chosen so that tokens are really dropped.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.models import TransformerConfig, attention, embed, head, transformer_init
from fshard.parallel import TRANSFORMER_TP_PLAN, gather_params, tp_embed, tp_enter, tp_exit, tp_logits, tp_specs
from fshard.parallel import vocab_parallel_cross_entropy
from fshard.parallel.ep import ep_rules, ep_specs, expert_capacity, moe_ffn, moe_init
from fshard.testing import local_block_diff, run_on_ranks

CFG = TransformerConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
HIDDEN, N_EXPERTS, ROWS_PER_RANK = 128, 8, 2
AXES = ("dp", "efsdp", "ep", "tp")  # torchtitan's order: ep ranks are the innermost data ranks
LAYOUTS = {
    "ep2": {"ep": 2},
    "ep4": {"ep": 4},
    "dp2_ep2": {"dp": 2, "ep": 2},
    "efsdp2_ep2": {"efsdp": 2, "ep": 2},
    "ep2_tp2": {"ep": 2, "tp": 2},
}


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(fs.tree.leaves(a), fs.tree.leaves(b)))


def _norm(p, x):
    return F.layer_norm(x, (x.shape[-1],), p["weight"], p["bias"], CFG.norm_eps)


def _params(n_experts=N_EXPERTS):
    """transformer_init's tree with each layer's feed_forward replaced by a MoE FFN."""
    params = transformer_init(CFG, 0, dtype=torch.float64)
    for i, lp in enumerate(params["layers"]):
        del lp["feed_forward"]
        lp["moe"] = moe_init(CFG.dim, HIDDEN, n_experts, 100 + i, dtype=torch.float64)
    return params


# --- the reference: every expert on every token, then keep each token's top-k slots ------------
def _dense_moe(p, x, top_k, cf, n_groups):
    """Same math as moe_ffn, written independently: returns (output, dropped assignments)."""
    wr, w1, w2 = p["router"]["weight"], p["experts"]["w1"], p["experts"]["w2"]
    tok = x.reshape(-1, x.shape[-1])  # (N, D)
    n, n_experts = tok.shape[0], wr.shape[0]
    top_p, top_e = (tok @ wr.T).softmax(-1).topk(top_k, dim=-1)  # (N, k)
    gates = top_p / top_p.sum(-1, keepdim=True) if top_k > 1 else top_p
    t = n // n_groups
    if cf is None:  # dropless: every assignment kept
        cap = t
    else:
        cap = expert_capacity(t, n_experts, top_k, cf)
    choice, keep = top_e.tolist(), torch.zeros(n, top_k)
    for g in range(n_groups):  # first choices before second choices, in token order
        used = [0] * n_experts
        for j in range(top_k):
            for i in range(g * t, (g + 1) * t):
                keep[i, j] = float(used[choice[i][j]] < cap)
                used[choice[i][j]] += 1
    h = F.gelu(torch.einsum("ehd,nd->neh", w1, tok))  # (N, E, H)
    every = torch.einsum("edh,neh->ned", w2, h)  # (N, E, D)
    chosen = every.gather(1, top_e.unsqueeze(-1).expand(n, top_k, tok.shape[-1]))  # (N, k, D)
    y = (chosen * (gates * keep.to(gates.dtype)).unsqueeze(-1)).sum(1)
    return y.view(x.shape), int((keep == 0).sum())


def _ref_loss(p, tok, tgt, top_k, cf, n_groups, drops):
    x = embed(p, tok, CFG)
    for lp in p["layers"]:
        x = x + attention(lp["attention"], _norm(lp["attention_norm"], x), CFG)
        y, dropped = _dense_moe(lp["moe"], _norm(lp["ffn_norm"], x), top_k, cf, n_groups)
        drops.append(dropped)
        x = x + y
    return F.cross_entropy(head(p, x, CFG).flatten(0, 1), tgt.flatten())


# --- the distributed run -------------------------------------------------------------------------
def _layout(name):
    shape = {a: LAYOUTS[name].get(a, 1) for a in AXES}
    big = tuple(a for a in AXES if shape[a] > 1)
    data = tuple(a for a in ("dp", "efsdp", "ep") if a in big)  # the batch is split over these
    dense = tuple(a for a in ("efsdp", "ep") if a in big)  # FSDP of everything but the experts
    rep = "dp" if "dp" in big else None
    return shape, data, dense, rep


def _specs(params, mesh, shape, dense):
    if shape["tp"] > 1:  # tp_rules takes one FSDP axis: (tp, (efsdp, ep)) would need 8 ranks here anyway
        assert dense == ("ep",)
        base = tp_specs(params, TRANSFORMER_TP_PLAN, "tp", fsdp_axis="ep")
    else:
        base = fs.parallel.fsdp_specs(params, dense)
    efsdp = "efsdp" if shape["efsdp"] > 1 else None
    return ep_specs(params, "ep", fsdp_axis=efsdp, tp_axis="tp" if shape["tp"] > 1 else None, base=base, mesh=mesh)


def _body(top_k, cf, data, dense, rep, efsdp, tp):
    """The per-device loss. ``tp`` is None on tp=1 meshes: the plain embedding, attention and
    loss then issue no tp call at all (checked mode would otherwise add a pvary over the
    size-1 axis in front of the embedding's psum, and its backward is a 1-rank all_reduce)."""
    dense_axes = dict(axis=dense, replicate_axis=rep)
    expert_axes = dict(axis=efsdp, replicate_axis=rep)

    def body(p, tok, tgt):
        root = gather_params({k: v for k, v in p.items() if k != "layers"}, **dense_axes)
        x = tp_embed(root, tok, CFG, tp) if tp else embed(root, tok, CFG)  # (b, T, D)
        for lp in p["layers"]:
            d = gather_params({"attention_norm": lp["attention_norm"], "attention": lp["attention"],
                               "ffn_norm": lp["ffn_norm"], "router": lp["moe"]["router"]}, **dense_axes)
            experts = gather_params(lp["moe"]["experts"], **expert_axes)  # this ep rank's E / ep experts
            h = _norm(d["attention_norm"], x)
            x = x + (tp_exit(attention(d["attention"], tp_enter(h, tp), CFG), tp) if tp else
                     attention(d["attention"], h, CFG))
            x = x + moe_ffn({"router": d["router"], "experts": experts}, _norm(d["ffn_norm"], x),
                            top_k=top_k, capacity_factor=cf, ep_axis="ep", tp_axis=tp)
        if tp:
            loss = vocab_parallel_cross_entropy(tp_logits(root, x, CFG, tp), tgt, tp, vocab_size=CFG.vocab_size)
        else:
            loss = F.cross_entropy(head(root, x, CFG).flatten(0, 1), tgt.flatten())
        return fs.lax.pmean(loss, data)

    return body


def _batch(step, n_rows):
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, CFG.vocab_size, (n_rows, CFG.max_seq_len), generator=g)
    return tok, torch.roll(tok, -1, dims=1)


def _train(name, steps, top_k, cf, check=True, order="outside"):
    """One rank's run: per step (loss, ref loss, dropped), fwd/bwd comm counts, worst diffs."""
    import logging

    # Redistributing a strided layout ((ep, efsdp) on dim 0 of an (efsdp, ep) mesh) logs a warning.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    shape, data, dense, rep = _layout(name)
    mesh = fs.make_mesh(shape)
    params = _params()
    specs = _specs(params, mesh, shape, dense)
    sharded = fs.shard(params, specs, mesh)
    # Each rank's blocks, here and below, instead of fs.gather: DTensor plans the gather of a
    # strided (efsdp x ep) layout by a graph search that cost more CPU than the whole run.
    init_diff = local_block_diff(sharded, params, specs, mesh)
    n_groups = 1
    for a in data:
        n_groups *= shape[a]
    efsdp = "efsdp" if shape["efsdp"] > 1 else None
    tp = "tp" if shape["tp"] > 1 else None
    body = _body(top_k, cf, data, dense, rep, efsdp, tp)
    marks = []

    def marked(p, tok, tgt):  # records where forward ends in the comm log
        loss = body(p, tok, tgt)
        marks.append(len(log.events))
        return loss

    in_specs = (specs, P(data), P(data))
    if order == "outside":  # value_and_grad(shard_map(f))
        step = fs.value_and_grad(fs.shard_map(marked, mesh=mesh, in_specs=in_specs, out_specs=P(), check=check))
    else:  # shard_map(value_and_grad(f))
        step = fs.shard_map(fs.value_and_grad(marked), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs),
                            check=check)

    opt, ref_opt = fs.optim.adamw(1e-2, weight_decay=0.1), fs.optim.adamw(1e-2, weight_decay=0.1)
    state, ref, ref_state = opt.init(sharded), params, ref_opt.init(params)
    losses, counts, g_diff = [], [], 0.0
    for s in range(steps):
        tok, tgt = _batch(s, ROWS_PER_RANK * n_groups)
        with fs.comm_log() as log:
            loss, grads = step(sharded, tok, tgt)
        fwd, bwd = log.events[:marks[-1]], log.events[marks[-1]:]
        counts.append(tuple(dict(Counter((k, a) for k, a, _ in ev)) for ev in (fwd, bwd)))
        drops = []
        ref_loss, ref_grads = fs.value_and_grad(lambda p: _ref_loss(p, tok, tgt, top_k, cf, n_groups, drops))(ref)
        # Each rank's blocks (no gather per step: with the strided expert layouts it cost more
        # than the step); the params likewise at the end.
        g_diff = max(g_diff, local_block_diff(grads, ref_grads, specs, mesh))
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)
        upd, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, upd)
        losses.append((loss.item(), ref_loss.item(), sum(drops)))
    p_diff = local_block_diff(sharded, ref, specs, mesh)  # per-step losses already track the params
    local = sharded["layers"][0]["moe"]["experts"]["w1"].to_local().shape
    return dict(init=init_diff, losses=losses, counts=counts, params=p_diff, grads=g_diff, local_w1=tuple(local))


def _expected_counts(name, dropless=False):
    """Hand-derived collectives per step, (forward, backward), by (kind, axes).

    MoE (L layers): 2 all_to_all over ep forward per layer (dispatch, return) and their 2
    transposes backward. FSDP with gather_params (no reshard): one all_gather forward and
    one psum_scatter backward per group: the root (embeddings, norm, output), each layer's
    dense group, and each layer's experts when efsdp > 1 (over efsdp only: experts are
    not replicated over ep). dp_replicate adds a psum per group. The loss pmean is one
    psum over the data axes. TP (Megatron): forward psum after the embedding, each
    attention, each MoE and in the loss, plus the loss' pmax; backward psum at each
    tp_enter (attention, head), the MoE input and the MoE gates.
    """
    shape, data, dense, rep = _layout(name)
    L, fwd, bwd = CFG.n_layers, Counter(), Counter()
    if dropless:  # per layer: the counts' all_gather, from which every rank knows both exchanges' plans
        fwd["all_gather", ("ep",)] = L
        fwd["ragged_all_to_all", ("ep",)] = bwd["ragged_all_to_all", ("ep",)] = 2 * L
    else:
        fwd["all_to_all", ("ep",)] = bwd["all_to_all", ("ep",)] = 2 * L
    fwd["all_gather", dense] += 1 + L
    bwd["psum_scatter", dense] = 1 + L
    if shape["efsdp"] > 1:
        fwd["all_gather", ("efsdp",)] = bwd["psum_scatter", ("efsdp",)] = L
    if rep:
        bwd["psum", ("dp",)] = 1 + 2 * L
    fwd["psum", data] += 1
    if shape["tp"] > 1:
        fwd["psum", ("tp",)], fwd["pmax", ("tp",)] = 2 * L + 2, 1
        bwd["psum", ("tp",)] = 3 * L + 1
    return dict(fwd), dict(bwd)


def _assert_parity(results, tol=1e-10, params_tol=None):
    """Losses and gradients within ``tol``; parameters within ``params_tol`` (default ``tol``:
    AdamW divides by the root of the second moment, which magnifies a 1e-14 gradient
    difference of a tiny-gradient element)."""
    for r in results:
        assert r["init"] == 0.0
        for got, want, _ in r["losses"]:
            assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)
        assert r["grads"] < tol, r["grads"]
        assert r["params"] < (params_tol or tol), r["params"]


CASES = [("ep2", 2, "outside"), ("ep2", 1, "outside"), ("ep4", 2, "outside"), ("dp2_ep2", 2, "outside"),
         ("efsdp2_ep2", 2, "outside"), ("ep2_tp2", 2, "outside"),
         ("ep2", 2, "inside"), ("dp2_ep2", 2, "inside"), ("efsdp2_ep2", 2, "inside"), ("ep2_tp2", 2, "inside")]


@pytest.mark.parametrize("name, top_k, order", CASES)
def test_moe_transformer_parity_and_counts(name, top_k, order):
    world = 1
    for v in LAYOUTS[name].values():
        world *= v
    # 3 AdamW steps in both orders (outside ran 5): each step's loss and gradients are
    # compared, steps 1-2 read the moments, and tokens are dropped in every step.
    results = run_on_ranks(_train, name, 3, top_k, 1.0, order=order, world_size=world)
    _assert_parity(results)
    assert sum(d for _, _, d in results[0]["losses"]) > 0  # capacity 1.0 really drops tokens
    want = _expected_counts(name)
    for r in results:
        assert all(c == want for c in r["counts"]), (r["counts"][0], want)
    shape = _layout(name)[0]
    tp = shape["tp"]
    assert results[0]["local_w1"] == (N_EXPERTS // (shape["ep"] * shape["efsdp"]), HIDDEN // tp, CFG.dim)


DROPLESS = [("ep2", 2, "outside"), ("ep4", 2, "outside"), ("efsdp2_ep2", 2, "outside"), ("dp2_ep2", 2, "inside"),
            ("ep2_tp2", 2, "inside"), ("ep2", 1, "inside")]


@pytest.mark.parametrize("name, top_k, order", DROPLESS)
def test_dropless_moe_transformer_parity_and_counts(name, top_k, order):
    """capacity_factor=None: the same Transformer, nothing dropped, against the dense
    reference that keeps every assignment (float64, 1e-12), with EP x FSDP, DP and TP."""
    world = 1
    for v in LAYOUTS[name].values():
        world *= v
    results = run_on_ranks(_train, name, 3, top_k, None, order=order, world_size=world)
    _assert_parity(results, tol=1e-12, params_tol=1e-10)
    assert sum(d for _, _, d in results[0]["losses"]) == 0
    want = _expected_counts(name, dropless=True)
    for r in results:
        assert all(c == want for c in r["counts"]), (r["counts"][0], want)


def test_unchecked_mode_gives_identical_results():
    a = run_on_ranks(_train, "ep2_tp2", 2, 2, 1.0, check=True, world_size=4)
    b = run_on_ranks(_train, "ep2_tp2", 2, 2, 1.0, check=False, world_size=4)
    assert [r["losses"] for r in a] == [r["losses"] for r in b]
    assert [r["counts"] for r in a] == [r["counts"] for r in b]  # the gates' pvary is explicit


# --- single process: the layer against the dense reference --------------------------------------
@pytest.mark.parametrize("top_k, cf, n_groups", [(1, 1.0, 1), (2, 1.0, 2), (2, 0.5, 4), (2, 8.0, 1)])
def test_local_moe_matches_dense_reference(top_k, cf, n_groups):
    p = moe_init(16, 32, 4, 0, dtype=torch.float64)
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def loss(fn):
        return lambda p, x: (fn(p, x) ** 2).sum()

    ours = fs.value_and_grad(loss(lambda p, x: moe_ffn(p, x, top_k=top_k, capacity_factor=cf, n_groups=n_groups)),
                             argnums=(0, 1))(p, x)
    drops = []

    def dense(p, x):
        y, d = _dense_moe(p, x, top_k, cf, n_groups)
        drops.append(d)
        return y

    ref = fs.value_and_grad(loss(dense), argnums=(0, 1))(p, x)
    assert abs(ours[0].item() - ref[0].item()) < 1e-12
    assert _max_diff(ours[1], ref[1]) < 1e-12
    assert (drops[0] == 0) == (cf == 8.0)  # a large factor keeps every token, the others drop some


def test_capacity_and_rules():
    assert expert_capacity(64, 8, 2, 1.0) == 16
    assert expert_capacity(64, 8, 2, 1.25) == 20
    assert expert_capacity(4, 8, 1, 0.1) == 1 and expert_capacity(4, 2, 2, 100.0) == 4
    assert ep_rules("ep", fsdp_axis="efsdp", tp_axis="tp") == [
        (r"(.*\.)?experts\.w1", P(("ep", "efsdp"), "tp")), (r"(.*\.)?experts\.w2", P(("ep", "efsdp"), None, "tp"))]
    specs = ep_specs(_params(), "ep", base=fs.parallel.fsdp_specs(_params(), "dp"))
    assert specs["layers"][1]["moe"]["experts"]["w2"] == P("ep")
    assert specs["layers"][1]["moe"]["router"]["weight"] == P("dp", None)


# --- bad inputs -----------------------------------------------------------------------------------------
def _indivisible(where):
    mesh = fs.make_mesh({"ep": 2})
    params = {"moe": moe_init(8, 16, 3, 0, dtype=torch.float64)}  # 3 experts over ep=2
    try:
        if where == "specs":
            ep_specs(params, "ep", mesh=mesh)
            return None
        specs = ep_specs(params, "ep")
        sharded = fs.shard(params, specs, mesh, uneven=True)  # ranks hold 2 and 1 experts
        f = fs.shard_map(lambda p, x: moe_ffn(p["moe"], x, ep_axis="ep"), mesh=mesh, in_specs=(specs, P("ep")),
                         out_specs=P("ep"))
        f(sharded, torch.zeros(4, 8, dtype=torch.float64))
    except ValueError as e:
        return str(e)


def test_experts_not_divisible_by_ep_is_an_error():
    msg = run_on_ranks(_indivisible, "specs", world_size=2)[0]
    assert "'moe.experts.w1' has 3 experts" in msg and "axis 'ep' (2)" in msg
    for msg in run_on_ranks(_indivisible, "body", world_size=2):  # every rank raises: no hang
        assert "'experts.w1' holds" in msg and "axis 'ep' of size 2" in msg and "router has 3 experts" in msg


def test_bad_top_k_and_groups():
    p = moe_init(8, 16, 4, 0)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, 4\]"):
        moe_ffn(p, torch.zeros(4, 8), top_k=5)
    with pytest.raises(ValueError, match="6 tokens do not split into n_groups=4"):
        moe_ffn(p, torch.zeros(6, 8), n_groups=4)
