"""fs.recipes.train: the loop around the composed step. A run stopped and resumed on another
layout gives the uninterrupted run's losses and parameters (float64, SGD, against one
process); a non-finite step is skipped or stops the run; another model's checkpoint is
refused; and examples/train_lm.py stays a thin command line over it."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
FEATURES, CLASSES, DIM, LAYERS, BATCH, STEPS = 5, 3, 8, 2, 8, 4


def _model() -> fs.recipes.LayeredModel:
    def init(seed: int, dtype: torch.dtype):
        g = torch.Generator().manual_seed(seed)

        def linear(n_out, n_in):
            return {"weight": torch.empty(n_out, n_in, dtype=dtype).normal_(0.0, n_in**-0.5, generator=g),
                    "bias": torch.zeros(n_out, dtype=dtype)}

        return {"inp": linear(DIM, FEATURES), "layers": [{"up": linear(DIM, DIM)} for _ in range(LAYERS)],
                "out": linear(CLASSES, DIM)}

    def lin(p, x):
        return F.linear(x, p["weight"], p["bias"])

    return fs.recipes.LayeredModel(
        init=init, embed=lambda root, x: lin(root["inp"], x), block=lambda layer, x: x + torch.tanh(lin(layer["up"], x)),
        head=lambda root, x: lin(root["out"], x), loss=F.cross_entropy, embed_keys=("inp",), head_keys=("out",))


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _run(mesh_text: str, config: fs.recipes.TrainConfig, meta=None, inject=None):
    layout = fs.parallel.Layout.parse(mesh_text, batch=BATCH, dtype="float64")
    run = fs.recipes.train(_model(), layout, fs.optim.sgd(0.3), _batch, config, meta=meta or {"dim": DIM},
                           inject=inject)
    return [r["loss"] for r in run.records], fs.recipes.pipeline.gather_full(run.params, run.composed.pipe), run.end


def _config(**kw) -> fs.recipes.TrainConfig:
    return fs.recipes.TrainConfig(STEPS, max_norm=1.0, progress=False, **kw)


def test_a_run_stopped_and_resumed_on_another_layout_gives_the_uninterrupted_run(tmp_path):
    want_losses, want_params, _ = _run("fsdp=1", _config())
    ck = fs.recipes.CheckpointConfig(str(tmp_path / "ck"), every=1, resume="auto")
    first = run_on_ranks(_run, "fsdp=2", _config(checkpoint=ck, stop_at=2), world_size=2)
    second = run_on_ranks(_run, "pp=2", _config(checkpoint=attrs.evolve(ck, resume=True)), world_size=2)
    for (l1, _, end1), (l2, params, end2) in zip(first, second, strict=True):
        assert (end1, end2) == (2, STEPS)
        assert l1 + l2 == pytest.approx(want_losses, rel=1e-12, abs=0)
        for a, b in zip(fs.tree.leaves(params), fs.tree.leaves(want_params), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)


def test_a_nonfinite_step_is_skipped_or_stops_the_run():
    want, _, _ = _run("fsdp=1", _config())
    losses, _, _ = _run("fsdp=1", _config(skip_nonfinite=True), inject=fs.recipes.Injection.parse("2:loss:inf"))
    assert losses[0] == want[0] and losses[1] == float("inf")
    with pytest.raises(fs.recipes.NonFiniteError, match=r"step 3: .*'layers.1.up.weight'.*stopped before the update"):
        _run("fsdp=1", _config(), inject=fs.recipes.Injection.parse("3:layers.1.up.weight"))
    with pytest.raises(fs.recipes.ConfigError, match=r"inject: no parameter 'nope'; parameters are e.g. inp.bias"):
        _run("fsdp=1", _config(), inject=fs.recipes.Injection.parse("1:nope"))


def test_another_models_checkpoint_is_refused_naming_the_field(tmp_path):
    ck = fs.recipes.CheckpointConfig(str(tmp_path / "ck"), resume="auto", hint="the flags")
    _run("fsdp=1", _config(checkpoint=ck, stop_at=1), meta={"dim": DIM})
    with pytest.raises(fs.recipes.ConfigError, match=r"holds another model: dim 8 \(this run: 9\)\. Give the flags\."):
        _run("fsdp=1", _config(checkpoint=ck), meta={"dim": 9})
    with pytest.raises(fs.recipes.ConfigError, match=r"needs a directory"):
        fs.recipes.CheckpointConfig(every=2)


def test_an_existing_checkpoint_is_kept_unless_resumed_or_overwritten(tmp_path):
    d = str(tmp_path / "ck")
    with pytest.raises(fs.recipes.ConfigError, match=r"there is no checkpoint in .*ck; .*resume 'auto'"):
        _run("fsdp=1", _config(checkpoint=fs.recipes.CheckpointConfig(d, resume=True)))
    assert not os.path.exists(d)
    _, _, end = _run("fsdp=1", _config(checkpoint=fs.recipes.CheckpointConfig(d, resume="auto"), stop_at=1))
    assert end == 1 and fs.checkpoint.load(d, like={"step": 0})["step"] == 1
    with pytest.raises(fs.recipes.ConfigError, match=r"ck holds a checkpoint \(step 1\); this run would replace it\. "
                       r"Give resume \(--resume\) to continue it, overwrite \(--overwrite\)"):
        _run("fsdp=1", _config(checkpoint=fs.recipes.CheckpointConfig(d)))
    assert fs.checkpoint.load(d, like={"step": 0})["step"] == 1  # untouched
    losses, _, _ = _run("fsdp=1", _config(checkpoint=fs.recipes.CheckpointConfig(d, overwrite=True), stop_at=2))
    assert len(losses) == 2 and fs.checkpoint.load(d, like={"step": 0})["step"] == 2  # from step 0, replaced
    with pytest.raises(fs.recipes.ConfigError, match=r"give one of them"):
        fs.recipes.CheckpointConfig(d, resume=True, overwrite=True)


def test_train_lm_is_a_thin_command_line():
    lines = (ROOT / "examples" / "train_lm.py").read_text().splitlines()
    assert len(lines) <= 250, f"examples/train_lm.py has {len(lines)} lines: move what is not its command line into fs.recipes"
