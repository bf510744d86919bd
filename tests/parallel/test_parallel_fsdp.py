"""FSDP / replicate / HSDP through scan_layers, against a single-process reference, on gloo.

Functional ports of seed_tests.md scenarios: 1 (uneven MLP shards), 3 (Transformer,
reshard after forward on/off, exact comm counts), 11 (remat), 12 (tied weights),
16/17 (HSDP), 22 (fsdp=1 issues nothing), 24 (replicate). Each rank gets different
data (global batch sliced over the data axes); the reference trains on the global batch.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.models import TransformerConfig, block, embed, head, transformer_init
from fshard.testing import run_on_ranks

CFG = dict(vocab_size=33, dim=16, n_layers=3, n_heads=4, max_seq_len=8)


def _setup(shape, mode, tie):
    mesh = fs.make_mesh(shape)
    cfg = TransformerConfig(**CFG, tie_weights=tie)
    params = transformer_init(cfg, 42, dtype=torch.float64)
    if mode == "fsdp":
        axes = dict(axis="fsdp", replicate_axis=None)
        specs = fs.parallel.fsdp_specs(params, "fsdp")
    elif mode == "hsdp":
        axes = dict(axis="fsdp", replicate_axis="dp")
        specs = fs.parallel.hsdp_specs(params, "fsdp", "dp")
    else:  # replicate
        axes = dict(axis=None, replicate_axis="dp")
        specs = fs.parallel.replicate_specs(params)
    data_axes = tuple(a for a in ("dp", "fsdp") if a in shape)
    return mesh, cfg, params, specs, axes, data_axes


def _loss(p, tokens, targets, cfg, axes, data_axes, raf, remat):
    root = {k: v for k, v in p.items() if k != "layers"}
    root = fs.parallel.gather_params(root, **axes)
    x = embed(root, tokens, cfg)                                              # (b, T, D)
    x = fs.parallel.scan_layers(lambda lp, h: block(lp, h, cfg), p["layers"], x,
                                reshard_after_forward=raf, remat=remat, **axes)
    logits = head(root, x, cfg)                                               # (b, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return fs.lax.pmean(loss, data_axes)


def _batch(step, n_rows, cfg):
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, cfg.vocab_size, (n_rows, cfg.max_seq_len), generator=g)
    return tok, torch.roll(tok, -1, dims=1)


def _train(shape, mode, raf, remat, tie, steps, check):
    mesh, cfg, params, specs, axes, data_axes = _setup(shape, mode, tie)
    n_data = math.prod(shape[a] for a in data_axes)
    sharded = fs.shard(params, specs, mesh, uneven=True)
    opt = fs.optim.adam(1e-2)
    state = opt.init(sharded)
    step = fs.shard_map(lambda p, a, b: _loss(p, a, b, cfg, axes, data_axes, raf, remat), mesh=mesh,
                        in_specs=(specs, P(data_axes), P(data_axes)), out_specs=P(), check=check)
    ref, ref_opt = params, fs.optim.adam(1e-2)
    ref_state = ref_opt.init(ref)
    losses, counts, worst = [], [], 0.0
    for s in range(steps):
        tok, tgt = _batch(s, 2 * n_data, cfg)
        with fs.comm_log() as log:
            loss, grads = fs.value_and_grad(step)(sharded, tok, tgt)
        counts.append(dict(log.counts))
        updates, state = opt.update(grads, state, sharded)
        sharded = fs.optim.apply_updates(sharded, updates)
        ref_loss, ref_grads = fs.value_and_grad(
            lambda p: F.cross_entropy(head(p, _ref_body(p, tok, cfg), cfg).flatten(0, 1), tgt.flatten()))(ref)
        upd, ref_state = ref_opt.update(ref_grads, ref_state, ref)
        ref = fs.optim.apply_updates(ref, upd)
        losses.append((loss.item(), ref_loss.item()))
        full = fs.gather(sharded)
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(fs.tree.leaves(full), fs.tree.leaves(ref))))
    return losses, counts, worst


def _ref_body(p, tok, cfg):
    x = embed(p, tok, cfg)
    for lp in p["layers"]:
        x = block(lp, x, cfg)
    return x


def _assert_parity(results, tol=1e-10):
    for losses, _, worst in results:
        for got, want in losses:
            assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)
        assert worst < tol, worst


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("raf", [True, False])
def test_fsdp_transformer_loss_params_and_comm_counts(n, raf):
    results = run_on_ranks(_train, {"fsdp": n}, "fsdp", raf, False, False, 3, True, world_size=n)
    _assert_parity(results)
    g = CFG["n_layers"] + 1  # one group per block plus the root group
    for _, counts, _ in results:
        for c in counts:
            # root gathered once (kept for backward); blocks twice with reshard, once without
            assert c["all_gather"] == (1 + 2 * CFG["n_layers"] if raf else g)
            assert c["psum_scatter"] == g
            assert c["psum"] == 1  # the loss pmean only: no gradient all-reduce


@pytest.mark.parametrize("remat, tie", [(True, False), (False, True), (True, True)])
def test_fsdp_remat_and_tied_weights(remat, tie):
    _assert_parity(run_on_ranks(_train, {"fsdp": 2}, "fsdp", True, remat, tie, 2, True, world_size=2))


def test_replicate_is_ddp():
    results = run_on_ranks(_train, {"dp": 2}, "replicate", False, False, False, 3, True, world_size=2)
    _assert_parity(results)
    for _, counts, _ in results:
        for c in counts:
            assert c.get("all_gather", 0) == 0 and c.get("psum_scatter", 0) == 0
            assert c["psum"] == 1 + 1 + 1  # loss + root group + one bucket for all blocks


def test_hsdp_2x2():
    results = run_on_ranks(_train, {"dp": 2, "fsdp": 2}, "hsdp", True, False, False, 2, True, world_size=4)
    _assert_parity(results)
    for _, counts, _ in results:
        for c in counts:
            assert c["psum_scatter"] == CFG["n_layers"] + 1
            assert c["psum"] == 1 + CFG["n_layers"] + 1  # loss + all-reduce over dp per group


def test_unchecked_mode_gives_identical_results():
    a = run_on_ranks(_train, {"fsdp": 2}, "fsdp", True, False, False, 2, True, world_size=2)
    b = run_on_ranks(_train, {"fsdp": 2}, "fsdp", True, False, False, 2, False, world_size=2)
    assert [x[0] for x in a] == [x[0] for x in b]


def test_fsdp_world_one_issues_nothing():
    (losses, counts, worst), = run_on_ranks(_train, {"fsdp": 1}, "fsdp", True, False, False, 2, True, world_size=1)
    assert all(c == {} for c in counts)
    _assert_parity([(losses, counts, worst)])
