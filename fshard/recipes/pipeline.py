"""Pipeline parallelism for a :class:`~fshard.recipes.model.LayeredModel`: its blocks cut
into stages, run by an ``fs.sched`` schedule."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh
from fshard.mesh.sharding import gather
from fshard.parallel.layout import LayoutError
from fshard.recipes.faults import Injection
from fshard.recipes.model import LayeredModel
from fshard.recipes.roles import Roles
from fshard.sched.ir import Schedule
from fshard.sched.registry import build_schedule
from fshard.sched.stage_fsdp import StageFSDP
from fshard.sched.step import pipeline_step
from fshard.transforms import remat

__all__ = ["Pipeline", "gather_full", "make_pipeline_grads"]


@attrs.frozen
class Pipeline:
    """Which blocks each pipeline stage holds, and the schedule that runs the stages.

    Attributes:
      schedule: an ``fs.sched`` schedule for the pp ranks and the microbatches.
      layers: per stage, the global indices of its blocks (contiguous, as even as possible).
      rank: this rank's index on the pp axis.
      embed_keys: the root entries the first stage holds; ``head_keys``: the last stage's.
    """

    schedule: Schedule
    layers: tuple[tuple[int, ...], ...]
    rank: int
    embed_keys: tuple[str, ...] = ()
    head_keys: tuple[str, ...] = ()

    @classmethod
    def build(
        cls,
        name: str,
        mesh: Mesh,
        n_layers: int,
        microbatches: int,
        n_virtual: int | None,
        model: LayeredModel | None = None,
    ) -> "Pipeline":
        """Raises LayoutError: an unknown schedule, sizes it rejects, or fewer blocks than stages;
        NotImplementedError: under ``fs.simulate`` (see :func:`_refuse_simulation`)."""
        _refuse_simulation(name, mesh)
        try:
            schedule = build_schedule(name, mesh.shape["pp"], microbatches, n_virtual=n_virtual)
        except ValueError as e:  # the generator's message names the rule
            raise LayoutError(f"Layout.schedule {name}: {e}") from None
        n = schedule.n_stages
        if n_layers < n:
            raise LayoutError(
                f"Layout.schedule {name} on pp={mesh.shape['pp']} has {n} stages "
                f"({schedule.n_virtual} per rank) but the model has {n_layers} blocks; "
                f"give it at least {n} blocks"
            )
        cuts = [s * n_layers // n for s in range(n + 1)]
        keys = {} if model is None else dict(embed_keys=model.embed_keys, head_keys=model.head_keys)
        return cls(schedule, tuple(tuple(range(cuts[s], cuts[s + 1])) for s in range(n)), mesh.axis_index("pp"), **keys)

    def root_keys(self, stage: int) -> tuple[str, ...]:
        last = self.schedule.n_stages - 1
        return (self.embed_keys if stage == 0 else ()) + (self.head_keys if stage == last else ())

    def keep_held(self, params: Any) -> dict[str, Any]:
        """This rank's part of the model's tree: the blocks and root groups of its stages.

        Blocks keep their global index as key (``layers.5``), so a checkpoint written on a
        pipeline has the same names as one written without, and either loads the other.
        """
        held = self.schedule.stages_of(self.rank)
        out: dict[str, Any] = {k: params[k] for s in held for k in self.root_keys(s)}
        out["layers"] = {str(i): params["layers"][i] for s in held for i in self.layers[s]}
        return out

    def split(self, held: dict[str, Any]) -> list[Any]:
        """The held tree as ``pipeline_step``'s ``stage_params``: one entry per stage, None elsewhere."""
        mine = self.schedule.stages_of(self.rank)
        return [
            {
                **{k: held[k] for k in self.root_keys(s)},
                "layers": {str(i): held["layers"][str(i)] for i in self.layers[s]},
            }
            if s in mine
            else None
            for s in range(self.schedule.n_stages)
        ]

    def merge(self, per_stage: Sequence[Any]) -> dict[str, Any]:
        """The inverse of :meth:`split` (e.g. for the gradients ``pipeline_step`` returns)."""
        out: dict[str, Any] = {"layers": {}}
        for entry in per_stage:
            if entry is not None:
                out.update({k: v for k, v in entry.items() if k != "layers"})
                out["layers"].update(entry["layers"])
        return out


