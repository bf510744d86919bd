"""A layout: how one training step uses the devices.

A :class:`Layout` names the mesh (sizes of ``pp``, ``dp``, ``fsdp``, ``ep``, ``tp``),
the global batch, the microbatches (pipeline microbatches with ``pp``, else gradient
accumulation), the pipeline schedule, remat, FSDP's reshard-after-forward, sequence
parallelism and the compute dtype: the choices ``examples/train_lm.py`` takes as flags
(:meth:`Layout.to_argv`).

Semantics are fshard's: ``fsdp`` shards parameters (``fs.parallel.scan_layers`` per block
plus one root group, or ``fs.sched.StageFSDP`` per pipeline stage), ``dp`` replicates them
(DDP, or HSDP with ``fsdp``), ``tp`` is Megatron's tensor parallelism
(``fs.parallel.TRANSFORMER_TP_PLAN``), ``pp`` cuts the blocks into contiguous stages run by
``fs.sched.pipeline_step``; the batch's rows split over ``dp``, ``fsdp`` and ``ep``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import attrs

from fshard.plan.model import DTYPE_BYTES, ModelDesc

__all__ = ["AXES", "Layout", "LayoutError"]

# Outermost first: inner axes get the closest ranks (one node), where traffic is highest.
AXES = ("pp", "dp", "fsdp", "ep", "tp")
DATA_AXES = ("dp", "fsdp", "ep")


@functools.lru_cache(maxsize=512)
def _schedule(name: str, pp: int, m: int, virtual: int | None) -> Any:
    from fshard.sched.registry import build_schedule

    return build_schedule(name, pp, m, n_virtual=virtual)


def _splits_backward(schedule: Any) -> bool:
    from fshard.sched.ir import Kind

    return any(p.kind is Kind.I for row in schedule.actions for a in row for p in a.parts)


class LayoutError(ValueError):
    """A layout that does not fit the model, the batch or the device count (the field is named)."""


def _mesh(value: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise LayoutError(f"Layout.mesh must be a mapping of axis -> size, got {value!r}")
    for axis, size in value.items():
        if axis not in AXES:
            raise LayoutError(f"Layout.mesh: unknown axis {axis!r}; axes are {', '.join(AXES)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise LayoutError(f"Layout.mesh[{axis!r}] must be an int >= 1, got {size!r}")
    return {a: value[a] for a in AXES if a in value and value[a] > 1} or {"fsdp": 1}


@attrs.frozen
class Layout:
    """One training step's use of the devices.

    Attributes:
      mesh: axis -> size, axes among ``pp, dp, fsdp, ep, tp`` (size-1 axes dropped; order
        is always :data:`AXES`).
      batch: global batch, in samples (sequences).
      microbatches: pipeline microbatches (with pp) or gradient-accumulation slices.
      schedule: pipeline schedule name (``fs.sched``'s names; used with pp only).
      virtual: pipeline stages per rank (None: the schedule's default).
      remat: recompute each block in backward.
      reshard: FSDP frees gathered parameters after forward and regathers in backward
        (None: fshard's default, True for ``scan_layers``, False for pipeline stages).
      sequence_parallel: with tp, split activations between TP regions over the sequence.
      dtype: compute dtype (``"bfloat16"`` computes and gathers in bf16 over fp32 masters).
      prefetch: FSDP gathers in flight ahead of the layer that runs.
    """

    mesh: Mapping[str, int] = attrs.field(converter=_mesh)
    batch: int
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual: int | None = None
    remat: bool = False
    reshard: bool | None = None
    sequence_parallel: bool = False
    dtype: str = "float32"
    prefetch: int = 1

    def size(self, axis: str) -> int:
        return self.mesh.get(axis, 1)

    @property
    def n_devices(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def fsdp(self) -> int:
        return self.size("fsdp")

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def data_axes(self) -> tuple[str, ...]:
        return tuple(a for a in DATA_AXES if a in self.mesh)

    @property
    def n_data(self) -> int:
        return math.prod(self.size(a) for a in DATA_AXES)

    @property
    def microbatch_size(self) -> int:
        """Samples per microbatch on one data rank."""
        return self.batch // (self.n_data * self.microbatches)

    @property
    def master_dtype(self) -> str:
        return "float32" if self.dtype in ("bfloat16", "float16") else self.dtype

    @property
    def resharding(self) -> bool:
        """Whether gathered parameters are freed after forward (the default resolved)."""
        if self.reshard is not None:
            return self.reshard
        return self.pp == 1

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours on ``axis`` (product of the inner axes' sizes)."""
        inner = AXES[AXES.index(axis) + 1:]
        return math.prod(self.size(a) for a in inner)

    def build_schedule(self) -> Any:
        """The pipeline schedule (``fs.sched``), or None without pp.

        Raises:
          LayoutError: the generator rejects the sizes (its reason is quoted).
        """
        if self.pp == 1:
            return None
        try:
            return _schedule(self.schedule, self.pp, self.microbatches, self.virtual)
        except (ValueError, KeyError) as e:
            raise LayoutError(f"Layout.schedule {self.schedule!r} on pp={self.pp} with microbatches="
                              f"{self.microbatches}: {e}") from None

    def validate(self, model: ModelDesc, n_devices: int | None = None) -> None:
        """Checks that this layout can run ``model``.

        Raises:
          LayoutError: naming the field and the sizes that do not fit.
        """
        if n_devices is not None and self.n_devices != n_devices:
            raise LayoutError(f"Layout.mesh {dict(self.mesh)} has {self.n_devices} devices, not {n_devices}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise LayoutError(f"Layout.batch must be an int >= 1, got {self.batch!r}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise LayoutError(f"Layout.microbatches must be an int >= 1, got {self.microbatches!r}")
        if self.batch % (self.n_data * self.microbatches):
            raise LayoutError(
                f"Layout.batch {self.batch} must be a multiple of microbatches {self.microbatches} x "
                f"data-parallel ranks {self.n_data} ({' x '.join(f'{a}={self.size(a)}' for a in DATA_AXES)})")
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"Layout.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        for d in model.tp_divides:
            if d % self.tp:
                raise LayoutError(f"Layout.mesh['tp']={self.tp} must divide {d} (model {model.name!r}: "
                                  f"tp_divides {model.tp_divides}, e.g. heads and KV heads)")
        if self.size("ep") > 1 and (not model.n_experts or model.n_experts % self.size("ep")):
            raise LayoutError(f"Layout.mesh['ep']={self.size('ep')} needs a model whose experts it divides; "
                              f"model {model.name!r} has n_experts={model.n_experts}")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("Layout.sequence_parallel needs tp > 1")
        if self.sequence_parallel and model.seq_len % self.tp:
            raise LayoutError(f"Layout.sequence_parallel: seq_len {model.seq_len} must be divisible by tp={self.tp}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise LayoutError(f"Layout.prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.pp > 1:
            sch = self.build_schedule()
            if model.n_blocks < sch.n_stages:
                raise LayoutError(f"Layout: schedule {self.schedule!r} on pp={self.pp} has {sch.n_stages} stages "
                                  f"but model {model.name!r} has {model.n_blocks} blocks")
            if self.remat and _splits_backward(sch):
                # Measured (comm_log, pp=2 x tp=2, zb): 13 TP psums per block and microbatch
                # instead of 5: each W group's pass recomputes the checkpointed block.
                raise LayoutError(f"Layout.remat with schedule {self.schedule!r} (backward split into I and W) "
                                  f"is not modeled: fshard's executor recomputes a checkpointed block in each W "
                                  f"pass; use remat with 1f1b, gpipe or interleaved")

    def label(self) -> str:
        """Short text: ``pp=2,fsdp=2 1f1b m=4 remat``."""
        parts = [",".join(f"{a}={n}" for a, n in self.mesh.items())]
        if self.pp > 1:
            v = f" v={self.virtual}" if self.virtual else ""
            parts.append(f"{self.schedule}{v}")
        if self.microbatches > 1:
            parts.append(f"m={self.microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.remat:
            parts.append("remat")
        if self.reshard is not None and self.reshard != (self.pp == 1) and self.fsdp > 1:
            parts.append("reshard" if self.reshard else "no-reshard")
        if self.dtype != "float32":
            parts.append(self.dtype)
        return " ".join(parts)

    def to_argv(self) -> list[str]:
        """The ``examples/train_lm.py`` flags for this layout (batch included)."""
        argv = ["--mesh", ",".join(f"{a}={n}" for a, n in self.mesh.items()), "--batch-size", str(self.batch),
                "--microbatches", str(self.microbatches), "--dtype", self.dtype]
        if self.pp > 1:
            argv += ["--schedule", self.schedule]
            if self.virtual:
                argv += ["--virtual", str(self.virtual)]
        if self.remat:
            argv.append("--remat")
        if self.sequence_parallel:
            argv.append("--sequence-parallel")
        return argv
