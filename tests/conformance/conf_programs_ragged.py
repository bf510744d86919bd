"""Conformance programs for ``ragged_all_to_all`` against ``jax.lax.ragged_all_to_all``.

Each program maps one call over an axis (``x4:x``, ``2x2:x``, ``2x2:y``, ``2x2:(x,y)``) on a
plan drawn from the program's seed: every rank sends ``K = n * per`` slices of 0 to 2
rows of its operand (``per`` slices to each peer) at random offsets, and each receiver
packs what it gets, source by source, with random gaps (rows no slice reaches keep
``output``'s values). The global inputs stack the per-rank blocks in axis-index order and
are mapped with ``P(ax)``. Templates: ``values``; ``outside`` (``value_and_grad`` of
``sum(y * w)`` outside shard_map, w.r.t. operand and output); ``inside``
(``shard_map(grad(local sum(y * w)))``), checked and unchecked.

JAX 0.10.2's XLA:CPU has no ragged-all-to-all kernel; ``conf_ops_jax`` lowers the
primitive on CPU to its docstring's rule (all_gather and selects), so JAX's own JVP and
transpose rules are what is compared.

Two plans where JAX's transpose is not the derivative of its forward (``jax_quirk``), each
with an oracle that computes the same function in a form JAX differentiates correctly:

- ``empty_at_a_start``: an empty slice written where another slice starts (packed
  offsets, an expert that gets no tokens): JAX's output-cotangent mask (a cumulative sum
  of +1 set at starts, duplicates collapsing, and -1 added at ends, duplicates adding up)
  goes wrong wherever an in-range empty slice shares an offset with another slice, and the
  received rows keep their cotangent. Only empty slices at offset ``M`` are safe. Oracle:
  the empty slices' offsets moved to the end of the output (``where(send_sizes == 0, M,
  output_offsets)``), the same values.
- ``overlapping_inputs``: input slices that share rows: JAX's operand transpose writes the
  cotangents into a zero buffer (the last one wins) instead of summing. Oracle: each slice
  sent from its own copy of the operand (``concat([operand] * K)``, offsets shifted).

And one where JAX types the result like ``output``: for an invariant (``P()``) output it
is typed invariant though it differs per rank, and JAX fails to differentiate it. Oracle:
``pvary(output)`` first.
"""

from __future__ import annotations

import numpy as np
from conf_programs import Program, axes_label, axis_size, mode_name, register

D = 2  # row width
_QUIRK_EMPTY = ("jax 0.10.2's ragged_all_to_all transpose keeps the output cotangent of rows received "
                "where an empty slice starts at another slice's start")
_QUIRK_OVERLAP = ("jax 0.10.2's ragged_all_to_all transpose keeps one cotangent (the last written) for "
                  "operand rows that two input slices share, instead of their sum")


_QUIRK_INVARIANT = ("jax 0.10.2 types ragged_all_to_all's result like its output argument, and fails to "
                    "differentiate a call whose output is invariant (P()): 'Expected cotangent type "
                    "float64[13,2] but got float64[13,2]{V:x}'")


def _plan(rng: np.random.Generator, n: int, per: int, kind: str) -> tuple:
    """Global ``(operand, output, io, ss, oo, rs, shift, w)``: per-rank blocks stacked."""
    k = n * per
    rows = 3 * k + 1  # operand and output rows per rank: room for every slice and gap
    low = 0 if kind == "with_empties" else 1
    size = rng.integers(low, 3, size=(n, k))  # size[s, i]: rows s sends in its slice i
    if kind == "empty_at_a_start":
        size[::2] = 0  # even sources send nothing: packed, each empty slice starts where the next one does
    io, oo, rs = (np.zeros((n, k), dtype=np.int64) for _ in range(3))
    for s in range(n):
        at = 0
        for i in range(k):
            if kind == "overlapping_inputs":
                io[s, i] = rng.integers(0, 2)  # k >= 4 slices start at row 0 or 1: some share rows
            else:
                at += int(rng.integers(0, 2))
                io[s, i], at = at, at + size[s, i]
    for d in range(n):
        at = 0
        for s in range(n):
            for j in range(per):
                i = d * per + j
                at += 0 if kind == "empty_at_a_start" else int(rng.integers(0, 2))
                oo[s, i], at = at, at + size[s, i]
                rs[d, s * per + j] = size[s, i]
    shift = np.tile(np.arange(k, dtype=np.int64) * rows, n)
    operand, output, w = (rng.standard_normal((n * rows, D)) for _ in range(3))
    return operand, output, io.reshape(-1), size.reshape(-1).astype(np.int64), oo.reshape(-1), rs.reshape(-1), \
        shift, w


