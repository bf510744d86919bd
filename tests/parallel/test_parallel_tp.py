"""Tensor / sequence parallelism composed with FSDP, HSDP and replicate, on 4 gloo ranks.

Functional ports of seed_tests.md scenarios 19 (FSDP x TP), 20 (HSDP x TP, 3-D
mesh: 2x2x2 on 8 ranks, and 2x1x2 / 2x2x1 on 4), 26 (replicate x TP) and the TP part of 30, for MLPStack and the Transformer
with a loss-parallel cross entropy. Every case trains against a single-process
reference on the global batch (float64): the initial gathered params equal it, and
every step's loss, gradients and updated params match (each rank compares its own blocks,
so no step pays a gather; the final params are gathered once). Communication per step is
asserted per axis against the Megatron counts derived in ``_mlp_counts`` /
``_transformer_counts``.
"""

import logging
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.models import (MLPStackConfig, TransformerConfig, block, embed, head, mlp_stack_apply,
                           mlp_stack_init, transformer_init)
from fshard.parallel import (MLP_STACK_TP_PLAN, TRANSFORMER_TP_PLAN, tp_embed, tp_logits, tp_mlp, tp_specs,
                             tp_transformer_block, vocab_parallel_cross_entropy)
from fshard.testing import local_block_diff, run_on_ranks

TF = dict(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=8)

# name -> (mesh shape, scan_layers axes, FSDP axis of the specs)
LAYOUTS = {
    "fsdp_tp": ({"fsdp": 2, "tp": 2}, dict(axis="fsdp", replicate_axis=None), "fsdp"),
    "dp_tp": ({"dp": 2, "tp": 2}, dict(axis=None, replicate_axis="dp"), None),
    "hsdp_tp": ({"dp": 2, "fsdp": 1, "tp": 2}, dict(axis="fsdp", replicate_axis="dp"), "fsdp"),
    "hsdp_tp1": ({"dp": 2, "fsdp": 2, "tp": 1}, dict(axis="fsdp", replicate_axis="dp"), "fsdp"),
    "tp_fsdp": ({"tp": 2, "fsdp": 2}, dict(axis="fsdp", replicate_axis=None), "fsdp"),
    # Scenario 20 proper: all three axes larger than 1 (8 ranks).
    "hsdp_tp_3d": ({"dp": 2, "fsdp": 2, "tp": 2}, dict(axis="fsdp", replicate_axis="dp"), "fsdp"),
}


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(fs.tree.leaves(a), fs.tree.leaves(b)))


