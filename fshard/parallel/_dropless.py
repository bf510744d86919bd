"""Dropless MoE dispatch: every assignment reaches its expert (``moe_ffn(capacity_factor=None)``).

Per rank, with ``N`` tokens, ``k`` experts per token, ``E`` experts, ``R`` ranks on the ep
axis and ``E_l = E / R`` experts per rank:

1. **Sort** the ``N * k`` assignments by expert (stable: token order within an expert), and
   count them per expert (``counts [E]``).
2. **Sizes**: one ``all_gather`` of ``counts`` over ep gives every rank the ``[R, E]``
   matrix, from which each rank computes both exchanges' plans for every rank (host ints,
   :func:`_tables`): what each rank sends to each expert's rank, where it lands there
   (rows grouped by expert, then by source rank), what it receives.
3. **Dispatch**: ``ragged_all_to_all`` of the sorted rows to the experts' ranks, handed its
   plan (``fs.lax._ragged_planned``: the public op would all-gather and check a plan that
   every rank already holds, valid by construction).
4. **Experts**: one grouped GEMM each way over the local experts' row groups
   (``torch._grouped_mm`` where the dtype and the row strides allow it, else one matmul
   per expert; :func:`expert_gemms`).
5. **Return**: ``ragged_all_to_all`` back along the transposed plan, unsort, and each
   token sums its experts' outputs times the gates.

Nothing is padded and nothing dropped; the price is host syncs (the sizes are read on the
host once per layer) and shapes that change every step. The single-process
form (``ep_axis=None``) runs steps 1, 4 and 5 on all experts: a distributed run's rows of
expert ``e`` are the reference's rows of ``e`` in the same order (source rank major), so
both run the same matrices.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from fshard import lax
from fshard.runtime import simulation

__all__ = ["dropless_experts", "expert_gemms", "grouped_mm_fits"]

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_fits(x: torch.Tensor, w: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``torch._grouped_mm`` takes these rows and weights: its dtypes (float32,
    bfloat16, float16; not float64) and rows whose byte strides are multiples of 16."""
    if x.dtype not in _GROUPED_DTYPES or any(t.dtype != x.dtype for t in w.values()):
        return False
    size = x.element_size()
    return all((t.shape[-1] * size) % 16 == 0 for t in (w["w1"], w["w2"]))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous cotangent (``_grouped_mm``'s backward
    refuses the stride-0 one of ``out.sum()``)."""

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def expert_gemms(
    w: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    sizes: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    *,
    grouped: bool | None = None,
) -> torch.Tensor:
    """Each expert's FFN on its group of rows: ``act(x_j @ w1[j].T) @ w2[j].T``.

    Args:
      w: ``{"w1" [E_l, H, D], "w2" [E_l, D, H]}``.
      x: ``(S, D)``, the rows of expert 0, then expert 1, ... (``sizes`` of them).
      sizes: ``(E_l,)`` int rows per expert (zeros allowed).
      grouped: ``True``: ``torch._grouped_mm`` (raises where it cannot run); ``False``: one
        matmul per expert; ``None``: grouped where :func:`grouped_mm_fits`.

    Returns:
      ``(S, D)``, rows in ``x``'s order.
    """
    if grouped is None:
        grouped = grouped_mm_fits(x, w)
    if grouped:
        offs = sizes.cumsum(0).to(torch.int32)
        h = activation(torch._grouped_mm(x, w["w1"].transpose(-2, -1), offs=offs))
        return _ContiguousGrad.apply(torch._grouped_mm(h, w["w2"].transpose(-2, -1), offs=offs))
    outs, at = [], 0
    for j, n in enumerate(sizes.tolist()):
        xj = x[at : at + n]
        outs.append(activation(xj @ w["w1"][j].T) @ w["w2"][j].T)
        at += n
    return torch.cat(outs) if outs else x[:0]


def dropless_experts(
    w: Mapping[str, torch.Tensor],
    tokens: torch.Tensor,
    experts: torch.Tensor,
    n_experts: int,
    *,
    ep_axis: str | None,
    activation: Callable[[torch.Tensor], torch.Tensor],
    grouped: bool | None = None,
) -> torch.Tensor:
    """Every assignment's expert output, in assignment order: ``(N, k, D)``.

    Args:
      w: this rank's experts (``E / ep`` of them, see :func:`expert_gemms`).
      tokens: ``(N, D)``.
      experts: ``(N, k)`` int64 expert ids.
      n_experts: ``E``.
      ep_axis: the expert-parallel axis, or ``None`` (all experts local).
    """
    n, k = experts.shape
    d = tokens.shape[-1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments by expert, token order within one
    rows = tokens.index_select(0, order.div(k, rounding_mode="floor"))  # (N*k, D)
    counts = torch.bincount(flat, minlength=n_experts)  # (E,)
    if ep_axis is None:
        out = expert_gemms(w, rows, counts, activation, grouped=grouped)
    else:
        every = lax.all_gather(counts, ep_axis)  # (ep, E): every rank's counts, the whole plan
        local_sizes = _local_sizes(every, lax.axis_index(ep_axis))
        dispatch, combine = simulation.per_rank(_tables)(every)  # the same on every rank of one ep group
        there = simulation.per_rank(_zeros)(local_sizes, rows)  # rows per rank differ: one size each
        x = lax._ragged_planned(rows, there, dispatch, ep_axis)
        y = expert_gemms(w, x, local_sizes, activation, grouped=grouped)
        out = lax._ragged_planned(y, rows.new_zeros(n * k, d), combine, ep_axis)
    back = torch.empty_like(out).index_copy(0, order, out)  # unsort
    return back.view(n, k, d)


def _zeros(sizes: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(int(sizes.sum()), like.shape[-1])


def _local_sizes(every: torch.Tensor, me: torch.Tensor) -> torch.Tensor:
    """``(E_l,)``: rows each of this rank's experts receives, from every rank's counts ``(ep, E)``
    (``index_select``, not ``[me]``: no host read of a per-rank index under ``fs.simulate``)."""
    n_ep, n_experts = every.shape
    per_expert = every.view(n_ep, n_ep, n_experts // n_ep).sum(0)  # (receiver, local expert)
    return per_expert.index_select(0, me.reshape(1))[0]


def _tables(every: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two exchanges' plans for every rank, ``table[u] = [input_offsets, send_sizes,
    output_offsets, recv_sizes]`` (``fs.lax.ragged_all_to_all``'s vectors; int64 ``(ep, 4, E)``,
    as tensors because under ``fs.simulate`` each ep group has its own), from every rank's
    counts ``every[s][e]``: rows rank ``s`` sends to expert ``e``.

    Dispatch: rank ``s``'s rows are sorted by expert; slice ``e = (r, j)`` goes to local
    expert ``j`` of rank ``r``, where rows are grouped by local expert and, within one, by
    source rank. Combine: the reverse, each slice back to where it came from.
    """
    cnt = every.tolist()
    n_ep, n_experts = len(cnt), len(cnt[0])
    el = n_experts // n_ep

    def c(s: int, r: int, j: int) -> int:
        return cnt[s][r * el + j]

    sent_from = [[sum(row[:e]) for e in range(n_experts)] for row in cnt]  # where s's rows for e start
    land = [[[0] * el for _ in range(n_ep)] for _ in range(n_ep)]  # land[s][r][j]: where s's slice lands on r
    for r in range(n_ep):
        at = 0
        for j in range(el):
            for s in range(n_ep):
                land[s][r][j], at = at, at + c(s, r, j)
    slots = [(r, j) for r in range(n_ep) for j in range(el)]
    dispatch = [
        [sent_from[s], cnt[s], [land[s][r][j] for r, j in slots], [c(q, s, j) for q, j in slots]] for s in range(n_ep)
    ]
    combine = [
        [
            [land[q][r][j] for q, j in slots],
            [c(q, r, j) for q, j in slots],
            [sent_from[q][r * el + j] for q, j in slots],
            cnt[r],
        ]
        for r in range(n_ep)
    ]
    return torch.tensor(dispatch, dtype=torch.int64), torch.tensor(combine, dtype=torch.int64)
