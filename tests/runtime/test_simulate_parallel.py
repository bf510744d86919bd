"""fs.simulate against real gloo ranks for the layer loop and the data/tensor/expert
parallel layouts: scan_layers with FSDP (even and uneven torch.chunk shards, an empty block
on the last rank), HSDP, DDP (bucketed all-reduce), reshard / prefetch / remat, gradient
accumulation and mixed precision, gather_params, TP and SP, EP (moe_ffn), and
fs.recipes.build_train_step on those layouts. Each program runs under ``fs.simulate(n)`` and
on ``n`` real ranks, in float64, and every rank's values must be equal bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.testing import assert_bitwise_equal, run_on_ranks, run_simulated

DIM, LAYERS, ROWS = 4, 3, 4  # ROWS: batch rows per data rank


def _data(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _mlp_params(hidden: int) -> dict:
    """An input projection and ``LAYERS`` residual MLP blocks of width ``hidden`` (9: uneven
    over 2 ranks, 5 + 4 rows, and over 4, 3 + 3 + 3 + 0: an empty block on the last rank)."""
    return {"inp": {"weight": _data(0, DIM, DIM)},
            "layers": [{"up": {"weight": _data(1 + k, hidden, DIM), "bias": _data(10 + k, hidden)},
                        "down": {"weight": _data(20 + k, DIM, hidden), "bias": _data(30 + k, DIM)}}
                       for k in range(LAYERS)]}


def _block(p, x):
    return x + F.linear(torch.tanh(F.linear(x, p["up"]["weight"], p["up"]["bias"])), p["down"]["weight"],
                        p["down"]["bias"])


def _layout(mode: str, n: int):
    """(mesh shape, scan_layers axes, data axes) of a data-parallel layout on ``n`` ranks."""
    if mode == "fsdp":
        return {"fsdp": n}, dict(axis="fsdp"), ("fsdp",)
    if mode == "hsdp":
        return {"dp": 2, "fsdp": n // 2}, dict(axis="fsdp", replicate_axis="dp"), ("dp", "fsdp")
    if mode == "fsdp2d":  # sharded over both axes; reshard_after_forward may name the inner one
        return {"fsdp_out": 2, "fsdp_in": n // 2}, dict(axis=("fsdp_out", "fsdp_in")), ("fsdp_out", "fsdp_in")
    return {"dp": n}, dict(axis=None, replicate_axis="dp"), ("dp",)  # ddp


def _specs(params, mode, axes):
    if mode == "ddp":
        return fs.parallel.replicate_specs(params)
    return fs.parallel.fsdp_specs(params, axes["axis"])


def _loop(n, mode, order, hidden=9, microbatches=1, policy=None, early_sync=True, check=True, **config):
    """value and grads of an MLP stack through gather_params + scan_layers on ``mode``.

    ``early_sync`` with microbatches: the earlier ones run with ``sync=False`` (True) or, on
    HSDP, ``"reduce_scatter"`` (the string)."""
    shape, axes, data = _layout(mode, n)
    mesh = fs.make_mesh(shape)
    params = _mlp_params(hidden)
    specs = _specs(params, mode, axes)
    loop = fs.parallel.ScanConfig(policy=policy, **config)

    def loss(p, x, acc, sync):
        root = fs.parallel.gather_params(p["inp"], **axes, policy=policy, accumulate=acc, sync=sync)
        h = torch.tanh(F.linear(x.to(root["weight"].dtype), root["weight"]))
        h = fs.parallel.scan_layers(_block, p["layers"], h, config=loop, accumulate=acc, sync=sync, **axes)
        return fs.lax.pmean(h.pow(2).mean().to(torch.float64), data)

    in_specs = (specs, P(data), None, None)
    if order == "outside":
        step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=in_specs, out_specs=P(), check=check))
    else:
        step = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs),
                            check=check)
    sharded = fs.shard(params, specs, mesh, uneven=True)
    if config.get("offload"):  # a no-op move on a CPU mesh; the offload path runs
        sharded = fs.parallel.scan.offload_shards(sharded)
    x = _data(99, ROWS * n * microbatches, DIM)
    acc = fs.parallel.GradAccumulator() if microbatches > 1 else None
    for k, xs in enumerate(x.chunk(microbatches)):
        last = k == microbatches - 1
        value, grads = step(sharded, xs, acc, True if last else (False if early_sync is True else early_sync))
    return fs.gather(value), fs.gather(grads), [g.to_local().clone() for g in fs.tree.leaves(grads)]


# --- tensor, sequence and expert parallelism ------------------------------------------------------
def _tp(n, order, sequence_parallel, hidden=8):
    """The MLP stack with MLP_STACK_TP_PLAN on fsdp x tp: scan_layers gathers over fsdp, the
    block is tp_mlp (with SP: the activations split over the rows between blocks)."""
    # Uneven rows must be cut in mesh order: tp first, fsdp minor (as tp_specs splits dim 0).
    mesh = fs.make_mesh({"tp": 2, "fsdp": n // 2} if hidden % 4 else {"fsdp": n // 2, "tp": 2})
    params = {"layers": [{"in_proj": {"weight": _data(1 + k, hidden, DIM), "bias": _data(10 + k, hidden)},
                          "out_proj": {"weight": _data(20 + k, DIM, hidden), "bias": _data(30 + k, DIM)}}
                         for k in range(LAYERS)]}
    specs = fs.parallel.tp_specs(params, fs.parallel.MLP_STACK_TP_PLAN, "tp", fsdp_axis="fsdp")

    def block(p, x):
        return x + fs.parallel.tp_mlp(p, x, "tp", sequence_parallel=sequence_parallel, seq_dim=0)

    def loss(p, x):
        if sequence_parallel:  # this tp rank's rows of the fsdp rank's batch (tensor code: SPMD)
            rows = x.shape[0] // 2
            x = x.index_select(0, fs.lax.axis_index("tp") * rows + torch.arange(rows))
        h = fs.parallel.scan_layers(block, p["layers"], x, axis="fsdp")
        local = h.pow(2).mean()
        return fs.lax.pmean(local, ("fsdp", "tp") if sequence_parallel else "fsdp")

    in_specs = (specs, P("fsdp"))
    if order == "outside":
        step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=in_specs, out_specs=P()))
    else:
        step = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs))
    value, grads = step(fs.shard(params, specs, mesh, uneven=True), _data(99, ROWS * n, DIM))
    return fs.gather(value), fs.gather(grads)


def _tp_dropout(n, sequence_parallel):
    """tp_transformer_block with dropout (training): the residual dropouts draw from the shared
    RNG (per rank inside tp_rng with SP), the attention probabilities per rank (tp_rng's seed
    per rank); the draw after the step checks every rank's RNG was put back."""
    from fshard.models import TransformerConfig, transformer_init

    cfg = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, max_seq_len=8, dropout=0.25)
    torch.manual_seed(5)  # the shared stream every rank starts from
    mesh = fs.make_mesh({"tp": n})
    params = transformer_init(cfg, 0, dtype=torch.float64)["layers"][0]
    specs = fs.parallel.tp_specs({"layers": [params]}, fs.parallel.TRANSFORMER_TP_PLAN, "tp")["layers"][0]

    def loss(p, x):
        y = fs.parallel.tp_transformer_block(p, x, cfg, "tp", sequence_parallel=sequence_parallel, training=True)
        return fs.lax.pmean(y.pow(2).mean(), "tp") if sequence_parallel else y.pow(2).mean()

    x_spec = P("tp") if sequence_parallel else P()  # with SP each tp rank holds batch rows
    step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=(specs, x_spec), out_specs=P()))
    value, grads = step(fs.shard(params, specs, mesh), _data(99, n, 8, 16))
    return fs.gather(value), fs.gather(grads), torch.rand(3)