def _train(model, layout, sp, steps, check=True, raf=True, dim=16, remat=False, order="outside", **tf):
    """One rank's run: per step (loss, ref loss), comm counts by axis, worst param/grad diffs."""
    # fs.gather of a strided (FSDP x TP) layout makes torch log a "2 sequential all_gathers" warning.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    shape, axes, fsdp_axis = LAYOUTS[layout]
    mesh = fs.make_mesh(shape)
    data_axes = tuple(a for a in ("dp", "fsdp") if a in shape)
    if model == "mlp":
        cfg = MLPStackConfig(dim)
        params, plan = mlp_stack_init(cfg, 42, dtype=torch.float64), MLP_STACK_TP_PLAN
    else:
        cfg = TransformerConfig(**{**TF, **tf})
        params, plan = transformer_init(cfg, 42, dtype=torch.float64), TRANSFORMER_TP_PLAN
    specs = tp_specs(params, plan, "tp", fsdp_axis=fsdp_axis)
    sharded = fs.shard(params, specs, mesh, uneven=True)
    # Each rank's blocks against the global params (fshard's layout); the final params go
    # through DTensor's own gather below, an independent check of the same layout.
    init_diff = local_block_diff(sharded, params, specs, mesh, uneven=True)
    body, ref_loss_fn, batch, in_axes = _MODELS[model](cfg, axes, data_axes, sp, dict(
        config=fs.parallel.ScanConfig(reshard_after_forward=raf, remat=remat), **axes))
    in_specs = (specs, P(in_axes), P(in_axes))
    if order == "outside":  # value_and_grad(shard_map(f))
        step = fs.value_and_grad(fs.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(), check=check))
    else:  # shard_map(value_and_grad(f)), JAX's usual order
        step = fs.shard_map(fs.value_and_grad(body), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs), check=check)
    opt, ref_opt, ref = fs.optim.adam(1e-2), fs.optim.adam(1e-2), params
    state, ref_state = opt.init(sharded), ref_opt.init(ref)
    # Placements, not specs: with a size-1 axis, P(("tp", "fsdp")) and P(("fsdp", "tp")) are one layout.
    want_placements = [fs.NamedSharding(mesh, s).placements for s in fs.tree.leaves(specs)]

    def laid_out(tree):
        return all(tuple(x.placements) == w and len(x.placements) == len(shape)
                   for x, w in zip(fs.tree.leaves(tree), want_placements))

    losses, counts, p_diff, g_diff, layouts_kept = [], [], 0.0, 0.0, True
    for s in range(steps):
        a, b = batch(s)
        with fs.comm_log() as log:
            loss, grads = step(sharded, a, b)
        counts.append(dict(log.by_axis))
        ref_loss, ref_grads = fs.value_and_grad(lambda p: ref_loss_fn(p, a, b))(ref)
        # Per step, each rank's blocks against the reference's (no gather: it cost as much as
        # the step); the gradients must be laid out like the params for that to be the check.
        layouts_kept &= laid_out(grads)
        g_diff = max(g_diff, local_block_diff(grads, ref_grads, specs, mesh, uneven=True))
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)
        upd, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, upd)
        losses.append((loss.item(), ref_loss.item()))
        p_diff = max(p_diff, local_block_diff(sharded, ref, specs, mesh, uneven=True))
    layouts_kept &= laid_out(sharded)
    p_diff = max(p_diff, _max_diff(fs.gather(sharded), ref))  # and once through DTensor's own gather
    placements = {str(tuple(x.placements)) for x in fs.tree.leaves(sharded)}
    return dict(init=init_diff, losses=losses, counts=counts, params=p_diff, grads=g_diff, layouts=layouts_kept,
                placements=placements)


def _mlp(cfg, axes, data_axes, sp, loop):
    # With SP the rows (the "sequence") are split over tp too, between and around layers.
    row_axes = data_axes + ("tp",) if sp else data_axes

    def body(p, x, y):
        h = fs.parallel.scan_layers(lambda lp, h: tp_mlp(lp, h, "tp", sequence_parallel=sp), p["layers"], x,
                                    **loop)  # (N_local, D)
        return fs.lax.pmean(((h - y) ** 2).mean(), row_axes)

    def ref_loss(p, x, y):
        return ((mlp_stack_apply(p, x, cfg) - y) ** 2).mean()

    def batch(s):
        g = torch.Generator().manual_seed(100 + s)
        return (torch.randn(8, cfg.dim, generator=g, dtype=torch.float64),
                torch.randn(8, cfg.dim, generator=g, dtype=torch.float64))

    return body, ref_loss, batch, row_axes


def _transformer(cfg, axes, data_axes, sp, loop):
    # sp: False, True (SP over the batch rows, the default) or "seq" (SP over the sequence, seq_dim=1).
    kw = dict(seq_dim=1) if sp == "seq" else {}
    sp = bool(sp)

    def body(p, tok, tgt):
        root = fs.parallel.gather_params({k: v for k, v in p.items() if k != "layers"}, **axes)
        x = tp_embed(root, tok, cfg, "tp", sp, **kw)                                 # SP: (b / tp, T, D)
        x = fs.parallel.scan_layers(lambda lp, h: tp_transformer_block(lp, h, cfg, "tp", sp, **kw), p["layers"], x,
                                    **loop)
        logits = tp_logits(root, x, cfg, "tp", sp, **kw)                             # (b, T, V / tp)
        loss = vocab_parallel_cross_entropy(logits, tgt, "tp", vocab_size=cfg.vocab_size)
        return fs.lax.pmean(loss, data_axes)

    def ref_loss(p, tok, tgt):
        x = embed(p, tok, cfg)
        for lp in p["layers"]:
            x = block(lp, x, cfg)
        return F.cross_entropy(head(p, x, cfg).flatten(0, 1), tgt.flatten())

    def batch(s):
        g = torch.Generator().manual_seed(1000 + s)
        tok = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=g)
        return tok, torch.roll(tok, -1, dims=1)

    return body, ref_loss, batch, data_axes


