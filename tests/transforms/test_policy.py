"""Mixed precision: Policy validation and casts, inside shard_map bodies, and FSDP with
bf16 compute and fp32 gradient reduction against a bf16-cast single-process reference.

The FSDP bodies are module-level functions (``run_on_ranks`` sends them by reference)
and follow tests/parallel/test_parallel_fsdp.py: a Transformer with uneven shards
(vocab 33 over 2 ranks), the root group through ``gather_params``, the blocks through
``scan_layers``, each rank on its slice of the global batch.
"""


import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.models import TransformerConfig, block, embed, head, transformer_init
from fshard.testing import run_on_ranks

BF16, F32 = torch.bfloat16, torch.float32
BF16_RTOL = 1.6e-2  # two bf16 ulps (eps = 2**-7 = 7.8e-3)
CFG = dict(vocab_size=33, dim=16, n_layers=3, n_heads=4, max_seq_len=8)
MIXED = fs.Policy(param_dtype=BF16, reduce_dtype=F32, output_dtype=F32)


# --- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize("bad", [torch.int32, torch.bool, torch.complex64, "bfloat16", float])
def test_non_floating_dtype_raises_type_error_naming_the_field(field, bad):
    with pytest.raises(TypeError, match=rf"Policy\.{field}="):
        fs.Policy(**{field: bad})


def test_defaults_and_reduce_dtype_fallback():
    assert fs.Policy() == fs.Policy(param_dtype=None, reduce_dtype=None, output_dtype=None)
    assert fs.Policy().grad_reduce_dtype is None
    assert fs.Policy(param_dtype=BF16).grad_reduce_dtype is BF16  # reduce in the compute dtype
    assert fs.Policy(param_dtype=BF16, reduce_dtype=F32).grad_reduce_dtype is F32
    with pytest.raises(TypeError):
        fs.Policy(BF16)  # keyword-only: a positional dtype would be ambiguous


# --- casts ----------------------------------------------------------------------------------

def test_cast_params_casts_floating_leaves_only_and_is_differentiable():
    tree = {"w": torch.randn(3, 2, dtype=torch.float64, requires_grad=True),
            "ids": torch.arange(4), "scale": 2.0, "none": None}
    cast = MIXED.cast_params(tree)
    assert cast["w"].dtype == BF16 and cast["ids"].dtype == torch.int64
    assert cast["scale"] == 2.0 and cast["none"] is None and cast["ids"] is tree["ids"]
    cast["w"].float().sum().backward()
    assert tree["w"].grad.dtype == torch.float64  # the gradient lands in the master's dtype
    assert torch.equal(tree["w"].grad, torch.ones(3, 2, dtype=torch.float64))


def test_none_dtypes_return_the_tree_itself():
    tree = {"w": torch.ones(2)}
    assert fs.Policy().cast_params(tree) is tree
    assert MIXED.cast_params(tree)["w"].dtype == BF16
    assert fs.Policy(param_dtype=BF16).cast_output(tree) is tree


def test_cast_output():
    out = (torch.ones(2, dtype=BF16), torch.tensor([1, 2]))
    a, b = MIXED.cast_output(out)
    assert a.dtype == F32 and b.dtype == torch.int64


# --- inside a shard_map body on one process ---------------------------------------------------

def _mlp_loss(p, x, y, policy):
    p = policy.cast_params(p)
    h = torch.relu(x.to(policy.param_dtype) @ p["w1"].T)  # (B, H) in bf16
    out = policy.cast_output(h @ p["w2"].T)  # (B, D) back in fp32
    return ((out - y) ** 2).mean()


def _one_process_body():
    mesh = fs.make_mesh({"x": 1})
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 4, generator=g), "w2": torch.randn(4, 8, generator=g)}
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    sharded = fs.shard(params, P(), mesh)
    step = fs.shard_map(lambda p, a, b: _mlp_loss(p, a, b, MIXED), mesh=mesh,
                        in_specs=(P(), P("x"), P("x")), out_specs=P())
    loss, grads = fs.value_and_grad(step)(sharded, x, y)
    ref_loss, ref_grads = fs.value_and_grad(lambda p: _mlp_loss(p, x, y, MIXED))(params)
    return (loss.dtype, {k: v.dtype for k, v in grads.items()}, (loss.full_tensor() - ref_loss).abs().item(),
            max((fs.gather(grads)[k] - ref_grads[k]).abs().max().item() for k in params))


