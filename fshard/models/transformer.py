"""A decoder-only Transformer as pure functions over a parameter pytree.

The architecture is the toy Transformer of PyTorch's distributed test suite (itself
after nanoGPT): token + learned position embeddings, pre-norm blocks of causal
self-attention and a two-layer MLP, a final LayerNorm and an output projection that
may share the token embedding's weight. ``TransformerModule`` is the same model as an
``nn.Module`` (``nn.Linear``/``nn.Embedding``/``nn.LayerNorm``, so torch's own
``fully_shard`` and ``parallelize_module`` apply to it) for parity tests and benchmarks.

The model is split where parallel code needs to cut it::

    x = embed(params, tokens, cfg)                     # (B, T, D)
    for layer_params in params["layers"]:
        x = block(layer_params, x, cfg)                # (B, T, D), one per-layer FSDP unit
    logits = head(params, x, cfg)                      # (B, T, V)

``block`` itself is ``x + attention(...)`` then ``x + feed_forward(...)``, both exposed
so tensor-parallel code can put its reduction between the projection and the residual.

Param tree (leaf paths are the ``state_dict`` names of ``TransformerModule``; weights
in torch's ``[out, in]`` layout; ``H`` heads of size ``D / H``, MLP width ``F``)::

    tok_embeddings.weight                  [V, D]
    pos_embeddings.weight                  [max_seq_len, D]
    layers.{i}.attention_norm.weight/bias  [D]
    layers.{i}.attention.wq.weight         [D, D]   (rows grouped by head)
    layers.{i}.attention.wk.weight         [D, D]
    layers.{i}.attention.wv.weight         [D, D]
    layers.{i}.attention.wo.weight         [D, D]   (columns grouped by head)
    layers.{i}.ffn_norm.weight/bias        [D]
    layers.{i}.feed_forward.w1.weight      [F, D]    w1.bias [F]
    layers.{i}.feed_forward.w2.weight      [D, F]    w2.bias [D]
    norm.weight/bias                       [D]
    output.weight                          [V, D]   (absent when cfg.tie_weights)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from fshard.nn import load_state

__all__ = [
    "TransformerConfig",
    "TransformerModule",
    "attention",
    "block",
    "embed",
    "feed_forward",
    "head",
    "transformer_apply",
    "transformer_init",
]

Params = dict[str, Any]

# A table, not an if-chain: adding an activation is one line.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": F.gelu, "relu": F.relu}
_INIT_STD = 0.02  # GPT-2's embedding and projection scale


def _check_positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a positive int, got {value!r}.")


@attrs.frozen
class TransformerConfig:
    """Shapes and choices of the decoder-only Transformer.

    Attributes:
      vocab_size: ``V``, number of token ids.
      dim: ``D``, the residual width.
      n_layers: number of blocks.
      n_heads: ``H``; ``dim`` must be a multiple of it.
      max_seq_len: rows of the position embedding; longer inputs are an error.
      mlp_ratio: the MLP's hidden width is ``F = mlp_ratio * dim`` (torch's suite: 4).
      tie_weights: the output projection reuses ``tok_embeddings.weight`` (no
        ``output`` entry in the params).
      activation: ``"gelu"`` (torch's suite) or ``"relu"``.
      dropout: probability for the embedding, attention and residual dropouts; they
        only act when a function is called with ``training=True`` (0 by default, so
        that the model is deterministic and mesh-invariant).
      norm_eps: LayerNorm epsilon.
    """

    vocab_size: int = attrs.field(validator=_check_positive)
    dim: int = attrs.field(validator=_check_positive)
    n_layers: int = attrs.field(validator=_check_positive)
    n_heads: int = attrs.field(validator=_check_positive)
    max_seq_len: int = attrs.field(validator=_check_positive)
    mlp_ratio: int = attrs.field(default=4, validator=_check_positive)
    tie_weights: bool = False
    activation: str = "gelu"
    dropout: float = 0.0
    norm_eps: float = 1e-5

    def __attrs_post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"TransformerConfig: dim={self.dim} is not a multiple of n_heads={self.n_heads}.")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"TransformerConfig.activation={self.activation!r}; choose one of {sorted(_ACTIVATIONS)}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TransformerConfig.dropout={self.dropout!r} must be in [0, 1).")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.mlp_ratio * self.dim


# ---------------------------------------------------------------------------
# init
# ---------------------------------------------------------------------------


def transformer_init(cfg: TransformerConfig, seed: int, *, dtype: torch.dtype = torch.float32) -> Params:
    """Draws the parameters from a generator seeded with ``seed`` (GPT-2 style).

    Embeddings and projections are ``N(0, 0.02)``; the two projections that write into
    the residual stream (``wo``, ``w2``) use ``0.02 / sqrt(2 * n_layers)`` so the
    residual's variance does not grow with depth; biases are 0 and norms are 1/0. Only
    shape-driven ops are used (``normal_``, ``zeros``, ``ones``; no ``trunc_normal_``),
    so ``fshard.init_sharded`` can replay it shard by shard. The draw order
    (embeddings, then each layer's wq, wk, wv, wo, w1, w2, then output) is part of the
    definition: changing it changes the values for a seed.

    Args:
      cfg: the model's shapes.
      seed: seed of the private ``torch.Generator`` (the global RNG is not touched).
      dtype: dtype of the parameters; values are drawn in this dtype.

    Returns:
      The param tree described in the module docstring, on CPU.
    """
    g = torch.Generator().manual_seed(seed)
    resid_std = _INIT_STD / math.sqrt(2 * cfg.n_layers)

    def normal(*shape: int, std: float = _INIT_STD) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=g)

    def norm() -> Params:
        return {"weight": torch.ones(cfg.dim, dtype=dtype), "bias": torch.zeros(cfg.dim, dtype=dtype)}

    D, hidden, V = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    params: Params = {
        "tok_embeddings": {"weight": normal(V, D)},
        "pos_embeddings": {"weight": normal(cfg.max_seq_len, D)},
        "layers": [],
    }
    for _ in range(cfg.n_layers):
        params["layers"].append(
            {
                "attention_norm": norm(),
                "attention": {
                    "wq": {"weight": normal(D, D)},
                    "wk": {"weight": normal(D, D)},
                    "wv": {"weight": normal(D, D)},
                    "wo": {"weight": normal(D, D, std=resid_std)},
                },
                "ffn_norm": norm(),
                "feed_forward": {
                    "w1": {"weight": normal(hidden, D), "bias": torch.zeros(hidden, dtype=dtype)},
                    "w2": {"weight": normal(D, hidden, std=resid_std), "bias": torch.zeros(D, dtype=dtype)},
                },
            }
        )
    params["norm"] = norm()
    if not cfg.tie_weights:
        params["output"] = {"weight": normal(V, D)}
    return params


# ---------------------------------------------------------------------------
# The pieces
# ---------------------------------------------------------------------------


def _dropout(x: torch.Tensor, cfg: TransformerConfig, training: bool) -> torch.Tensor:
    # Skipping the call at p=0 saves a kernel and leaves the global RNG alone.
    if training and cfg.dropout > 0.0:
        return F.dropout(x, cfg.dropout, training=True)
    return x


def _layer_norm(norm_params: Params, x: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), norm_params["weight"], norm_params["bias"], cfg.norm_eps)


def embed(
    params: Params,
    tokens: torch.Tensor,
    cfg: TransformerConfig,
    *,
    training: bool = False,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token plus position embeddings.

    Args:
      params: the model's tree (reads ``tok_embeddings`` and ``pos_embeddings``).
      tokens: int64 token ids of shape ``(B, T)`` with ``T <= cfg.max_seq_len``.
      cfg: the model's config.
      training: apply dropout (only matters when ``cfg.dropout > 0``).
      positions: int64 ``(T,)``, each token's position in its sequence (default
        ``arange(T)``); a context-parallel rank passes ``fs.parallel.cp_positions``.

    Returns:
      Activations of shape ``(B, T, D)``.

    Raises:
      ValueError: ``tokens`` is not 2-d, or ``T > cfg.max_seq_len``.
    """
    if tokens.dim() != 2:
        raise ValueError(f"embed: tokens must have shape (B, T), got {tuple(tokens.shape)}.")
    T = tokens.shape[1]
    if positions is None and T > cfg.max_seq_len:
        raise ValueError(f"embed: sequence length {T} exceeds cfg.max_seq_len={cfg.max_seq_len}.")
    pos = torch.arange(T, device=tokens.device) if positions is None else positions.to(tokens.device)  # (T,)
    x = F.embedding(tokens, params["tok_embeddings"]["weight"])  # (B, T, D)
    x = x + F.embedding(pos, params["pos_embeddings"]["weight"])  # (B, T, D) + (T, D)
    return _dropout(x, cfg, training)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention(
    attn_params: Params,
    x: torch.Tensor,
    cfg: TransformerConfig,
    *,
    training: bool = False,
    output_dropout: bool = True,
    attend: Attend | None = None,
) -> torch.Tensor:
    """Causal multi-head self-attention, ``wo(sdpa(wq x, wk x, wv x))``.

    The number of heads is read from ``wq``'s shape (``rows / head_dim``), so the same
    function runs on a tensor-parallel shard holding whole heads: with ``wq``, ``wk``,
    ``wv`` split by rows and ``wo`` by columns, it returns this rank's partial sum of
    the output, which the caller reduces.

    Args:
      attn_params: ``{"wq", "wk", "wv", "wo"}`` of one layer.
      x: normalized input of shape ``(B, T, D)``.
      cfg: the model's config (``head_dim`` and ``dropout``).
      training: apply attention and residual dropout.
      output_dropout: with ``training``, also drop out the output (the residual
        dropout). A tensor-parallel caller passes False: its output is a partial sum,
        and the dropout belongs after the reduction.
      attend: ``attend(q, k, v) -> y`` on ``(B, H, T, hd)``, the causal attention itself
        (default: SDPA); a context-parallel caller passes ``fs.parallel.ring_attention``
        over its axis. It has no dropout: ``training`` with ``cfg.dropout > 0`` is refused.

    Returns:
      Output of shape ``(B, T, D)`` (a partial sum when the weights are TP shards).
    """
    B, T, _ = x.shape
    hd = cfg.head_dim
    q = F.linear(x, attn_params["wq"]["weight"])  # (B, T, H * hd)
    k = F.linear(x, attn_params["wk"]["weight"])  # (B, T, H * hd)
    v = F.linear(x, attn_params["wv"]["weight"])  # (B, T, H * hd)
    H = q.shape[-1] // hd  # local heads under tensor parallelism
    q = q.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
    k = k.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
    v = v.view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
    p_drop = cfg.dropout if training else 0.0
    if attend is None:
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, is_causal=True)  # (B, H, T, hd)
    elif p_drop > 0.0:
        raise ValueError(
            f"attention: attend={getattr(attend, '__qualname__', type(attend).__name__)} has no attention "
            f"dropout, and cfg.dropout is {cfg.dropout}: train with cfg.dropout=0, or without attend."
        )
    else:
        y = attend(q, k, v)  # (B, H, T, hd)
    y = y.transpose(1, 2).reshape(B, T, H * hd)  # (B, T, H * hd)
    y = F.linear(y, attn_params["wo"]["weight"])  # (B, T, D)
    return _dropout(y, cfg, training and output_dropout)


def feed_forward(
    ffn_params: Params, x: torch.Tensor, cfg: TransformerConfig, *, training: bool = False
) -> torch.Tensor:
    """``w2(act(w1 x))``.

    Under tensor parallelism (``w1`` split by rows, ``w2`` by columns) this returns a
    partial sum, and ``w2``'s bias must be added once, after the reduction.

    Args:
      ffn_params: ``{"w1": {"weight", "bias"}, "w2": {"weight", "bias"}}`` of one layer.
      x: normalized input of shape ``(B, T, D)``.
      cfg: the model's config (``activation`` and ``dropout``).
      training: apply residual dropout.

    Returns:
      Output of shape ``(B, T, D)``.
    """
    w1, w2 = ffn_params["w1"], ffn_params["w2"]
    h = _ACTIVATIONS[cfg.activation](F.linear(x, w1["weight"], w1["bias"]))  # (B, T, F)
    y = F.linear(h, w2["weight"], w2["bias"])  # (B, T, D)
    return _dropout(y, cfg, training)


def block(
    layer_params: Params,
    x: torch.Tensor,
    cfg: TransformerConfig,
    *,
    training: bool = False,
    attend: Attend | None = None,
    ffn: Callable[[Params, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One pre-norm block: ``x + attention(norm(x))``, then ``x + feed_forward(norm(x))``.

    Args:
      layer_params: ``params["layers"][i]``.
      x: residual stream of shape ``(B, T, D)``.
      cfg: the model's config.
      training: apply dropout.
      attend: as in :func:`attention`.
      ffn: ``ffn(layer_params, h) -> (B, T, D)`` in place of :func:`feed_forward` on the
        normalized ``h`` (a mixture of experts, reading its own entries of ``layer_params``).

    Returns:
      The residual stream after the block, ``(B, T, D)``.
    """
    h = _layer_norm(layer_params["attention_norm"], x, cfg)
    x = x + attention(layer_params["attention"], h, cfg, training=training, attend=attend)
    h = _layer_norm(layer_params["ffn_norm"], x, cfg)
    if ffn is not None:
        return x + ffn(layer_params, h)
    return x + feed_forward(layer_params["feed_forward"], h, cfg, training=training)


def head(params: Params, x: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    """Final LayerNorm and output projection (``tok_embeddings.weight`` when tied).

    Args:
      params: the model's tree (reads ``norm`` and ``output``, or ``tok_embeddings``
        when ``cfg.tie_weights``).
      x: residual stream of shape ``(B, T, D)``.
      cfg: the model's config.

    Returns:
      Logits of shape ``(B, T, V)``, in the parameters' dtype.
    """
    x = _layer_norm(params["norm"], x, cfg)
    w_out = params["tok_embeddings"]["weight"] if cfg.tie_weights else params["output"]["weight"]
    return F.linear(x, w_out)  # (B, T, V)


def transformer_apply(
    params: Params, tokens: torch.Tensor, cfg: TransformerConfig, *, training: bool = False
) -> torch.Tensor:
    """The whole model: ``head(block(...block(embed(tokens))))``.

    Dropout (``training=True`` with ``cfg.dropout > 0``) draws from torch's global RNG,
    like ``nn.Dropout``; under ``torch.func.vmap`` pass ``randomness="different"``.

    Args:
      params: the tree from :func:`transformer_init` (or any tree with its paths).
      tokens: int64 token ids of shape ``(B, T)``.
      cfg: the model's config.
      training: apply dropout.

    Returns:
      Logits of shape ``(B, T, V)``.
    """
    x = embed(params, tokens, cfg, training=training)  # (B, T, D)
    for layer_params in params["layers"]:
        x = block(layer_params, x, cfg, training=training)  # (B, T, D)
    return head(params, x, cfg)  # (B, T, V)


# ---------------------------------------------------------------------------
# nn.Module twin: TransformerModule(cfg).state_dict() names == param tree paths
# ---------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False, dtype=dtype)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        H, hd = self.cfg.n_heads, self.cfg.head_dim
        q = self.wq(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        v = self.wv(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        p_drop = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, is_causal=True)  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        return self.resid_dropout(self.wo(y))


class _FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, dtype=dtype)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, dtype=dtype)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.act(self.w1(x))))


class _Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype)
        self.attention = _Attention(cfg, dtype)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype)
        self.feed_forward = _FeedForward(cfg, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TransformerModule(nn.Module):
    """The Transformer as an ``nn.Module``, holding :func:`transformer_init`'s values.

    ``fshard.nn.functionalize(TransformerModule(cfg, seed))`` gives exactly the tree of
    ``transformer_init(cfg, seed)``; with ``cfg.tie_weights`` the module's
    ``output.weight`` *is* ``tok_embeddings.weight`` (one leaf in the tree). To load other
    values use ``fshard.nn.load_state(module, params)``.

    Args:
      cfg: the model's config.
      seed: passed to :func:`transformer_init`.
      dtype: dtype of the parameters.
    """

    def __init__(self, cfg: TransformerConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=dtype)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim, dtype=dtype)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(_Block(cfg, dtype) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=dtype)
        if cfg.tie_weights:
            self.output.weight = self.tok_embeddings.weight
        load_state(self, transformer_init(cfg, seed, dtype=dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"TransformerModule: sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}.")
        pos = torch.arange(T, device=tokens.device)  # (T,)
        x = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(pos))  # (B, T, D)
        for layer in self.layers:
            x = layer(x)  # (B, T, D)
        return self.output(self.norm(x))  # (B, T, V)