_MODELS = {"mlp": _mlp, "transformer": _transformer}


def _assert_parity(results, tol=1e-10):
    for r in results:
        assert r["init"] == 0.0  # sharding moved no value: strided layouts are right
        assert r["layouts"]  # params still carry their specs, one placement per mesh axis
        for got, want in r["losses"]:
            assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)
        assert r["params"] < tol and r["grads"] < tol, (r["params"], r["grads"])


def _expected_counts(model, layout, sp, raf, n_layers):
    """Hand-derived collectives per step, by (kind, axes).

    Megatron, per MLP (L layers; the first layer's input needs no gradient, so its
    tp_enter has no backward): without SP, a psum forward per layer and one backward per
    layer but the first; with SP, all_gather + psum_scatter forward per layer, their
    transposes backward, and one psum of out_proj's bias grad per layer.

    Transformer (L blocks): without SP, psum forward after the embedding, attention,
    MLP and in the loss (2L + 2), and backward at each tp_enter (2L + 1: blocks and
    head); with SP, the embedding's psum_scatter, 2 all_gather/psum_scatter pairs per
    block and the head's all_gather forward, their transposes backward, and a psum for
    the loss, each block's norms + w2 bias (one flat buffer), the position embedding
    and the final norm. The loss parallel cross entropy adds one pmax.

    Data parallel: 2 all_gathers per layer with reshard after forward (1 without) and
    1 for the root group, a psum_scatter per group; HSDP adds an all-reduce per group,
    DDP one bucketed all-reduce per loop (these models are far below 25 MiB); the loss
    pmean is one psum over the data axes (and tp with SP on the MLP, whose rows are split).
    """
    shape = LAYOUTS[layout][0]
    L, c = n_layers, Counter()
    tp = ("tp",) if shape["tp"] > 1 else None
    if model == "mlp" and tp:
        if sp:
            c["all_gather", tp], c["psum_scatter", tp], c["psum", tp] = 2 * L, 2 * L - 1, L
        else:
            c["psum", tp] = 2 * L - 1
    elif tp:
        if sp:
            c["all_gather", tp], c["psum_scatter", tp], c["psum", tp] = 4 * L + 2, 4 * L + 2, L + 3
        else:
            c["psum", tp] = 4 * L + 3
        c["pmax", tp] = 1
    root = 1 if model == "transformer" else 0  # gather_params group (embeddings, norm, output)
    n_fsdp, n_dp = shape.get("fsdp", 1), shape.get("dp", 1)
    if n_fsdp > 1:
        c["all_gather", ("fsdp",)] = (2 if raf else 1) * L + root
        c["psum_scatter", ("fsdp",)] = L + root
        if n_dp > 1:
            c["psum", ("dp",)] = L + root
    elif n_dp > 1:
        c["psum", ("dp",)] = 1 + root
    loss_axes = tuple(a for a in shape if a in ("dp", "fsdp") or (a == "tp" and sp and model == "mlp"))
    if any(shape[a] > 1 for a in loss_axes):
        c["psum", loss_axes] += 1
    return {k: v for k, v in c.items() if v}


MLP_STEPS = 4
_TRANSFORMER_RUNS: dict = {}


def _transformer_run(layout, sp, check):
    """Every rank's ``_train`` results for 3 steps of the Transformer, run once per session
    (the checked-mode comparison reads a parity test's run)."""
    key = (layout, sp, check)
    if key not in _TRANSFORMER_RUNS:
        _TRANSFORMER_RUNS[key] = run_on_ranks(_train, "transformer", layout, sp, 3, check=check, world_size=4)
    return _TRANSFORMER_RUNS[key]

CASES = [("fsdp_tp", False), ("fsdp_tp", True), ("dp_tp", False), ("dp_tp", True), ("hsdp_tp", False),
         ("hsdp_tp", True), ("hsdp_tp1", False)]
