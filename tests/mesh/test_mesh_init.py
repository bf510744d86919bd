"""init_sharded equals the one-process init bit for bit, on 1, 2 and 4 ranks, within one parameter of memory."""

import math

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks


def init_fn(seed):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    tok = torch.randn(32, 8) * 0.02
    layers = []
    for _ in range(3):
        wq = torch.empty(8, 8)
        torch.nn.init.normal_(wq, std=0.1).clamp_(-0.25, 0.25)
        lin = torch.nn.Linear(8, 16)  # kaiming_uniform_ through nn.init
        layers.append({"wq": wq, "w1": lin.weight.detach(), "b1": lin.bias.detach(), "ln": torch.ones(8)})
    out = torch.randn(32, 8, generator=gen)
    return {"tok": tok, "layers": layers, "out": out, "tied": tok, "wq0_t": layers[0]["wq"].t()}


def _specs(axes):
    a, b = axes[0], axes[-1]
    return {"tok": P(a), "layers": [{"wq": P(None, b), "w1": P(tuple(axes)), "b1": P(a), "ln": P()}] * 3,
            "out": P(a, b) if a != b else P(a), "tied": P(), "wq0_t": P(b)}


def _body(shape, seed):
    mesh = fs.make_mesh(shape)
    got, stats = fs.init_sharded(init_fn, _specs(list(shape)), mesh, seed, return_stats=True)
    ref = init_fn(seed)
    full = fs.gather(got)
    equal = [torch.equal(a, b) for a, b in zip(fs.tree.leaves(full), fs.tree.leaves(ref))]
    total = sum(x.numel() * x.element_size() for x in fs.tree.leaves(ref))
    return equal, stats, total


@pytest.mark.parametrize("shape", [{"x": 1}, {"x": 2}, {"x": 4}, {"a": 2, "b": 2}])
def test_init_sharded_equals_one_process_init(shape):
    for equal, stats, total in run_on_ranks(_body, shape, 7, world_size=math.prod(shape.values())):
        assert all(equal) and len(equal) == 16
        # Never more than one parameter's full value and its temporaries at once.
        assert stats.peak_bytes <= 2 * stats.max_param_bytes < total


def test_init_sharded_spec_error_lists_path():
    mesh = fs.make_mesh({"x": 1})
    with pytest.raises(ValueError, match=r"layers\.0\.wq.*'nope'"):
        fs.init_sharded(init_fn, {"tok": P(), "layers": [{"wq": P("nope"), "w1": P(), "b1": P(), "ln": P()}] * 3,
                                  "out": P(), "tied": P(), "wq0_t": P()}, mesh, 0)


def test_data_dependent_init_is_a_clear_error():
    mesh = fs.make_mesh({"x": 1})

    def trunc(seed):
        torch.manual_seed(seed)
        return {"w": torch.nn.init.trunc_normal_(torch.empty(4, 4))}

    with pytest.raises(ValueError, match="trunc_normal_"):
        fs.init_sharded(trunc, P(), mesh, 0)
