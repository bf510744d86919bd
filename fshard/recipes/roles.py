"""``Roles``: what each axis of a built mesh does for a training step, derived from a ``Layout``."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from fshard.mesh.mesh import Mesh
from fshard.mesh.spec import PartitionSpec as P
from fshard.parallel.accumulate import GradAccumulator
from fshard.parallel.ep import ep_specs
from fshard.parallel.layout import Layout, LayoutError
from fshard.parallel.specs import fsdp_specs, replicate_specs
from fshard.parallel.tp import tp_specs
from fshard.transforms.policy import Policy

__all__ = ["Roles", "check_batch", "torch_dtype"]

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``, for the compute dtypes the recipes run.

    Raises:
      LayoutError: a dtype the recipes do not run (``float8``: the planner models it only).
    """
    if name not in _TORCH_DTYPES:
        raise LayoutError(f"Layout.dtype {name!r}: the recipes run {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


@attrs.frozen
class Roles:
    """How the parameters and the batch are laid out on the mesh.

    Attributes:
      mesh: the named mesh.
      shard_axis: the axis parameters are sharded over (FSDP), or None.
      replicate_axis: the axis parameters are replicated over with gradients all-reduced
        (DDP; with ``shard_axis`` that is HSDP), or None.
      tp_axis: the tensor-parallel axis (Megatron: heads, MLP width and vocabulary split),
        or None.
      pp_axis: the pipeline axis (blocks split into stages), or None.
      cp_axis: the context-parallel axis (each sequence split over it, parameters
        replicated over it), or None.
      ep_axis: the expert-parallel axis, or None: a data axis (rows split over it) whose
        ranks hold different experts (``fs.parallel.ep_specs``: dim 0 over ep, then over
        ``shard_axis``); every other parameter is replicated over it, with its gradient
        summed over it as over dp.
      sequence_parallel: between TP regions, split the activations' rows over tp too.
      data_axes: the axes the batch's rows are split over.
      master_dtype: the dtype of the parameters and the optimizer state.
      policy: mixed precision for the gathers and the compute (None: compute in master_dtype).
      remat: recompute blocks in backward instead of keeping their activations.
      prefetch: FSDP gathers in flight ahead of the block that runs (``scan_layers``).
      reshard: free gathered parameters after forward (None: each loop's default: yes for
        ``scan_layers``, no for pipeline stages).
    """

    mesh: Mesh
    shard_axis: str | None
    replicate_axis: str | None
    tp_axis: str | None
    pp_axis: str | None
    sequence_parallel: bool
    data_axes: tuple[str, ...]
    master_dtype: torch.dtype
    policy: Policy | None
    remat: bool
    prefetch: int = 1
    reshard: bool | None = None
    cp_axis: str | None = None
    ep_axis: str | None = None

    @classmethod
    def for_mesh(
        cls, mesh: Mesh, *, compute_dtype: torch.dtype, master_dtype: torch.dtype, remat: bool, sequence_parallel: bool
    ) -> "Roles":
        """The roles of ``mesh``'s axes by name (``fsdp``, ``dp``, ``cp``, ``ep``, ``tp``, ``pp``).

        Raises:
          LayoutError: sequence parallelism without a ``tp`` axis; ep with tp; ep with pp and
            dp or cp but no fsdp.
        """
        axes = mesh.axis_names
        # Only dp: parameters replicated (DDP). fsdp, alone or with dp (HSDP): sharded.
        shard = "fsdp" if "fsdp" in axes else None
        replicate = "dp" if "dp" in axes else None
        tp = "tp" if "tp" in axes else None
        pp = "pp" if "pp" in axes else None
        if sequence_parallel and tp is None:
            raise LayoutError(f"Layout.sequence_parallel needs a tp axis; the mesh has {dict(mesh.shape)}")
        data = tuple(a for a in ("dp", "fsdp", "ep") if a in axes)  # tp ranks share their rows
        policy = None
        if compute_dtype != master_dtype:
            # Gather and compute in bf16, reduce gradients in the masters' precision.
            policy = Policy(param_dtype=compute_dtype, reduce_dtype=master_dtype)
        cp = "cp" if "cp" in axes and mesh.shape["cp"] > 1 else None  # a size-1 cp splits nothing
        ep = "ep" if "ep" in axes and mesh.shape["ep"] > 1 else None
        _check_ep(mesh, ep, tp, pp, shard)
        return cls(
            mesh, shard, replicate, tp, pp, sequence_parallel, data, master_dtype, policy, remat, cp_axis=cp, ep_axis=ep
        )

    @classmethod
    def of(cls, layout: Layout, mesh: Mesh) -> "Roles":
        """The roles ``layout`` gives the axes of ``mesh`` (``layout.mesh()``, or a mesh that
        also keeps size-1 axes)."""
        if layout.offload:
            raise LayoutError(
                "Layout.offload: the recipes do not offload yet; use fs.parallel.offload_shards "
                "with scan_layers(config=ScanConfig(offload=True)) in a step of your own, or leave offload out"
            )
        roles = cls.for_mesh(
            mesh,
            compute_dtype=torch_dtype(layout.dtype),
            master_dtype=torch_dtype(layout.master_dtype),
            remat=layout.remat,
            sequence_parallel=layout.sequence_parallel,
        )
        return attrs.evolve(roles, prefetch=layout.prefetch, reshard=layout.reshard)

    def group_axes(self, acc: GradAccumulator | None = None, sync: bool = True) -> dict[str, Any]:
        """The keyword arguments of ``gather_params`` and ``scan_layers``."""
        return dict(
            axis=self.shard_axis, replicate_axis=self.replicate_axes, policy=self.policy, accumulate=acc, sync=sync
        )

    @property
    def replicate_axes(self) -> tuple[str, ...]:
        """The axes parameters are replicated over with their gradients summed: dp, cp (each
        cp rank's gradient is its part of the sequence's) and ep. The experts, split over ep,
        are not summed over it (``fs.parallel.scan_layers`` reads that from their spec): the
        expert dispatch's transpose already brings each expert the gradient of every ep
        rank's tokens."""
        return tuple(a for a in (self.replicate_axis, self.cp_axis, self.ep_axis) if a is not None)

    @property
    def loss_axes(self) -> tuple[str, ...]:
        """The axes the loss is averaged over: the data axes (rows), then cp (each rank's
        loss is the mean over its equal share of every sequence's tokens)."""
        return self.data_axes + ((self.cp_axis,) if self.cp_axis is not None else ())

    def layer_loop(self) -> dict[str, Any]:
        """The keyword arguments of ``scan_layers`` beyond :meth:`group_axes` (remat, prefetch, reshard)."""
        extra: dict[str, Any] = {"remat": self.remat, "prefetch": self.prefetch}
        if self.reshard is not None:
            extra["reshard_after_forward"] = self.reshard
        return extra

    def param_specs(self, params: Any, tp_plan: Any = None) -> Any:
        """One ``P`` per parameter.

        FSDP shards dim 0 (uneven sizes are padded); DDP replicates; TP splits by
        ``tp_plan`` (``fs.parallel.tp_specs``' rules; the Transformer's: wq/wk/wv/w1 by
        rows, wo/w2 by columns, embeddings by vocabulary), with FSDP on dim 0 as the minor
        split.

        Raises:
          LayoutError: a tp axis, and no ``tp_plan`` to split the parameters by.
        """
        if self.tp_axis is not None:
            if tp_plan is None:
                raise LayoutError(
                    f"the mesh has a tp axis ({dict(self.mesh.shape)}) but the model has no TP "
                    f"plan: give LayeredModel(tp_plan=...) and TP versions of its pieces, or "
                    f"leave tp out of the layout"
                )
            return tp_specs(params, tp_plan, self.tp_axis, fsdp_axis=self.shard_axis)
        base = fsdp_specs(params, self.shard_axis) if self.shard_axis is not None else replicate_specs(params)
        if self.ep_axis is None:
            return base
        return ep_specs(params, self.ep_axis, fsdp_axis=self.shard_axis, base=base, mesh=self.mesh)

    @property
    def batch_spec(self) -> P:
        """Rows of the batch split over every data axis."""
        return P(self.data_axes)


def _check_ep(mesh: Mesh, ep: str | None, tp: str | None, pp: str | None, shard: str | None) -> None:
    """What the recipes build with ep.

    Raises:
      LayoutError: ep with tp; ep with pp and dp or cp but no fsdp (``fs.sched.pipeline_step``
        leaves a leaf split over a data axis to the stage body, so the experts' gradients
        would not be summed over dp or cp: ``StageFSDP`` over fsdp sums them).
    """
    if ep is None:
        return
    shape = dict(mesh.shape)
    if tp is not None:
        raise LayoutError(
            f"the mesh {shape} has ep and tp: the recipes do not build experts split over tp yet "
            f"(fs.parallel.moe_ffn(tp_axis=...) in a step of your own); leave one out"
        )
    others = [a for a in ("dp", "cp") if mesh.shape.get(a, 1) > 1]
    if pp is not None and others and shard is None:
        raise LayoutError(
            f"the mesh {shape} has pp and ep with {' and '.join(others)} but no fsdp: in a pipeline the experts' "
            f"gradients are summed over {' and '.join(others)} by the stages' FSDP only; add an fsdp axis, or "
            f"drop {' and '.join(others)}"
        )


def check_sp_rows(layout: Layout) -> None:
    """With SP the recipes' Transformer keeps ``1 / tp`` of each microbatch's rows per tp rank
    (``fs.parallel.tp_embed``'s ``seq_dim=0``), so tp must divide them.

    Not a ``Layout`` rule: ``fs.plan`` also describes Megatron's sequence split, which does not ask it.

    Raises:
      LayoutError: naming the batch, the microbatches, the data ranks and the fixes.
    """
    rows, tp = layout.microbatch_size, layout.tp
    if layout.sequence_parallel and rows % tp:
        raise LayoutError(
            f"Layout.sequence_parallel splits a microbatch's rows over tp={tp}: Layout.batch {layout.batch} / "
            f"({layout.microbatches} microbatches x {layout.n_data} data ranks) = {rows} rows, not a multiple of "
            f"{tp}; make Layout.batch a multiple of {layout.microbatches * layout.n_data * tp}, use fewer "
            f"microbatches, or leave sequence_parallel out"
        )


def check_batch(batch_size: int, microbatches: int, mesh: Mesh, roles: Roles) -> None:
    """Every microbatch must split evenly over the data-parallel ranks.

    Raises:
      LayoutError: naming the batch, the microbatches and the data ranks.
    """
    n_data = mesh.axis_size(roles.data_axes) if roles.data_axes else 1
    if batch_size % (microbatches * n_data):
        raise LayoutError(
            f"batch {batch_size} must be a multiple of {microbatches} microbatches "
            f"x {n_data} data-parallel ranks ({' x '.join(roles.data_axes) or 'none'})"
        )