# SP over the sequence (seq_dim=1), the layout kept for a batch smaller than tp (Transformer only).
SEQ_CASES = [("fsdp_tp", "seq"), ("dp_tp", "seq")]


@pytest.mark.parametrize("layout, sp", CASES)
def test_mlp_stack_parity_and_megatron_counts(layout, sp):
    # 4 Adam steps (the seed scenarios run 10): every step's loss, gradients and params are
    # compared, and from step 1 on the update reads Adam's moments, so a fault in a layout,
    # a collective or the optimizer state shows within these steps.
    results = run_on_ranks(_train, "mlp", layout, sp, MLP_STEPS, world_size=4)
    _assert_parity(results)
    want = _expected_counts("mlp", layout, sp, True, 3)
    for r in results:
        assert all(c == want for c in r["counts"]), (r["counts"][0], want)


@pytest.mark.parametrize("layout, sp", CASES + SEQ_CASES)
def test_transformer_loss_parallel_parity_and_megatron_counts(layout, sp):
    # 3 Adam steps: a layout or collective fault shows in step 0's loss and gradients, and
    # steps 1-2 update with Adam's moments.
    results = _transformer_run(layout, sp, check=True)
    _assert_parity(results)
    want = _expected_counts("transformer", layout, sp, True, TF["n_layers"])
    for r in results:
        assert all(c == want for c in r["counts"]), (r["counts"][0], want)


@pytest.mark.parametrize("model, layout, sp, check", [
    ("mlp", "fsdp_tp", True, True), ("mlp", "dp_tp", False, True), ("transformer", "fsdp_tp", True, True),
    ("transformer", "hsdp_tp", False, True), ("transformer", "fsdp_tp", True, False),
    ("transformer", "fsdp_tp", "seq", True)])
def test_gradients_inside_shard_map_equal_reference_with_the_same_counts(model, layout, sp, check):
    """shard_map(value_and_grad(f)): same losses, params and Megatron counts as the other order."""
    results = run_on_ranks(_train, model, layout, sp, 3, check=check, order="inside", world_size=4)
    _assert_parity(results)
    n_layers = 3 if model == "mlp" else TF["n_layers"]
    want = _expected_counts(model, layout, sp, True, n_layers)
    for r in results:
        assert all(c == want for c in r["counts"]), (r["counts"][0], want)


@pytest.mark.parametrize("raf, remat", [(False, False), (True, True)])
def test_fsdp_tp_reshard_and_remat(raf, remat):
    """Scenario 19's RAF x AC grid: the TP block runs unchanged inside scan_layers."""
    results = run_on_ranks(_train, "mlp", "fsdp_tp", True, 3, raf=raf, remat=remat, world_size=4)
    _assert_parity(results)
    if not remat:  # recomputation replays the forward collectives
        want = _expected_counts("mlp", "fsdp_tp", True, raf, 3)
        assert all(c == want for r in results for c in r["counts"])


@pytest.mark.parametrize("dim", [3, 5])
@pytest.mark.parametrize("layout", ["dp_tp", "tp_fsdp"])
def test_mlp_stack_uneven_dims(dim, layout):
    """Hidden sizes 3d, 4d split over tp=2 unevenly (torch.chunk layout): replicate x TP, and
    FSDP x TP on a tp-major mesh (tp, fsdp), where the uneven layout is a plain DTensor Shard.
    Rows are cut over tp, then each tp block over fsdp: dim 3's 9 rows are 5 + 4, then 3 + 2
    and 2 + 2 (tp block 0 uneven over fsdp); dim 5's 15 are 8 + 7, then 4 + 4 and 4 + 3 (tp
    block 1 uneven); D over fsdp is 2 + 1 and 3 + 2. dim 17 (51 rows: 26 + 25, then 13 + 13
    and 13 + 12; D: 9 + 8) cut the same way as dim 5 and was dropped."""
    _assert_parity(run_on_ranks(_train, "mlp", layout, False, MLP_STEPS, dim=dim, world_size=4))


