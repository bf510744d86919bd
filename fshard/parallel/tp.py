"""Tensor and sequence parallelism (Megatron) as spec rules plus explicit collectives.

A TP plan is data, path regex -> style; :func:`tp_specs` turns it into ``P`` specs
(with FSDP when ``fsdp_axis`` is given: ``P(("tp", "fsdp"))``, fsdp minor, so
:func:`fshard.parallel.scan_layers` gathers over fsdp only and hands the block its
tp-local shard). The forward code calls the collectives by hand:

==============  ======================  =====================================
style           weight ``[out, in]``    after the local matmul
==============  ======================  =====================================
``"colwise"``   rows (and bias) split   nothing: the output is split
``"rowwise"``   columns split           ``tp_exit`` (psum), then the bias once
``"vocab"``     ``[V, D]`` rows split   masked lookup + psum / loss parallel
==============  ======================  =====================================

A region runs from :func:`tp_enter` (``pvary``, Megatron's "f"; with sequence
parallelism ``all_gather`` over the sequence) to :func:`tp_exit` (``psum``, "g";
with SP ``psum_scatter``). With SP, replicated parameters used between regions go
through :func:`sp_params` (one ``psum`` of their grads). The Transformer's SP splits the
residual stream's batch rows (dim 0, ``(B / tp, T, D)``) by default: a collective's buffer
is its dim 0, so the gathers land in place and the scatters read their chunks in place;
``seq_dim=1`` splits the sequence instead (for a batch smaller than tp; every collective
then copies to and from a transposed layout). Checked mode proves a block:
a forgotten ``tp_exit`` leaves an output varying over ``tp`` and the out_spec check
names it. How to write TP for a new block: ``docs/tp.md``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from fshard import lax
from fshard import tree as tree_util
from fshard.mesh.spec import P, PartitionSpec
from fshard.models.transformer import TransformerConfig, attention, feed_forward
from fshard.parallel.specs import match_specs
from fshard.runtime import simulation

__all__ = [
    "MLP_STACK_TP_PLAN",
    "TRANSFORMER_TP_PLAN",
    "tp_rules",
    "tp_specs",
    "tp_enter",
    "tp_exit",
    "sp_params",
    "vocab_parallel_embed",
    "vocab_parallel_cross_entropy",
    "tp_mlp",
    "tp_embed",
    "tp_transformer_block",
    "tp_logits",
    "tp_dropout",
    "tp_rng",
]

MLP_STACK_TP_PLAN: dict[str, str] = {
    r"layers\.\d+\.in_proj\.(weight|bias)": "colwise",
    r"layers\.\d+\.out_proj\.weight": "rowwise",  # out_proj.bias: replicated, added after psum
}

TRANSFORMER_TP_PLAN: dict[str, str] = {
    r"tok_embeddings\.weight": "vocab",
    r"layers\.\d+\.attention\.w[qkv]\.weight": "colwise",  # whole heads per rank
    r"layers\.\d+\.attention\.wo\.weight": "rowwise",
    r"layers\.\d+\.feed_forward\.w1\.(weight|bias)": "colwise",
    r"layers\.\d+\.feed_forward\.w2\.weight": "rowwise",
    r"output\.weight": "vocab",  # logits come out split over the vocabulary
}


def tp_rules(
    plan: Mapping[str, str], axis: str = "tp", *, fsdp_axis: str | None = None
) -> list[tuple[str, PartitionSpec]]:
    """``match_specs`` rules for a TP plan: ``[(regex, P), ...]``, in the plan's order.

    Args:
      plan: path regex -> ``"colwise"``, ``"rowwise"`` or ``"vocab"``.
      axis: the tensor-parallel mesh axis.
      fsdp_axis: also shard dim 0 over this axis, minor to ``axis`` when the TP split
        is on dim 0 too (optional, default None).

    Raises:
      ValueError: an unknown style (the path and the known styles are named).
    """
    dim0 = (axis, fsdp_axis) if fsdp_axis else axis  # tp major, fsdp minor on dim 0
    styles = {"colwise": P(dim0), "vocab": P(dim0), "rowwise": P(fsdp_axis, axis)}
    rules = []
    for rx, style in plan.items():
        if style not in styles:
            raise ValueError(f"tp_rules: plan entry {rx!r} has style {style!r}; use one of {sorted(styles)}.")
        rules.append((rx, styles[style]))
    return rules


def tp_specs(
    params: Any, plan: Mapping[str, str], axis: str = "tp", *, fsdp_axis: str | None = None, module: Any = None
) -> Any:
    """The specs of a TP (or FSDP x TP) layout: the entry point of this module.

    A plan of module path patterns (``"model.layers.*.mlp.up_proj": "colwise"``, as
    :data:`fshard.parallel.HF_LLAMA_TP_PLAN`) gives each planned module's weight and bias
    their split (:func:`fshard.parallel.module_tp.module_tp_specs`; ``module``, the model
    or its ``apply``, tells ``nn.Linear`` from ``Conv1D`` weights and checks the plan).

    Leaves no plan entry matches are replicated over ``axis`` (and FSDP-sharded on
    dim 0 when ``fsdp_axis`` is given). Replicate (DDP) and HSDP axes are the axes no
    spec names, so the same specs serve ``dp x tp`` and ``dp x fsdp x tp`` meshes.

    Args:
      params: pytree of global tensors (e.g. ``transformer_init(cfg, 0)``).
      plan: e.g. :data:`TRANSFORMER_TP_PLAN` or :data:`MLP_STACK_TP_PLAN`.
      axis: the tensor-parallel mesh axis.
      fsdp_axis: the FSDP mesh axis (optional, default None).
      module: for a module plan, the ``nn.Module`` or its ``apply`` (optional).

    Returns:
      A pytree of ``P`` for ``fs.shard(params, specs, mesh, uneven=...)``.
    """
    from fshard.parallel.module_tp import is_module_plan, module_tp_specs

    if module is not None or is_module_plan(plan):
        return module_tp_specs(params, plan, axis, fsdp_axis=fsdp_axis, module=module)
    default = P(fsdp_axis) if fsdp_axis else P()
    return match_specs(params, tp_rules(plan, axis, fsdp_axis=fsdp_axis), default=default)


# --- region boundaries -------------------------------------------------------------------
def tp_enter(x: torch.Tensor, axis: str = "tp", *, sequence_parallel: bool = False, seq_dim: int = 0) -> torch.Tensor:
    """Enters a TP region: the full activation every tp rank multiplies by its shard.

    Args:
      x: ``(B, T, D)`` (or ``(N, D)``), the same on every tp rank; with SP this rank's
        share, split over ``seq_dim``: ``(B / tp, T, D)``.
      axis: the tensor-parallel axis.
      sequence_parallel: ``x`` is split over ``seq_dim``: all-gather it.
      seq_dim: the split dim with SP (default 0, the rows: the gather lands in place;
        any other dim is gathered through a transposed copy).

    Returns:
      ``(B, T, D)``. Backward sums the gradient over ``axis`` (psum, or psum_scatter with SP).
    """
    if sequence_parallel:
        return lax.all_gather(x, axis, axis=seq_dim, tiled=True)  # (B, T, D)
    return lax.pvary(x, axis)


def tp_exit(y: torch.Tensor, axis: str = "tp", *, sequence_parallel: bool = False, seq_dim: int = 0) -> torch.Tensor:
    """Leaves a TP region: sums the per-rank partial outputs of a row-parallel linear.

    Args:
      y: ``(B, T, D)`` (or ``(N, D)``), this rank's partial sum.
      axis: the tensor-parallel axis.
      sequence_parallel: reduce-scatter over ``seq_dim`` instead of all-reduce.
      seq_dim: the split dim with SP (default 0, the rows), divisible by the axis size.

    Returns:
      ``(B, T, D)`` (with SP ``(B / tp, T, D)``), the same on every tp rank
      (with SP: this rank's slice). Backward: identity (all-gather with SP).
    """
    if sequence_parallel:
        return lax.psum_scatter(y, axis, scatter_dimension=seq_dim, tiled=True)  # (B / tp, T, D)
    return lax.psum(y, axis)


def sp_params(params: Any, axis: str = "tp") -> Any:
    """Marks replicated parameters used on sequence-split data as varying over ``axis``.

    Each tp rank computes their gradient from its own ``T / tp`` positions; the
    gradients must be summed over ``axis``. The leaves go through one ``pvary`` as one
    flat buffer, so backward issues one ``psum`` for all of them (Megatron all-reduces
    its "sequence parallel" parameters' grads the same way).

    Args:
      params: pytree of tensors, replicated over ``axis``.
      axis: the tensor-parallel axis.

    Returns:
      The same values, typed varying over ``axis``.
    """
    leaves, treedef = tree_util.tree_flatten(params)
    if not leaves:
        return params
    flat = lax.pvary(torch.cat([x.reshape(-1) for x in leaves]), axis)  # (sum of numels,)
    parts = flat.split([x.numel() for x in leaves])
    return tree_util.tree_unflatten(treedef, [p.view(x.shape) for p, x in zip(parts, leaves)])


# --- vocabulary parallelism ------------------------------------------------------------------
def _vocab_range(local_size: int, axis: str, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[start, start + local_size)`` of the vocabulary (torch.chunk layout).

    0-d CPU tensors varying over ``axis`` (from ``axis_index``): the masks made from them
    are typed varying, and comparing CUDA ids with them needs no device sync.
    """
    n, r = lax.axis_size(axis), lax.axis_index(axis)
    start = r * local_size if vocab_size is None else (r * -(-vocab_size // n)).clamp(max=vocab_size)
    return start, start + local_size


def vocab_parallel_embed(
    weight: torch.Tensor, tokens: torch.Tensor, axis: str = "tp", *, vocab_size: int | None = None
) -> torch.Tensor:
    """This rank's partial embedding: rows it holds, zeros for other tokens.

    Args:
      weight: ``[V / tp, D]``, this rank's rows of the ``[V, D]`` table.
      tokens: int64 ids ``(B, T)``, the same on every tp rank.
      axis: the tensor-parallel axis.
      vocab_size: ``V``; give it when ``V`` is not divisible by the axis size
        (torch.chunk layout). Optional, default None (even split).

    Returns:
      ``(B, T, D)``, a partial sum: finish it with :func:`tp_exit`.
    """
    start, stop = _vocab_range(weight.shape[0], axis, vocab_size)
    mine = (tokens >= start) & (tokens < stop)  # (B, T)
    local = torch.where(mine, tokens - start, torch.zeros_like(tokens))  # (B, T)
    return F.embedding(local, weight) * mine.unsqueeze(-1).to(weight.dtype)  # (B, T, D)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, axis: str = "tp", *, vocab_size: int | None = None
) -> torch.Tensor:
    """Mean cross entropy of vocab-split logits without gathering them (loss parallel).

    ``logsumexp`` over the full vocabulary from a ``pmax`` of local maxima and a
    ``psum`` of local sums of exponentials; the target's logit from the one rank that
    holds it (masks elsewhere), summed in the same ``psum``. Communication: one
    ``pmax`` and one ``psum`` of ``2 * B * T`` numbers; backward needs none (the psum's
    transpose is the identity), and each rank gets the gradient of its own columns.

    Args:
      logits: ``(..., V / tp)``, this rank's columns of the ``(..., V)`` logits.
      targets: int64 ``(...)`` ids in ``[0, V)``, the same on every tp rank.
      axis: the tensor-parallel axis.
      vocab_size: as in :func:`vocab_parallel_embed`.

    Returns:
      The scalar mean over all positions, the same on every tp rank.
    """
    start, stop = _vocab_range(logits.shape[-1], axis, vocab_size)
    m = lax.pmax(logits.detach().amax(-1), axis)  # (...,); any shift is exact, so no gradient
    z = logits - m.unsqueeze(-1)  # (..., V / tp)
    mine = (targets >= start) & (targets < stop)  # (...)
    idx = torch.where(mine, targets - start, torch.zeros_like(targets)).unsqueeze(-1)  # (..., 1)
    target_z = z.gather(-1, idx).squeeze(-1) * mine.to(z.dtype)  # (...)
    sums = lax.psum(torch.stack([z.exp().sum(-1), target_z]), axis)  # (2, ...)
    return (sums[0].log() - sums[1]).mean()


# --- blocks -------------------------------------------------------------------------------------
def tp_mlp(
    layer_params: Any, x: torch.Tensor, axis: str = "tp", *, sequence_parallel: bool = False, seq_dim: int = 0
) -> torch.Tensor:
    """One MLP (``in_proj`` colwise, ReLU, ``out_proj`` rowwise) on tp-local shards.

    Args:
      layer_params: ``{"in_proj": {"weight" [H / tp, D], "bias" [H / tp]},
        "out_proj": {"weight" [D, H / tp], "bias" [D]}}`` (biases optional).
      x: ``(N, D)`` (or ``(..., T, D)``), the same on every tp rank; with SP split
        over ``seq_dim``: ``(N / tp, D)``.
      axis: the tensor-parallel axis.
      sequence_parallel: activations outside the block are split over ``seq_dim``.
      seq_dim: the split dim with SP (default 0, the rows).

    Returns:
      The MLP's output, laid out like ``x``.
    """
    w_in, w_out = layer_params["in_proj"], layer_params["out_proj"]
    sp = dict(sequence_parallel=sequence_parallel, seq_dim=seq_dim)
    h = tp_enter(x, axis, **sp)  # (N, D)
    h = F.relu(F.linear(h, w_in["weight"], w_in.get("bias")))  # (N, H / tp)
    y = tp_exit(F.linear(h, w_out["weight"]), axis, **sp)  # (N, D), or (N / tp, D) with SP
    if w_out.get("bias") is not None:
        b = sp_params(w_out["bias"], axis) if sequence_parallel else w_out["bias"]
        y = y + b  # once, after the reduction
    return y


def _norm(p: Any, x: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), p["weight"], p["bias"], cfg.norm_eps)


def tp_dropout(
    x: torch.Tensor, cfg: TransformerConfig, axis: str = "tp", *, training: bool = False, split: bool = False
) -> torch.Tensor:
    """Dropout in a TP program, Megatron's way: ``F.dropout`` with ``p = cfg.dropout``.

    Where ``x`` is the same on every tp rank (``split=False``), every rank must draw the
    same mask, or the replicas drift apart: it draws from torch's global RNG, which
    must therefore be seeded alike on every rank (``torch.manual_seed(seed)``
    everywhere, as Megatron's default generator). Where ``x`` differs per tp rank
    (heads, sequence-parallel slices: ``split=True``), each rank needs its own mask:
    see :func:`tp_rng`.

    The masks are not the single-process model's (that one draws the full tensor at
    once), so dropout runs are statistically, not numerically, mesh-invariant; keep
    ``cfg.dropout = 0`` (the default) where curves must match exactly.
    """
    if not training or cfg.dropout == 0.0:
        return x
    with tp_rng(axis, x.device) if split else contextlib.nullcontext():
        return F.dropout(x, cfg.dropout, training=True)


@contextlib.contextmanager
def tp_rng(axis: str, device: torch.device):
    """Inside, torch's RNG on ``device`` differs per rank of ``axis``; outside it is untouched.

    The seed is drawn from the shared global stream (so it changes every call and
    advances every rank's global RNG alike) plus this rank's index on ``axis``.
    """
    # A host int (manual_seed takes one), from the mesh: int(lax.axis_index(...)) would
    # leave checked mode's types (every P() output then verified at run time). The masks
    # vary because the value they drop from does (split=True), so the seed needs no type.
    # per_rank: under fs.simulate each rank reads its own draw (and the mesh's int is per rank).
    seed = simulation.per_rank(int)(torch.randint(0, 2**62, (1,))) + lax.BODY.get().mesh.axis_index(axis)
    devices = [device] if device.type == "cuda" else []
    with _seeded(seed, devices):
        yield


@contextlib.contextmanager
def _seeded(seed: int, devices: list[torch.device]):
    """Inside, torch's RNG (CPU and ``devices``) seeded with ``seed``; outside, as before.

    Under ``fs.simulate`` ``seed`` is a per-rank int and each rank draws from its own
    generator state (torch's simulation keeps one per rank and sets it before each rank's
    run of an op): each rank's state is seeded with its seed here, and every rank's state
    is put back after, as ``fork_rng`` puts back a real rank's.
    """
    from torch.distributed._local_tensor import _get_rng_state, enabled_local_tensor_mode

    def seed_all(value: int) -> None:
        torch.default_generator.manual_seed(value)
        if devices:
            torch.cuda.manual_seed(value)

    mode = enabled_local_tensor_mode()
    states = mode._per_rank_rng_states if mode is not None else None
    if not states:  # real ranks (or a simulation without per-rank states)
        with torch.random.fork_rng(devices=devices):
            seed_all(simulation.host_int(seed, "tp_rng's seed"))
            yield
        return
    saved = dict(states)
    try:
        for r in sorted(states):
            with torch.random.fork_rng(devices=devices):
                seed_all(seed.node._local_ints[r] if isinstance(seed, torch.SymInt) else seed)
                states[r] = _get_rng_state()
        yield
    finally:
        states.clear()
        states.update(saved)  # in place: a nested simulation may share this dict


def tp_transformer_block(
    layer_params: Any,
    x: torch.Tensor,
    cfg: TransformerConfig,
    axis: str = "tp",
    sequence_parallel: bool = False,
    *,
    training: bool = False,
    seq_dim: int = 0,
    attend: Any = None,
) -> torch.Tensor:
    """:func:`fshard.models.block` on tp-local shards: 2 collectives forward, 2 backward.

    Without SP: ``psum`` after attention and after the MLP (backward: ``psum`` of
    the gradient at each ``tp_enter``). With SP: ``all_gather`` / ``psum_scatter``
    pairs instead, plus one ``psum`` of the norms' and ``w2`` bias' gradients.

    Dropout (``training`` and ``cfg.dropout > 0``): attention probabilities of this
    rank's heads with a per-rank RNG, residual dropouts after the reductions (shared
    RNG, or per-rank with SP): see :func:`tp_dropout`.

    Args:
      layer_params: ``params["layers"][i]`` laid out by :data:`TRANSFORMER_TP_PLAN`:
        ``wq/wk/wv`` ``[D / tp, D]`` (whole heads), ``wo`` ``[D, D / tp]``, ``w1``
        ``[F / tp, D]``, ``w2`` ``[D, F / tp]``, norms and ``w2.bias`` whole.
      x: residual stream ``(B, T, D)``; with SP this rank's share: ``(B / tp, T, D)``
        (``seq_dim=0``) or ``(B, T / tp, D)`` (``seq_dim=1``).
      cfg: the model's config.
      axis: the tensor-parallel axis.
      sequence_parallel: the residual stream is split over ``axis`` between regions.
      training: apply dropout.
      seq_dim: with SP, the split dim of ``x`` (see :func:`tp_embed`).
      attend: ``attend(q, k, v)`` on this rank's heads (``fshard.models.attention``'s;
        default SDPA), e.g. ``fs.parallel.ring_attention`` over a cp axis.

    Returns:
      The residual stream after the block, laid out like ``x``.

    Raises:
      ValueError: a rank's ``wq`` does not hold whole heads.
    """
    p, sp = layer_params, dict(sequence_parallel=sequence_parallel, seq_dim=_sp_dim(seq_dim, "tp_transformer_block"))
    rows = p["attention"]["wq"]["weight"].shape[0]
    if rows % cfg.head_dim:
        raise ValueError(
            f"tp_transformer_block: this rank's wq has {rows} rows, not a multiple of head_dim="
            f"{cfg.head_dim}; n_heads={cfg.n_heads} must be divisible by the size of axis {axis!r}."
        )
    rep = {"attention_norm": p["attention_norm"], "ffn_norm": p["ffn_norm"], "b2": p["feed_forward"]["w2"]["bias"]}
    if sequence_parallel:
        rep = sp_params(rep, axis)
    drop = dict(training=training, split=sequence_parallel)
    h = tp_enter(_norm(rep["attention_norm"], x, cfg), axis, **sp)  # (B, T, D)
    with tp_rng(axis, h.device) if training and cfg.dropout > 0 else contextlib.nullcontext():
        a = attention(p["attention"], h, cfg, training=training, output_dropout=False, attend=attend)  # local heads
    x = x + tp_dropout(tp_exit(a, axis, **sp), cfg, axis, **drop)  # (B, T, D), SP: (B / tp, T, D)
    h = tp_enter(_norm(rep["ffn_norm"], x, cfg), axis, **sp)  # (B, T, D)
    ffn = {"w1": p["feed_forward"]["w1"], "w2": {"weight": p["feed_forward"]["w2"]["weight"], "bias": None}}
    y = feed_forward(ffn, h, cfg)  # partial sum (B, T, D); w2's bias is added once, after it
    return x + tp_dropout(tp_exit(y, axis, **sp) + rep["b2"], cfg, axis, **drop)


def tp_embed(
    params: Any,
    tokens: torch.Tensor,
    cfg: TransformerConfig,
    axis: str = "tp",
    sequence_parallel: bool = False,
    *,
    training: bool = False,
    seq_dim: int = 0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Vocab-parallel token embedding plus position embedding.

    Args:
      params: the model's tree with ``tok_embeddings.weight`` ``[V / tp, D]``.
      tokens: int64 ``(B, T)``, the same on every tp rank.
      cfg: the model's config.
      axis: the tensor-parallel axis.
      sequence_parallel: return this rank's share of the tokens, split over ``seq_dim``.
      training: apply dropout (:func:`tp_dropout`).
      seq_dim: with SP, the dim split over ``axis``: 0 (the default), rank ``r``'s
        ``B / tp`` batch rows ``[r * B / tp, (r + 1) * B / tp)``, whole sequences; or 1,
        its ``T / tp`` positions. Norms, dropout and residual adds are per token, so
        either split computes the same model; dim 0 is the collectives' own layout (no
        copies around them), dim 1 serves a batch smaller than tp.
      positions: int64 ``(T,)``, the tokens' positions (default ``arange(T)``), e.g.
        ``fs.parallel.cp_positions`` on a context-parallel rank; not with SP on dim 1.

    Returns:
      ``(B, T, D)``; with SP ``(B / tp, T, D)`` (``seq_dim=0``) or ``(B, T / tp, D)``.

    Raises:
      ValueError: with SP, ``tokens``' dim ``seq_dim`` is not divisible by the size of ``axis``;
        ``positions`` with SP on dim 1.
    """
    T = tokens.shape[1]
    d = _sp_dim(seq_dim, "tp_embed")
    if positions is not None and sequence_parallel and d == 1:
        raise ValueError("tp_embed: positions= with sequence_parallel on seq_dim=1; split the batch rows (seq_dim=0)")
    if sequence_parallel:
        _check_sp_split(tokens, d, axis)
    x = vocab_parallel_embed(params["tok_embeddings"]["weight"], tokens, axis, vocab_size=cfg.vocab_size)
    x = tp_exit(x, axis, sequence_parallel=sequence_parallel, seq_dim=d)  # (B, T, D), SP: split over d
    table = params["pos_embeddings"]["weight"]
    pos = table[:T] if positions is None else table.index_select(0, positions.to(table.device))  # (T, D)
    if sequence_parallel:
        pos = sp_params(pos, axis)  # every rank's tokens use it: its gradient is summed over axis
    if sequence_parallel and d == 1:
        t = x.shape[1]
        # The mesh's int (a per-rank int under fs.simulate, which slicing cannot take; narrow can).
        r = lax.BODY.get().mesh.axis_index(axis)
        pos = pos.narrow(0, r * t, t)  # (T / tp, D)
    return tp_dropout(x + pos, cfg, axis, training=training, split=sequence_parallel)


def _sp_dim(seq_dim: int, where: str) -> int:
    """``seq_dim`` of the residual stream ``(B, T, D)``, checked: 0 (batch rows) or 1 (sequence)."""
    if seq_dim not in (0, 1):
        raise ValueError(
            f"{where}: seq_dim={seq_dim!r}; the residual stream (B, T, D) is split over tp on dim 0 "
            f"(batch rows, the default) or dim 1 (the sequence)."
        )
    return seq_dim


def _check_sp_split(tokens: torch.Tensor, d: int, axis: str) -> None:
    n, size = lax.axis_size(axis), tokens.shape[d]
    if size % n:
        what, other = ("batch rows", "seq_dim=1 to split the sequence") if d == 0 else ("positions", "seq_dim=0")
        raise ValueError(
            f"tp_embed: sequence_parallel with seq_dim={d} splits the {size} {what} of this rank's tokens "
            f"{tuple(tokens.shape)} over axis {axis!r} of size {n}, which must divide {size}. Give each rank "
            f"(each microbatch) a batch whose dim {d} is a multiple of {n}, or pass {other} "
            f"(dim {1 - d} has {tokens.shape[1 - d]})."
        )


def tp_logits(
    params: Any,
    x: torch.Tensor,
    cfg: TransformerConfig,
    axis: str = "tp",
    sequence_parallel: bool = False,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """Final norm and vocab-split output projection; feed to :func:`vocab_parallel_cross_entropy`.

    Args:
      params: the model's tree with ``output.weight`` (or, tied, ``tok_embeddings.weight``)
        ``[V / tp, D]``.
      x: ``(B, T, D)``; with SP this rank's share, split over ``seq_dim``.
      cfg: the model's config.
      axis: the tensor-parallel axis.
      sequence_parallel: ``x`` is split over ``axis``: gather it before the projection.
      seq_dim: with SP, the split dim of ``x`` (see :func:`tp_embed`).

    Returns:
      This rank's logits ``(B, T, V / tp)`` (never the full ``(B, T, V)``).
    """
    norm = sp_params(params["norm"], axis) if sequence_parallel else params["norm"]
    d = _sp_dim(seq_dim, "tp_logits")
    h = tp_enter(_norm(norm, x, cfg), axis, sequence_parallel=sequence_parallel, seq_dim=d)  # (B, T, D)
    w = params["tok_embeddings" if cfg.tie_weights else "output"]["weight"]
    return F.linear(h, w)  # (B, T, V / tp)
