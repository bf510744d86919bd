"""MLP and MLPStack as pure functions, with ``nn.Module`` twins for parity tests.

The shapes are those of PyTorch's FSDP2/TP test suites (``MLP(dim, dim_multiplier)``
and ``MLPStack``, whose hidden sizes ``3 * dim`` and ``4 * dim`` with dims like 3, 5
or 17 split unevenly over 2 or 4 ranks). One difference: torch's test ``MLP`` applies
a ReLU after ``out_proj`` too; this one is Linear-ReLU-Linear.

Every model in ``fshard.models`` has the same four parts::

    cfg = MLPStackConfig(dim=16)                 # frozen config: shapes and choices
    params = mlp_stack_init(cfg, seed=0)         # pytree of tensors, torch's [out, in] layout
    y = mlp_stack_apply(params, x, cfg)          # pure function of (params, inputs)
    module = MLPStackModule(cfg, seed=0)         # the same model as an nn.Module

Param tree of an MLP (names match ``nn.Linear``, so ``state_dict`` names line up)::

    in_proj.weight  [dim * dim_multiplier, dim]    in_proj.bias  [dim * dim_multiplier]
    out_proj.weight [dim, dim * dim_multiplier]    out_proj.bias [dim]

and of an MLPStack: ``layers.{i}.<the MLP tree>``, one entry per multiplier.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from fshard.nn import load_state

__all__ = [
    "MLPConfig",
    "MLPModule",
    "MLPStackConfig",
    "MLPStackModule",
    "mlp_apply",
    "mlp_init",
    "mlp_stack_apply",
    "mlp_stack_init",
]

Params = dict[str, Any]


def _check_positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{type(instance).__name__}.{attribute.name} must be a positive int, got {value!r}.")


@attrs.frozen
class MLPConfig:
    """One Linear-ReLU-Linear block.

    Attributes:
      dim: input and output width.
      dim_multiplier: hidden width is ``dim * dim_multiplier`` (3 gives uneven shards).
      bias: whether both projections have a bias.
    """

    dim: int = attrs.field(validator=_check_positive)
    dim_multiplier: int = attrs.field(default=4, validator=_check_positive)
    bias: bool = True

    @property
    def hidden_dim(self) -> int:
        return self.dim * self.dim_multiplier


@attrs.frozen
class MLPStackConfig:
    """A sequence of MLPs of the same ``dim``; torch's ``MLPStack`` uses multipliers 3, 4, 3.

    Attributes:
      dim: width of every layer's input and output.
      dim_multipliers: one hidden-width multiplier per layer.
      bias: whether the projections have biases.
    """

    dim: int = attrs.field(validator=_check_positive)
    dim_multipliers: tuple[int, ...] = attrs.field(default=(3, 4, 3), converter=tuple)
    bias: bool = True

    @dim_multipliers.validator
    def _check_multipliers(self, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
        if not value:
            raise ValueError("MLPStackConfig.dim_multipliers must name at least one layer.")
        for m in value:
            _check_positive(self, attribute, m)

    @property
    def layers(self) -> tuple[MLPConfig, ...]:
        """The config of each layer, in order."""
        return tuple(MLPConfig(self.dim, m, self.bias) for m in self.dim_multipliers)


# ---------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------


def _linear_init(g: torch.Generator, out_dim: int, in_dim: int, bias: bool, dtype: torch.dtype) -> Params:
    # nn.Linear's default distribution, U(-1/sqrt(in), 1/sqrt(in)) for weight and bias,
    # drawn from `g` so that the same seed gives the same values on every mesh.
    bound = 1.0 / math.sqrt(in_dim)
    p = {"weight": torch.empty(out_dim, in_dim, dtype=dtype).uniform_(-bound, bound, generator=g)}
    if bias:
        p["bias"] = torch.empty(out_dim, dtype=dtype).uniform_(-bound, bound, generator=g)
    return p


def _mlp_init(cfg: MLPConfig, g: torch.Generator, dtype: torch.dtype) -> Params:
    return {
        "in_proj": _linear_init(g, cfg.hidden_dim, cfg.dim, cfg.bias, dtype),
        "out_proj": _linear_init(g, cfg.dim, cfg.hidden_dim, cfg.bias, dtype),
    }


def mlp_init(cfg: MLPConfig, seed: int, *, dtype: torch.dtype = torch.float32) -> Params:
    """Draws an MLP's parameters from a generator seeded with ``seed``.

    Only shape-driven ops (``empty``/``uniform_``) are used, so
    ``fshard.init_sharded`` can replay it shard by shard.

    Args:
      cfg: the MLP's shapes.
      seed: seed of the private ``torch.Generator`` (the global RNG is not touched).
      dtype: dtype of the parameters; values are drawn in this dtype.

    Returns:
      ``{"in_proj": {"weight", "bias"}, "out_proj": {"weight", "bias"}}`` on CPU.
    """
    return _mlp_init(cfg, torch.Generator().manual_seed(seed), dtype)


def mlp_apply(params: Params, x: torch.Tensor, cfg: MLPConfig) -> torch.Tensor:
    """``out_proj(relu(in_proj(x)))``.

    Args:
      params: an MLP tree from :func:`mlp_init`.
      x: input of shape ``(..., dim)``.
      cfg: the MLP's config (says whether there are biases).

    Returns:
      Output of shape ``(..., dim)``.
    """
    in_proj, out_proj = params["in_proj"], params["out_proj"]
    h = F.linear(x, in_proj["weight"], in_proj["bias"] if cfg.bias else None)  # (..., hidden)
    h = F.relu(h)
    return F.linear(h, out_proj["weight"], out_proj["bias"] if cfg.bias else None)  # (..., dim)


def mlp_stack_init(cfg: MLPStackConfig, seed: int, *, dtype: torch.dtype = torch.float32) -> Params:
    """Draws ``{"layers": [mlp_params, ...]}`` from one generator, layer by layer.

    Args:
      cfg: the stack's shapes.
      seed: seed of the private ``torch.Generator``.
      dtype: dtype of the parameters.

    Returns:
      ``{"layers": [...]}`` with one :func:`mlp_init`-style tree per layer, on CPU.
    """
    g = torch.Generator().manual_seed(seed)
    return {"layers": [_mlp_init(layer, g, dtype) for layer in cfg.layers]}


def mlp_stack_apply(params: Params, x: torch.Tensor, cfg: MLPStackConfig) -> torch.Tensor:
    """Runs the layers in order; each one is :func:`mlp_apply`.

    Args:
      params: the tree from :func:`mlp_stack_init`.
      x: input of shape ``(..., dim)``.
      cfg: the stack's config.

    Returns:
      Output of shape ``(..., dim)``.
    """
    for layer_params, layer_cfg in zip(params["layers"], cfg.layers, strict=True):
        x = mlp_apply(layer_params, x, layer_cfg)  # (..., dim)
    return x


# ---------------------------------------------------------------------------
# nn.Module twins: state_dict names equal the param tree's paths
# ---------------------------------------------------------------------------


class MLPModule(nn.Module):
    """:func:`mlp_apply` as a module, initialized with :func:`mlp_init` values."""

    def __init__(self, cfg: MLPConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.bias, dtype=dtype)
        self.out_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.bias, dtype=dtype)
        load_state(self, mlp_init(cfg, seed, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


class MLPStackModule(nn.Module):
    """:func:`mlp_stack_apply` as a module, initialized with :func:`mlp_stack_init` values."""

    def __init__(self, cfg: MLPStackConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(MLPModule(layer, dtype=dtype) for layer in cfg.layers)
        load_state(self, mlp_stack_init(cfg, seed, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
