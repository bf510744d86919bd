"""Metrics (issue 35, item 6): the validation loss of the composed step without an update on
every kind of layout (forward only, or a pipeline's step with its gradients dropped), MFU from
a machine file only (never a calibration), peak memory labelled by what it measures, and the
summary table."""

from __future__ import annotations

import attrs
import pytest
import torch

import fshard as fs
from fshard import plan
from fshard.models import TransformerConfig
from fshard.plan.estimate import model_flops
from fshard.plan.machine import Link, Machine
from fshard.recipes.metrics import MFU, mfu_for, peak_memory, summarize, summary_table
from fshard.testing import run_on_ranks

CFG = TransformerConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
BATCH, STEPS = 4, 3


def _batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run(mesh_text: str, options: dict, validate: bool):
    layout = fs.parallel.Layout.parse(mesh_text, batch=BATCH, dtype="float64", **options)
    config = fs.recipes.TrainConfig(STEPS, max_norm=1.0, progress=False, val_every=2)
    # The held-out "set" is the batch of step 3: the loss after step 2 on it is step 3's training loss.
    run = fs.recipes.train(fs.recipes.transformer(CFG), layout, fs.optim.sgd(0.5), _batch, config,
                           val_batch_at=(lambda i: _batch(2)) if validate else None)
    return [(r["loss"], r.get("val_loss")) for r in run.records]


LAYOUTS = [("fsdp=2", {"microbatches": 2}), ("tp=2", {"sequence_parallel": True}), ("pp=2", {"microbatches": 2}),
           ("dp=2", {"remat": True})]


def _every_layout():
    return {m: _run(m, o, True) for m, o in LAYOUTS}


def test_validation_loss_is_the_models_loss_without_an_update_on_every_layout():
    one, plain = _run("fsdp=1", {}, True), _run("fsdp=1", {}, False)
    assert [loss for loss, _ in one] == [loss for loss, _ in plain]  # validating updates nothing
    assert one[1][1] == pytest.approx(one[2][0], rel=1e-12)  # after step 2, on step 3's batch
    assert [v is None for _, v in one] == [True, False, False]  # every 2 steps, and at the end
    for results in run_on_ranks(_every_layout, world_size=2):
        for mesh, got in results.items():  # the one-process curves: no update here either
            assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in one], rel=1e-9), mesh
            assert got[1][1] == pytest.approx(got[2][0], rel=1e-12), mesh
            assert [v is None for _, v in got] == [True, False, False], mesh
            assert got[2][1] == pytest.approx(one[2][1], rel=1e-9), mesh


def _mlp_model() -> fs.recipes.ModuleModel:
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)]).double()
    module.drop = torch.nn.Dropout(0.5)  # on while training: validation must turn it off
    module.forward = lambda x: module.drop(module.layers[0](x))
    return fs.recipes.ModuleModel(module, loss=torch.nn.functional.mse_loss, blocks="layers", name="mlp")


def test_validation_of_a_module_model_is_its_loss_in_eval_mode_without_an_update():
    model = _mlp_model()
    g = torch.Generator().manual_seed(3)
    held = (torch.randn(2, 4, generator=g, dtype=torch.float64), torch.randn(2, 4, generator=g, dtype=torch.float64))
    layout = fs.parallel.Layout.parse("fsdp=1", batch=2, dtype="float64")
    run = fs.recipes.train(model, layout, fs.optim.sgd(0.1), lambda s: held, fs.recipes.TrainConfig(2, progress=False),
                           val_batch_at=lambda i: held)
    assert all(m.training for m in model.module.modules())  # the flags it had, given back
    model.module.eval()  # the reference: the module itself, dropout off, with the trained values
    fs.nn.load_state(model.module, fs.gather(run.params))
    with torch.no_grad():
        want = torch.nn.functional.mse_loss(model.module(held[0]), held[1]).item()
    assert run.records[-1]["val_loss"] == pytest.approx(want, rel=1e-13)


