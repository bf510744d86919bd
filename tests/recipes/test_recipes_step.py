"""fs.recipes.build_train_step: a model written in the test and fshard's Transformer, on every
layout the recipe composes, against the one-process run in float64 with SGD (loss by loss,
and the final parameters), plus the layouts it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard.models import TransformerConfig
from fshard.testing import run_on_ranks

FEATURES, CLASSES, DIM, LAYERS, BATCH, STEPS = 6, 3, 8, 4, 8, 3


def _init(seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)

    def linear(n_out, n_in):
        return {"weight": torch.empty(n_out, n_in, dtype=dtype).normal_(0.0, n_in ** -0.5, generator=g),
                "bias": torch.empty(n_out, dtype=dtype).normal_(0.0, 0.1, generator=g)}

    # Hidden width 3 x DIM = 24 rows and out 3: uneven over 4 ranks in the head.
    return {"inp": linear(DIM, FEATURES), "layers": [{"up": linear(3 * DIM, DIM), "down": linear(DIM, 3 * DIM)}
                                                      for _ in range(LAYERS)], "out": linear(CLASSES, DIM)}


def _lin(p, x):
    return F.linear(x, p["weight"], p["bias"])


def _model() -> fs.recipes.LayeredModel:
    return fs.recipes.LayeredModel(
        init=_init, embed=lambda root, x: _lin(root["inp"], x),
        block=lambda layer, x: x + _lin(layer["down"], torch.tanh(_lin(layer["up"], x))),
        head=lambda root, x: _lin(root["out"], x), loss=F.cross_entropy,
        embed_keys=("inp",), head_keys=("out",), name="residual-mlp")


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64),
             torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(STEPS)]


def _train(model, mesh_text: str, options: dict, inputs=None) -> tuple[list[float], dict]:
    layout = fs.parallel.Layout.parse(mesh_text, batch=BATCH, dtype="float64", **options)
    init_state, step = fs.recipes.build_train_step(model, layout, fs.optim.sgd(0.5), max_norm=2.0)
    params, state = init_state(0)
    losses = []
    for x, y in inputs or _batches():
        params, state, loss, _, bad = step(params, state, x, y)
        assert bad is None
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    pipe = None
    if "pp" in layout.shape:  # each pp rank holds its stages: gather_full puts the tree together
        mesh = layout.mesh()
        pipe = fs.recipes.Pipeline.build(layout.schedule, mesh, LAYERS, layout.microbatches, layout.virtual,
                                         fs.recipes.model.resolve_model(model, fs.recipes.Roles.of(layout, mesh)))
    return losses, fs.recipes.pipeline.gather_full(params, pipe)


def _custom(mesh_text, options):
    return _train(_model(), mesh_text, options)


CASES = [  # (mesh, layout options, ranks)
    ("fsdp=2", {}, 2), ("dp=2", {}, 2), ("fsdp=2", {"microbatches": 2}, 2), ("fsdp=2", {"remat": True}, 2),
    ("pp=2", {"microbatches": 2}, 2), ("pp=2", {"microbatches": 4, "schedule": "gpipe"}, 2),
    ("dp=2,fsdp=2", {}, 4), ("fsdp=4", {"prefetch": 2, "reshard": False}, 4), ("pp=2,fsdp=2", {"microbatches": 2}, 4),
]


@pytest.fixture(scope="module")
def reference():
    return _custom("fsdp=1", {})


@pytest.mark.parametrize("mesh_text, options, ranks", CASES)
def test_a_model_of_ones_own_gives_the_one_process_losses_and_params(mesh_text, options, ranks, reference):
    want_losses, want_params = reference
    results = run_on_ranks(_custom, mesh_text, options, world_size=ranks)
    for losses, params in results:
        assert losses == pytest.approx(want_losses, rel=1e-12, abs=0), (mesh_text, options)
        for a, b in zip(fs.tree.leaves(params), fs.tree.leaves(want_params), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


CFG = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, max_seq_len=8)


def _tokens():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 32, (BATCH, 8), generator=g), torch.randint(0, 32, (BATCH, 8), generator=g))
            for _ in range(2)]


def _transformer(mesh_text, options):
    return _train(fs.recipes.transformer(CFG), mesh_text, options, _tokens())[0]


@pytest.mark.parametrize("mesh_text, options", [("fsdp=2,tp=2", {"sequence_parallel": True}), ("pp=2,tp=2", {}),
                                                ("pp=2,tp=2", {"sequence_parallel": True, "microbatches": 2})])
def test_the_transformer_recipe_on_tp_layouts_gives_the_one_process_losses(mesh_text, options):
    want = _transformer("fsdp=1", {})
    for got in run_on_ranks(_transformer, mesh_text, options, world_size=4):
        assert got == pytest.approx(want, rel=1e-12, abs=0)


MOE = fs.recipes.MoE(n_experts=4, top_k=2, hidden=24)


def _moe_transformer(mesh_text, options):
    return _train(fs.recipes.transformer(CFG, MOE), mesh_text, options, _tokens())


@pytest.fixture(scope="module")
def moe_reference():
    return _moe_transformer("fsdp=1", {})


@pytest.mark.parametrize("mesh_text, options, ranks", [
    ("ep=2", {}, 2), ("ep=2,fsdp=2", {}, 4), ("dp=2,ep=2", {"microbatches": 2}, 4), ("ep=4", {}, 4),
    ("pp=2,ep=2", {"microbatches": 2}, 4), ("pp=2,fsdp=2,ep=2", {"microbatches": 2}, 8),
])
def test_the_moe_transformer_on_ep_layouts_gives_the_one_process_losses_and_params(
    mesh_text, options, ranks, moe_reference
):
    # SGD: a wrong gradient scale on the experts or the dense leaves shows in the parameters.
    want_losses, want_params = moe_reference
    for losses, params in run_on_ranks(_moe_transformer, mesh_text, options, world_size=ranks):
        assert losses == pytest.approx(want_losses, rel=1e-12, abs=0), mesh_text
        for a, b in zip(fs.tree.leaves(params), fs.tree.leaves(want_params), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("mesh, model, says", [
    ({"ep": 2}, fs.recipes.transformer(CFG), r"has an ep axis .* no experts: give transformer\(cfg, moe=MoE"),
    ({"ep": 2, "tp": 2}, fs.recipes.transformer(CFG, MOE), r"has ep and tp: the recipes do not build experts"),
    ({"pp": 2, "dp": 2, "ep": 2}, fs.recipes.transformer(CFG, MOE), r"pp and ep with dp but no fsdp"),
    ({"cp": 2, "ep": 2}, fs.recipes.transformer(CFG, MOE), r"runs with pp, dp, fsdp and ep; .* has cp"),
    ({"ep": 8}, fs.recipes.transformer(CFG, MOE), r"n_experts 4 must be a multiple of ep x fsdp = 8"),
])
def test_moe_layouts_the_recipe_does_not_run_are_refused(mesh, model, says):
    with pytest.raises(fs.parallel.LayoutError, match=says):
        roles = fs.recipes.Roles.for_mesh(_ShapeOnly(mesh), compute_dtype=torch.float32, master_dtype=torch.float32,
                                          remat=False, sequence_parallel=False)
        fs.recipes.model.resolve_model(model, roles)


class _ShapeOnly:
    """What the roles and the model's checks read of a mesh (no process group needed)."""

    def __init__(self, shape):
        self.shape, self.axis_names = dict(shape), tuple(shape)

    def axis_size(self, axes):
        return torch.Size([self.shape[a] for a in axes]).numel()


