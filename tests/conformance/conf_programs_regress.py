"""Named regression programs: ordinary PyTorch code on which fshard's checked mode once
disagreed with JAX (issue 29), each in both compositions.

- ``embed_by_indexing``: ``e[(u > 0)]``-style lookup of a replicated table with per-rank
  indices (a data-parallel embedding): the table's gradient is summed over the ranks.
  fshard used to take ``__getitem__`` (and every name ending in ``_``) for an in-place op
  and skip its implicit ``pvary``.
- ``axis_index_minus_w`` / ``w_times_axis_index_over_4``: ``axis_index`` in reversed and
  true-division arithmetic is varying (it was an ``int`` typed only through ``+ - * // %``).
- ``inplace_add`` / ``inplace_setitem``: ``y = w * 1.0; y += x`` and ``y[0] = ...`` on a
  replicated ``y``: JAX's out-of-place ``y = y + x`` sums ``w``'s gradient.
- ``reversed_ops``: ``1 - w``, ``2 / w``, ``2 ** w`` of a replicated ``w`` with data.
- ``grad_of_grad``: nested ``grad`` outside and inside ``shard_map`` (it was zero).
"""

from __future__ import annotations

from conf_programs import Program, normals, register

N = 4  # the x4 mesh


def _both_orders(name: str, loss, inputs, *, w_spec=None, x_spec=None) -> None:
    """Registers ``shard_map(grad(loss))`` (local loss) and ``grad(shard_map(psum(loss)))``."""
    def inside(ops, w, x):
        specs = (ops.P() if w_spec is None else w_spec(ops), ops.P("x") if x_spec is None else x_spec(ops))
        g = ops.shard_map(ops.grad(lambda w, x: loss(ops, w, x)), in_specs=specs, out_specs=specs[0])(w, x)
        return {"grad": g}

    def outside(ops, w, x):
        specs = (ops.P() if w_spec is None else w_spec(ops), ops.P("x") if x_spec is None else x_spec(ops))
        sm = ops.shard_map(lambda w, x: ops.psum(loss(ops, w, x), "x"), in_specs=specs, out_specs=ops.P())
        return {"grad": ops.grad(sm)(w, x)}

    group = "regress/x4"
    register(Program(f"regress/{name}/x4/checked/inside", "x4", True, inside, inputs, name, group=group))
    register(Program(f"regress/{name}/x4/checked/outside", "x4", True, outside, inputs, name, group=group))


def _embed_by_indexing(ops, e, u):
    return ops.sum(ops.index(e, ops.gt0_int(u)))


def _axis_index_minus_w(ops, w, x):
    return ops.sum(ops.axis_index("x") - w)


def _w_times_axis_index_over_4(ops, w, x):
    return ops.sum(w * (ops.axis_index("x") / 4))


def _inplace_add(ops, w, x):
    y = ops.iadd(w * 1.0, x)
    return ops.sum(y * y)


def _inplace_setitem(ops, w, x):
    y = ops.setitem(w * 2.0, 0, x[0] * w[1])
    return ops.sum(y * x)


def _reversed_ops(ops, w, x):
    return ops.sum((1.0 - w) * x) + ops.sum(2.0 / (w + 3.0) * x) + ops.sum(2.0 ** w * x)


_both_orders("embed_by_indexing", _embed_by_indexing, normals((2,), (N * 2,)))
_both_orders("axis_index_minus_w", _axis_index_minus_w, normals((3,), (N,)))
_both_orders("w_times_axis_index_over_4", _w_times_axis_index_over_4, normals((3,), (N,)))
_both_orders("inplace_add", _inplace_add, normals((3,), (N * 3,)))
_both_orders("inplace_setitem", _inplace_setitem, normals((3,), (N * 3,)))
_both_orders("reversed_ops", _reversed_ops, normals((3,), (N * 3,)))


def _grad_of_grad(ops, x):  # no shard_map: d/dx sum(d/dx sum(x ** 3)) = 6x
    return {"grad": ops.grad(lambda x: ops.sum(ops.grad(lambda y: ops.sum(y ** 3))(x)))(x)}


def _grad_of_grad_in_shard_map(ops, w, x):  # shard_map(grad(grad)) of a replicated w
    def inner(w, x):
        return ops.sum(ops.grad(lambda w: ops.sum(x * w ** 3))(w) * x)
    g = ops.shard_map(ops.grad(inner), in_specs=(ops.P(), ops.P("x")), out_specs=ops.P())(w, x)
    return {"grad": g}


