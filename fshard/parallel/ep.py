"""Expert parallelism (MoE): a functional top-k mixture-of-experts FFN and its spec rules.

Layout. The experts' weights are stacked on dim 0, ``w1 [E, H, D]`` and ``w2 [E, D, H]``
(torch's ``[out, in]`` per expert), and sharded over the ``ep`` axis on that dim: ep
rank r holds experts ``[r * E / ep, (r + 1) * E / ep)``. The router ``[E, D]`` is an
ordinary dense parameter (replicated, or FSDP like the rest of the model). Two
optional extra splits compose with it: FSDP of the experts over a second axis
(``efsdp``, minor to ``ep`` on dim 0, gathered with ``gather_params(axis="efsdp")``),
and tensor parallelism inside every expert (``w1`` colwise, ``w2`` rowwise).

Dispatch is **capacity-based, through** ``fs.lax.all_to_all``, or dropless
(``capacity_factor=None``: :mod:`fshard.parallel._dropless`, by
``fs.lax.ragged_all_to_all``). With capacity, each rank routes its own tokens (softmax
router, top-k experts per token) into a buffer of ``C`` slots per expert, ``[E, C, D]``;
an all_to_all over ``ep`` sends each expert's slots to the rank that holds it; the
experts run as one batched matmul on ``[E / ep, ep * C, D]``; a second all_to_all brings
the results home, where each token sums its experts' outputs weighted by their gates.
Capacity keeps every shape static (``fs.lax.all_to_all``, like ``jax.lax.all_to_all``,
exchanges equal chunks); the dropless dispatch reads per-rank split sizes on the host
instead, and pads and drops nothing.

Capacity per expert and dispatch group: ``C = min(T, ceil(capacity_factor * T * k / E))``
for ``T`` tokens in the group. Assignments beyond ``C`` are dropped (the token's
residual carries it, and its gate gets no gradient); slots fill as in GShard: every
token's first choice before any token's second choice, in token order within a choice.
In EP mode the group is one rank's tokens, so every rank on the ``ep`` axis must hold
the same number of tokens; the single-process form (``ep_axis=None``) takes
``n_groups`` to reproduce the groups of a distributed run exactly.

Communication per MoE layer, ``C`` slots, ``D`` model dim:

=================================  ===================================================
forward                            2 ``all_to_all`` over ``ep`` of ``E * C * D``
                                   numbers each (dispatch, return)
backward                           their 2 transposes (``all_to_all``, axes swapped)
with ``tp_axis``                   forward: 1 ``psum`` of the output ``(N, D)``;
                                   backward: 1 ``psum`` of the input grad ``(N, D)``
                                   and 1 ``psum`` of the gates' grad ``(N, k)``
=================================  ===================================================

The expert weights' gradient is summed over ``ep`` by the all_to_all's transpose (each
expert sees every ep rank's tokens); FSDP/replicate axes reduce it like any other
parameter. How to write a MoE model with it: ``docs/ep.md``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

import attrs
import torch
import torch.nn.functional as F

from fshard import lax
from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh
from fshard.mesh.spec import P, PartitionSpec
from fshard.parallel import _dropless

__all__ = [
    "EXPERT_TP_DIM",
    "Routing",
    "ep_rules",
    "ep_specs",
    "expert_capacity",
    "moe_ffn",
    "moe_init",
    "route",
    "router_losses",
]

# The dim of each stacked expert weight that tensor parallelism splits: w1 [E, H, D] by
# hidden rows (colwise), w2 [E, D, H] by hidden columns (rowwise); dim 0 is the expert.
EXPERT_TP_DIM: dict[str, int] = {"w1": 1, "w2": 2}
_EXPERTS = r"(.*\.)?experts\."  # leaves under any "experts" key


def moe_init(
    dim: int,
    hidden: int,
    n_experts: int,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
    router_std: float | None = None,
) -> dict[str, Any]:
    """Parameters of one MoE FFN, drawn from a private generator (global RNG untouched).

    Args:
      dim: model dim ``D``.
      hidden: each expert's hidden dim ``H``.
      n_experts: ``E``.
      seed: seed of the generator; the draw order is router, w1, w2.
      dtype: parameter dtype.
      std: std of the expert weights.
      router_std: std of the router (default ``dim ** -0.5``, so routing is not uniform
        at init).

    Returns:
      ``{"router": {"weight" [E, D]}, "experts": {"w1" [E, H, D], "w2" [E, D, H]}}``.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, s: float) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype).normal_(0.0, s, generator=g)

    return {
        "router": {"weight": normal(n_experts, dim, s=router_std or dim**-0.5)},
        "experts": {"w1": normal(n_experts, hidden, dim, s=std), "w2": normal(n_experts, dim, hidden, s=std)},
    }


