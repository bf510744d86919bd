"""``ScanConfig``: the options of the layer loop (:func:`fshard.parallel.scan_layers`).

What FSDP does with each layer's gathered parameters (prefetch, reshard after forward,
mixed precision, CPU offload, the sharded dim), whether layers are recomputed in backward
(remat and its policy), and DDP's gradient bucket. Not in it: where the parameters live
(``axis``, ``replicate_axis``) and the per-microbatch state (``accumulate``, ``sync``),
which ``scan_layers`` takes directly.

A config is frozen and checked once, when it is built: build it once (outside the step)
and ``scan_layers`` only reads it. What needs the mesh (an int ``reshard_after_forward``
against the axis sizes) is checked by ``scan_layers``.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from fshard.transforms.policy import Policy
from fshard.transforms.remat import resolve_policy

__all__ = ["ScanConfig"]


def _int_at_least(low: int, what: str):
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"ScanConfig.{attribute.name}={value!r}: must be an int >= {low} ({what}).")

    return check


def _bool(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"ScanConfig.{attribute.name}={value!r} ({type(value).__name__}): must be True or False.")


def _axes_or_flag(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _reshard(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, (bool, int, str)):
        return
    if isinstance(value, tuple) and value and all(isinstance(a, str) for a in value):
        return
    raise TypeError(
        f"ScanConfig.reshard_after_forward={value!r} ({type(value).__name__}); use True, False, an int "
        f"(the size of the group to stay sharded over) or mesh axis name(s) from scan_layers' axis=."
    )


def _remat_policy(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str) and not callable(value):
        raise TypeError(
            f"ScanConfig.remat_policy={value!r} ({type(value).__name__}): must be a policy name "
            f"(e.g. 'save_collectives'), an op -> bool function, or None."
        )
    try:
        resolve_policy(value)
    except ValueError as e:  # an unknown name: the message lists the known ones
        raise ValueError(f"ScanConfig.remat_policy={value!r}: {e}") from None


def _policy(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, Policy):
        raise TypeError(
            f"ScanConfig.policy={value!r} ({type(value).__name__}): must be an fs.Policy (mixed precision: "
            f"param_dtype, reduce_dtype) or None."
        )


def _dim(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(
            f"ScanConfig.dim={value!r} ({type(value).__name__}): must be an int (the sharded dim of every "
            f"leaf) or None to infer it per leaf from its spec."
        )


def _lists(value: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    return None if value is None else tuple(tuple(layers) for layers in value)


@attrs.frozen(kw_only=True)
class ScanConfig:
    """How :func:`fshard.parallel.scan_layers` runs its layers; the defaults are FSDP's.

    Attributes:
      prefetch: how many layers ahead the forward all-gathers run.
      reshard_after_forward: ``True``: free gathered parameters after each layer's
        forward and gather them again in backward (2 all-gathers per layer instead of
        1). ``False``: keep them until the layer's backward. A mesh axis name (or tuple
        of names) from ``axis``: keep them sharded over that smaller group only (FSDP2's
        int ``reshard_after_forward``): each rank keeps a copy of its ``1/k`` slice of
        the gathered layer, ``k`` the group's size, and backward's regather is one
        all-gather over that group (e.g. with ``axis=("fsdp_out", "fsdp_in")`` and
        ``"fsdp_in"`` the ranks of one node: inter-node traffic only in forward). An int
        ``k`` means the trailing axes of ``axis`` whose sizes multiply to ``k``
        (``mesh.shape["fsdp_in"]`` above); ``1`` means ``False`` (with a warning) and
        the full size ``True``, as in FSDP2. On a single axis only those two exist: split
        it (``make_mesh({"fsdp_out": 2, "fsdp_in": 2})``, ``axis=("fsdp_out", "fsdp_in")``).
        A list of names is kept as a tuple. Which ints and names fit ``axis`` is checked
        by ``scan_layers``, which knows the mesh.
      remat: recompute each layer in backward (activation checkpointing); its gather
        is redone inside the recomputation.
      remat_policy: a :func:`fshard.remat` policy for ``remat`` (a name or ``op -> bool``).
        One that saves collectives (``"save_collectives"``, ``"dots_saveable"``) keeps
        each block's gathered parameters from forward to its backward (no regather
        there); one that does not redoes the gather inside the recomputation.
      policy: mixed precision (gather in ``param_dtype``, reduce in ``reduce_dtype``);
        None: the values' own dtypes.
      dim: the sharded dim of every leaf (None: inferred per leaf from its spec).
      forward_prefetch: explicit lists: ``forward_prefetch[i]`` = layers whose gathers
        start when layer i starts (overrides ``prefetch``). Kept as tuples.
      backward_prefetch: ``backward_prefetch[i]`` = layers whose regathers start when
        layer i's backward starts (default: ``[i - 1]``). Kept as tuples.
      bucket_bytes: replicate (DDP) only: consecutive layers' gradients share one
        all-reduce up to this size (default 25 MiB, as DDP).
      offload: CPU offload (FSDP2's ``CPUOffloadPolicy``). The shards in
        ``layer_params`` live on the CPU (so does the optimizer state made from them;
        :func:`~fshard.parallel.scan.offload_shards` moves a sharded pytree there, pinned
        when CUDA is available). Each layer's flat shard buffer is built on the host (in
        pinned memory when the mesh computes on CUDA) and copied to the mesh's device
        without blocking just before its all-gather, so the copy is prefetched with the
        gather; gathered parameters, activations and the reduction run on the device, and
        the reduced shard gradients are copied back to the CPU at the end of backward (one
        synchronization for all layers): the gradients returned for these leaves live on
        the CPU. Partial reshard slices stay on the device. Tested on CPU meshes only
        (where the copies are no-ops); the CUDA path is unverified:
        ``bench/gpu_checks/offload_check.py`` checks it on a GPU machine.

    Raises:
      ValueError: ``prefetch`` or ``bucket_bytes`` not an int >= 0, an unknown
        ``remat_policy`` name.
      TypeError: an option of the wrong type (named, with what it accepts).
    """

    prefetch: int = attrs.field(default=1, validator=_int_at_least(0, "layers whose gathers run ahead; 0: none"))
    reshard_after_forward: bool | int | str | tuple[str, ...] = attrs.field(
        default=True, converter=_axes_or_flag, validator=_reshard
    )
    remat: bool = attrs.field(default=False, validator=_bool)
    remat_policy: Any = attrs.field(default=None, validator=_remat_policy)
    policy: Policy | None = attrs.field(default=None, validator=_policy)
    dim: int | None = attrs.field(default=None, validator=_dim)
    forward_prefetch: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=_lists)
    backward_prefetch: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=_lists)
    bucket_bytes: int = attrs.field(
        default=25 * 2**20, validator=_int_at_least(0, "bytes of gradients per DDP all-reduce; 0: one per layer")
    )
    offload: bool = attrs.field(default=False, validator=_bool)


DEFAULT = ScanConfig()