def _ep(n, order, tp, efsdp=False):
    """A two-layer MoE stack through moe_ffn over ``ep`` (n / 2 with tp=2 inside each expert,
    or with the experts also FSDP-sharded over ``efsdp``), the router FSDP-gathered over
    ``ep`` like the dense parameters."""
    ep = n // 2 if tp or efsdp else n
    mesh = fs.make_mesh({"ep": ep, "tp": 2} if tp else {"ep": ep, "efsdp": 2} if efsdp else {"ep": ep})
    params = {"layers": [fs.parallel.moe_init(DIM, 6, 8, seed=k, dtype=torch.float64) for k in range(2)]}
    base = fs.parallel.fsdp_specs(params, "ep")
    specs = fs.parallel.ep_specs(params, "ep", fsdp_axis="efsdp" if efsdp else None, tp_axis="tp" if tp else None,
                                 base=base, mesh=mesh)

    def loss(p, x):
        for lp in p["layers"]:
            router = fs.parallel.gather_params(lp["router"], axis="ep")
            experts = fs.parallel.gather_params(lp["experts"], axis="efsdp") if efsdp else lp["experts"]
            x = x + fs.parallel.moe_ffn({"router": router, "experts": experts}, x, top_k=2,
                                        capacity_factor=1.0, ep_axis="ep", tp_axis="tp" if tp else None)
        return fs.lax.pmean(x.pow(2).mean(), ("ep", "efsdp") if efsdp else "ep")

    in_specs = (specs, P(("ep", "efsdp") if efsdp else "ep"))
    if order == "outside":
        step = fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=in_specs, out_specs=P()))
    else:
        step = fs.shard_map(fs.value_and_grad(loss), mesh=mesh, in_specs=in_specs, out_specs=(P(), specs))
    value, grads = step(fs.shard(params, specs, mesh), _data(99, 2 * ROWS * n, DIM))
    return fs.gather(value), fs.gather(grads)


# --- the recipe's train step ------------------------------------------------------------------------
def _recipe(n, mesh_text, options):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
    import test_recipes_step as recipes

    return recipes._custom(mesh_text, options)


def _recipe_transformer(n, mesh_text, options):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
    import test_recipes_step as recipes

    return recipes._transformer(mesh_text, options)