def _refuse_simulation(name: str, mesh: Mesh) -> None:
    """The recipe's pipeline on simulated ranks is not supported yet: each pp rank keeps its
    own part of the model's tree (:meth:`Pipeline.keep_held`), and the optimizer, clipping
    (a norm summed over pp) and checkpoints act on that per-rank tree, which one simulated
    program cannot hold. ``fs.sched.pipeline_step`` itself runs simulated."""
    from fshard.runtime import simulation

    sim = simulation.active()
    if sim is not None and mesh.shape.get("pp", 1) > 1:
        raise NotImplementedError(
            f"fs.recipes: Layout.schedule {name} on pp={mesh.shape['pp']} under {sim}: the recipe's "
            f"pipeline keeps a different part of the model on each pp rank (its stages' blocks), and "
            f"its optimizer, clipping and checkpoints act on that per-rank tree, which one simulated "
            f"program cannot hold yet. Run the recipe on real ranks (fs.run_local / torchrun), or "
            f"call fs.sched.pipeline_step directly, which every schedule runs under fs.simulate."
        )


def make_pipeline_grads(
    model: LayeredModel, roles: Roles, pipe: Pipeline, inject: Injection
) -> Callable[..., tuple[torch.Tensor, Any]]:
    """``pipeline_grads(params, tokens, targets) -> (loss, grads)``: this rank's held tree in,
    its gradients (the same tree) out, through ``fs.sched.pipeline_step``."""
    last = pipe.schedule.n_stages - 1
    fsdp = (
        None
        if roles.shard_axis is None
        else StageFSDP(roles.shard_axis, policy=roles.policy, reshard_after_forward=bool(roles.reshard))
    )
    dtype = None if roles.policy is None else roles.policy.param_dtype

    def stage_fn(params: Any, x: torch.Tensor, stage: int) -> torch.Tensor:
        if dtype is not None:  # gathered leaves already are; replicated ones (no fsdp) not
            params = tree_util.tree_map(lambda t: t.to(dtype), params)
        if stage == 0:  # x: the inputs (token ids)
            x = model.embed(params, x)  # (b, T, D)
        block_fn = remat(model.block) if roles.remat else model.block
        for i in pipe.layers[stage]:
            x = block_fn(params["layers"][str(i)], x)  # (b, T, D)
        if stage == last:
            x = model.head(params, x)  # (b, T, V[/tp])
        return x

    def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return inject.loss(model.loss(output, targets))

    def pipeline_grads(params: Any, tokens: torch.Tensor, targets: torch.Tensor):
        loss, grads = pipeline_step(
            stage_fn,
            loss_fn,
            pipe.split(params),
            (tokens, targets),
            schedule=pipe.schedule,
            mesh=roles.mesh,
            axis="pp",
            data_axes=roles.data_axes,
            seq_axes=() if roles.cp_axis is None else (roles.cp_axis,),
            fsdp=fsdp,
        )[:2]
        return loss, pipe.merge(grads)

    return pipeline_grads


def gather_full(params: Any, pipe: Pipeline | None) -> Any:
    """The whole model as plain CPU tensors on every rank (collective), e.g. for sampling.

    ``fs.gather`` puts each stage's shards together among the ranks that hold it; with a
    pipeline the stages then travel to every rank as Python objects (fine for a small
    model: a large one would sample through the pipeline instead), and ``layers`` is a list
    again, in block order.
    """
    # torch warns that a strided (FSDP x TP) layout takes two all-gathers; here that is fine.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    full = tree_util.tree_map(lambda t: t.cpu(), gather(params))
    if pipe is None:
        return full
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, full)
    merged = pipe.merge(parts)
    merged["layers"] = [merged["layers"][str(i)] for i in range(len(merged["layers"]))]
    return merged
