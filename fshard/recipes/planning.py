"""The planner around a training run: the machine, an automatic layout, and the prediction
next to what the run measured.

``fs.plan`` predicts a layout's step time and peak memory from a model description and a
machine file; these are the three places a training script meets it: :func:`machine` (the
same on every rank), :func:`auto_layout` (the fastest layout that fits) and
:func:`predicted_vs_measured` (after the run, for its log).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import attrs
import torch
import torch.distributed as dist

from fshard.models import TransformerConfig
from fshard.parallel.layout import Layout
from fshard.plan.freshness import stale
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

    This host's file is reused only while it holds (:func:`fshard.plan.freshness.stale`:
    the same torch and fshard versions and cores, a load within the band of the
    calibration's); otherwise it is measured again, with a warning naming the file and the
    field that differs. A file that records no conditions (written before they were
    recorded) is used, with a warning that its freshness is unknown. A file named by ``name``
    is used as given, with the warning.
    """
    from fshard import plan
    from fshard.mesh.mesh import make_mesh
    from fshard.plan.report import file_note

    found, why = None, "none was there"
    log = logging.getLogger(__name__)
    if name:
        found = plan.get_machine(name)
        if name.lower() not in plan.MACHINES:  # a machine file: where and how old, and whether it holds
            found = _noted(found, file_note(name))
            problem = stale(found.conditions, name, ranks=world)
            if problem and is_rank0():  # the user named it: used, with the reason it may be off
                log.warning("fs.plan: %s (used as given by --machine)", problem)
    elif is_rank0():
        path = plan.default_machine_path()
        if path.exists():
            found = _noted(plan.load_machine(path), file_note(path))
            problem = stale(found.conditions, path, ranks=world)
            if problem and not found.conditions:  # an older file: nothing to compare, so used, said
                log.warning("fs.plan: %s", problem)
            elif problem:  # this host's cache: measured again rather than reused
                log.warning("fs.plan: %s; calibrating again now", problem.split("; measure again")[0])
                found, why = None, "the file was stale"
    if world > 1:
        box: list[Any] = [found, why]
        dist.broadcast_object_list(box, src=0)
        found, why = box[0], box[1]
    if found is None:  # collective: every rank measures at once
        found = plan.calibrate(make_mesh({"ranks": world}), quick=True, block=block)
        found = _noted(found, f"{_FILE}{plan.default_machine_path()}, calibrated now ({why})")
    return found


_FILE = "machine file "  # report.file_note's opening: the sources entry auto_layout names


def _noted(found: Any, note: str) -> Any:
    return attrs.evolve(found, sources=(*found.sources, note))


def _origin(on: Any) -> str:
    """``", from machine file PATH, written ... (AGE ago)"``, or ``""`` for a shipped machine."""
    notes = [s for s in on.sources if s.startswith(_FILE)]
    return f", from {notes[-1]}" if notes else ""


def auto_layout(
    cfg: TransformerConfig,
    template: Layout,
    world: int,
    on: Any,
    *,
    axes: Sequence[str],
    seq_len: int,
    moe: Any = None,
) -> tuple[Layout, str]:
    """The planner's fastest layout of ``world`` ranks for ``cfg`` (with ``moe``, an
    ``fs.recipes.MoE``: its experts, balanced routing) that fits ``on`` (a machine).

    ``template`` gives the batch and the dtype. Returns the layout and one line saying why.

    Raises:
      ConfigError: no layout of ``world`` ranks fits the batch in the machine's memory.
    """
    from fshard import plan

    model = plan.describe_transformer(cfg, seq_len=seq_len, dtype=template.dtype, moe=moe)
    found = plan.search(
        model, on, world, template.batch, config=plan.SearchConfig(axes=tuple(axes), dtype=template.dtype)
    )
    # The recipes' SP keeps a microbatch's rows (tp must divide them); the planner's also
    # describes Megatron's sequence split, which does not ask it: skip what the recipes refuse.
    runnable = [e for e in found.ranked if not (e.layout.sequence_parallel and e.layout.microbatch_size % e.layout.tp)]
    if not runnable:
        raise ConfigError(
            f"--mesh auto: no layout of {world} rank(s) fits --batch-size {template.batch} "
            f"in {on.memory_bytes / 2**30:.1f} GiB per rank"
        )
    best = runnable[0]
    return best.layout, (
        f"{best.layout.label()} (best of {found.considered} layouts on {on.name}{_origin(on)}): {best.explain()}"
    )