def test_policy_in_shard_map_body_one_process():
    loss_dtype, grad_dtypes, dloss, dgrad = run_on_ranks(_one_process_body, world_size=1)[0]
    assert loss_dtype == F32 and grad_dtypes == {"w1": F32, "w2": F32}
    assert dloss == 0.0 and dgrad == 0.0  # the same bf16 ops as without shard_map


# --- FSDP with scan_layers(policy=...) ----------------------------------------------------------

def _fsdp_loss(p, tokens, targets, cfg, policy):
    root = fs.parallel.gather_params({k: v for k, v in p.items() if k != "layers"}, axis="fsdp",
                                     policy=policy)
    x = embed(root, tokens, cfg)                                              # (b, T, D), param dtype
    x = fs.parallel.scan_layers(lambda lp, h: block(lp, h, cfg), p["layers"], x, axis="fsdp",
                                config=fs.parallel.ScanConfig(policy=policy))
    logits = policy.cast_output(head(root, x, cfg))                           # (b, T, V), fp32
    return fs.lax.pmean(F.cross_entropy(logits.flatten(0, 1), targets.flatten()), "fsdp")


def _ref_loss(p, tokens, targets, cfg, policy):
    """The same computation on one process: cast the fp32 masters, then run the model."""
    p = policy.cast_params(p)
    x = embed(p, tokens, cfg)
    for lp in p["layers"]:
        x = block(lp, x, cfg)
    logits = policy.cast_output(head(p, x, cfg))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _split_ref(p, tokens, targets, cfg, policy, n):
    """What FSDP over n ranks computes, on one process: rank i's batch slice in the
    param dtype, then the mean of the n losses and gradients in fp32 (the reduce dtype).

    Summing rank gradients is the only step whose precision the policy changes, so
    FSDP must equal this to fp32 rounding, while the whole-batch bf16 reference differs
    from it by bf16 noise.
    """
    vg = fs.value_and_grad(lambda q, a, b: _ref_loss(q, a, b, cfg, policy))
    parts = [vg(p, a, b) for a, b in zip(tokens.chunk(n), targets.chunk(n))]
    loss = sum(l.float() for l, _ in parts) / n
    grads = fs.tree.tree_map(lambda *gs: sum(g.float() for g in gs) / n, *[g for _, g in parts])
    return loss, grads


def _batch(step, n_rows, cfg):
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, cfg.vocab_size, (n_rows, cfg.max_seq_len), generator=g)
    return tok, torch.roll(tok, -1, dims=1)


def _rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _max_rel_err(got, want):
    return max(_rel_err(a, b) for a, b in zip(fs.tree.leaves(got), fs.tree.leaves(want)))


