"""``search(model, machine, n_devices, global_batch, memory_limit, config=SearchConfig(...))``: rank the layouts.

Enumerates every mesh whose axis sizes multiply to ``n_devices`` (each axis rule of
:data:`fshard.plan.axes.RULES` gives its sizes: pp up to the number of blocks, tp dividing
the model's heads and at most one node, ep dividing its experts; the data axes divide the
batch), and for each the microbatch counts, remat and the choices the rules add (schedules,
reshard, sequence parallelism); estimates each
(:func:`fshard.plan.estimate`), drops those whose peak memory per rank is above the
limit, and sorts the rest by predicted step time.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any, Iterable, Sequence

import attrs

from fshard._deprecated import config_from_keywords
from fshard.plan.axes import RULES
from fshard.plan.estimate import Estimate, estimate
from fshard.plan.layout import AXES, Layout, LayoutError
from fshard.plan.machine import Machine
from fshard.plan.model import ModelDesc

__all__ = ["SCHEDULES", "SearchConfig", "SearchResult", "search"]

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
    """Every mesh of ``n`` devices over ``axes``: each axis rule in turn (:data:`RULES`'
    order) picks a size from the devices left, an axis not searched keeps 1; the axes that
    split the batch must divide it."""

    def pick(k: int, rest: int, mesh: dict[str, int]) -> Iterable[dict[str, int]]:
        if k == len(RULES):
            if rest == 1 and batch % math.prod(mesh[r.name] for r in RULES if r.splits_batch) == 0:
                yield {a: mesh.get(a, 1) for a in AXES}
            return
        r = RULES[k]
        for size in r.sizes(model, machine, rest) if r.name in axes else [1]:
            if rest % size == 0:
                yield from pick(k + 1, rest // size, {**mesh, r.name: size})

    yield from pick(0, n, {})


def _microbatch_choices(local: int, pp: int, limit: int) -> list[int]:
    """Microbatch counts dividing the local batch: with pp at least pp of them."""
    ds = [d for d in _divisors(local) if (d >= pp if pp > 1 else True)]
    if len(ds) <= limit:
        return ds
    # An even spread over the divisors (which are themselves roughly geometric), both ends kept.
    return sorted({ds[round(i * (len(ds) - 1) / max(1, limit - 1))] for i in range(limit)})


def _axes(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(a) for a in value)


def _check_axes(inst: Any, attribute: Any, value: tuple[str, ...]) -> None:
    unknown = [a for a in value if a not in AXES]
    if unknown:
        raise ValueError(f"SearchConfig.axes: unknown axes {unknown} (known: {list(AXES)}); e.g. axes=('fsdp', 'tp')")


def _check_count(inst: Any, attribute: Any, value: Any) -> None:
    if value is None and attribute.name == "top":
        return
    least = 0 if attribute.name == "top" else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"SearchConfig.{attribute.name} must be an int >= {least}, got {value!r}")


@attrs.frozen
class SearchConfig:
    """What :func:`search` tries: the axes, schedules and knobs, and how much it keeps.

    Attributes:
      axes: mesh axes to consider (default all of ``fs.plan.AXES``).
      schedules: pipeline schedules to consider with pp (default :data:`SCHEDULES`).
      dtype: compute dtype (default None: the model's dtype).
      remat, sequence_parallel, reshard: the choices to try for each knob.
      max_microbatch_choices: at most this many microbatch counts per mesh, an int >= 1.
      top: keep only the fastest ``top`` (None or 0: all).

    Raises:
      ValueError: an unknown axis, or a count that is not an int in range (named).
    """

    axes: tuple[str, ...] = attrs.field(
        default=("pp", "dp", "fsdp", "cp", "ep", "tp"), converter=_axes, validator=_check_axes
    )
    schedules: tuple[str, ...] = attrs.field(default=SCHEDULES, converter=_axes)
    dtype: str | None = None
    remat: tuple[bool, ...] = attrs.field(default=(False, True), converter=tuple)
    sequence_parallel: tuple[bool, ...] = attrs.field(default=(False, True), converter=tuple)
    reshard: tuple[bool | None, ...] = attrs.field(default=(None, True, False), converter=tuple)
    max_microbatch_choices: int = attrs.field(default=8, validator=_check_count)
    top: int | None = attrs.field(default=None, validator=_check_count)


def search(
    model: ModelDesc,
    machine: Machine,
    n_devices: int,
    global_batch: int,
    memory_limit: float | None = None,
    *,
    config: SearchConfig | None = None,
    **deprecated: Any,
) -> SearchResult:
    """Enumerates layouts of ``n_devices`` for ``model``, keeps those that fit, ranks them.

    Args:
      model: the model description.
      machine: the machine description.
      n_devices: devices to use (the product of the mesh sizes).
      global_batch: samples per optimizer step.
      memory_limit: bytes per device (optional; default the machine's memory less its reserve).
      config: what to try and keep (optional, default ``SearchConfig()``: every axis,
        schedule and knob).
      **deprecated: :class:`SearchConfig`'s fields as keywords (``axes=``, ``top=``, ...),
        as before it existed: each warns (DeprecationWarning) and goes in the next release.

    Returns:
      A :class:`SearchResult`.

    Raises:
      ValueError: ``n_devices`` or ``global_batch`` below 1.
      TypeError: both ``config`` and deprecated keywords, or an unknown keyword.
    """
    if deprecated:
        cfg = config_from_keywords("search", SearchConfig, config, deprecated)
    else:
        cfg = config if config is not None else SearchConfig()
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"search: n_devices must be an int >= 1, got {n_devices!r}")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"search: global_batch must be an int >= 1, got {global_batch!r}")
    dtype = cfg.dtype or model.dtype
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

    for mesh in _meshes(model, machine, n_devices, global_batch, cfg.axes):
        pp = mesh["pp"]
        local = global_batch // math.prod(mesh[r.name] for r in RULES if r.splits_batch)
        choices: dict[str, list] = {"schedule": [("1f1b", None)], "sequence_parallel": [False], "reshard": [None]}
        for rule in RULES:
            choices.update(rule.choices(cfg, mesh))
        # Knobs that only trade time for memory, fastest first: keep gathered parameters
        # (no reshard), free them (reshard), recompute blocks (remat). Once one fits, the
        # later ones can only be slower.
        knobs = [(r, m) for m in cfg.remat for r in choices["reshard"]]
        knobs.sort(key=lambda k: (k[1], {False: 0, None: 1 if pp == 1 else 0, True: 1}[k[0]]))
        for (sched, virt), sp in itertools.product(choices["schedule"], choices["sequence_parallel"]):
            for m in _microbatch_choices(local, pp, cfg.max_microbatch_choices):
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
        ranked=tuple(fits[: cfg.top] if cfg.top else fits),
        rejected=dict(rejected),
        best_unfit=best_unfit,
        considered=considered,
    )
