"""``Layout``: the one description of how a training step uses the devices.

A layout names the mesh's axes by role and size (``pp``, ``dp``, ``fsdp``, ``cp``, ``ep``, ``tp``),
the global batch, the microbatches (pipeline microbatches with ``pp``, else gradient
accumulation), the pipeline schedule, remat, FSDP's reshard-after-forward, prefetch and
offload, sequence parallelism and the compute dtype. ``fs.plan`` searches over layouts and
returns them, ``examples/train_lm.py`` builds one from its flags (:meth:`Layout.parse`
reads ``--mesh``), and :meth:`Layout.mesh` makes the mesh it runs on.

Roles are fshard's: ``fsdp`` shards parameters (``fs.parallel.scan_layers`` per block plus
one root group, or ``fs.sched.StageFSDP`` per pipeline stage), ``dp`` replicates them (DDP,
or HSDP with ``fsdp``), ``tp`` is Megatron's tensor parallelism, ``ep`` holds experts, ``pp``
cuts the blocks into contiguous stages run by ``fs.sched.pipeline_step``, ``cp`` splits each
sequence (context parallelism: ``fs.parallel.ring_attention`` over head-tail chunks), with
the parameters replicated over it and their gradients summed over it as over ``dp``; the
batch's rows split over ``dp``, ``fsdp`` and ``ep``. A new parallelism adds its axis to :data:`AXES` (at
its place in the rank order) and, if it splits the batch's rows, to :data:`DATA_AXES`.

What needs a model or a schedule (heads that ``tp`` must divide, stages per block) is
checked by ``fs.plan.check_layout``: this module imports neither.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import attrs

__all__ = ["AXES", "DATA_AXES", "DTYPES", "Layout", "LayoutError", "parse_mesh"]

# Outermost first: inner axes get the closest ranks (one node), where traffic is highest.
AXES = ("pp", "dp", "fsdp", "cp", "ep", "tp")
DATA_AXES = ("dp", "fsdp", "ep")
# Compute dtypes; bfloat16 and float16 keep float32 masters.
DTYPES = ("float32", "bfloat16", "float16", "float64", "float8")


class LayoutError(ValueError):
    """A layout that does not fit the model, the batch or the device count (the field is named)."""


def parse_mesh(text: str, axes: Sequence[str] = AXES) -> dict[str, int]:
    """``"tp=2,pp=2"`` -> ``{"pp": 2, "tp": 2}``: every axis among ``axes``, once, with an
    integer size >= 1, in ``axes``' order (size-1 axes kept: a mesh may have them).

    Raises:
      LayoutError: quoting the text, naming the axis and the value, and what is allowed.
    """
    out: dict[str, int] = {}
    for item in text.split(","):
        name, eq, size = (part.strip() for part in item.partition("="))
        if not eq or not name:
            raise LayoutError(
                f"{text!r}: expected axis=size items separated by commas (e.g. fsdp=4,tp=2), got {item!r}"
            )
        if name not in axes:
            raise LayoutError(f"{text!r}: unknown axis {name!r}; axes are {', '.join(axes)}")
        if name in out:
            raise LayoutError(f"{text!r}: axis {name!r} is given twice")
        try:
            value = int(size)
        except ValueError:
            raise LayoutError(f"{text!r}: axis {name!r} has size {size!r}; a size is an integer >= 1") from None
        if value < 1:
            raise LayoutError(
                f"{text!r}: axis {name!r} has size {value}; a size is an integer >= 1 (1 leaves the axis out)"
            )
        out[name] = value
    return {a: out[a] for a in axes if a in out}


def _shape(value: Mapping[str, int]) -> dict[str, int]:
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
      shape: axis -> size (given as ``mesh=``, the first argument), axes among :data:`AXES`;
        size-1 axes are dropped and the order is always :data:`AXES`'s.
      batch: global batch, in samples (sequences).
      microbatches: pipeline microbatches (with pp) or gradient-accumulation slices.
      schedule: pipeline schedule name (``fs.sched``'s names; used with pp only).
      virtual: pipeline stages per rank (None: the schedule's default).
      remat: recompute each block in backward.
      reshard: FSDP frees gathered parameters after forward and regathers in backward
        (None: fshard's default, True for ``scan_layers``, False for pipeline stages).
      sequence_parallel: with tp, split the activations between TP regions over tp.
      dtype: compute dtype (``"bfloat16"`` computes and gathers in bf16 over fp32 masters).
      prefetch: FSDP gathers in flight ahead of the layer that runs.
      offload: FSDP keeps the shards and the optimizer state in CPU memory.
    """

    shape: Mapping[str, int] = attrs.field(converter=_shape, alias="mesh")
    batch: int
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual: int | None = None
    remat: bool = False
    reshard: bool | None = None
    sequence_parallel: bool = False
    dtype: str = "float32"
    prefetch: int = 1
    offload: bool = False

    @classmethod
    def parse(cls, text: str, **options: Any) -> "Layout":
        """``Layout.parse("pp=2,fsdp=2", batch=16, ...)``: the mesh from :func:`parse_mesh`.

        Raises:
          LayoutError: as :func:`parse_mesh`, or a field the options give wrong.
        """
        return cls(parse_mesh(text), **options)

    def mesh(self) -> Any:
        """The ``fs.Mesh`` of :attr:`shape`, axes in :data:`AXES` order (collective: every rank calls it)."""
        from fshard.mesh import make_mesh

        return make_mesh(dict(self.shape))

    def size(self, axis: str) -> int:
        return self.shape.get(axis, 1)

    @property
    def n_devices(self) -> int:
        return math.prod(self.shape.values())

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
    def ep(self) -> int:
        return self.size("ep")

    @property
    def cp(self) -> int:
        return self.size("cp")

    @property
    def data_axes(self) -> tuple[str, ...]:
        return tuple(a for a in DATA_AXES if a in self.shape)

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
        inner = AXES[AXES.index(axis) + 1 :]
        return math.prod(self.size(a) for a in inner)

    def validate(self, n_devices: int | None = None) -> None:
        """Checks what the layout alone decides (``fs.plan.check_layout`` adds a model's checks).

        Raises:
          LayoutError: naming the field and the sizes that do not fit.
        """
        if n_devices is not None and self.n_devices != n_devices:
            raise LayoutError(f"Layout.mesh {dict(self.shape)} has {self.n_devices} devices, not {n_devices}")
        if not isinstance(self.batch, int) or isinstance(self.batch, bool) or self.batch < 1:
            raise LayoutError(f"Layout.batch must be an int >= 1, got {self.batch!r}")
        if not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise LayoutError(f"Layout.microbatches must be an int >= 1, got {self.microbatches!r}")
        if self.batch % (self.n_data * self.microbatches):
            raise LayoutError(
                f"Layout.batch {self.batch} must be a multiple of microbatches {self.microbatches} x "
                f"data-parallel ranks {self.n_data} ({' x '.join(f'{a}={self.size(a)}' for a in DATA_AXES)})"
            )
        if self.dtype not in DTYPES:
            raise LayoutError(f"Layout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("Layout.sequence_parallel needs tp > 1")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise LayoutError(f"Layout.prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.virtual is not None and (not isinstance(self.virtual, int) or self.virtual < 1):
            raise LayoutError(f"Layout.virtual must be an int >= 1 or None, got {self.virtual!r}")

    def label(self) -> str:
        """Short text: ``pp=2,fsdp=2 1f1b m=4 remat``."""
        parts = [",".join(f"{a}={n}" for a, n in self.shape.items())]
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
        if self.offload:
            parts.append("offload")
        if self.dtype != "float32":
            parts.append(self.dtype)
        return " ".join(parts)

    def mesh_text(self) -> str:
        """``"pp=2,fsdp=2"``: :attr:`shape` as :meth:`parse` reads it."""
        return ",".join(f"{a}={n}" for a, n in self.shape.items())
