"""fs.recipes.ModuleModel: a Hugging Face model (tiny GPT-2 and Llama, float64) trained through
build_train_step on FSDP, DDP, HSDP, TP and FSDP x TP layouts gives the one-process losses and
final parameters (SGD, clipping on); fs.jit's step gives the eager one's; layouts the recipe
does not run for a module are refused naming the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard.testing import run_on_ranks

pytest.importorskip("transformers", reason="pip install fshard[hf]")

from _harness.hf_models import BLOCKS, MODELS, batch  # noqa: E402

ROWS, STEPS = 4, 3
PLANS = {"gpt2": "HF_GPT2_TP_PLAN", "llama": "HF_LLAMA_TP_PLAN"}


def _lm_loss(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def _model(kind: str) -> fs.recipes.ModuleModel:
    return fs.recipes.ModuleModel(MODELS[kind](), _lm_loss, blocks=BLOCKS[kind],
                                  tp_plan=getattr(fs.parallel, PLANS[kind]), name=kind)


def _train(kind: str, mesh_text: str, options: dict, jit_backend=None):
    layout = fs.parallel.Layout.parse(mesh_text, batch=ROWS, dtype="float64", **options)
    init_state, step = fs.recipes.build_train_step(_model(kind), layout, fs.optim.sgd(0.2), max_norm=0.5,
                                                   jit_backend=jit_backend)
    params, state = init_state(0)
    losses = []
    for s in range(STEPS):
        params, state, loss, _, bad = step(params, state, *batch(s, ROWS))
        assert bad is None
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    return losses, fs.gather(params)


CASES = [  # (model, mesh, options, ranks)
    ("gpt2", "fsdp=2", {}, 2), ("llama", "dp=2", {}, 2), ("llama", "tp=2", {}, 2),
    ("gpt2", "fsdp=2", {"prefetch": 2, "reshard": False}, 2),
    ("llama", "dp=2,fsdp=2", {}, 4), ("llama", "fsdp=2,tp=2", {}, 4),
]


@pytest.mark.parametrize("kind, mesh_text, options, ranks", CASES)
def test_a_hf_model_gives_the_one_process_losses_and_params(kind, mesh_text, options, ranks):
    want_losses, want_params = _train(kind, "fsdp=1", {})
    for losses, params in run_on_ranks(_train, kind, mesh_text, options, world_size=ranks):
        assert losses == pytest.approx(want_losses, rel=1e-12, abs=0), (kind, mesh_text)
        for a, b in zip(fs.tree.leaves(params), fs.tree.leaves(want_params), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_the_jit_step_gives_the_eager_losses():
    eager = run_on_ranks(_train, "llama", "fsdp=2", {}, world_size=2)
    jitted = run_on_ranks(_train, "llama", "fsdp=2", {}, "none", world_size=2)
    for (want, _), (got, _) in zip(eager, jitted, strict=True):
        assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_the_module_is_left_as_it_was():
    model = _model("llama")
    before = {k: v.clone() for k, v in model.module.state_dict().items()}
    layout = fs.parallel.Layout({"fsdp": 1}, batch=ROWS, dtype="float64")
    init_state, step = fs.recipes.build_train_step(model, layout, fs.optim.sgd(0.2))
    step(*init_state(0), *batch(0, ROWS))
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("mesh_text, options, says", [
    ("pp=1", {}, r"Layout.pp: the recipe does not run it for a ModuleModel 'llama' \(LlamaForCausalLM\) yet"),
    ("fsdp=1", {"remat": True}, r"Layout.remat: .* gradient_checkpointing_enable"),
    ("fsdp=1", {"microbatches": 2}, r"Layout.microbatches: "),
    ("fsdp=1", {"dtype": "float32"}, r"parameters are \['float64'\] but Layout.master_dtype is 'float32'"),
])
def test_layouts_the_module_recipe_does_not_run_are_refused(mesh_text, options, says):
    layout = fs.parallel.Layout.parse(mesh_text, batch=ROWS, **{"dtype": "float64", **options})
    mesh = fs.make_mesh({mesh_text.split("=")[0]: 1})  # keeps the size-1 axis the layout drops
    with pytest.raises(fs.parallel.LayoutError, match=says):
        fs.recipes.build_train_step(_model("llama"), layout, fs.optim.sgd(0.1), mesh=mesh)


def test_tp_without_a_plan_is_refused():
    model = fs.recipes.ModuleModel(MODELS["llama"](), _lm_loss, name="llama")
    layout = fs.parallel.Layout({"tp": 1}, batch=ROWS, dtype="float64")
    with pytest.raises(fs.parallel.LayoutError, match=r"has a tp axis but ModuleModel 'llama' .* has no TP plan"):
        fs.recipes.build_train_step(model, layout, fs.optim.sgd(0.1), mesh=fs.make_mesh({"tp": 1}))
