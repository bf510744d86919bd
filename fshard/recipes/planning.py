"""The planner around a training run: the machine, an automatic layout, and the prediction
next to what the run measured.

``fs.plan`` predicts a layout's step time and peak memory from a model description and a
machine file; these are the three places a training script meets it: :func:`machine` (the
same on every rank), :func:`auto_layout` (the fastest layout that fits) and
:func:`predicted_vs_measured` (after the run, for its log).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import attrs
import torch
import torch.distributed as dist

from fshard.models import TransformerConfig
from fshard.parallel.layout import Layout
from fshard.recipes.trainer import ConfigError
from fshard.runtime.process import is_rank0

__all__ = ["auto_layout", "machine", "predicted_vs_measured", "prediction_line"]


def machine(name: str | None, world: int, block: TransformerConfig | None = None) -> Any:
    """The ``fs.plan.Machine`` to plan for (collective when ``world`` > 1).

    ``name`` (``h100``, ``a100`` or a machine file), else this host's machine file, else a
    quick calibration (saved) whose compute efficiency is fitted on ``block``'s sizes.
    Rank 0 decides and its machine goes to every rank, so all ranks plan alike. A machine
    read from a file, or calibrated now, names the file (and its age) in its last
    ``sources`` entry, which :func:`auto_layout`'s line repeats.
    """
    from fshard import plan
    from fshard.mesh.mesh import make_mesh
    from fshard.plan.report import file_note

    found = None
    if name:
        found = plan.get_machine(name)
        if name.lower() not in plan.MACHINES:  # a machine file: where and how old
            found = _noted(found, file_note(name))
    elif is_rank0():
        path = plan.default_machine_path()
        found = _noted(plan.load_machine(path), file_note(path)) if path.exists() else None
    if world > 1:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    if found is None:  # collective: every rank measures at once
        found = plan.calibrate(make_mesh({"ranks": world}), quick=True, block=block)
        found = _noted(found, f"{_FILE}{plan.default_machine_path()}, calibrated now (none was there)")
    return found


_FILE = "machine file "  # report.file_note's opening: the sources entry auto_layout names


def _noted(found: Any, note: str) -> Any:
    return attrs.evolve(found, sources=(*found.sources, note))


def _origin(on: Any) -> str:
    """``", from machine file PATH, written ... (AGE ago)"``, or ``""`` for a shipped machine."""
    notes = [s for s in on.sources if s.startswith(_FILE)]
    return f", from {notes[-1]}" if notes else ""


def auto_layout(
    cfg: TransformerConfig, template: Layout, world: int, on: Any, *, axes: Sequence[str], seq_len: int
) -> tuple[Layout, str]:
    """The planner's fastest layout of ``world`` ranks for ``cfg`` that fits ``on`` (a machine).

    ``template`` gives the batch and the dtype. Returns the layout and one line saying why.

    Raises:
      ConfigError: no layout of ``world`` ranks fits the batch in the machine's memory.
    """
    from fshard import plan

    model = plan.describe_transformer(cfg, seq_len=seq_len, dtype=template.dtype)
    found = plan.search(
        model, on, world, template.batch, config=plan.SearchConfig(axes=tuple(axes), dtype=template.dtype)
    )
    if found.best is None:
        raise ConfigError(
            f"--mesh auto: no layout of {world} rank(s) fits --batch-size {template.batch} "
            f"in {on.memory_bytes / 2**30:.1f} GiB per rank"
        )
    best = found.best
    return best.layout, (
        f"{best.layout.label()} (best of {found.considered} layouts on {on.name}{_origin(on)}): {best.explain()}"
    )


def predicted_vs_measured(
    cfg: TransformerConfig, layout: Layout, on: Any, probe: Any, records: list[dict[str, Any]], *, seq_len: int
) -> dict[str, Any]:
    """``predicted_step_s``, ``measured_step_s`` (median after the warm-up), ``predicted_peak_mib``
    and ``measured_peak_mib`` (one profiled step, the largest rank's), and the prediction's
    breakdown, layout and machine: the fields a run adds to its last log record.

    Collective when the process group is initialized (the peak is the largest rank's).
    """
    from fshard import plan

    try:
        est = plan.estimate(plan.describe_transformer(cfg, seq_len=seq_len, dtype=layout.dtype), on, layout)
    except plan.LayoutError as e:  # a layout the planner does not model: measure only
        est = None
        logging.getLogger(__name__).warning("fs.plan: no prediction: %s", e)
    peak = probe.summary([r["step_time_s"] for r in records])
    if dist.is_initialized() and peak["measured_peak_mib"] is not None:  # the largest rank, as predicted
        t = torch.tensor([peak["measured_peak_mib"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak["measured_peak_mib"] = float(t)
    return {
        "predicted_step_s": est and est.step_s,
        "measured_step_s": peak["measured_step_s"],
        "predicted_peak_mib": est and est.peak_bytes / 2**20,
        "measured_peak_mib": peak["measured_peak_mib"],
        "predicted_breakdown_s": est and est.breakdown,
        "plan_layout": est and est.layout.label(),
        "plan_machine": on.name,
    }


def prediction_line(r: dict[str, Any]) -> str:
    """One line comparing a record's prediction with its measurement."""

    def fmt(key: str, spec: str, unit: str) -> str:
        return "n/a" if r[key] is None else f"{r[key]:{spec}} {unit}"

    return (
        f"fs.plan: step predicted {fmt('predicted_step_s', '.4f', 's')}, measured "
        f"{fmt('measured_step_s', '.4f', 's')} (median after warm-up); peak memory per rank predicted "
        f"{fmt('predicted_peak_mib', '.1f', 'MiB')}, measured {fmt('measured_peak_mib', '.1f', 'MiB')}"
    )