# --- spec rules -----------------------------------------------------------------------------
def ep_rules(
    ep_axis: str = "ep", *, fsdp_axis: str | None = None, tp_axis: str | None = None, pattern: str = _EXPERTS
) -> list[tuple[str, PartitionSpec]]:
    """``match_specs`` rules for the stacked expert weights.

    Args:
      ep_axis: the expert-parallel axis (dim 0, the expert dim).
      fsdp_axis: also shard dim 0 over this axis, minor to ``ep_axis``, so that
        gathering over it alone gives this ep rank's experts (optional).
      tp_axis: split each expert like a Megatron MLP: ``w1`` rows, ``w2`` columns
        (optional).
      pattern: regex prefix of the expert leaves' paths (default: under an
        ``experts`` key).

    Returns:
      ``[(regex, P), ...]`` for ``w1`` and ``w2``.
    """
    dim0 = (ep_axis, fsdp_axis) if fsdp_axis else ep_axis  # ep major: whole experts per ep rank
    rules = []
    for name, tp_dim in EXPERT_TP_DIM.items():
        entries: list[Any] = [dim0] + ([None] * (tp_dim - 1) + [tp_axis] if tp_axis else [])
        rules.append((pattern + name, P(*entries)))
    return rules


def ep_specs(
    params: Any,
    ep_axis: str = "ep",
    *,
    fsdp_axis: str | None = None,
    tp_axis: str | None = None,
    base: Any = None,
    mesh: Mesh | None = None,
    pattern: str = _EXPERTS,
) -> Any:
    """The specs of a model with experts: :func:`ep_rules` for expert leaves, ``base`` elsewhere.

    Args:
      params: pytree of global tensors.
      ep_axis, fsdp_axis, tp_axis, pattern: as in :func:`ep_rules`.
      base: a pytree of ``P`` for the whole model (e.g. from ``tp_specs`` or
        ``fsdp_specs``) whose expert leaves are overridden; default ``P()`` everywhere.
      mesh: when given, check that every expert leaf holds whole experts per rank.

    Returns:
      A pytree of ``P`` with the structure of ``params``.

    Raises:
      ValueError: (with ``mesh``) an expert leaf's dim 0 is not divisible by the size of
        ``ep_axis`` (times ``fsdp_axis``); the leaf, the axes and the sizes are named.
    """
    rules = [
        (re.compile(rx), spec) for rx, spec in ep_rules(ep_axis, fsdp_axis=fsdp_axis, tp_axis=tp_axis, pattern=pattern)
    ]
    base = tree_util.tree_map(lambda x: P(), params) if base is None else base

    def one(path: str, x: Any, spec: PartitionSpec) -> PartitionSpec:
        for rx, ep_spec in rules:
            if rx.fullmatch(path):
                if mesh is not None:
                    _check_whole_experts(path, x, ep_axis, fsdp_axis, mesh)
                return ep_spec
        return spec

    return tree_util.tree_map_with_path(one, params, base)


def _check_whole_experts(path: str, x: torch.Tensor, ep_axis: str, fsdp_axis: str | None, mesh: Mesh) -> None:
    n_experts, n_ep = x.shape[0], mesh.axis_size(ep_axis)
    if n_experts % n_ep:
        raise ValueError(
            f"ep_specs: '{path}' has {n_experts} experts (dim 0 of shape {tuple(x.shape)}), not divisible by "
            f"the size of axis {ep_axis!r} ({n_ep}); every ep rank must hold whole experts: use a multiple "
            f"of {n_ep} experts or a smaller ep axis."
        )
    if fsdp_axis is not None and n_experts % (n_ep * mesh.axis_size(fsdp_axis)):
        n_fsdp = mesh.axis_size(fsdp_axis)
        raise ValueError(
            f"ep_specs: '{path}' has {n_experts} experts (dim 0 of shape {tuple(x.shape)}), not divisible by "
            f"the sizes of axes ({ep_axis!r}, {fsdp_axis!r}) = ({n_ep}, {n_fsdp}), product {n_ep * n_fsdp}."
        )


