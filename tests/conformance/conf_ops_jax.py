"""The shim's JAX side: the same names as ``conf_ops_fshard.FshardOps`` on jax / jax.lax.

Imported only in the JAX worker process (``conf_jax_worker.py``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import mlir
from jax._src.lax import parallel
from jax.sharding import AxisType, Mesh, PartitionSpec

_COLLECTIVE_PRIMS = {"psum", "psum_invariant", "all_gather", "all_gather_invariant", "reduce_scatter",
                     "psum_scatter", "all_to_all", "ppermute", "pmax", "pmin"}


def _save_collectives(prim, *_, **__) -> bool:
    # fshard's "save_collectives": keep the outputs of collectives, recompute the rest.
    return prim.name in _COLLECTIVE_PRIMS


POLICIES = {
    None: None,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "save_collectives": _save_collectives,
}


def _ragged_all_to_all_on_cpu(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups):
    """jax.lax.ragged_all_to_all's rule (its docstring's pseudocode) in all_gathers and
    selects: XLA:CPU in jax 0.10.2 has no kernel for the primitive (the custom call fails
    to compile). Only the forward is emulated; JAX's JVP and transpose rules run as they are."""
    if axis_index_groups is not None:
        raise NotImplementedError("axis_index_groups")
    every = lambda t: jax.lax.all_gather(t, axis_name)  # noqa: E731  (n, ...): rank s's block at s
    ops, ios, sss, oos = every(operand), every(input_offsets), every(send_sizes), every(output_offsets)
    n, k = ios.shape
    per, me = k // n, jax.lax.axis_index(axis_name)
    rows = jnp.arange(output.shape[0])
    result = output
    for s in range(n):  # in order: a later slice overwrites an earlier one, as the rule's loop does
        for j in range(per):
            i = me * per + j
            start, size, at = ios[s, i], sss[s, i], oos[s, i]
            hit = (rows >= at) & (rows < at + size)
            src = jnp.clip(start + rows - at, 0, operand.shape[0] - 1)
            hit = hit.reshape(hit.shape + (1,) * (output.ndim - 1))
            result = jnp.where(hit, ops[s][src], result)
    return result


mlir.register_lowering(parallel.ragged_all_to_all_p, mlir.lower_fun(_ragged_all_to_all_on_cpu, multiple_results=False),
                       platform="cpu")


def make_mesh(axes: dict[str, int]) -> Mesh:
    # Devices in id order, row-major: device i is fshard's rank i.
    devices = np.array(jax.devices()[: math.prod(axes.values())]).reshape(tuple(axes.values()))
    return Mesh(devices, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


class JaxOps:
    framework = "jax"

    def __init__(self, mesh: Mesh, check: bool) -> None:
        self.mesh, self.check = mesh, check

    P = staticmethod(PartitionSpec)
    psum = staticmethod(jax.lax.psum)
    pmean = staticmethod(jax.lax.pmean)
    pmax = staticmethod(jax.lax.pmax)
    pmin = staticmethod(jax.lax.pmin)
    all_gather = staticmethod(jax.lax.all_gather)
    psum_scatter = staticmethod(jax.lax.psum_scatter)
    ppermute = staticmethod(jax.lax.ppermute)
    all_to_all = staticmethod(jax.lax.all_to_all)
    axis_index = staticmethod(jax.lax.axis_index)
    pbroadcast = staticmethod(jax.lax.pbroadcast)
    pshuffle = staticmethod(jax.lax.pshuffle)
    pswapaxes = staticmethod(jax.lax.pswapaxes)
    pcast = staticmethod(jax.lax.pcast)
    ragged_all_to_all = staticmethod(jax.lax.ragged_all_to_all)

    def axis_size(self, ax) -> int:
        return math.prod(self.mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax))

    @staticmethod
    def pvary(x, ax):
        return jax.tree.map(lambda t: jax.lax.pcast(t, ax, to="varying"), x)

    def shard_map(self, f: Callable, in_specs: Any, out_specs: Any, check: bool | None = None) -> Callable:
        return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=self.check if check is None else check)

    grad = staticmethod(jax.grad)
    value_and_grad = staticmethod(jax.value_and_grad)
    func_grad = staticmethod(jax.grad)

    @staticmethod
    def remat(f: Callable, policy: str | None = None) -> Callable:
        return jax.checkpoint(f, policy=POLICIES[policy])

    @staticmethod
    def vmap(f: Callable, in_axes: Any = 0, out_axes: Any = 0) -> Callable:
        return jax.vmap(f, in_axes=in_axes, out_axes=out_axes)

    relu = staticmethod(jax.nn.relu)
    tanh = staticmethod(jnp.tanh)
    exp = staticmethod(jnp.exp)

    @staticmethod
    def sum(x, axis=None):
        return jnp.sum(x, axis=axis)

    @staticmethod
    def mean(x, axis=None):
        return jnp.mean(x, axis=axis)

    @staticmethod
    def concat(xs, axis=0):
        return jnp.concatenate(list(xs), axis=axis)

    @staticmethod
    def einsum(spec, *xs):
        return jnp.einsum(spec, *xs)

    @staticmethod
    def to_float(x):
        return float(x)

    @staticmethod
    def gt0_int(x):
        return (x > 0).astype(jnp.int32)

    @staticmethod
    def index(x, i):
        return x[i]

    @staticmethod
    def iadd(y, x):
        return y + x

    @staticmethod
    def setitem(y, i, v):
        return y.at[i].set(v)

    moveaxis = staticmethod(jnp.moveaxis)
    where = staticmethod(jnp.where)

    @staticmethod
    def int32(x):
        return x.astype(jnp.int32)
