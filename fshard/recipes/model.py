"""``LayeredModel``: a model as the recipes run it, and fshard's Transformer as one.

A layered model's parameters are one pytree ``{"layers": [block_0, block_1, ...], **root}``:
root parameters (embeddings, a head) around a stack of blocks of one structure. That is what
per-block FSDP (one gather group per block, ``fs.parallel.scan_layers``), pipelines (blocks
cut into stages) and remat need to know; everything else is the model's own functions, run
per device on local shards inside ``shard_map``.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F

from fshard import tree as tree_util
from fshard.models.transformer import TransformerConfig, block, embed, head, transformer_init
from fshard.parallel.cp import cp_positions, cp_shard, ring_attention
from fshard.parallel.ep import moe_ffn, moe_init
from fshard.parallel.layout import LayoutError
from fshard.parallel.tp import (
    TRANSFORMER_TP_PLAN,
    tp_embed,
    tp_logits,
    tp_transformer_block,
    vocab_parallel_cross_entropy,
)
from fshard.recipes.roles import Roles

__all__ = ["LayeredModel", "MoE", "count_params", "resolve_model", "transformer"]

Tensor = torch.Tensor


@attrs.frozen
class LayeredModel:
    """A model as pure functions of its parameters, per device.

    Attributes:
      init: ``init(seed, dtype) -> params``, the one-process values; called on the meta
        device for shapes, and by ``fs.init_sharded`` for each shard's values.
      embed: ``embed(root, inputs) -> x`` (``root``: every entry but ``layers``).
      block: ``block(layer, x) -> x``, one block of the stack.
      head: ``head(root, x) -> outputs``.
      loss: ``loss(outputs, targets) -> scalar``, the mean over this rank's rows.
      embed_keys: root entries the first pipeline stage holds (those ``embed`` reads).
      head_keys: root entries the last pipeline stage holds (those ``head`` reads).
      tp_plan: ``fs.parallel.tp_specs`` rules for a tp axis; None: the model runs no TP
        (a layout with tp is refused, naming the model).
      name: for messages.
    """

    init: Callable[[int, torch.dtype], Any]
    embed: Callable[[Any, Tensor], Tensor]
    block: Callable[[Any, Tensor], Tensor]
    head: Callable[[Any, Tensor], Tensor]
    loss: Callable[[Tensor, Tensor], Tensor]
    embed_keys: tuple[str, ...] = ()
    head_keys: tuple[str, ...] = ()
    tp_plan: Any = None
    name: str = "model"

    def specs(self, params: Any, roles: Roles) -> Any:
        """One ``P`` per parameter for ``roles`` (``Roles.param_specs`` with :attr:`tp_plan`)."""
        return roles.param_specs(params, self.tp_plan)


ModelLike = LayeredModel | Callable[[Roles], LayeredModel]


def resolve_model(model: ModelLike, roles: Roles) -> LayeredModel:
    """``model`` itself, or ``model(roles)`` for a model built per layout (its TP pieces)."""
    return model if isinstance(model, LayeredModel) else model(roles)


def _check_moe_field(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MoE.{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class MoE:
    """Each block's MLP as a dropless top-k mixture of experts (``fs.parallel.moe_ffn`` with
    ``capacity_factor=None``), the experts split over the layout's ``ep`` axis.

    Attributes:
      n_experts: experts per block; ``ep`` (times ``fsdp``) must divide it: whole experts
        per rank.
      top_k: experts per token (at most ``n_experts``).
      hidden: each expert's hidden width (None: the dense MLP's, ``cfg.hidden_dim``).
    """

    n_experts: int = attrs.field(validator=_check_moe_field)
    top_k: int = attrs.field(default=2, validator=_check_moe_field)
    hidden: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.top_k > self.n_experts:
            raise ValueError(f"MoE.top_k {self.top_k} exceeds n_experts {self.n_experts}")

    def init_layers(self, params: Any, cfg: TransformerConfig, seed: int, dtype: torch.dtype) -> Any:
        """``params`` with each block's ``feed_forward`` replaced by ``moe`` (``moe_init``'s
        tree), drawn from ``seed`` alone: the same values on every mesh."""
        for i, lp in enumerate(params["layers"]):
            del lp["feed_forward"]
            lp["moe"] = moe_init(
                cfg.dim, self.hidden or cfg.hidden_dim, self.n_experts, seed * 7919 + 101 + i, dtype=dtype
            )
        return params


def count_params(cfg: TransformerConfig, moe: MoE | None = None) -> int:
    """Parameters of the Transformer (with ``moe``: every expert counted), on the meta device."""
    with torch.device("meta"):
        params = transformer_init(cfg, 0)
        if moe is not None:
            params = moe.init_layers(params, cfg, 0, torch.float32)
    return sum(x.numel() for x in tree_util.leaves(params))


EMBED_KEYS = ("tok_embeddings", "pos_embeddings")  # the first stage's root parameters
HEAD_KEYS = ("norm", "output")  # the last stage's


@attrs.frozen
class _Transformer:
    """The Transformer's pieces as one layout runs them on local shards.

    Without tp they are ``fshard.models``' own ``embed``/``block``/``head``; with tp,
    their Megatron versions from ``fshard.parallel``, which call the collectives over
    tp by hand (an all-reduce after attention and after the MLP; the logits stay split
    over the vocabulary and the loss is computed without gathering them).

    With a cp axis every rank of it reads whole sequences and keeps its head-tail share
    (``fs.parallel.cp_shard``: tokens and targets alike), embeds it at its positions
    (``cp_positions``) and attends by ``ring_attention`` over cp.
    """

    cfg: TransformerConfig
    tp_axis: str | None = None
    sequence_parallel: bool = False
    cp_axis: str | None = None
    moe: MoE | None = None
    ep_axis: str | None = None

    def init(self, seed: int, dtype: torch.dtype) -> Any:
        params = transformer_init(self.cfg, seed, dtype=dtype)
        return params if self.moe is None else self.moe.init_layers(params, self.cfg, seed, dtype)

    def _experts(self, layer: Any, h: Tensor) -> Tensor:
        assert self.moe is not None
        return moe_ffn(layer["moe"], h, top_k=self.moe.top_k, capacity_factor=None, ep_axis=self.ep_axis)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ring_attention(q, k, v, self.cp_axis)

    def embed(self, root: Any, tokens: Tensor) -> Tensor:
        pos = None
        if self.cp_axis is not None:  # (b, T) -> (b, T / cp), and where those tokens sit
            if tokens.shape[1] > self.cfg.max_seq_len:
                raise ValueError(
                    f"embed: sequence length {tokens.shape[1]} exceeds cfg.max_seq_len={self.cfg.max_seq_len}."
                )
            pos = cp_positions(tokens.shape[1], self.cp_axis).to(tokens.device)
            tokens = cp_shard(tokens, self.cp_axis)
        if self.tp_axis is None:
            return embed(root, tokens, self.cfg, positions=pos)  # (b, T, D)
        return tp_embed(root, tokens, self.cfg, self.tp_axis, self.sequence_parallel, positions=pos)

    def block(self, layer: Any, x: Tensor) -> Tensor:
        attend = None if self.cp_axis is None else self._attend
        if self.tp_axis is None:
            ffn = None if self.moe is None else self._experts
            return block(layer, x, self.cfg, attend=attend, ffn=ffn)  # (b, T, D)
        return tp_transformer_block(layer, x, self.cfg, self.tp_axis, self.sequence_parallel, attend=attend)

    def logits(self, root: Any, x: Tensor) -> Tensor:
        if self.tp_axis is None:
            return head(root, x, self.cfg)  # (b, T, V)
        return tp_logits(root, x, self.cfg, self.tp_axis, self.sequence_parallel)  # (b, T, V/tp)

    def cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean over this rank's rows (and its share of each sequence), the softmax in at least fp32."""
        if self.cp_axis is not None:
            targets = cp_shard(targets, self.cp_axis)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.tp_axis is None:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return vocab_parallel_cross_entropy(logits, targets, self.tp_axis, vocab_size=self.cfg.vocab_size)


