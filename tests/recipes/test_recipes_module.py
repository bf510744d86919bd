"""fs.recipes.ModuleModel: a Hugging Face model (tiny GPT-2 and Llama, float64) trained through
build_train_step on FSDP, DDP, HSDP, TP and FSDP x TP layouts gives the one-process losses and
final parameters (SGD, clipping on); fs.jit's step gives the eager one's; layouts the recipe
does not run for a module are refused naming the fix; validation (fs.recipes.train's val_batch_at)
is the module's own loss in eval mode on the final values, on 2-rank layouts as in one process."""

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


def _train_validated(kind: str, mesh_text: str, validate: bool = True):
    model = _model(kind)
    layout = fs.parallel.Layout.parse(mesh_text, batch=ROWS, dtype="float64")
    config = fs.recipes.TrainConfig(STEPS, max_norm=0.5, progress=False, val_every=2)
    # The held-out "set" is the batch of step 3: the loss after step 2 on it is step 3's training loss.
    run = fs.recipes.train(model, layout, fs.optim.sgd(0.2), lambda s: batch(s, ROWS), config,
                           val_batch_at=(lambda i: batch(2, ROWS)) if validate else None)
    modes = [m.training for m in model.module.modules()]
    return [(r["loss"], r.get("val_loss")) for r in run.records], fs.gather(run.params), modes


VALIDATED = [("gpt2", "fsdp=2"), ("llama", "tp=2"), ("llama", "dp=2")]


def _every_validated():
    return {c: _train_validated(*c) for c in VALIDATED}


def _module_loss(kind: str, params, tokens, targets) -> float:
    """The reference: the module itself in eval mode, one process, float64, with ``params`` loaded."""
    module = fs.nn.load_state(MODELS[kind]().eval(), params)
    with torch.no_grad():
        return _lm_loss(module(tokens), targets).item()


def test_validation_of_a_hf_model_is_the_modules_loss_in_eval_mode_on_every_layout():
    ones = {}
    for kind in ("gpt2", "llama"):
        one, params, modes = ones[kind] = _train_validated(kind, "fsdp=1")
        plain, _, _ = _train_validated(kind, "fsdp=1", validate=False)
        assert [loss for loss, _ in one] == [loss for loss, _ in plain], kind  # validating updates nothing
        assert [v is None for _, v in one] == [True, False, False], kind  # every 2 steps, and at the end
        assert one[1][1] == pytest.approx(one[2][0], rel=1e-12), kind  # after step 2, on step 3's batch
        assert one[2][1] == pytest.approx(_module_loss(kind, params, *batch(2, ROWS)), rel=1e-12), kind
        assert all(modes), kind  # the module's train flags, given back
    for results in run_on_ranks(_every_validated, world_size=2):
        for (kind, mesh_text), (got, params, modes) in results.items():
            want = _module_loss(kind, params, *batch(2, ROWS))  # this layout's final values, one process
            assert [v is None for _, v in got] == [True, False, False], mesh_text
            assert got[1][1] == pytest.approx(got[2][0], rel=1e-12), (kind, mesh_text)
            assert got[2][1] == pytest.approx(want, rel=1e-12), (kind, mesh_text)
            flat = [[x for pair in curve for x in pair if x is not None] for curve in (got, ones[kind][0])]
            assert flat[0] == pytest.approx(flat[1], rel=1e-11), (kind, mesh_text)  # losses and val losses
            assert all(modes), (kind, mesh_text)


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