ORDERS = ("outside", "inside")  # value_and_grad(shard_map(f)), shard_map(value_and_grad(f))
PROGRAMS = {  # name: (program, args after n, world sizes)
    **{f"fsdp_{o}": (_loop, ("fsdp", o), (2, 4)) for o in ORDERS},
    **{f"fsdp_even_{o}": (_loop, ("fsdp", o, 8), (2, 4)) for o in ORDERS},
    "fsdp_keep_prefetch2": (_loop, ("fsdp", "outside"), (4,), dict(reshard_after_forward=False, prefetch=2)),
    "fsdp_reshard_to_inner": (_loop, ("fsdp2d", "inside"), (4,), dict(reshard_after_forward="fsdp_in")),
    **{f"fsdp_remat_{o}": (_loop, ("fsdp", o), (2,), dict(remat=True)) for o in ORDERS},
    **{f"fsdp_microbatches_{o}": (_loop, ("fsdp", o), (2,), dict(microbatches=2)) for o in ORDERS},
    "fsdp_remat_save_collectives": (_loop, ("fsdp", "inside"), (4,), dict(remat=True, remat_policy="save_collectives")),
    "fsdp_offload": (_loop, ("fsdp", "outside"), (2,), dict(offload=True)),
    "fsdp_unchecked": (_loop, ("fsdp", "inside"), (4,), dict(check=False)),
    "hsdp_unchecked": (_loop, ("hsdp", "outside"), (4,), dict(check=False)),
    "fsdp_bfloat16": (_loop, ("fsdp", "outside"), (4,),
                      dict(policy=fs.Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
    "fsdp_mixed_precision": (_loop, ("fsdp", "outside"), (2,),
                             dict(policy=fs.Policy(param_dtype=torch.float32, reduce_dtype=torch.float32))),
    **{f"hsdp_{o}": (_loop, ("hsdp", o), (4,)) for o in ORDERS},
    "hsdp_microbatches": (_loop, ("hsdp", "outside"), (4,), dict(microbatches=2)),
    "hsdp_microbatches_reduce_scatter": (_loop, ("hsdp", "inside"), (4,),
                                         dict(microbatches=3, early_sync="reduce_scatter")),
    **{f"ddp_{o}": (_loop, ("ddp", o), (2, 4), dict(bucket_bytes=512)) for o in ORDERS},
    "ddp_microbatches": (_loop, ("ddp", "inside"), (2,), dict(microbatches=2)),
    **{f"tp_{o}": (_tp, (o, False), (4,)) for o in ORDERS},
    **{f"tp_sp_{o}": (_tp, (o, True), (4,)) for o in ORDERS},
    "tp_dropout": (_tp_dropout, (False,), (2, 4)),
    "tp_sp_dropout": (_tp_dropout, (True,), (2, 4)),
    **{f"ep_{o}": (_ep, (o, False), (2,)) for o in ORDERS},
    "ep_tp": (_ep, ("inside", True), (4,)),
    "ep_efsdp": (_ep, ("outside", False, True), (4,)),
    "recipe_fsdp4_uneven": (_recipe, ("fsdp=4", {"prefetch": 2, "reshard": False}), (4,)),
    "recipe_hsdp_microbatches": (_recipe, ("dp=2,fsdp=2", {"microbatches": 2}), (4,)),
    "recipe_transformer_tp_sp": (_recipe_transformer, ("fsdp=2,tp=2", {"sequence_parallel": True}), (4,)),
}
CASES = [(name, n) for name, (_, _, sizes, *_) in PROGRAMS.items() for n in sizes]


def _run(name, n, runner):
    fn, args, _, *kw = PROGRAMS[name]
    return runner(fn, n, *args, world_size=n, **(kw[0] if kw else {}))


@pytest.mark.parametrize("name, n", CASES, ids=[f"{name}-{n}" for name, n in CASES])
def test_a_simulated_layout_equals_the_real_ranks_bit_for_bit(name, n):
    real = _run(name, n, run_on_ranks)
    simulated = _run(name, n, run_simulated)
    assert len(simulated) == n
    for r in range(n):
        assert_bitwise_equal(simulated[r], real[r], what=f"{name}, rank {r}")


def test_the_uneven_case_holds_an_empty_block_on_the_last_rank():
    """9 hidden rows over 4 ranks: torch.chunk's blocks 3, 3, 3, 0 (the case that must run)."""
    out = _run("fsdp_outside", 4, run_simulated)
    shapes = [[tuple(t.shape) for t in out[r][2]] for r in range(4)]  # every local grad block
    assert (0, DIM) in shapes[3] and (3, DIM) in shapes[0], shapes


def test_uneven_tp_under_fsdp_is_refused_naming_the_fix():
    """9 rows over tp=2 (5 and 4), then FSDP: each tp rank's gathered layer has another shape,
    so another flat buffer; the simulated layer loop refuses it (real ranks run it)."""
    from fshard.runtime.simulation import RankBranchError

    with pytest.raises(RankBranchError, match=r"differs per rank on dim 0 \(rank 0: 5, rank 1: 5, rank 2: 4.*divisible"):
        run_simulated(_tp, 4, "outside", False, 9, world_size=4)