def test_a_tp_layout_without_a_tp_plan_is_refused_naming_the_fix():
    with pytest.raises(fs.parallel.LayoutError, match=r"has a tp axis .* no TP plan: give LayeredModel\(tp_plan"):
        fs.recipes.build_train_step(_model(), fs.parallel.Layout({"tp": 1}, batch=4), fs.optim.sgd(0.1),
                                    mesh=fs.make_mesh({"tp": 1}))


@pytest.mark.parametrize("layout, says", [
    (fs.parallel.Layout({"fsdp": 1}, batch=4, offload=True), r"Layout.offload: the recipes do not offload yet"),
    (fs.parallel.Layout({"fsdp": 1}, batch=4, dtype="float8"), r"Layout.dtype 'float8': the recipes run"),
    (fs.parallel.Layout({"fsdp": 1}, batch=6, microbatches=4), r"Layout.batch 6 must be a multiple of microbatches 4"),
    (fs.parallel.Layout({"tp": 2}, batch=2, microbatches=2, sequence_parallel=True),
     r"splits a microbatch's rows over tp=2: .* = 1 rows, not a multiple of 2; make Layout.batch a multiple of 4"),
])
def test_layouts_the_recipe_does_not_run_are_refused(layout, says):
    with pytest.raises(fs.parallel.LayoutError, match=says):
        fs.recipes.build_train_step(_model(), layout, fs.optim.sgd(0.1))


def test_layout_parse_and_its_errors():
    lay = fs.parallel.Layout.parse("tp=2, pp=2,fsdp=1", batch=8)
    assert dict(lay.shape) == {"pp": 2, "tp": 2} and lay.mesh_text() == "pp=2,tp=2"
    assert fs.parallel.Layout(mesh={"dp": 2}, batch=2) == fs.parallel.Layout({"dp": 2}, batch=2)
    for text, says in [("tp", "expected axis=size"), ("xp=2", "unknown axis 'xp'"), ("dp=2,dp=2", "given twice"),
                       ("dp=0", "has size 0"), ("dp=x", "has size 'x'")]:
        with pytest.raises(fs.parallel.LayoutError, match=says):
            fs.parallel.Layout.parse(text, batch=8)
    assert fs.plan.Layout is fs.parallel.Layout
