"""functionalize: outputs, gradients, buffers and ties equal the module's own; state-dict names."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fshard import nn as fnn
from fshard import tree as tree_util
from fshard.models import MLPStackConfig, MLPStackModule, TransformerConfig, TransformerModule
from fshard.testing import assert_close

TIGHT = dict(rtol=1e-12, atol=1e-12)


def _module_grads(module: nn.Module, loss_fn) -> dict[str, torch.Tensor]:
    module.zero_grad()
    loss_fn(module).backward()
    return {n: p.grad for n, p in module.named_parameters()}


def _check_matches_module(module: nn.Module, x: torch.Tensor) -> None:
    ref = copy.deepcopy(module)
    apply, params, _ = fnn.functionalize(module)
    assert_close(apply(params, x), ref(x), **TIGHT, what="output")
    grads = torch.func.grad(lambda p: apply(p, x).square().sum())(params)
    ref_grads = _module_grads(ref, lambda m: m(x).square().sum())
    assert_close(fnn.to_state_dict(grads), ref_grads, **TIGHT, what="grad")


def test_mlp_stack_matches_module():
    module = MLPStackModule(MLPStackConfig(dim=5), seed=1, dtype=torch.float64)
    _check_matches_module(module, torch.randn(4, 5, dtype=torch.float64))


def test_tied_transformer_matches_module_and_tie_is_one_leaf():
    cfg = TransformerConfig(vocab_size=8, dim=16, n_layers=2, n_heads=4, max_seq_len=16, tie_weights=True)
    module = TransformerModule(cfg, seed=0, dtype=torch.float64)
    tokens = torch.randint(0, 8, (2, 9), generator=torch.Generator().manual_seed(0))
    _check_matches_module(module, tokens)

    apply, params, _ = fnn.functionalize(module)
    assert "output" not in params
    assert "output.weight" in module.state_dict()  # the module still has both names
    # The gradient of the tied leaf is the sum over both uses: compare with an untied copy.
    untied = copy.deepcopy(module)
    untied.output.weight = nn.Parameter(untied.tok_embeddings.weight.detach().clone())
    grads = _module_grads(untied, lambda m: m(tokens).square().sum())
    tied_grad = torch.func.grad(lambda p: apply(p, tokens).square().sum())(params)
    torch.testing.assert_close(tied_grad["tok_embeddings"]["weight"],
                               grads["tok_embeddings.weight"] + grads["output.weight"], **TIGHT)


class _SharedTwice(nn.Module):
    """The same Parameter registered under two names (bad input: must stay tied)."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
        self.w_out = self.w_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.w_in)), self.w_out)


def test_parameter_shared_under_two_names_stays_tied():
    module = _SharedTwice()
    x = torch.randn(2, 3, dtype=torch.float64)
    apply, params, _ = fnn.functionalize(module)
    assert list(params) == ["w_in"]
    _check_matches_module(module, x)
    # A new value for the one leaf reaches both uses.
    w = torch.randn(3, 3, dtype=torch.float64)
    torch.testing.assert_close(apply({"w_in": w}, x), F.linear(torch.tanh(F.linear(x, w)), w), **TIGHT)


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double()


def test_batchnorm_train_returns_new_buffers_and_leaves_old_ones():
    module = _bn_net().train()
    ref = copy.deepcopy(module)
    x = torch.randn(8, 4, dtype=torch.float64)
    apply, params, buffers = fnn.functionalize(module)
    assert params[2] == {}  # the ReLU's hole keeps the indices equal to the names
    before = {n: b.clone() for n, b in fnn.to_state_dict(buffers).items()}

    out, new = apply(params, x, buffers=buffers, return_buffers=True)
    assert_close(out, ref(x), **TIGHT, what="output")
    assert_close(fnn.to_state_dict(new), dict(ref.named_buffers()), **TIGHT, what="buffers")
    assert int(new[1]["num_batches_tracked"]) == 1
    # Neither the caller's buffers nor the module's own changed.
    assert_close(fnn.to_state_dict(buffers), before, rtol=0, atol=0, what="old buffers")
    assert_close(dict(module.named_buffers()), before, rtol=0, atol=0, what="module buffers")

    # Threading the state through a second step equals the module's second step.
    out2, new2 = apply(params, x * 2, buffers=new, return_buffers=True)
    assert_close(out2, ref(x * 2), **TIGHT, what="output 2")
    assert_close(fnn.to_state_dict(new2), dict(ref.named_buffers()), **TIGHT, what="buffers 2")

    grads = torch.func.grad(lambda p: apply(p, x, return_buffers=True)[0].sum())(params)
    ref2 = copy.deepcopy(module)
    assert_close(fnn.to_state_dict(grads), _module_grads(ref2, lambda m: m(x).sum()), **TIGHT, what="grad")


