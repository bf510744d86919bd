"""``pipeline_step``: one training step of a pipeline-parallel model on every rank.

This module owns what goes in and out of a step: argument checks, the schedule's
preparation (validate, lower, validate again, cached per schedule), the microbatch
split, parameters in (plain tensors or DTensors) and gradients out, the gradient sum
over data-parallel axes, and the loss on every rank. The action loop itself is
:class:`fshard.sched.runtime.Executor`.

Example (one MLP layer per stage, 2 pipeline ranks)::

    mesh = fs.make_mesh({"pp": 2})
    sch = fs.sched.one_f_one_b(2, 4)
    stage_params = [params_0 if rank == 0 else None, params_1 if rank == 1 else None]
    loss, grads = fs.sched.pipeline_step(
        lambda p, x, s: torch.relu(x @ p["w"].T), lambda y, t: ((y - t) ** 2).mean(),
        stage_params, (inputs, targets), schedule=sch, mesh=mesh)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from fshard import comm, lax
from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh, get_mesh
from fshard.mesh.sharding import spec_of
from fshard.mesh.spec import PartitionSpec
from fshard.runtime import simulation
from fshard.sched import simulated
from fshard.sched.ir import Action, Kind, Schedule
from fshard.sched.lower import add_reduce_grad, add_unshard_reshard, lower
from fshard.sched.runtime import Executor, ExecutorConfig, tracing
from fshard.sched.stage_fsdp import StageFSDP, StageShards
from fshard.sched.validate import validate
from fshard.transforms.shard_map import set_global_shape

__all__ = ["StageFSDP", "StepStats", "pipeline_step"]


@attrs.frozen
class StepStats:
    """What one :func:`pipeline_step` did on this rank.

    Attributes:
        peak_activations: the most (stage, microbatch) pairs alive at once (from the
            start of F to the end of B or W); equals
            ``fs.sched.simulate(schedule).peak_activations[rank]``.
        losses: per-microbatch losses on the rank holding the last stage, else None.
        busy_s: seconds spent in F/B/I/W (waiting for transfers excluded).
        wait_s: seconds blocked on receives and on sends at the end.
        wall_s: seconds for the whole call.
        n_sends: payload sends issued (one per SEND action).
        n_recvs: payload receives issued (one per RECV action).
        bytes_sent: payload bytes sent.
        bytes_received: payload bytes received.
        spans: ``(action, start_s, end_s)`` of every compute action, in seconds from the
            start of the action loop, waits for inputs excluded (for timeline plots).
    """

    peak_activations: int
    losses: tuple[torch.Tensor, ...] | None
    busy_s: float
    wait_s: float
    wall_s: float
    n_sends: int
    n_recvs: int
    bytes_sent: int
    bytes_received: int
    spans: tuple[tuple[Action, float, float], ...] = ()

    @property
    def bubble_fraction(self) -> float:
        """1 - busy_s / wall_s: the share of the step this rank did not compute."""
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


# id(schedule) -> (schedule, (needs REDUCE_GRAD, UNSHARD/RESHARD window or 0), prepared);
# the schedule is kept alive so that its id is not reused while cached.
_PREPARED: dict[int, tuple[Schedule, tuple[bool, int], Schedule]] = {}
_MAX_CACHED = 64


def pipeline_step(
    stage_fn: Callable[[Any, Any, int], Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    stage_params: Sequence[Any],
    batch: tuple[Any, Any],
    *,
    schedule: Schedule,
    mesh: Mesh | None = None,
    axis: str = "pp",
    data_axes: str | Sequence[str] = (),
    fsdp: StageFSDP | str | Sequence[str] | None = None,
    return_stats: bool = False,
    seq_axes: str | Sequence[str] = (),
) -> tuple[torch.Tensor, list[Any]] | tuple[torch.Tensor, list[Any], StepStats]:
    """Runs forward and backward of every microbatch through the pipeline on ``axis``.

    Every rank of ``mesh`` calls this with the same arguments (except its own entries
    of ``stage_params``). Rank ``r`` on ``axis`` executes ``schedule.actions[r]``
    (lowered and validated first, so a schedule that deadlocks or computes a
    microbatch twice is rejected before anything runs).

    The stage body runs like a ``shard_map(check=False)`` body over ``mesh``: it sees
    local tensors and may call ``fs.lax`` collectives over the other mesh axes (tp,
    fsdp, dp), Megatron style (place ``fs.lax.pvary`` yourself where needed).

    Loss scaling happens in one place: the gradient seeded at each microbatch loss is
    1 / (n_microbatches * data-parallel size). Every call returns fresh gradients, so to
    accumulate k steps add their grads and divide by k.

    Data parallelism: ``data_axes`` names mesh axes over which the global batch is
    split (dim 0, before the microbatch split). Gradients of leaves that are plain
    tensors or DTensors replicated over those axes are summed over them (each rank's
    loss is already scaled by 1 / its share of the batch); leaves sharded over a data
    axis (FSDP) are left to the body's own collectives (all_gather's transpose
    reduce-scatters), so pass them as DTensors.

    Args:
        stage_fn: ``stage_fn(params_of_stage, x, stage_index) -> y``. Stage 0 gets the
            microbatch of ``inputs`` (any pytree); every other stage gets the previous
            stage's output. Non-last stages return one tensor of a fixed shape and
            dtype (at most 8 dims); the last stage's output goes to ``loss_fn``.
        loss_fn: ``loss_fn(output, target) -> scalar``, the *mean* over the microbatch.
        stage_params: one entry per stage (``schedule.n_stages`` = n_ranks *
            n_virtual); entries of stages this rank does not hold may be None. An
            entry is a pytree whose tensor leaves are this rank's local values: plain
            tensors, or DTensors (their ``to_local()`` is used). Keep global names in
            it (``{"layers": {"5": ...}}``): it is passed through unchanged in shape.
        batch: ``(inputs, targets)``, pytrees of tensors with the same dim-0 size B,
            the global batch (the same on every rank).
        schedule: a :class:`~fshard.sched.Schedule` (compute-only or lowered).
        mesh: the mesh (default: the current mesh).
        axis: the pipeline axis (default ``"pp"``).
        data_axes: data-parallel mesh axes (default none).
        fsdp: FSDP per stage (a :class:`~fshard.sched.StageFSDP`, or its axis): leaves
            sharded over that axis are gathered by the executor, one flat all-gather per
            stage (per step, or per microbatch with ``reshard_after_forward=True``), so
            ``stage_fn`` sees them whole over it; their gradients are summed over
            microbatches and reduce-scattered once per stage per step. The axis must be
            one of ``data_axes``. Default None: the body gathers what it needs itself
            (e.g. with ``fs.parallel.scan_layers``, per microbatch).
        return_stats: also return a :class:`StepStats` (default False).
        seq_axes: mesh axes over which each sequence is split (context parallelism,
            ``fs.parallel.ring_attention``; default none). The batch is not split over
            them: every rank of them gets the same rows and the stage body keeps its share
            (``fs.parallel.cp_shard``). Each rank's loss is the mean over its equal share,
            so the seed is also divided by their size, and the loss and the replicated
            leaves' gradients are averaged and summed over them as over ``data_axes``.

    Returns:
        ``(loss, grads)`` or ``(loss, grads, stats)``. ``loss`` is the mean of the
        microbatch losses (and over ``data_axes``), a 0-dim tensor on every rank.
        ``grads`` is a list like ``stage_params``: for held stages a pytree like the
        entry with the gradient of ``loss`` (the single-device gradient of the mean
        loss; zeros for unused leaves, None for non-float leaves; DTensors with the
        parameter's placements for DTensor leaves), None for other stages.

    Raises:
        ScheduleError: the schedule deadlocks, repeats or misses work (names the rank
            and action).
        ValueError: sizes that do not fit: mesh axis vs n_ranks, number of
            stage_params entries vs n_stages, a missing entry for a held stage, batch
            rows not divisible by n_microbatches (times the data-parallel size), a
            stage output whose shape changes between microbatches, a non-scalar loss.
        TypeError: ``schedule`` is not a Schedule or ``batch`` is not a pair.
    """
    t_start = time.perf_counter()
    if not isinstance(schedule, Schedule):
        raise TypeError(f"pipeline_step: schedule must be an fs.sched.Schedule, got {type(schedule).__name__}")
    mesh = get_mesh(mesh, what="pipeline_step")
    (axis,) = mesh.check_axes(axis, what="pipeline_step: axis")
    data = mesh.check_axes(data_axes, what="pipeline_step: data_axes")
    if axis in data:
        raise ValueError(f"pipeline_step: data_axes={data} contains the pipeline axis {axis!r}")
    seq = mesh.check_axes(seq_axes, what="pipeline_step: seq_axes")
    if axis in seq or set(seq) & set(data):
        raise ValueError(
            f"pipeline_step: seq_axes={seq} must name neither the pipeline axis {axis!r} nor a data axis "
            f"(data_axes={data}): an axis splits the rows or the sequences, not both"
        )
    name = (
        f"schedule {schedule.name!r} (n_ranks={schedule.n_ranks}, n_stages="
        f"{schedule.n_stages}, n_microbatches={schedule.n_microbatches})"
    )
    if mesh.shape[axis] != schedule.n_ranks:
        raise ValueError(
            f"pipeline_step: {name} needs mesh axis {axis!r} of size n_ranks="
            f"{schedule.n_ranks}, but {mesh!r} has {axis}={mesh.shape[axis]}"
        )
    if not isinstance(stage_params, (list, tuple)) or len(stage_params) != schedule.n_stages:
        got = len(stage_params) if isinstance(stage_params, (list, tuple)) else type(stage_params).__name__
        raise ValueError(
            f"pipeline_step: stage_params must be a list with one entry per stage; "
            f"{name} has n_stages = n_ranks * n_virtual = {schedule.n_ranks} * "
            f"{schedule.n_virtual} = {schedule.n_stages}, got {got}"
        )
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError("pipeline_step: batch must be a pair (inputs, targets)")
    if return_stats and tracing():
        # Checked before any transfer, so that no peer waits for this rank's trace.
        raise ValueError(
            "pipeline_step(return_stats=True) cannot be captured by fs.jit: StepStats holds "
            "wall-clock timings of one eager run and is no pytree of tensors (its losses "
            "would be the trace's fake tensors). Inside fs.jit pass return_stats=False and "
            "time the jitted call; for per-microbatch losses or timings, run an eager step."
        )
    step = _Step(
        stage_fn,
        loss_fn,
        stage_params,
        batch,
        schedule,
        mesh,
        axis,
        data,
        _fsdp_config(fsdp, mesh, axis, data),
        name,
        seq,
    )
    if simulation.active() is not None:
        if return_stats:
            raise ValueError(
                f"pipeline_step(return_stats=True) under {simulation.active()}: StepStats holds one rank's "
                f"wall-clock timings, and simulated ranks share one process and take turns; pass "
                f"return_stats=False, or run on real ranks (fs.run_local / torchrun) to time a step."
            )
        return _simulated_step(step)
    rank = mesh.axis_index(axis)
    executor, prepared, originals, held = _run_rank(step, rank)
    loss = _share_loss(*_loss_buffer(executor, prepared, mesh), prepared, mesh, axis, step.averaged)
    grads = _grads_out(stage_params, originals, held, executor)
    if not return_stats:
        return loss, grads
    last = rank == prepared.last_rank
    stats = StepStats(
        peak_activations=executor.peak_activations,
        losses=tuple(executor.losses) if last else None,
        busy_s=executor.busy_s,
        wait_s=executor.wait_s,
        wall_s=time.perf_counter() - t_start,
        n_sends=executor.n_sends,
        n_recvs=executor.n_recvs,
        bytes_sent=executor.bytes_sent,
        bytes_received=executor.bytes_received,
        spans=tuple(executor.spans),
    )
    return loss, grads, stats


@attrs.frozen
class _Step:
    """One call's checked arguments, as :func:`_run_rank` takes them (``name``: the
    schedule as errors name it; ``config``: the stage-level FSDP, if any)."""

    stage_fn: Callable[[Any, Any, int], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    stage_params: Sequence[Any]
    batch: tuple[Any, Any]
    schedule: Schedule
    mesh: Mesh
    axis: str
    data: tuple[str, ...]
    config: StageFSDP | None
    name: str
    seq: tuple[str, ...] = ()

    @property
    def averaged(self) -> tuple[str, ...]:
        """The axes the loss is averaged over and replicated gradients summed over."""
        return tuple(self.data) + tuple(self.seq)


def _simulated_step(step: _Step) -> tuple[torch.Tensor, list[Any]]:
    """The step under ``fs.simulate``: each pipeline coordinate's part as one program over
    its simulated ranks (:mod:`fshard.sched.simulated`), then the loss shared by all.

    Every entry of ``stage_params`` must be given (a simulated program has no per-rank
    None): each coordinate reads the entries of its stages. A stage's gradients hold
    blocks on the ranks of its coordinate only.
    """
    world = simulation.world_size() or 1
    groups, peer = simulated.pp_groups(step.mesh, step.axis, world)
    transport = simulated.Transport(peer)

    def program(p: int) -> tuple[Any, ...]:
        ranks = groups[p]
        view = simulated.restricted_mesh(step.mesh, ranks)
        params = simulated.restrict(list(step.stage_params), ranks)
        mine = attrs.evolve(step, stage_params=params, batch=simulated.restrict(step.batch, ranks), mesh=view)
        executor, prepared, originals, held = _run_rank(mine, p, transport)
        buf, code = _loss_buffer(executor, prepared, view)
        return prepared, buf, _grads_out(params, originals, held, executor)

    results = simulated.run_per_coordinate(groups, transport, program)
    prepared = results[0][0]
    buf = simulated.join_blocks([(groups[p], r[1]) for p, r in enumerate(results)])
    loss = _share_loss(buf, 1, prepared, step.mesh, step.axis, step.averaged)
    grads = [results[prepared.rank_of(s)][2][s] for s in range(step.schedule.n_stages)]
    return loss, grads


def _run_rank(
    step: _Step, rank: int, transport: Any = None
) -> tuple[Executor, Schedule, dict[int, list[Any]], dict[int, tuple[list[Any], Any]]]:
    """Pipeline rank ``rank``'s part of the step: its executor run (with the stage-level
    FSDP and the data-parallel gradient sums); returns ``(executor, prepared, originals, held)``."""
    stage_fn, loss_fn, stage_params, batch = step.stage_fn, step.loss_fn, step.stage_params, step.batch
    schedule, mesh, axis, data, config, name = step.schedule, step.mesh, step.axis, step.data, step.config, step.name
    n_data = mesh.axis_size(data) if data else 1
    summed = step.averaged  # data, then seq: each rank's loss is a mean over its share of both
    n_summed = mesh.axis_size(summed) if summed else 1
    originals, held = _local_params(stage_params, schedule, rank, name)
    reduce = (
        {
            s: [i for i, leaf in enumerate(leaves) if _reduced(leaf, held[s][0][i], summed)]
            for s, leaves in originals.items()
        }
        if n_summed > 1
        else {}
    )
    m = schedule.n_microbatches
    inputs, targets = _microbatches(batch, m, n_data, mesh.axis_index(data) if data else 0, name, tuple(data))

    token = lax.BODY.set(lax.Body(mesh, False))
    try:
        shards = None
        if config is not None:
            paths = {s: list(tree_util.zip_with_path(stage_params[s])[0]) for s in held}
            shards = StageShards(config, held, tuple(a for a in summed if a not in config.axis), paths) or None
        # UNSHARD/RESHARD actions, at most max_active_stages stages gathered at once (0: none).
        unshard = config.max_active_stages if shards is not None and not config.reshard_after_forward else 0
        prepared = _prepare(schedule, any(reduce.values()) or shards is not None, unshard)
        reducer = _GradReducer(mesh, summed, reduce)

        def reduce_grad(stage: int, executor: Executor) -> None:
            if shards is not None:
                shards.reduce(stage)
            reducer.launch(stage, executor)

        hooks = {Kind.REDUCE_GRAD: reduce_grad}
        if shards is not None:
            hooks.update({Kind.UNSHARD: shards.unshard, Kind.RESHARD: shards.reshard})
        executor = Executor(
            prepared,
            stage_fn,
            loss_fn,
            held,
            inputs,
            targets,
            1.0 / (m * n_summed),
            config=ExecutorConfig(
                rank=rank,
                group=mesh.group(axis),
                axis=axis,
                device=mesh.device,
                hooks=hooks,
                stages=shards,
                transport=transport,
            ),
        )
        with mesh:
            executor.run()
            if shards is not None:
                shards.finish(executor)
            reducer.finish(executor)
    finally:
        lax.BODY.reset(token)
    return executor, prepared, originals, held


def _prepare(schedule: Schedule, reduce: bool, unshard: int = 0) -> Schedule:
    """Validated, lowered schedule (with REDUCE_GRAD when grads are reduced, and
    UNSHARD/RESHARD for stage-level FSDP that keeps parameters, at most ``unshard``
    stages gathered at once), cached."""
    hit = _PREPARED.get(id(schedule))
    if hit is not None and hit[0] is schedule and hit[1] == (reduce, unshard):
        return hit[2]
    if not schedule.is_lowered:
        # Checks work and compute order first, so its errors name compute actions.
        validate(schedule, p2p="eager")
        prepared = lower(schedule)
    else:
        prepared = schedule
    kinds = {a.kind for row in prepared.actions for a in row}
    if unshard and Kind.UNSHARD not in kinds:
        prepared = add_unshard_reshard(prepared, max_active_stages=unshard)
    if reduce and Kind.REDUCE_GRAD not in kinds:
        prepared = add_reduce_grad(prepared)
    validate(prepared, p2p="batched")
    if len(_PREPARED) >= _MAX_CACHED:
        _PREPARED.clear()
    _PREPARED[id(schedule)] = (schedule, (reduce, unshard), prepared)
    return prepared


def _fsdp_config(fsdp: Any, mesh: Mesh, axis: str, data: tuple[str, ...]) -> StageFSDP | None:
    if fsdp is None:
        return None
    config = fsdp if isinstance(fsdp, StageFSDP) else StageFSDP(fsdp)
    axes = mesh.check_axes(config.axis, what="pipeline_step: fsdp axis")
    if axis in axes:
        raise ValueError(
            f"pipeline_step: fsdp={config} shards over the pipeline axis {axis!r}; "
            f"pipeline ranks hold different stages, so shard over another axis"
        )
    missing = [a for a in axes if a not in data]
    if missing:
        raise ValueError(
            f"pipeline_step: fsdp={config} shards over {missing}, which are not in data_axes="
            f"{data}; FSDP ranks must see different rows of the batch (their gradients are "
            f"summed by the reduce-scatter), so pass data_axes={tuple(data) + tuple(missing)}"
        )
    return config


def _local_params(
    stage_params: Sequence[Any], schedule: Schedule, rank: int, name: str
) -> tuple[dict[int, list[Any]], dict[int, tuple[list[Any], Any]]]:
    """Per held stage: the original leaves, and (local leaves needing grad, treedef)."""
    originals: dict[int, list[Any]] = {}
    held: dict[int, tuple[list[Any], Any]] = {}
    for s in schedule.stages_of(rank):
        if stage_params[s] is None:
            raise ValueError(
                f"pipeline_step: stage_params[{s}] is None, but pipeline rank "
                f"{rank} holds stage {s} in {name} (stages of rank {rank}: "
                f"{list(schedule.stages_of(rank))})"
            )
        leaves, treedef = tree_util.tree_flatten(stage_params[s])
        local = []
        for leaf in leaves:
            t = leaf.to_local() if isinstance(leaf, DTensor) else leaf
            if isinstance(t, torch.Tensor):
                # A fresh leaf sharing storage: the caller's tensors get no .grad and no graph.
                t = t.detach().requires_grad_(t.is_floating_point() or t.is_complex())
                if isinstance(leaf, DTensor):
                    # As shard_map does: fs.parallel.scan_layers inside a stage needs the
                    # global shape and spec of each shard (uneven FSDP shards, gathers).
                    set_global_shape(t, tuple(leaf.shape), spec_of(leaf))
            local.append(t)
        originals[s] = leaves
        held[s] = (local, treedef)
    return originals, held


def _reduced(leaf: Any, local: Any, data: tuple[str, ...]) -> bool:
    """True if this leaf's gradient must be summed over the data axes."""
    if not (isinstance(local, torch.Tensor) and local.requires_grad):
        return False
    if not isinstance(leaf, DTensor):
        return True
    names = leaf.device_mesh.mesh_dim_names or ()
    return all(leaf.placements[names.index(a)].is_replicate() for a in data if a in names)