def predicted_vs_measured(
    cfg: TransformerConfig,
    layout: Layout,
    on: Any,
    probe: Any,
    records: list[dict[str, Any]],
    *,
    seq_len: int,
    moe: Any = None,
) -> dict[str, Any]:
    """``predicted_step_s``, ``measured_step_s`` (median after the warm-up), ``predicted_peak_mib``
    and ``measured_peak_mib`` (one profiled step, the largest rank's), and the prediction's
    breakdown, layout and machine: the fields a run adds to its last log record. Also the
    interval (``predicted_step_lo_s``, ``predicted_step_hi_s``: :func:`fshard.plan.estimate.interval`),
    ``prediction_off`` (the prediction over the step, less 1, when the step is outside it,
    else None), ``plan_regime``, ``plan_uncertain`` (the machine's noisy fits), and the
    machine file used with its age (``plan_machine_file``: ``"PATH, written ... (AGE ago)"``
    or ``"PATH, calibrated now (...)"``; ``plan_calibration_age_s`` from the calibration's
    recorded time; None for a shipped machine or a file that records none).

    With ``moe`` (an ``fs.recipes.MoE``) the model is described with its experts, at
    balanced routing (``plan_skew``: 1.0).

    Collective when the process group is initialized (the peak is the largest rank's).
    """
    from fshard import plan

    try:
        model = plan.describe_transformer(cfg, seq_len=seq_len, dtype=layout.dtype, moe=moe)
        est = plan.estimate(model, on, layout)
    except plan.LayoutError as e:  # a layout the planner does not model: measure only
        est = None
        logging.getLogger(__name__).warning("fs.plan: no prediction: %s", e)
    peak = probe.summary([r["step_time_s"] for r in records])
    if dist.is_initialized() and peak["measured_peak_mib"] is not None:  # the largest rank, as predicted
        t = torch.tensor([peak["measured_peak_mib"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak["measured_peak_mib"] = float(t)
    measured = peak["measured_step_s"]
    off = None
    if est is not None and measured and not est.step_lo_s <= measured <= est.step_hi_s:
        off = est.step_s / measured - 1.0  # the relative error as docs/plan.md counts it
    notes = [s for s in on.sources if s.startswith(_FILE)]
    when = on.conditions.get("time")
    return {
        "predicted_step_s": est and est.step_s,
        "predicted_step_lo_s": est and est.step_lo_s,
        "predicted_step_hi_s": est and est.step_hi_s,
        "prediction_off": off,
        "plan_regime": est and est.regime,
        "plan_uncertain": list(on.uncertain),
        "plan_machine_file": notes[-1].removeprefix(_FILE) if notes else None,
        "plan_calibration_age_s": None if when is None else time.time() - when,
        "measured_step_s": measured,
        "predicted_peak_mib": est and est.peak_bytes / 2**20,
        "measured_peak_mib": peak["measured_peak_mib"],
        "predicted_breakdown_s": est and est.breakdown,
        "plan_layout": est and est.layout.label(),
        "plan_machine": on.name,
        "plan_skew": 1.0 if moe is not None else None,
    }


def prediction_line(r: dict[str, Any]) -> str:
    """One line comparing a record's prediction (and its interval) with its measurement, and a
    second, ``"prediction off by X: calibration stale or model incomplete"``, when the
    measured step is outside the interval."""

    def fmt(key: str, spec: str, unit: str) -> str:
        return "n/a" if r[key] is None else f"{r[key]:{spec}} {unit}"

    band = ""
    if r.get("predicted_step_lo_s") is not None:
        band = f" ({r['predicted_step_lo_s']:.4f}-{r['predicted_step_hi_s']:.4f} s)"
    line = (
        f"fs.plan: step predicted {fmt('predicted_step_s', '.4f', 's')}{band}, measured "
        f"{fmt('measured_step_s', '.4f', 's')} (median after warm-up); peak memory per rank predicted "
        f"{fmt('predicted_peak_mib', '.1f', 'MiB')}, measured {fmt('measured_peak_mib', '.1f', 'MiB')}"
    )
    if r.get("plan_uncertain"):
        line += f"; calibration uncertain: {', '.join(r['plan_uncertain'])} (noisy fits)"
    if r.get("prediction_off") is not None:
        line += f"\nfs.plan: prediction off by {r['prediction_off']:+.0%}: calibration stale or model incomplete"
    return line
