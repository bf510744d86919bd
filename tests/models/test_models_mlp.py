"""MLP / MLPStack: pure functions equal their nn.Module twins; per-example grads; sharded init."""

import pytest
import torch

import fshard as fs
from fshard import nn as fnn
from fshard.models import (
    MLPConfig,
    MLPModule,
    MLPStackConfig,
    MLPStackModule,
    mlp_apply,
    mlp_init,
    mlp_stack_apply,
    mlp_stack_init,
)
from fshard.testing import assert_close

TIGHT = dict(rtol=1e-12, atol=1e-12)
F64 = torch.float64


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.sin().sum()


def _module_grads(module, x):
    _loss(module(x)).backward()
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("dim", [3, 5, 16, 17])
def test_mlp_stack_equals_module(dim):
    cfg = MLPStackConfig(dim=dim)
    params = mlp_stack_init(cfg, seed=dim, dtype=F64)
    module = MLPStackModule(cfg, seed=dim, dtype=F64)
    x = torch.randn(4, 2, dim, dtype=F64)
    assert_close(mlp_stack_apply(params, x, cfg), module(x), **TIGHT, what="output")
    grads = torch.func.grad(lambda p: _loss(mlp_stack_apply(p, x, cfg)))(params)
    assert_close(fnn.to_state_dict(grads), _module_grads(module, x), **TIGHT, what="grad")


def test_param_tree_layout_is_torch_linear_layout():
    cfg = MLPStackConfig(dim=5, dim_multipliers=(3, 4))
    params = mlp_stack_init(cfg, seed=0)
    shapes = {k: tuple(v.shape) for k, v in fnn.to_state_dict(params).items()}
    assert shapes == {
        "layers.0.in_proj.weight": (15, 5), "layers.0.in_proj.bias": (15,),
        "layers.0.out_proj.weight": (5, 15), "layers.0.out_proj.bias": (5,),
        "layers.1.in_proj.weight": (20, 5), "layers.1.in_proj.bias": (20,),
        "layers.1.out_proj.weight": (5, 20), "layers.1.out_proj.bias": (5,),
    }
    # functionalize on the module twin gives the same tree, values included.
    _, from_module, _ = fnn.functionalize(MLPStackModule(cfg, seed=0))
    assert_close(from_module, params, rtol=0, atol=0)
    assert_close(mlp_stack_init(cfg, seed=0), params, rtol=0, atol=0, what="same seed")
    assert not torch.equal(mlp_stack_init(cfg, seed=1)["layers"][0]["in_proj"]["weight"],
                           params["layers"][0]["in_proj"]["weight"])


def test_mlp_without_bias_equals_module():
    cfg = MLPConfig(dim=4, dim_multiplier=3, bias=False)
    params = mlp_init(cfg, seed=0, dtype=F64)
    assert set(params["in_proj"]) == {"weight"}
    x = torch.randn(3, 4, dtype=F64)
    assert_close(mlp_apply(params, x, cfg), MLPModule(cfg, seed=0, dtype=F64)(x), **TIGHT)


def test_per_example_grads_equal_a_loop():
    cfg = MLPStackConfig(dim=3)
    params = mlp_stack_init(cfg, seed=0, dtype=F64)
    xs, ys = torch.randn(6, 3, dtype=F64), torch.randn(6, 3, dtype=F64)

    def loss(p, x, y):
        return (mlp_stack_apply(p, x, cfg) - y).square().sum()

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    for i in range(len(xs)):
        assert_close(fs.tree.tree_map(lambda g: g[i], batched),
                     torch.func.grad(loss)(params, xs[i], ys[i]), **TIGHT, what=f"example {i}")


def test_init_sharded_equals_init_on_one_process():
    cfg = MLPStackConfig(dim=17)
    mesh = fs.make_mesh({"x": 1})
    specs = fs.tree.tree_map(lambda _: fs.P("x"), mlp_stack_init(cfg, seed=0))
    sharded = fs.init_sharded(lambda s: mlp_stack_init(cfg, s), specs, mesh, seed=3)
    assert_close(fs.gather(sharded), mlp_stack_init(cfg, seed=3), rtol=0, atol=0)


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match=r"MLPConfig.dim must be a positive int, got 0"):
        MLPConfig(dim=0)
    with pytest.raises(ValueError, match=r"MLPStackConfig.dim_multipliers must be a positive int, got -1"):
        MLPStackConfig(dim=3, dim_multipliers=(3, -1))
    with pytest.raises(ValueError, match="at least one layer"):
        MLPStackConfig(dim=3, dim_multipliers=())