# --- routing ------------------------------------------------------------------------------------
def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert for a group of ``n_tokens``: ``ceil(cf * T * k / E)``, in ``[1, T]``.

    No expert can receive more than ``T`` assignments (a token picks distinct experts).
    """
    return max(1, min(n_tokens, math.ceil(capacity_factor * n_tokens * top_k / n_experts)))


@attrs.frozen
class Routing:
    """Where each token's k assignments go.

    Attributes:
      gates: ``(N, k)`` combine weights, 0 for dropped assignments (differentiable).
      experts: ``(N, k)`` int64 expert ids.
      slots: ``(N, k)`` int64 rows of the flat dispatch buffer ``[G * E * C]``
        (group-major, then expert, then slot); a dropped assignment points at row
        ``G * E * C``, a trash row that is cut off.
      capacity: ``C``, slots per expert and group.
      n_groups: ``G``.
      n_experts: ``E``.
      logits: ``(N, E)`` router logits (for :func:`router_losses`).
    """

    gates: torch.Tensor
    experts: torch.Tensor
    slots: torch.Tensor
    capacity: int
    n_groups: int
    n_experts: int
    logits: torch.Tensor | None = None

    @property
    def kept(self) -> torch.Tensor:
        """``(N, k)`` bool: assignments that got a slot."""
        return self.slots < self.n_groups * self.n_experts * self.capacity


def _router(router_w: torch.Tensor, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits (N, E), gates (N, k), experts (N, k))``: softmax router, top-k choice, and
    the gates (top-1 probability for ``k = 1``, else the top-k renormalized)."""
    logits = F.linear(x, router_w)
    top_p, experts = logits.softmax(-1).topk(top_k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True) if top_k > 1 else top_p
    return logits, gates, experts


def router_losses(logits: torch.Tensor, experts: torch.Tensor, n_groups: int = 1) -> dict[str, torch.Tensor]:
    """The router's auxiliary losses, per dispatch group and averaged over the groups.

    - ``"load_balance"`` (Switch / GShard): ``E * sum_e f_e * p_e``, with ``f_e`` the share
      of the group's ``T * k`` assignments that chose expert ``e`` (not differentiable)
      and ``p_e`` the group's mean router probability of ``e``; 1 when routing is uniform.
    - ``"z_loss"`` (ST-MoE): the mean over tokens of ``logsumexp(logits) ** 2``.

    Args:
      logits: ``(N, E)`` router logits.
      experts: ``(N, k)`` chosen experts.
      n_groups: contiguous groups of tokens (one per data rank in the reference).

    Returns:
      ``{"load_balance": 0-d, "z_loss": 0-d}``. In a ``shard_map`` body these are this
      rank's group's; ``pmean`` them over the data axes with the loss.
    """
    n, n_experts = logits.shape
    t, k = n // n_groups, experts.shape[1]
    probs = logits.softmax(-1).view(n_groups, t, n_experts).mean(1)  # (G, E)
    chosen = F.one_hot(experts, n_experts).to(logits.dtype).view(n_groups, t * k, n_experts).mean(1)  # (G, E)
    balance = (n_experts * (chosen * probs).sum(-1)).mean()
    z = logits.logsumexp(-1).square().mean()
    return {"load_balance": balance, "z_loss": z}


