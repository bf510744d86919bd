"""The recipes' context parallelism: what they refuse, and pipeline_step's seq_axes checks.

The parity of cp layouts (loss curves equal to one process, both step orders through the
recipe's shard_map and pipeline) is in tests/integration/test_examples.py and
tests/parallel/test_parallel_cp.py; the planner's cp collectives in tests/plan/test_plan_comm.py.
"""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard.models import TransformerConfig
from fshard.sched import build_schedule


def _cfg(**kw) -> TransformerConfig:
    return TransformerConfig(**{"vocab_size": 64, "dim": 16, "n_layers": 2, "n_heads": 4, "max_seq_len": 16, **kw})


@pytest.mark.parametrize("kw, says", [
    ({"max_seq_len": 18}, r"cp=2 cuts each sequence into 2 x cp = 4 head-tail chunks, .* 18: use a sequence length "
                          r"that is a multiple of 4"),
    ({"dropout": 0.1}, r"cp=2: ring attention has no attention dropout"),
])
def test_the_transformer_refuses_what_cp_cannot_split(kw, says):
    layout = fs.parallel.Layout({"cp": 2}, batch=4, dtype="float64")
    with fs.simulate(2):
        with pytest.raises(fs.parallel.LayoutError, match=says):
            fs.recipes.build_train_step(fs.recipes.transformer(_cfg(**kw)), layout, fs.optim.sgd(0.1))


def _stage(params, x, stage):
    return x


def _loss(y, t):
    return y.sum()


def test_pipeline_step_seq_axes_must_not_split_rows_too():
    with fs.simulate(4):
        mesh = fs.make_mesh({"pp": 2, "cp": 2})
        schedule = build_schedule("1f1b", 2, 2)
        with pytest.raises(ValueError, match=r"seq_axes=\('cp',\) must name neither the pipeline axis 'pp' nor a "
                                             r"data axis \(data_axes=\('cp',\)\)"):
            fs.sched.pipeline_step(_stage, _loss, [{}, {}], ((), ()), schedule=schedule, mesh=mesh,
                                   data_axes="cp", seq_axes="cp")


def test_a_module_model_is_refused_on_a_cp_mesh():
    from fshard.models import TransformerModule

    module = TransformerModule(_cfg(), dtype=torch.float64)
    model = fs.recipes.ModuleModel(module, lambda out, tgt: out.sum(), name="toy")
    layout = fs.parallel.Layout({"cp": 2}, batch=4, dtype="float64")
    with fs.simulate(2):
        with pytest.raises(fs.parallel.LayoutError, match=r"Layout.cp: .* must be fs.parallel.ring_attention over cp"):
            fs.recipes.build_train_step(model, layout, fs.optim.sgd(0.1))


def test_a_size_one_cp_axis_splits_nothing():
    # an odd sequence length is fine when the cp axis has one rank
    layout = fs.parallel.Layout({"fsdp": 1}, batch=4, dtype="float64")
    mesh = fs.make_mesh({"cp": 1})
    fs.recipes.build_train_step(fs.recipes.transformer(_cfg(max_seq_len=17)), layout, fs.optim.sgd(0.1), mesh=mesh)