def _grad_of_shard_map_of_grad(ops, w, x):  # grad(shard_map(grad)): the outer grad outside
    def inner(w, x):
        return ops.grad(lambda w: ops.psum(ops.sum(x * w ** 3), "x"))(w)
    sm = ops.shard_map(inner, in_specs=(ops.P(), ops.P("x")), out_specs=ops.P())
    return {"grad": ops.grad(lambda w, x: ops.sum(sm(w, x) ** 2))(w, x)}


register(Program("regress/grad_of_grad/x4/checked/no_shard_map", "x4", True, _grad_of_grad, normals((3,)),
                 "grad_of_grad", group="regress/x4"))
register(Program("regress/grad_of_grad/x4/checked/inside", "x4", True, _grad_of_grad_in_shard_map,
                 normals((3,), (N * 3,)), "grad_of_grad_sm", group="regress/x4"))
register(Program("regress/grad_of_grad/x4/checked/outside", "x4", True, _grad_of_shard_map_of_grad,
                 normals((3,), (N * 3,)), "grad_of_grad_sm", group="regress/x4"))



def _axis_index_over_3(ops, x):  # integer true division: float32 in both (JAX's axis_index is int32)
    sm = ops.shard_map(lambda x: x * 0.0 + ops.axis_index("x") / 3, in_specs=ops.P("x"), out_specs=ops.P("x"))
    return {"q": sm(x)}


register(Program("regress/axis_index_over_3/x4/checked/values", "x4", True, _axis_index_over_3, normals((N,)),
                 "axis_index_over_3", group="regress/x4"))


# --- a designed difference: a varying value converted to a Python number ------------------
VALUES_LEAVE_THE_TYPES = "values_leave_the_types"


def _scaled_by_python_float(ops, x):  # JAX: a tracer cannot become a float (ConcretizationTypeError)
    sm = ops.shard_map(lambda x: x * ops.to_float(ops.sum(x)), in_specs=ops.P("x"), out_specs=ops.P("x"))
    return {"y": sm(x)}


def _scaled_by_tensor(ops, x):  # the oracle: the same value kept as an array
    sm = ops.shard_map(lambda x: x * ops.sum(x), in_specs=ops.P("x"), out_specs=ops.P("x"))
    return {"y": sm(x)}


_SCALED = register(Program("regress/values_leave_the_types/x4/checked/oracle", "x4", True, _scaled_by_tensor,
                           normals((2 * N,)), VALUES_LEAVE_THE_TYPES, group="regress/x4"))
register(Program("diff/values_leave_the_types/x4/checked", "x4", True, _scaled_by_python_float,
                 normals((2 * N,)), VALUES_LEAVE_THE_TYPES, differs=VALUES_LEAVE_THE_TYPES, oracle=_SCALED.name))


def _out_spec_splits_an_invariant_value(ops, w):  # found by the fuzzer
    """An output spec that splits a value invariant over its axis: the global array holds one
    copy per rank, and the gradient of a replicated input sums them (JAX's pvary at the
    boundary): 8 = 4 copies x 2, not 2."""
    sm = ops.shard_map(lambda w: w * 2.0, in_specs=ops.P(), out_specs=ops.P("x"))
    return {"grad": ops.grad(lambda w: ops.sum(sm(w) ** 2))(w)}


_SPLITS = register(Program("regress/out_spec_splits_an_invariant_value/x4/checked/outside", "x4", True,
                           _out_spec_splits_an_invariant_value, normals((3,)), "out_spec_splits",
                           group="regress/x4"))
# Unchecked, fshard has no types to see the value invariant, so it adds no pvary at the
# boundary (as it adds none for replicated inputs): 2, against 8 in both JAX modes.
register(Program("diff/unchecked_out_spec_splits_invariant/x4/unchecked/outside", "x4", False,
                 _out_spec_splits_an_invariant_value, normals((3,)), "out_spec_splits",
                 differs="unchecked_out_spec_splits_invariant", oracle=_SPLITS.name))


def _grad_of_grad_through_selective_remat(ops, a):  # found by the fuzzer (seed 1093)
    """grad of grad inside shard_map through ``remat(policy="dots_saveable")``: torch's
    selective checkpointing allows one backward through a region ("Trying to backward an
    extra time"); fshard recomputes everything under a graph-keeping grad instead."""
    f = ops.remat(lambda a: ops.tanh(ops.einsum("ij,kj->ik", a, ops.psum(a, "x"))), policy="dots_saveable")

    def outer(a):
        return ops.sum(ops.grad(lambda a: ops.sum(f(a) ** 2))(a) ** 2)

    return {"grad": ops.shard_map(ops.grad(outer), in_specs=ops.P("x"), out_specs=ops.P("x"))(a)}


register(Program("regress/grad_of_grad_selective_remat/x4/checked/inside", "x4", True,
                 _grad_of_grad_through_selective_remat, normals((N * 2, 3)), "grad_grad_remat", group="regress/x4"))