def route(router_w: torch.Tensor, x: torch.Tensor, *, top_k: int, capacity_factor: float, n_groups: int = 1) -> Routing:
    """Softmax router, top-k experts per token, and capacity slots (see the module doc).

    Gates: the top-1 probability for ``k = 1`` (Switch); for ``k > 1`` the top-k
    probabilities renormalized to sum to 1 (Mixtral). Only the computation of the
    gates is differentiable; expert choice and slots are discrete.

    Args:
      router_w: ``[E, D]``.
      x: ``(N, D)`` tokens; ``N`` must be divisible by ``n_groups`` (contiguous groups).
      top_k: experts per token, in ``[1, E]``.
      capacity_factor: slots per expert relative to an even split.
      n_groups: dispatch groups, each with its own capacity.
    """
    n, n_experts = x.shape[0], router_w.shape[0]
    t = n // n_groups
    logits, gates, experts = _router(router_w, x, top_k)
    cap = expert_capacity(t, n_experts, top_k, capacity_factor)
    # Slot of each assignment = how many earlier assignments chose the same expert in its
    # group, counting choice-major (all first choices, then all second choices).
    onehot = F.one_hot(experts, n_experts).view(n_groups, t, top_k, n_experts)  # (G, T, k, E)
    order = onehot.transpose(1, 2).reshape(n_groups, top_k * t, n_experts)  # (G, k*T, E)
    pos = ((order.cumsum(1) - 1) * order).sum(-1)  # (G, k*T): slot within the chosen expert
    pos = pos.view(n_groups, top_k, t).transpose(1, 2).reshape(n, top_k)  # (N, k)
    group = torch.arange(n, device=x.device).div(t, rounding_mode="floor").unsqueeze(1)  # (N, 1)
    kept = pos < cap
    trash = n_groups * n_experts * cap
    slots = torch.where(kept, (group * n_experts + experts) * cap + pos, torch.full_like(pos, trash))
    gates = gates * kept.to(gates.dtype)  # dropped assignments contribute (and learn) nothing
    return Routing(gates, experts, slots, cap, n_groups, n_experts, logits)


# --- the layer -------------------------------------------------------------------------------------
def _experts(w: Mapping[str, torch.Tensor], buf: torch.Tensor, activation: Callable) -> torch.Tensor:
    """Every local expert on its own slots: ``buf [E_l, S, D] -> [E_l, S, D]`` (one bmm each way)."""
    h = activation(torch.bmm(buf, w["w1"].transpose(1, 2)))  # (E_l, S, H_l)
    return torch.bmm(h, w["w2"].transpose(1, 2))  # (E_l, S, D); a partial sum under TP


def moe_ffn(
    params: Mapping[str, Any],
    x: torch.Tensor,
    *,
    top_k: int = 2,
    capacity_factor: float | None = 1.25,
    ep_axis: str | None = None,
    tp_axis: str | None = None,
    n_groups: int = 1,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
    return_aux: bool = False,
) -> Any:
    """A top-k MoE FFN: route, dispatch over ``ep_axis``, run experts, combine.

    With ``ep_axis=None`` and no ``tp_axis`` it is the single-process layer (all experts
    local, no communication): the reference for a distributed run, given the same groups.

    Args:
      params: ``{"router": {"weight" [E, D]}, "experts": {"w1" [E_l, H_l, D],
        "w2" [E_l, D, H_l]}}``: the router whole, this rank's ``E_l = E / ep`` experts
        (with TP, ``H_l = H / tp`` of each).
      x: ``(..., D)`` normalized tokens; the same on every ``tp_axis`` rank.
      top_k: experts per token.
      capacity_factor: slots per expert relative to an even split (see
        :func:`expert_capacity`; dispatch by ``all_to_all``), or ``None``: dropless
        (every assignment reaches its expert, by ``ragged_all_to_all``; see
        :mod:`fshard.parallel._dropless`).
      ep_axis: the expert-parallel axis (``None``: all experts local).
      tp_axis: the tensor-parallel axis inside each expert (optional).
      n_groups: dispatch groups (capacity and the router losses are per group); the
        reference for a run on ``R`` data ranks passes ``R``.
      activation: the experts' nonlinearity.
      return_aux: also return :func:`router_losses` (this rank's group's).

    Returns:
      ``(..., D)``, the same on every ``tp_axis`` rank; add it to the residual. With
      ``return_aux``: ``(output, {"load_balance": 0-d, "z_loss": 0-d})``.

    Raises:
      ValueError: the experts' leaves do not hold ``E / ep`` whole experts each (the leaf,
        the axis and the sizes are named), a bad ``top_k``, or tokens not divisible into
        ``n_groups``.
    """
    router_w, w = params["router"]["weight"], params["experts"]
    shape, d = x.shape, x.shape[-1]
    tokens = x.reshape(-1, d)  # (N, D)
    n, n_experts = tokens.shape[0], router_w.shape[0]
    n_ep = lax.axis_size(ep_axis) if ep_axis is not None else 1
    _check_layer(w, n_experts, n_ep, ep_axis, top_k, n, n_groups)
    logits: torch.Tensor | None
    if capacity_factor is None:
        logits, gates, experts = _router(router_w, tokens, top_k)
        tokens_e, gates = _tp_varying(tokens, gates, tp_axis)
        out = _dropless.dropless_experts(w, tokens_e, experts, n_experts, ep_axis=ep_axis, activation=activation)
        y = (out * gates.unsqueeze(-1)).sum(1)  # (N, k, D) -> (N, D)
    else:
        r = route(router_w, tokens, top_k=top_k, capacity_factor=capacity_factor, n_groups=n_groups)
        logits, experts = r.logits, r.experts
        tokens_e, gates = _tp_varying(tokens, r.gates, tp_axis)
        y = _capacity_dispatch(w, tokens_e, gates, r, ep_axis, activation)
    if tp_axis is not None:
        y = lax.psum(y, tp_axis)  # sum the experts' tp partial outputs once, after combining
    y = y.view(shape)
    if return_aux:
        assert logits is not None
        return y, router_losses(logits, experts, n_groups)
    return y