def _call(ops, ax, form, operand, output, io, ss, oo, rs, shift):
    """The call, rewritten by each of ``form``'s "+"-joined rewrites (none for "plain")."""
    forms = form.split("+")
    if "output_made_varying" in forms:
        output = ops.pvary(output, ax)
    if "empties_to_the_end" in forms:
        oo = ops.where(ss == 0, output.shape[0], oo)
    if "one_copy_per_slice" in forms:
        operand, io = ops.concat([operand] * io.shape[0], axis=0), io + shift
    return ops.ragged_all_to_all(operand, output, io, ss, oo, rs, axis_name=ax)


def _program(ax, form: str, template: str, replicated_output: int = 0):
    def fn(ops, operand, output, io, ss, oo, rs, shift, w):
        spec = ops.P(ax)
        plan = (io, ss, oo, rs, shift)
        if replicated_output:  # one output for every rank (the first block), mapped with P()
            output = output[: operand.shape[0] // replicated_output]
        ins = (spec, ops.P() if replicated_output else spec) + (spec,) * 5

        def mapped(operand, output, io, ss, oo, rs, shift):
            return _call(ops, ax, form, operand, output, io, ss, oo, rs, shift)

        if template == "values":
            return {"y": ops.shard_map(mapped, in_specs=ins, out_specs=spec)(operand, output, *plan)}
        if template == "outside":
            sm = ops.shard_map(mapped, in_specs=ins, out_specs=spec)
            loss, grads = ops.value_and_grad(lambda a, b: ops.sum(sm(a, b, *plan) * w), argnums=(0, 1))(
                operand, output)
            return {"loss": loss, "d_operand": grads[0], "d_output": grads[1]}

        def local(operand, output, io, ss, oo, rs, shift, w):
            return ops.grad(lambda a, b: ops.sum(mapped(a, b, io, ss, oo, rs, shift) * w), argnums=(0, 1))(
                operand, output)

        outs = (spec, ops.P() if replicated_output else spec)
        g = ops.shard_map(local, in_specs=ins + (spec,), out_specs=outs)(operand, output, *plan, w)
        return {"d_operand": g[0], "d_output": g[1]}

    return fn


_WHERE = [("x4", "x"), ("2x2", "x"), ("2x2", "y"), ("2x2", ("x", "y"))]
_TEMPLATES = ("values", "outside", "inside")


def _register(mesh: str, ax, kind: str, per: int, form: str, *, oracle_form: str | None = None,
              quirk: str | None = None, modes=(True, False), replicated_output: bool = False) -> None:
    n = axis_size(mesh, ax)
    where = f"{mesh}:{axes_label(ax)}"
    family = f"{kind}_per{per}" + ("_replicated_output" if replicated_output else "")
    rep = n if replicated_output else 0
    for template in _TEMPLATES:
        if quirk and template == "values":
            continue  # the forward agrees; the quirk is in the transpose
        for check in modes:
            mode = mode_name(check)
            seed = f"lax/ragged_all_to_all/{where}/{family}"
            inputs = lambda rng, n=n, per=per, kind=kind: _plan(rng, n, per, kind)  # noqa: E731
            oracle = None
            if oracle_form:
                ref = register(Program(f"lax/ragged_all_to_all.ref/{where}/{family}/{mode}/{template}", mesh, check,
                                       _program(ax, oracle_form, template, rep), inputs, seed,
                                       group=f"lax/ragged_all_to_all.ref/{where}"))
                oracle = ref.name
            register(Program(f"lax/ragged_all_to_all/{where}/{family}/{mode}/{template}", mesh, check,
                             _program(ax, form, template, rep), inputs, seed, oracle=oracle, jax_quirk=quirk,
                             group=None if quirk else f"lax/ragged_all_to_all/{where}"))


for _mesh, _ax in _WHERE:
    _register(_mesh, _ax, "full", 1, "plain")
    _register(_mesh, _ax, "with_empties", 2 if _mesh == "x4" else 1, "empties_to_the_end")
_register("x4", "x", "full", 2, "plain")
_register("2x2", ("x", "y"), "full", 2, "plain")
_register("x4", "x", "empty_at_a_start", 1, "plain", oracle_form="empties_to_the_end", quirk=_QUIRK_EMPTY)
_register("2x2", ("x", "y"), "empty_at_a_start", 2, "plain", oracle_form="empties_to_the_end", quirk=_QUIRK_EMPTY,
          modes=(True,))
_register("x4", "x", "overlapping_inputs", 1, "plain", oracle_form="one_copy_per_slice", quirk=_QUIRK_OVERLAP)
_register("2x2", "y", "overlapping_inputs", 2, "plain", oracle_form="one_copy_per_slice", quirk=_QUIRK_OVERLAP,
          modes=(True,))
_register("x4", "x", "full", 1, "plain", oracle_form="output_made_varying", quirk=_QUIRK_INVARIANT, modes=(True,),
          replicated_output=True)
_register("2x2", ("x", "y"), "with_empties", 1, "empties_to_the_end",
          oracle_form="empties_to_the_end+output_made_varying", quirk=_QUIRK_INVARIANT, modes=(True,),
          replicated_output=True)
