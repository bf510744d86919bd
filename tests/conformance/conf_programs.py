"""The conformance programs' registry: each program is written ONCE against the shim ``ops``.

A program is ``fn(ops, *inputs) -> pytree`` (dicts, tuples, arrays). ``ops`` is the shim
(``conf_ops_fshard.FshardOps`` or ``conf_ops_jax.JaxOps``): the collectives with
jax.lax's signatures, ``shard_map(f, in_specs, out_specs)`` (on the program's mesh, in the
program's checked/unchecked mode; its results are global arrays), ``grad`` /
``value_and_grad`` / ``remat`` / ``vmap``, and a few array functions. Inputs are float64
numpy arrays drawn from a seed derived from the program's ``seed_key``, identical for both
frameworks. This module imports numpy only: the JAX process imports it without torch.

Programs are registered by ``conf_programs_lax`` (every fs.lax op and option) and
``conf_programs_patterns`` (gradient patterns: DP, FSDP, HSDP, TP, remat, vmap, ...).
"""

from __future__ import annotations

import dataclasses
import importlib
import zlib
from typing import Any, Callable

import numpy as np

# name -> ((axis, size), ...) in mesh order (major to minor); every mesh has 4 devices.
MESHES: dict[str, tuple[tuple[str, int], ...]] = {
    "x4": (("x", 4),),
    "2x2": (("x", 2), ("y", 2)),
}

MODULES = ("conf_programs_lax", "conf_programs_patterns", "conf_programs_mixed", "conf_programs_regress",
           "conf_programs_ragged")


@dataclasses.dataclass(frozen=True)
class Program:
    """One program, run by both frameworks.

    Attributes:
      name: unique id, ``kind/family/mesh:axes/mode/template``.
      mesh: a key of :data:`MESHES`.
      check: checked mode (JAX ``check_vma=True``, fshard ``check=True``) or unchecked.
      fn: ``fn(ops, *inputs) -> pytree``.
      inputs: ``inputs(rng) -> tuple`` of numpy arrays.
      seed_key: the inputs' seed; programs that share it get the same inputs (a checked
        program and its unchecked twin, for the tests of designed differences).
      differs: the ``docs/jax.md`` row this program illustrates when fshard differs from
        JAX on purpose: such programs are left out of the parity test and checked by
        ``test_conformance_differences.py`` instead.
      group: programs of one group are compiled by JAX in one ``jit`` (faster); a program
        JAX refuses at trace time must be alone (``None``).
      oracle: the program whose JAX result fshard's must equal (default: this one). A
        ``differs`` program names its checked twin (same function and inputs, checked
        mode); a program that JAX cannot run or runs inconsistently (``jax_quirk``) names
        an equivalent formulation with the same inputs.
      jax_quirk: why JAX's own result for this program is not the oracle (JAX raises, or
        contradicts its own documented semantics); a test pins that it still does, so
        the workaround is dropped once JAX changes.
      tags: free-form labels (``"vmap"``: run in a separate fshard batch; ``"jax_only"``:
        an oracle whose meaning differs in fshard, never run there).
    """

    name: str
    mesh: str
    check: bool
    fn: Callable[..., Any]
    inputs: Callable[[np.random.Generator], tuple]
    seed_key: str
    differs: str | None = None
    group: str | None = None
    oracle: str | None = None
    jax_quirk: str | None = None
    tags: tuple[str, ...] = ()

    def make_inputs(self) -> tuple:
        return self.inputs(np.random.default_rng(zlib.crc32(self.seed_key.encode())))

    @property
    def mesh_axes(self) -> dict[str, int]:
        return dict(MESHES[self.mesh])


_REGISTRY: dict[str, Program] = {}


def register(p: Program) -> Program:
    if p.name in _REGISTRY:
        raise ValueError(f"conformance program {p.name!r} is registered twice")
    _REGISTRY[p.name] = p
    return p


def programs() -> dict[str, Program]:
    """Every registered program, by name (imports the program modules once)."""
    for m in MODULES:
        importlib.import_module(m)
    return _REGISTRY


def normals(*shapes: tuple[int, ...]) -> Callable[[np.random.Generator], tuple]:
    """An ``inputs`` function: one standard-normal float64 array per shape."""
    return lambda rng: tuple(rng.standard_normal(s) for s in shapes)


def mode_name(check: bool) -> str:
    return "checked" if check else "unchecked"


def axis_size(mesh: str, axes: str | tuple[str, ...]) -> int:
    sizes = dict(MESHES[mesh])
    return int(np.prod([sizes[a] for a in ((axes,) if isinstance(axes, str) else axes)]))


def mesh_order_index(mesh: str, axes: tuple[str, ...], u: int) -> int:
    """The index that position ``u`` of ``axes`` (row-major in the tuple's order) has when
    the same axes are numbered in mesh order."""
    sizes = dict(MESHES[mesh])
    coord = {}
    for a in reversed(axes):
        coord[a], u = u % sizes[a], u // sizes[a]
    g = 0
    for a, s in MESHES[mesh]:
        if a in coord:
            g = g * s + coord[a]
    return g


def axes_label(axes: str | tuple[str, ...]) -> str:
    return axes if isinstance(axes, str) else "(" + ",".join(axes) + ")"