@pytest.mark.parametrize("layout", ["dp_tp", "tp_fsdp"])
def test_transformer_tied_uneven_vocab(layout):
    """Tied embedding/output, vocab 33 over tp=2 (rows 17 + 16): embedding lookup and the
    loss-parallel cross entropy find each rank's vocabulary range from the chunk layout."""
    results = run_on_ranks(_train, "transformer", layout, True, 3, vocab_size=33, tie_weights=True, world_size=4)
    _assert_parity(results)


def test_scenario20_hsdp_x_tp_on_a_2x2x2_mesh():
    """dp_replicate=2 x dp_shard=2 x tp=2 on 8 ranks: strided (fsdp x tp) shards are right
    at init, 3 Adam steps match one process, and every collective runs over the axis the
    Megatron/HSDP count says, each of the three axes carrying traffic."""
    results = run_on_ranks(_train, "mlp", "hsdp_tp_3d", False, 3, world_size=8)  # 8 ranks: 3 steps (5 before)
    _assert_parity(results)
    want = _expected_counts("mlp", "hsdp_tp_3d", False, True, 3)
    assert {axes for _, axes in want} == {("tp",), ("fsdp",), ("dp",), ("dp", "fsdp")}, want
    for r in results:
        assert all(c == want for c in r["counts"]), (r["counts"][0], want)
        # in_proj's weight: rows split over fsdp (outer) and tp (inner), replicated over dp
        assert any("Replicate()" in p and "_StridedShard(dim=0" in p and "Shard(dim=0)" in p
                   for p in r["placements"]), r["placements"]


def _uneven_on_fsdp_major_mesh():
    mesh = fs.make_mesh({"fsdp": 2, "tp": 2})
    params = mlp_stack_init(MLPStackConfig(5), 0, dtype=torch.float64)
    specs = tp_specs(params, MLP_STACK_TP_PLAN, "tp", fsdp_axis="fsdp")
    try:
        fs.shard(params, specs, mesh, uneven=True)
    except ValueError as e:
        return str(e)
    return None


def test_mlp_stack_uneven_on_fsdp_major_mesh_fails_clearly():
    """On a (fsdp, tp) mesh the FSDP-minor split is a _StridedShard, which DTensor cannot cut
    unevenly: fs.shard names every such leaf, its dim, sizes and axes."""
    msg = run_on_ranks(_uneven_on_fsdp_major_mesh, world_size=4)[0]
    assert msg is not None
    assert "layers.0.in_proj.weight" in msg and "dim 0 of size 15" in msg
    assert "split unevenly over ('tp', 'fsdp')" in msg and "mesh order ('fsdp', 'tp')" in msg


def test_unchecked_mode_gives_identical_results():
    # The checked run is test_transformer_loss_parallel_parity_and_megatron_counts[fsdp_tp-True]'s.
    a = _transformer_run("fsdp_tp", True, check=True)
    b = _transformer_run("fsdp_tp", True, check=False)
    assert [r["losses"] for r in a] == [r["losses"] for r in b]
    assert [r["counts"] for r in a] == [r["counts"] for r in b]  # checked mode adds no collective


def _mlp_bodies(with_psum):
    """Two TP layers written with the fewest calls: in checked mode no pvary is needed."""
    def body(p, x):
        for lp in p["layers"]:
            h = F.relu(F.linear(x, lp["in_proj"]["weight"], lp["in_proj"]["bias"]))  # (b, H / tp)
            y = F.linear(h, lp["out_proj"]["weight"])  # (b, D), partial over tp
            x = (fs.lax.psum(y, "tp") if with_psum else y) + lp["out_proj"]["bias"]
        return {"y": x}
    return body


def _checked_mode(with_psum):
    mesh = fs.make_mesh({"dp": 2, "tp": 2})
    cfg = MLPStackConfig(16, (3, 4))
    params = mlp_stack_init(cfg, 0, dtype=torch.float64)
    specs = tp_specs(params, MLP_STACK_TP_PLAN)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    f = fs.shard_map(_mlp_bodies(with_psum), mesh=mesh, in_specs=(specs, P("dp")), out_specs={"y": P("dp")})
    loss = lambda p: (f(p, x)["y"] ** 2).sum()  # noqa: E731
    try:
        _, grads = fs.value_and_grad(loss)(fs.shard(params, specs, mesh))
    except ValueError as e:
        return str(e)
    _, ref = fs.value_and_grad(lambda p: (mlp_stack_apply(p, x, cfg) ** 2).sum())(params)
    return _max_diff(fs.gather(grads), ref)