def _fsdp_body(n, policy, steps, order="outside"):
    mesh = fs.make_mesh({"fsdp": n})
    cfg = TransformerConfig(**CFG)
    params = transformer_init(cfg, 42, dtype=F32)  # fp32 masters
    specs = fs.parallel.fsdp_specs(params, "fsdp")
    sharded = fs.shard(params, specs, mesh, uneven=True)
    def loss_fn(p, a, b):
        return _fsdp_loss(p, a, b, cfg, policy)

    in_specs = (specs, P("fsdp"), P("fsdp"))
    step = (fs.value_and_grad(fs.shard_map(loss_fn, mesh=mesh, in_specs=in_specs, out_specs=P())) if order == "outside"
            else fs.shard_map(fs.value_and_grad(loss_fn), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs)))
    opt, ref_opt = fs.optim.adam(1e-2), fs.optim.adam(1e-2)
    state, ref, ref_state = opt.init(sharded), params, ref_opt.init(params)
    out = {"losses": [], "grad_err": 0.0, "grad_err_bf16_rounded": 0.0}
    for s in range(steps):
        tok, tgt = _batch(s, 2 * n, cfg)
        with fs.comm_log() as log:
            loss, grads = step(sharded, tok, tgt)
        if s == 0:
            out["comm"] = {k: (log.counts[k], log.bytes[k]) for k in ("all_gather", "psum_scatter")}
            out["grad_layout"] = all(
                g.dtype == F32 and g.placements == p.placements and g.shape == p.shape
                for g, p in zip(fs.tree.leaves(grads), fs.tree.leaves(sharded)))
            out["loss_dtype"] = loss.dtype
        split_loss, split_grads = _split_ref(ref, tok, tgt, cfg, policy, n)
        whole_loss = _ref_loss(ref, tok, tgt, cfg, policy)
        out["losses"].append((loss.full_tensor().item(), split_loss.item(), whole_loss.item()))
        full_grads = fs.gather(grads)
        out["grad_err"] = max(out["grad_err"], _max_rel_err(full_grads, split_grads))
        rounded = fs.tree.tree_map(lambda g: g.to(BF16).float(), split_grads)
        out["grad_err_bf16_rounded"] = max(out["grad_err_bf16_rounded"], _max_rel_err(full_grads, rounded))
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)
        upd, ref_state = ref_opt.update(split_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, upd)
    full = fs.gather(sharded)
    out["master_dtypes"] = {x.dtype for x in fs.tree.leaves(full)}
    out["param_err"] = _max_rel_err(full, ref)
    return out


@pytest.mark.parametrize("n, order", [(1, "outside"), (2, "outside"), (2, "inside")])
def test_fsdp_bf16_params_fp32_reduce_matches_bf16_reference(n, order):
    results = run_on_ranks(_fsdp_body, n, MIXED, 3, order, world_size=n)
    for r in results:
        for got, split, whole in r["losses"]:
            assert got == pytest.approx(whole, rel=BF16_RTOL), r["losses"]
            assert got == pytest.approx(split, rel=1e-6), r["losses"]
        assert r["loss_dtype"] == F32  # output_dtype
        assert r["grad_layout"], "grads must be fp32 shards laid out like the fp32 masters"
        assert r["master_dtypes"] == {F32}
        # bf16 compute, fp32 sum over ranks: FSDP is the split reference up to fp32 rounding.
        assert r["grad_err"] < 1e-6, r["grad_err"]
        assert r["param_err"] < 1e-6, r["param_err"]
    if n == 1:
        assert all(r["comm"] == {"all_gather": (0, 0), "psum_scatter": (0, 0)} for r in results)


def test_fsdp_gathers_in_param_dtype_and_reduces_in_reduce_dtype():
    """Same collectives as without a policy; all-gathers move half the bytes; the
    reduction moves fp32, or bf16 when reduce_dtype is left to default to param_dtype."""
    mixed = run_on_ranks(_fsdp_body, 2, MIXED, 1, world_size=2)
    plain = run_on_ranks(_fsdp_body, 2, fs.Policy(), 1, world_size=2)
    bf16_reduce = run_on_ranks(_fsdp_body, 2, fs.Policy(param_dtype=BF16, output_dtype=F32), 1, world_size=2)
    for m, p, b in zip(mixed, plain, bf16_reduce):
        (ag_n, ag_bytes), (rs_n, rs_bytes) = m["comm"]["all_gather"], m["comm"]["psum_scatter"]
        (pag_n, pag_bytes), (prs_n, prs_bytes) = p["comm"]["all_gather"], p["comm"]["psum_scatter"]
        assert (ag_n, rs_n) == (pag_n, prs_n) and ag_n == 1 + 2 * CFG["n_layers"]
        assert ag_bytes * 2 == pag_bytes  # gathered in bf16
        assert rs_bytes == prs_bytes  # reduced in fp32
        assert b["comm"]["psum_scatter"][1] * 2 == prs_bytes
        # A bf16 reduction rounds the fp32 sum to bf16 and still lands in the fp32 masters.
        assert b["grad_layout"] and b["grad_err"] > 1e-4
        assert b["grad_err_bf16_rounded"] == 0.0 and m["grad_err_bf16_rounded"] > 1e-4
