"""``search(model, machine, n_devices, global_batch, memory_limit)``: rank the layouts.

Enumerates every mesh whose axis sizes multiply to ``n_devices`` (pp up to the number of
blocks, tp dividing the model's heads and at most one node, ep dividing its experts, the
data axes dividing the batch), and for each the schedules, microbatch counts, remat,
reshard and sequence-parallel choices that apply; estimates each
(:func:`fshard.plan.estimate`), drops those whose peak memory per rank is above the
limit, and sorts the rest by predicted step time.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Iterable, Sequence

import attrs

from fshard.plan.estimate import Estimate, estimate
from fshard.plan.layout import Layout, LayoutError
from fshard.plan.machine import Machine
from fshard.plan.model import ModelDesc

__all__ = ["SearchResult", "search", "SCHEDULES"]

SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zb", "gpipe")


@attrs.frozen
class SearchResult:
    """The ranked layouts.

    Attributes:
      ranked: estimates of the layouts that fit, fastest first.
      rejected: how many layouts were dropped, by reason (``"memory"``, or the layout
        rule that failed).
      best_unfit: the layout with the smallest peak among those that did not fit (what it
        would take), or None.
      considered: how many layouts were estimated.
    """

    ranked: tuple[Estimate, ...]
    rejected: dict[str, int]
    best_unfit: Estimate | None
    considered: int

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def __iter__(self):
        return iter(self.ranked)

    def __len__(self) -> int:
        return len(self.ranked)

    def __getitem__(self, i: int) -> Estimate:
        return self.ranked[i]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(model: ModelDesc, machine: Machine, n: int, batch: int, axes: Sequence[str]) -> Iterable[dict[str, int]]:
    tps = [t for t in _divisors(n) if all(d % t == 0 for d in model.tp_divides) and t <= machine.devices_per_node]
    eps = [e for e in _divisors(n) if e == 1 or (model.n_experts and model.n_experts % e == 0)]
    for tp in tps if "tp" in axes else [1]:
        for ep in eps if "ep" in axes else [1]:
            rest = n // (tp * ep) if n % (tp * ep) == 0 else 0
            if not rest:
                continue
            for pp in _divisors(rest) if "pp" in axes else [1]:
                if pp > model.n_blocks:
                    continue
                data = rest // pp
                for dp in _divisors(data) if "dp" in axes else [1]:
                    fsdp = data // dp
                    if "fsdp" not in axes and fsdp > 1:
                        continue
                    if batch % (dp * fsdp * ep):
                        continue
                    yield {"pp": pp, "dp": dp, "fsdp": fsdp, "ep": ep, "tp": tp}


def _microbatch_choices(local: int, pp: int, limit: int) -> list[int]:
    """Microbatch counts dividing the local batch: with pp at least pp of them."""
    ds = [d for d in _divisors(local) if (d >= pp if pp > 1 else True)]
    if len(ds) <= limit:
        return ds
    # An even spread over the divisors (which are themselves roughly geometric), both ends kept.
    return sorted({ds[round(i * (len(ds) - 1) / max(1, limit - 1))] for i in range(limit)})


def search(
    model: ModelDesc,
    machine: Machine,
    n_devices: int,
    global_batch: int,
    memory_limit: float | None = None,
    *,
    axes: Sequence[str] = ("pp", "dp", "fsdp", "ep", "tp"),
    schedules: Sequence[str] = SCHEDULES,
    dtype: str | None = None,
    remat: Sequence[bool] = (False, True),
    sequence_parallel: Sequence[bool] = (False, True),
    reshard: Sequence[bool | None] = (None, True, False),
    max_microbatch_choices: int = 8,
    top: int | None = None,
) -> SearchResult:
    """Enumerates layouts of ``n_devices`` for ``model``, keeps those that fit, ranks them.

    Args:
      model: the model description.
      machine: the machine description.
      n_devices: devices to use (the product of the mesh sizes).
      global_batch: samples per optimizer step.
      memory_limit: bytes per device (optional; default the machine's memory less its reserve).
      axes: mesh axes to consider (optional, default all).
      schedules: pipeline schedules to consider with pp (optional).
      dtype: compute dtype (optional; default ``"bfloat16"`` when the machine has a figure
        for it and the model was described in it, else the model's dtype).
      remat, sequence_parallel, reshard: the choices to try (optional).
      max_microbatch_choices: at most this many microbatch counts per mesh (optional).
      top: keep only the fastest ``top`` (optional, default all).

    Returns:
      A :class:`SearchResult`.

    Raises:
      ValueError: ``n_devices`` or ``global_batch`` below 1.
    """
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"search: n_devices must be an int >= 1, got {n_devices!r}")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"search: global_batch must be an int >= 1, got {global_batch!r}")
    dtype = dtype or model.dtype
    limit = memory_limit if memory_limit is not None else machine.memory_bytes - machine.reserved_bytes
    fits: list[Estimate] = []
    rejected: Counter = Counter()
    best_unfit: Estimate | None = None
    considered = 0

    def run(layout: Layout) -> Estimate | None:
        nonlocal considered, best_unfit
        try:
            est = estimate(model, machine, layout, memory_limit=limit, time_unfit=False)
        except LayoutError as e:
            rejected[str(e).split(":")[0]] += 1
            return None
        considered += 1
        if est.fits:
            fits.append(est)
            return est
        rejected["memory"] += 1
        if best_unfit is None or est.peak_bytes < best_unfit.peak_bytes:
            best_unfit = est
        return None

    for mesh in _meshes(model, machine, n_devices, global_batch, axes):
        pp, tp, fsdp = mesh["pp"], mesh["tp"], mesh["fsdp"]
        local = global_batch // (mesh["dp"] * fsdp * mesh["ep"])
        scheds: list[tuple[str, int | None]] = [(s, None) for s in schedules] if pp > 1 else [("1f1b", None)]
        # Knobs that only trade time for memory, fastest first: keep gathered parameters
        # (no reshard), free them (reshard), recompute blocks (remat). Once one fits, the
        # later ones can only be slower.
        knobs = [
            (r, m) for m in remat for r in (reshard if fsdp > 1 else (None,)) if not (r is not None and r == (pp == 1))
        ]
        knobs.sort(key=lambda k: (k[1], {False: 0, None: 1 if pp == 1 else 0, True: 1}[k[0]]))
        for (sched, virt), sp in itertools.product(scheds, sequence_parallel if tp > 1 else (False,)):
            for m in _microbatch_choices(local, pp, max_microbatch_choices):
                fitted_first = False
                for j, (rs, rm) in enumerate(knobs):
                    layout = Layout(
                        mesh,
                        batch=global_batch,
                        microbatches=m,
                        schedule=sched,
                        virtual=virt,
                        remat=rm,
                        reshard=rs,
                        sequence_parallel=sp,
                        dtype=dtype,
                    )
                    if run(layout) is not None:
                        fitted_first = j == 0
                        break
                if pp == 1 and fitted_first:
                    # Without a pipeline more microbatches only regather more often: the
                    # fewest that fit with the fastest knobs is the fastest.
                    break
    fits.sort(key=lambda e: (e.step_s, e.peak_bytes))
    return SearchResult(
        ranked=tuple(fits[:top] if top else fits), rejected=dict(rejected), best_unfit=best_unfit, considered=considered
    )