def test_batchnorm_update_without_return_buffers_is_an_error_and_eval_is_not():
    module = _bn_net().train()
    apply, params, buffers = fnn.functionalize(module)
    x = torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"updated buffers of \['1'\] \(seen: 1.num_batches_tracked\).*return_buffers=True"):
        apply(params, x)
    module.eval()
    assert_close(apply(params, x), copy.deepcopy(module)(x), **TIGHT, what="eval output")


def test_state_dict_round_trip_uses_module_names():
    module = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.ModuleDict({"a": nn.Linear(3, 3)}),
                           nn.BatchNorm1d(3))
    _, params, buffers = fnn.functionalize(module)
    assert params[1] == {} and list(params[2]) == ["a"]
    flat = fnn.to_state_dict(params)
    assert list(flat) == ["0.weight", "0.bias", "2.a.weight", "2.a.bias", "3.weight", "3.bias"]
    assert {**flat, **fnn.to_state_dict(buffers)}.keys() == module.state_dict().keys()
    assert_close(fnn.from_state_dict(flat), params, rtol=0, atol=0, what="round trip")
    # A module's own state_dict nests the same way (buffers included).
    nested = fnn.from_state_dict(module.state_dict())
    assert_close(nested[3]["running_var"], buffers[3]["running_var"], rtol=0, atol=0)
    assert_close(fnn.to_state_dict(nested), dict(module.state_dict()), rtol=0, atol=0)


def test_load_state_copies_values_into_the_module():
    cfg = TransformerConfig(vocab_size=8, dim=8, n_layers=1, n_heads=2, max_seq_len=4, tie_weights=True)
    a, b = TransformerModule(cfg, seed=0), TransformerModule(cfg, seed=1)
    _, params_b, _ = fnn.functionalize(b)
    fnn.load_state(a, params_b)
    assert_close(dict(a.named_parameters()), dict(b.named_parameters()), rtol=0, atol=0)
    assert a.output.weight is a.tok_embeddings.weight


def test_per_example_grads_through_functional_call():
    module = MLPStackModule(MLPStackConfig(dim=3), seed=0, dtype=torch.float64)
    apply, params, _ = fnn.functionalize(module)
    xs, ys = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)

    def loss(p, x, y):
        return (apply(p, x) - y).square().sum()

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    for i in range(5):
        assert_close(tree_util.tree_map(lambda g: g[i], batched),
                     torch.func.grad(loss)(params, xs[i], ys[i]), **TIGHT, what=f"example {i}")


def test_bad_trees_name_the_paths():
    module = MLPStackModule(MLPStackConfig(dim=3))
    apply, params, _ = fnn.functionalize(module)
    x = torch.randn(2, 3)
    broken = copy.copy(params)
    broken["layers"] = [dict(layer) for layer in params["layers"]]
    del broken["layers"][1]["in_proj"]
    broken["layers"][0]["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing: +layers.1.in_proj.bias, layers.1.in_proj.weight"
                                         r"(.|\n)*unexpected: layers.0.extra"):
        apply(broken, x)
    with pytest.raises(TypeError, match="must be the nested tree"):
        apply(torch.zeros(3), x)
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fnn.functionalize(lambda x: x)
    with pytest.raises(ValueError, match="contains '.'"):
        fnn.to_state_dict({"a.b": torch.zeros(1)})
    with pytest.raises(ValueError, match="'a' is a leaf"):
        fnn.from_state_dict({"a": torch.zeros(1), "a.b": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"layers.0.in_proj.weight: given \(1,\)"):
        fnn.load_state(module, fnn.from_state_dict(
            {**fnn.to_state_dict(params), "layers.0.in_proj.weight": torch.zeros(1)}))