def _check_cp(cfg: TransformerConfig, cp: int) -> None:
    if cfg.max_seq_len % (2 * cp):
        raise LayoutError(
            f"cp={cp} cuts each sequence into 2 x cp = {2 * cp} head-tail chunks, but the Transformer's "
            f"max_seq_len (the sequence length) is {cfg.max_seq_len}: use a sequence length that is a "
            f"multiple of {2 * cp}, or another cp size"
        )
    if cfg.dropout > 0:
        raise LayoutError(
            f"cp={cp}: ring attention has no attention dropout, and TransformerConfig.dropout is "
            f"{cfg.dropout}; set it to 0, or leave cp out"
        )


def _check_moe(cfg: TransformerConfig, moe: MoE | None, roles: Roles) -> None:
    shape = dict(roles.mesh.shape)
    if moe is None:
        if roles.ep_axis is not None:
            raise LayoutError(
                f"the mesh has an ep axis ({shape}) but the Transformer has no experts: give "
                f"transformer(cfg, moe=MoE(n_experts=...)) (train_lm.py --moe N), or leave ep out"
            )
        return
    if roles.tp_axis is not None or roles.cp_axis is not None:
        raise LayoutError(
            f"the MoE Transformer runs with pp, dp, fsdp and ep; the mesh {shape} has "
            f"{'tp' if roles.tp_axis else 'cp'}, which the recipe does not build with experts yet "
            f"(fs.parallel.moe_ffn takes tp_axis in a step of your own): leave it out"
        )
    if cfg.dropout > 0:
        raise LayoutError(f"the MoE layer has no dropout, and TransformerConfig.dropout is {cfg.dropout}: set it to 0")
    n = roles.mesh.axis_size(tuple(a for a in (roles.ep_axis, roles.shard_axis) if a is not None))
    if roles.ep_axis is not None and moe.n_experts % n:
        raise LayoutError(
            f"MoE.n_experts {moe.n_experts} must be a multiple of ep x fsdp = {n} (mesh {shape}): whole experts "
            f"per rank; use a multiple of {n} experts (--moe), or a smaller ep or fsdp"
        )