def _tp_varying(tokens: torch.Tensor, gates: torch.Tensor, tp_axis: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tp rank runs its slice of every expert on the same tokens: the input's grad
    and the gates' grad are partial sums over tp ("f"); the output is one ("g")."""
    if tp_axis is None:
        return tokens, gates
    return lax.pvary(tokens, tp_axis), lax.pvary(gates, tp_axis)


def _capacity_dispatch(
    w: Mapping[str, torch.Tensor],
    tokens_e: torch.Tensor,
    gates: torch.Tensor,
    r: Routing,
    ep_axis: str | None,
    activation: Callable,
) -> torch.Tensor:
    """Slots ``[E, G*C, D]``, all_to_all to the experts' ranks, experts, back, combine: ``(N, D)``."""
    n, top_k = r.experts.shape
    d, n_groups, n_experts = tokens_e.shape[-1], r.n_groups, r.n_experts
    cap, rows = r.capacity, n_groups * n_experts * r.capacity
    # Dispatch: copy each kept assignment's token into its slot; dropped ones land in the
    # trash row, cut off below. index_add's backward gathers the slots' grads per token.
    src = tokens_e.unsqueeze(1).expand(n, top_k, d).reshape(n * top_k, d)  # (N*k, D)
    buf = tokens_e.new_zeros(rows + 1, d).index_add(0, r.slots.reshape(-1), src)[:rows]  # (G*E*C, D)
    buf = buf.view(n_groups, n_experts, cap, d).transpose(0, 1).reshape(n_experts, n_groups * cap, d)  # (E, G*C, D)
    if ep_axis is not None:
        # Expert j's slots go to the ep rank holding it; received slots stack by source rank.
        buf = lax.all_to_all(buf, ep_axis, 0, 1, tiled=True)  # (E/ep, ep*G*C, D)
    out = _experts(w, buf, activation)  # (E_l, ep*G*C, D)
    if ep_axis is not None:
        out = lax.all_to_all(out, ep_axis, 1, 0, tiled=True)  # (E, G*C, D): back to the tokens' rank
    out = out.view(n_experts, n_groups, cap, d).transpose(0, 1).reshape(rows, d)  # (G*E*C, D)
    out = torch.cat([out, out.new_zeros(1, d)])  # the trash row reads as zeros
    return (out[r.slots] * gates.unsqueeze(-1)).sum(1)  # (N, k, D) -> (N, D): gate-weighted sum


def _check_layer(
    w: Mapping[str, torch.Tensor], n_experts: int, n_ep: int, ep_axis: str | None, top_k: int, n: int, n_groups: int
) -> None:
    where = f"axis {ep_axis!r} of size {n_ep}" if ep_axis is not None else "no ep axis (all experts local)"
    for name in EXPERT_TP_DIM:
        local = w[name].shape[0]
        if n_experts % n_ep or local * n_ep != n_experts:
            raise ValueError(
                f"moe_ffn: 'experts.{name}' holds {local} experts on this rank (shape {tuple(w[name].shape)}) over "
                f"{where}, but the router has {n_experts} experts: every ep rank must hold {n_experts} / {n_ep} "
                f"whole experts (n_experts divisible by the size of {ep_axis!r})."
            )
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"moe_ffn: top_k={top_k} must be in [1, {n_experts}] (the number of experts).")
    if n_groups < 1 or n % n_groups:
        raise ValueError(f"moe_ffn: {n} tokens do not split into n_groups={n_groups} equal groups.")