def _microbatches(
    batch: tuple[Any, Any], m: int, n_data: int, data_index: int, name: str, data: tuple[str, ...] = ()
) -> tuple[list[Any], list[Any]]:
    """Microbatch ``0 .. m-1`` of this data rank's rows: its block ``data_index`` of the
    batch's ``n_data`` (dim 0), cut in ``m``. A DTensor leaf laid out ``P(data)`` is that
    block already (each rank built only its rows) and is cut as it is."""
    paths, leaves, _ = tree_util.zip_with_path(list(batch))
    sizes = {p: x.shape[0] for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor) and x.dim() > 0}
    if not sizes:
        raise ValueError("pipeline_step: batch (inputs, targets) holds no tensor to split")
    rows = set(sizes.values())
    if len(rows) != 1:
        raise ValueError(f"pipeline_step: every tensor of the batch needs the same dim-0 size; got {sizes}")
    (n,) = rows
    if n % (m * n_data):
        what = f"n_microbatches={m}" + (f" * data-parallel size {n_data}" if n_data > 1 else "")
        raise ValueError(
            f"pipeline_step: {name} splits the batch along dim 0 into {what} "
            f"equal parts, but the batch has {n} rows; use a batch size "
            f"divisible by {m * n_data}"
        )
    k = n // (m * n_data)
    base = data_index * (n // n_data)
    for p, x in zip(paths, leaves):
        if isinstance(x, DTensor) and spec_of(x).padded(x.dim()) != PartitionSpec(data).padded(x.dim()):
            raise ValueError(
                f"pipeline_step: batch leaf {p} is a DTensor laid out as {spec_of(x)}; a DTensor batch holds "
                f"each rank's own rows, laid out {PartitionSpec(data)} over data_axes; pass a plain tensor "
                f"(the global batch) otherwise"
            )

    def rows(x: torch.Tensor, mb: int) -> torch.Tensor:
        if isinstance(x, DTensor):  # this data rank's rows already (fs.recipes.data.rank_batches): no gather
            return x.to_local().narrow(0, mb * k, k)
        return x.narrow(0, base + mb * k, k)

    def piece(mb: int, tree: Any) -> Any:
        return tree_util.tree_map(lambda x: rows(x, mb) if isinstance(x, torch.Tensor) and x.dim() > 0 else x, tree)

    return [piece(i, batch[0]) for i in range(m)], [piece(i, batch[1]) for i in range(m)]


class _GradReducer:
    """Sums replicated leaves' gradients over the data axes, one stage at a time.

    Launched by REDUCE_GRAD (right after a stage's last weight gradient), so the
    all-reduce overlaps the rest of the schedule; waited before the step returns.
    """

    def __init__(self, mesh: Mesh, data: tuple[str, ...], reduce: dict[int, list[int]]) -> None:
        self.mesh, self.data, self.reduce = mesh, data, reduce
        self.pending: list[tuple[int, list[int], torch.Tensor, Any]] = []
        self.launched: set[int] = set()

    def launch(self, stage: int, executor: Executor) -> None:
        idx = self.reduce.get(stage, [])
        if not idx or stage in self.launched:
            return
        self.launched.add(stage)
        grads, leaves = executor.grads[stage], executor.params[stage][0]
        for i in idx:
            if grads[i] is None:  # unused here; dp peers must still add the same sizes
                grads[i] = torch.zeros_like(leaves[i])
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in idx:
            by_dtype.setdefault(grads[i].dtype, []).append(i)
        for members in by_dtype.values():
            flat = torch.cat([grads[i].reshape(-1) for i in members])
            # Through fshard.comm: counted by comm_log, and one at a time per gloo group
            # (docs/reliability.md), reduced in place (the cat is ours alone).
            handle = comm.all_reduce_async(flat, self.mesh.group(self.data), axes=self.data, inplace=True)
            self.pending.append((stage, members, flat, handle))

    def finish(self, executor: Executor) -> None:
        for stage in sorted(self.reduce):
            self.launch(stage, executor)
        for stage, members, flat, handle in self.pending:
            flat = handle.wait()
            grads, offset = executor.grads[stage], 0
            for i in members:
                n = grads[i].numel()
                grads[i] = flat[offset : offset + n].view_as(grads[i])
                offset += n
        self.pending.clear()


_LOSS_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _loss_buffer(executor: Executor, schedule: Schedule, mesh: Mesh) -> tuple[torch.Tensor, int]:
    """``([mean loss, dtype code], code)`` on the last stage's rank, zeros (code 1) elsewhere."""
    buf = torch.zeros(2, dtype=torch.float64, device=mesh.device)
    code = 1
    if executor.rank == schedule.last_rank:
        loss = torch.stack(executor.losses).mean()
        code = _LOSS_DTYPES.index(loss.dtype) if loss.dtype in _LOSS_DTYPES else 1
        buf[0], buf[1] = loss.double(), code
    return buf, code


def _share_loss(
    buf: torch.Tensor, code: int, schedule: Schedule, mesh: Mesh, axis: str, data: tuple[str, ...]
) -> torch.Tensor:
    """The mean microbatch loss, broadcast from the last stage's rank (and averaged over data)."""
    codes = _LOSS_DTYPES
    traced = tracing()
    if schedule.n_ranks > 1:
        group = mesh.group(axis)
        comm.record("broadcast", (axis,), buf.numel() * buf.element_size())
        comm.one_at_a_time(group)
        if traced:
            # The dtype is a Python value every rank's graph needs: sent for real, once, at
            # trace time; the value itself is broadcast by the graph (same bytes as eager).
            with _disable_current_modes():
                real = torch.tensor([code], dtype=torch.int64, device=mesh.device)
                dist.broadcast(real, group=group, group_src=schedule.last_rank)
                code = int(real[0])
            with _unlogged():  # logged above, as eager logs it
                buf = _C10D.wait_tensor(_C10D.broadcast(buf, schedule.last_rank, group.group_name))
        else:
            dist.broadcast(buf, dist.get_global_rank(group, schedule.last_rank), group=group)
            code = int(buf[1])
    value = buf[0]
    if data and mesh.axis_size(data) > 1:
        part = buf[:1].clone()
        comm.record("psum", data, part.numel() * part.element_size())
        comm.one_at_a_time(mesh.group(data))
        if traced:
            with _unlogged():
                part = _C10D.wait_tensor(_C10D.all_reduce(part, "sum", mesh.group(data).group_name))
        else:
            dist.all_reduce(part, group=mesh.group(data))
        value = part[0] / mesh.axis_size(data)
    return value.to(codes[code])


_C10D = torch.ops._c10d_functional


@contextlib.contextmanager
def _unlogged() -> Iterator[None]:
    """comm_log's dispatch mode records nothing while no log is open (the caller logged it)."""
    token = comm._LOGS.set(())
    try:
        yield
    finally:
        comm._LOGS.reset(token)


def _grads_out(
    stage_params: Sequence[Any],
    originals: dict[int, list[Any]],
    held: dict[int, tuple[list[Any], Any]],
    executor: Executor,
) -> list[Any]:
    out: list[Any] = [None] * len(stage_params)
    for s, leaves in originals.items():
        local, treedef = held[s]
        grads = []
        for leaf, t, g in zip(leaves, local, executor.grads[s]):
            if not (isinstance(t, torch.Tensor) and t.requires_grad):
                grads.append(None)
                continue
            g = torch.zeros_like(t) if g is None else g
            if isinstance(leaf, DTensor) and simulation.active() is not None:
                # The leaf's spec, wrapped directly: from_local asks the mesh for this rank's
                # coordinate, which a pipeline coordinate's program cannot (its ranks only).
                g = DTensor(g, leaf._spec, requires_grad=False)
            elif isinstance(leaf, DTensor):
                g = DTensor.from_local(
                    g, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
                )
            grads.append(g)
        out[s] = tree_util.tree_unflatten(treedef, grads)
    return out
