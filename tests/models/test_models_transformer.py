"""Transformer: pure functions equal the nn.Module twin; pieces compose; vmap; sharded init."""

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard import nn as fnn
from fshard.models import (
    TransformerConfig,
    TransformerModule,
    attention,
    block,
    embed,
    head,
    transformer_apply,
    transformer_init,
)
from fshard.testing import assert_close

TIGHT = dict(rtol=1e-12, atol=1e-12)
F64 = torch.float64
# PyTorch's distributed test-suite ModelArgs: vocab 8, dim 16, 2 layers, 4 heads, 16 positions.
SUITE = TransformerConfig(vocab_size=8, dim=16, n_layers=2, n_heads=4, max_seq_len=16)


def _tokens(b: int, t: int, vocab: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


@pytest.mark.parametrize("tie_weights", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_equals_module_outputs_and_grads(tie_weights, activation):
    cfg = TransformerConfig(vocab_size=11, dim=12, n_layers=2, n_heads=3, max_seq_len=10,
                            tie_weights=tie_weights, activation=activation)
    params = transformer_init(cfg, seed=5, dtype=F64)
    module = TransformerModule(cfg, seed=5, dtype=F64)
    tokens, targets = _tokens(3, 7, 11, seed=1), _tokens(3, 7, 11, seed=2)

    assert_close(transformer_apply(params, tokens, cfg), module(tokens), **TIGHT, what="logits")
    grads = torch.func.grad(lambda p: _loss(transformer_apply(p, tokens, cfg), targets))(params)
    _loss(module(tokens), targets).backward()
    assert_close(fnn.to_state_dict(grads), {n: p.grad for n, p in module.named_parameters()},
                 **TIGHT, what="grad")


def test_module_twin_functionalizes_to_the_init_tree():
    for tie in (False, True):
        cfg = TransformerConfig(8, 16, 2, 4, 16, tie_weights=tie)
        _, from_module, buffers = fnn.functionalize(TransformerModule(cfg, seed=0))
        params = transformer_init(cfg, seed=0)
        assert list(fnn.to_state_dict(from_module)) == list(fnn.to_state_dict(params))
        assert_close(from_module, params, rtol=0, atol=0)
        assert buffers == {} and ("output" in params) is not tie


def test_param_paths_and_shapes():
    params = transformer_init(SUITE, seed=0)
    shapes = {k: tuple(v.shape) for k, v in fnn.to_state_dict(params).items()}
    assert len(params["layers"]) == 2
    assert shapes["tok_embeddings.weight"] == (8, 16)
    assert shapes["pos_embeddings.weight"] == (16, 16)
    assert shapes["layers.1.attention.wq.weight"] == (16, 16)
    assert shapes["layers.1.feed_forward.w1.weight"] == (64, 16)
    assert shapes["layers.1.feed_forward.w2.weight"] == (16, 64)
    assert shapes["output.weight"] == (8, 16)
    assert sorted(params["layers"][0]) == ["attention", "attention_norm", "feed_forward", "ffn_norm"]


def test_apply_is_embed_blocks_head():
    params = transformer_init(SUITE, seed=0, dtype=F64)
    tokens = _tokens(2, 16)
    x = embed(params, tokens, SUITE)
    for layer in params["layers"]:
        x = block(layer, x, SUITE)
    torch.testing.assert_close(head(params, x, SUITE), transformer_apply(params, tokens, SUITE), **TIGHT)


def test_attention_on_head_shards_sums_to_full_attention():
    # The tensor-parallel contract: wq/wk/wv split by rows (whole heads), wo by columns;
    # each shard's attention() is a partial sum of the full output.
    cfg = SUITE
    attn = transformer_init(cfg, seed=0, dtype=F64)["layers"][0]["attention"]
    x = torch.randn(2, 5, cfg.dim, dtype=F64)
    tp, rows = 2, cfg.dim // 2
    partial = [
        attention({"wq": {"weight": attn["wq"]["weight"][r * rows:(r + 1) * rows]},
                   "wk": {"weight": attn["wk"]["weight"][r * rows:(r + 1) * rows]},
                   "wv": {"weight": attn["wv"]["weight"][r * rows:(r + 1) * rows]},
                   "wo": {"weight": attn["wo"]["weight"][:, r * rows:(r + 1) * rows]}}, x, cfg)
        for r in range(tp)
    ]
    torch.testing.assert_close(sum(partial), attention(attn, x, cfg), **TIGHT)


def test_dropout_in_training_matches_module_with_same_rng():
    cfg = TransformerConfig(8, 16, 2, 4, 16, dropout=0.25, tie_weights=True)
    params = transformer_init(cfg, seed=0, dtype=F64)
    module = TransformerModule(cfg, seed=0, dtype=F64).train()
    tokens = _tokens(2, 9)
    torch.manual_seed(123)
    ref = module(tokens)
    torch.manual_seed(123)
    out = transformer_apply(params, tokens, cfg, training=True)
    torch.testing.assert_close(out, ref, **TIGHT)
    # Without training=True dropout is off, like module.eval().
    torch.testing.assert_close(transformer_apply(params, tokens, cfg), module.eval()(tokens), **TIGHT)


# torch has no vmap rule for CPU flash attention yet and loops over examples; the values
# are right, only slower.
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_per_example_grads_equal_a_loop():
    cfg = TransformerConfig(8, 16, 2, 4, 16, tie_weights=True)
    params = transformer_init(cfg, seed=0, dtype=F64)
    tokens, targets = _tokens(4, 6, seed=1), _tokens(4, 6, seed=2)

    def loss(p, tok, tgt):  # one example: tok and tgt are (T,)
        return _loss(transformer_apply(p, tok[None], cfg), tgt[None])

    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, tokens, targets)
    for i in range(len(tokens)):
        assert_close(fs.tree.tree_map(lambda g: g[i], batched),
                     torch.func.grad(loss)(params, tokens[i], targets[i]), **TIGHT, what=f"example {i}")


@pytest.mark.parametrize("tie_weights", [False, True])
def test_init_sharded_equals_init_on_one_process(tie_weights):
    cfg = TransformerConfig(8, 16, 2, 4, 16, tie_weights=tie_weights)
    mesh = fs.make_mesh({"x": 1})
    specs = fs.tree.tree_map(lambda _: fs.P("x"), transformer_init(cfg, seed=0))
    sharded = fs.init_sharded(lambda s: transformer_init(cfg, s), specs, mesh, seed=11)
    assert_close(fs.gather(sharded), transformer_init(cfg, seed=11), rtol=0, atol=0)


def test_bad_inputs_and_configs():
    params = transformer_init(SUITE, seed=0)
    with pytest.raises(ValueError, match="sequence length 17 exceeds cfg.max_seq_len=16"):
        transformer_apply(params, _tokens(1, 17), SUITE)
    with pytest.raises(ValueError, match=r"tokens must have shape \(B, T\), got \(5,\)"):
        transformer_apply(params, _tokens(1, 5)[0], SUITE)
    with pytest.raises(ValueError, match="dim=10 is not a multiple of n_heads=4"):
        TransformerConfig(8, 10, 2, 4, 16)
    with pytest.raises(ValueError, match=r"activation='swish'; choose one of \['gelu', 'relu'\]"):
        TransformerConfig(8, 16, 2, 4, 16, activation="swish")
    with pytest.raises(ValueError, match="n_layers must be a positive int"):
        TransformerConfig(8, 16, 0, 4, 16)
    with pytest.raises(ValueError, match=r"dropout=1.0 must be in \[0, 1\)"):
        TransformerConfig(8, 16, 2, 4, 16, dropout=1.0)