def test_checked_mode_accepts_tp_with_specs_only():
    """No pvary written: checked mode inserts the "f" (psum of activation grads) itself."""
    for diff in run_on_ranks(_checked_mode, True, world_size=4):
        assert diff < 1e-12


def test_checked_mode_rejects_a_forgotten_psum():
    for msg in run_on_ranks(_checked_mode, False, world_size=4):
        assert "outputs.y has spec P('dp')" in msg and "('tp',)" in msg
        assert "max difference" in msg and "fs.lax.psum" in msg


def _indivisible_heads():
    mesh = fs.make_mesh({"tp": 4})
    cfg = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8)
    params = transformer_init(cfg, 0, dtype=torch.float64)
    specs = tp_specs(params, TRANSFORMER_TP_PLAN)
    f = fs.shard_map(lambda p, x: tp_transformer_block(p["layers"][0], x, cfg), mesh=mesh,
                     in_specs=(specs, P()), out_specs=P())
    try:
        f(fs.shard(params, specs, mesh), torch.zeros(1, 8, 16, dtype=torch.float64))
    except ValueError as e:
        return str(e)


def test_heads_not_divisible_by_tp_is_an_error():
    msg = run_on_ranks(_indivisible_heads, world_size=4)[0]
    assert "n_heads=2 must be divisible by the size of axis 'tp'" in msg


def _sp_batch_smaller_than_tp():
    mesh = fs.make_mesh({"tp": 2})
    cfg = TransformerConfig(**TF)
    params = transformer_init(cfg, 0, dtype=torch.float64)
    specs = tp_specs(params, TRANSFORMER_TP_PLAN)
    f = fs.shard_map(lambda p, tok: tp_embed(p, tok, cfg, "tp", True), mesh=mesh, in_specs=(specs, P()),
                     out_specs=P("tp"))
    try:
        f(fs.shard(params, specs, mesh), torch.zeros(1, 8, dtype=torch.int64))
    except ValueError as e:
        return str(e)


def test_sp_over_a_batch_smaller_than_tp_is_an_error_naming_seq_dim():
    msg = run_on_ranks(_sp_batch_smaller_than_tp, world_size=2)[0]
    assert "splits the 1 batch rows of this rank's tokens (1, 8) over axis 'tp' of size 2" in msg, msg
    assert "or pass seq_dim=1 to split the sequence (dim 1 has 8)" in msg, msg


def test_tp_rules_are_data():
    rules = fs.parallel.tp_rules({r"a\.weight": "colwise", r"b\.weight": "rowwise"}, "tp", fsdp_axis="fsdp")
    assert rules == [(r"a\.weight", P(("tp", "fsdp"))), (r"b\.weight", P("fsdp", "tp"))]
    with pytest.raises(ValueError, match=r"style 'diagonal'.*'colwise', 'rowwise', 'vocab'"):
        fs.parallel.tp_rules({r"a": "diagonal"})