def transformer(cfg: TransformerConfig, moe: MoE | None = None) -> Callable[[Roles], LayeredModel]:
    """fshard's Transformer (``fshard.models``) as a :class:`LayeredModel` for any roles:
    Megatron TP (``fs.parallel.TRANSFORMER_TP_PLAN``) and sequence parallelism with a tp axis,
    ring attention with a cp axis; with ``moe``, each block's MLP is a dropless mixture of
    experts, split over an ep axis (with pp, dp and fsdp; not with tp or cp yet).

    Raises (when called with the roles):
      LayoutError: ``cfg.n_heads`` is not divisible by the tp axis (whole heads per rank);
        a cp axis whose head-tail chunks ``2 x cp`` do not divide ``cfg.max_seq_len``, or
        with dropout; an ep axis without ``moe``; ``moe`` with tp or cp, with dropout, or
        with experts that ep x fsdp does not divide.
    """

    def build(roles: Roles) -> LayeredModel:
        _check_moe(cfg, moe, roles)
        if roles.tp_axis is not None and cfg.n_heads % roles.mesh.shape[roles.tp_axis]:
            raise LayoutError(
                f"the Transformer's n_heads {cfg.n_heads} must be divisible by "
                f"tp={roles.mesh.shape[roles.tp_axis]} (whole heads per rank)"
            )
        if roles.cp_axis is not None:
            _check_cp(cfg, roles.mesh.shape[roles.cp_axis])
        t = _Transformer(cfg, roles.tp_axis, roles.sequence_parallel, roles.cp_axis, moe, roles.ep_axis)
        return LayeredModel(
            init=t.init,
            embed=t.embed,
            block=t.block,
            head=t.logits,
            loss=t.cross_entropy,
            embed_keys=EMBED_KEYS,
            head_keys=HEAD_KEYS,
            tp_plan=TRANSFORMER_TP_PLAN,
            name="transformer" if moe is None else f"transformer with {moe.n_experts} experts",
        )

    return build