def test_validation_of_a_model_whose_step_has_no_forward_loss_is_refused_before_training():
    inner = _mlp_model()

    class OwnStep:  # composes its own step, without ComposedStep.forward_loss
        def compose(self, *args):
            return attrs.evolve(inner.compose(*args), forward_loss=None)

    layout = fs.parallel.Layout.parse("fsdp=1", batch=2, dtype="float64")
    batch = (torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(fs.recipes.ConfigError, match=r"validation .* ModuleModel 'mlp' composes a step without a "
                                                     r"forward_loss"):
        fs.recipes.train(OwnStep(), layout, fs.optim.sgd(0.1), lambda s: batch,
                         fs.recipes.TrainConfig(1, progress=False), val_batch_at=lambda i: batch)


def _machine_file(tmp_path) -> str:
    m = Machine(name="test-cpu", memory_bytes=2**30, flops={"float32": 2e9}, mem_bandwidth=2e9, devices_per_node=64,
                links={"intra": Link(5e8, 5e-5), "inter": Link(5e8, 5e-5)}, cores_per_node=2, calibrated_ranks=2)
    plan.save_machine(m, tmp_path / "machine.json")
    return str(tmp_path / "machine.json")


def test_mfu_comes_from_a_machine_file_and_never_from_a_calibration(tmp_path, monkeypatch):
    def no_calibration(*a, **k):
        raise AssertionError("mfu_for calibrated")

    monkeypatch.setattr(plan, "calibrate", no_calibration)
    monkeypatch.setenv("FSHARD_MACHINE", str(tmp_path / "none.json"))
    mfu, line = mfu_for(CFG, 8, "float32", None, 1)
    assert mfu is None and "--machine h100" in line and "none.json" in line
    per_token = model_flops(plan.describe_transformer(CFG, seq_len=8)) / 8
    monkeypatch.setenv("FSHARD_MACHINE", _machine_file(tmp_path))
    for world, share in ((1, 1.0), (4, 0.5)):  # 2 cores calibrated with 2 ranks: 4 ranks get half each
        mfu, line = mfu_for(CFG, 8, "float32", None, world)
        assert mfu == MFU(per_token, 2e9 * share * world, "test-cpu"), world
        assert f"{world} x test-cpu" in line
    assert mfu.of(1000.0) == pytest.approx(per_token * 1000 / 4e9)
    h100, _ = mfu_for(CFG, 8, "bfloat16", "h100", 8)
    assert h100.peak_flops == 8 * plan.get_machine("h100").flops["bfloat16"]
    assert mfu_for(CFG, 8, "float64", None, 1)[0] is None  # no figure for the dtype: said, not guessed
    with fs.simulate(2):  # one process runs both ranks: no peak to hold it to
        assert mfu_for(CFG, 8, "float32", None, 2) == (None, "MFU: not measured under fs.simulate (one process "
                                                             "runs every rank)")


def test_peak_memory_summary_and_table():
    mib, kind = peak_memory(torch.device("cpu"))
    assert kind == "rss" and mib > 50  # the process: interpreter and torch included
    records = [{"step": s, "loss": 3.0 - s, "step_time_s": t, "val_loss": v}
               for s, t, v in ((1, 5.0, None), (2, 0.5, 2.5), (3, 0.5, None), (4, 0.5, 2.75))]
    s = summarize(records, 100, MFU(10.0, 1e4, "m"), torch.device("cpu"), 12.0)
    assert s["tokens_per_s"] == pytest.approx(200.0)  # after the first step: 300 tokens in 1.5 s
    assert (s["final_val_loss"], s["best_val_loss"], s["best_val_step"], s["mfu"]) == (2.75, 2.5, 2, 0.2)
    table = summary_table(s)
    for row in ("steps        1-4 (4 run)", "val loss     final 2.7500, best 2.5000 (step 2)",
                "tokens/s     200", "MFU          20.00% of 10 kFLOP/s", "(rank 0, process peak RSS)",
                "elapsed      0:12"):
        assert row in table, table
    none = summary_table(summarize(records[:1], 100, None, torch.device("cpu"), 1.0))
    assert "not measured (--val-every)" in none and "MFU          not measured" in none