def _dropout_body(sp):
    # Megatron-style dropout: the residual stream stays identical on both tp ranks (shared
    # RNG where it is replicated), heads and sequence slices draw their own masks.
    mesh = fs.make_mesh({"tp": 2, "fsdp": 2})
    cfg = TransformerConfig(**{**TF, "dropout": 0.3})
    params = transformer_init(cfg, 42, dtype=torch.float64)
    sharded = fs.shard(params, tp_specs(params, TRANSFORMER_TP_PLAN, "tp"), mesh)
    specs = fs.tree.tree_map(fs.spec_of, sharded)
    tok = torch.randint(0, cfg.vocab_size, (4, cfg.max_seq_len), generator=torch.Generator().manual_seed(3))

    def body(p, tok, training):
        x = tp_embed(p, tok, cfg, "tp", sp, training=training)                        # (b[/tp], T, D)
        for lp in p["layers"]:
            x = tp_transformer_block(lp, x, cfg, "tp", sp, training=training)
        if sp:
            x = fs.lax.all_gather(x, "tp", axis=0, tiled=True)                         # (b, T, D)
        copies = fs.lax.all_gather(x.detach(), "tp")                                    # (tp, b, T, D)
        with fs.parallel.tp_rng("tp", x.device):
            draws = fs.lax.all_gather(torch.rand(3, dtype=torch.float64), "tp")       # (tp, 3)
        after = fs.lax.all_gather(torch.rand(3, dtype=torch.float64), "tp")            # (tp, 3)
        return (x, (copies[0] - copies[1]).abs().max(), (draws[0] - draws[1]).abs().min(),
                (after[0] - after[1]).abs().max())

    out = {}
    for training in (False, True):
        torch.manual_seed(7)  # the same on every rank, as tp_dropout requires
        f = fs.shard_map(lambda p, t: body(p, t, training), mesh=mesh, in_specs=(specs, P("fsdp")),
                         out_specs=(P("fsdp"), P(), P(), P()), check=False)
        x, drift, rank_draws, shared_after = f(sharded, tok)
        out[training] = (fs.gather(x), drift.item(), rank_draws.item(), shared_after.item())
    ref = embed(params, tok, cfg)
    for lp in params["layers"]:
        ref = block(lp, ref, cfg)
    return out, ref


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_dropout_keeps_tp_replicas_identical_and_per_rank_masks_independent(sp):
    for out, ref in run_on_ranks(_dropout_body, sp, world_size=4):
        x_eval, drift_eval, _, _ = out[False]
        x_train, drift, rank_draws, shared_after = out[True]
        assert (x_eval - ref).abs().max() < 1e-10  # training=False: no dropout anywhere
        assert (x_train - ref).abs().max() > 1e-2  # training=True: dropout happened
        assert drift_eval == 0.0 and drift == 0.0  # replicas did not drift apart
        assert rank_draws > 0.0  # inside tp_rng each tp rank draws its own numbers
        assert shared_after == 0.0  # and the shared global RNG is in step again afterwards


def _layout_copies(mode):
    """aten copies (clone, copy_, _to_copy) in one forward + backward of tp_transformer_block
    on 2 real ranks: plain TP ("tp"), SP over the batch rows ("rows") or the sequence ("seq")."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}

    class CountCopies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in copies
            return func(*args, **(kwargs or {}))

    cfg = TransformerConfig(**{**TF, "n_layers": 1})
    mesh = fs.make_mesh({"tp": 2})
    layer = transformer_init(cfg, 0, dtype=torch.float64)["layers"][0]
    specs = tp_specs({"layers": [layer]}, TRANSFORMER_TP_PLAN, "tp")["layers"][0]
    sp, kw = mode != "tp", dict(seq_dim=1) if mode == "seq" else {}

    def loss(p, x):
        y = tp_transformer_block(p, x, cfg, "tp", sp, **kw)
        return fs.lax.pmean(y.pow(2).mean(), "tp") if sp else y.pow(2).mean()

    x_spec = {"tp": P(), "rows": P("tp"), "seq": P(None, "tp")}[mode]
    step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=(specs, x_spec), out_specs=P(), check=False))
    sharded, x = fs.shard(layer, specs, mesh), torch.randn(4, cfg.max_seq_len, cfg.dim, dtype=torch.float64)
    step(sharded, x)  # warm: first-call work is not the layout's
    with CountCopies() as count:
        step(sharded, x)
    return count.n


def test_sp_over_the_batch_rows_adds_no_layout_copy_around_its_collectives():
    # A collective's buffer is its dim 0: gathering the rows lands (B, T, D) in place and
    # scattering them reads contiguous chunks, so the block copies exactly as plain TP does.
    # Over the sequence every gather lands transposed and every scatter chunks a copy.
    for plain, rows, seq in zip(*(run_on_ranks(_layout_copies, m, world_size=2) for m in ("tp", "rows", "seq"))):
        assert rows == plain, (plain, rows)
        assert seq > rows, (seq, rows)  # the count sees the copies it is meant to rule out
