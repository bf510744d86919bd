"""Conformance programs for collectives on values in mixed states (checked mode's type rule).

On the 2x2 mesh (``x`` major, ``y`` minor), every collective runs over ``x``, ``y``,
``("x", "y")`` and ``("y", "x")`` on an input that is invariant, varying over ``x``
only, over ``y`` only, or over both (its ``in_spec`` says which). JAX 0.10.2's rule,
measured with these programs:

- ``psum``, ``pmean``, ``psum_scatter`` and ``pvary`` (``pcast(to="varying")``) over
  several axes take a value that varies over all of them or none: a value varying over
  some only is refused ("can only accept axis_name which corresponds to one of varying,
  unreduced, reduced or invarying state of the input");
- ``pmax``, ``pmin``, ``all_gather``, ``ppermute`` and ``all_to_all`` take any mix (an
  invariant part is made varying first);
- ``pvary`` of a value already varying over all of its axes is refused ("Unsupported
  pcast from=varying, to='varying'"); fshard returns it as it is (a row of docs/jax.md,
  program ``diff/pvary_already_varying/...``, oracle: JAX on the program without it);
- unchecked mode (``check_vma=False``) takes everything.

Templates: ``values`` (every collective the mode accepts, one program per input state),
``outside`` (checked: gradients of ``sum(y * w)`` w.r.t. the input through the
differentiable ones), and one program per refusal, alone (JAX refuses it while tracing).
"""

from __future__ import annotations

from typing import Any

from conf_programs import Program, axes_label, axis_size, normals, register

MESH = "2x2"
MESH_AXES = ("x", "y")
ROWS, COLS = 4, 2  # local block: dim 0 divisible by every axis size (tiled scatter, all_to_all)
STATES = {"inv": (), "x": ("x",), "y": ("y",), "xy": ("x", "y")}
AXES: list[str | tuple[str, ...]] = ["x", "y", ("x", "y"), ("y", "x")]

# Collectives that take a value varying over all of their axes or none (JAX refuses the rest).
ALL_OR_NONE = ("psum", "pmean", "psum_scatter", "pvary")
ANY_MIX = ("pmax", "pmin", "all_gather", "ppermute", "all_to_all")
DIFFERENTIABLE = ("psum", "pmean", "psum_scatter", "pvary", "all_gather", "ppermute", "all_to_all")
REDUCING = ("psum", "pmean", "pmax", "pmin")  # result invariant over the axes


def _names(ax) -> tuple[str, ...]:
    return (ax,) if isinstance(ax, str) else tuple(ax)


def _shift(ops, ax) -> list[tuple[int, int]]:
    n = ops.axis_size(ax)
    return [(i, (i + 1) % n) for i in range(n)]


OPS = {
    "psum": lambda o, x, ax: o.psum(x, ax),
    "pmean": lambda o, x, ax: o.pmean(x * x, ax),
    "pmax": lambda o, x, ax: o.pmax(x, ax),
    "pmin": lambda o, x, ax: o.pmin(x, ax),
    "all_gather": lambda o, x, ax: o.all_gather(x, ax, tiled=True),
    "psum_scatter": lambda o, x, ax: o.psum_scatter(x, ax, tiled=True),
    "ppermute": lambda o, x, ax: o.ppermute(x * 2.0, ax, _shift(o, ax)),
    "all_to_all": lambda o, x, ax: o.all_to_all(x, ax, 0, 0, tiled=True),
    "pvary": lambda o, x, ax: o.pvary(x, ax),
    "identity": lambda o, x, ax: x * 1.0,
}


def _rows_out(op: str, n: int) -> int:
    return {"all_gather": ROWS * n, "psum_scatter": ROWS // n}.get(op, ROWS)


def out_axes(op: str, state: tuple[str, ...], ax) -> tuple[str, ...]:
    """The axes the result varies over (JAX's rule), in mesh order."""
    names = set(_names(ax))
    vary = set(state) - names if op in REDUCING else set(state) | (set() if op == "identity" else names)
    return tuple(a for a in MESH_AXES if a in vary)


def _spec(ops, axes: tuple[str, ...]):
    return ops.P() if not axes else ops.P(axes[0] if len(axes) == 1 else axes)


def _global_rows(rows: int, axes: tuple[str, ...]) -> int:
    return rows * (axis_size(MESH, axes) if axes else 1)


def _mapped(ops, op_names, state, ax):
    return ops.shard_map(lambda x: tuple(OPS[op](ops, x, ax) for op in op_names),
                         in_specs=_spec(ops, state),
                         out_specs=tuple(_spec(ops, out_axes(op, state, ax)) for op in op_names))


def _values(op_names, state, ax, keys=None):
    def fn(ops, x):
        return {"y": dict(zip(keys or op_names, _mapped(ops, op_names, state, ax)(x)))}
    return fn


def _outside(op_names, state, ax):
    def fn(ops, x, *ws):
        sm = _mapped(ops, op_names, state, ax)
        def loss(x):
            return sum((y * w).sum() for y, w in zip(sm(x), ws))
        value, grad = ops.value_and_grad(loss)(x)
        return {"loss": value, "dx": grad}
    return fn


def _inputs(op_names, state, ax, with_w: bool):
    n = axis_size(MESH, ax)
    shapes = [(_global_rows(ROWS, state), COLS)]
    if with_w:
        shapes += [(_global_rows(_rows_out(op, n), out_axes(op, state, ax)), COLS) for op in op_names]
    return normals(*shapes)


def _mixed(state: tuple[str, ...], ax) -> bool:
    """The value varies over some of the axes but not all."""
    common = set(state) & set(_names(ax))
    return bool(common) and common != set(_names(ax))


def _register(name: str, check: bool, fn: Any, inputs: Any, group: str | None, seed: str | None = None,
              **kw) -> Program:
    return register(Program(name, MESH, check, fn, inputs, seed or name, group=group, **kw))


PVARY_ALREADY_VARYING = "pvary_already_varying"


def _register_config(ax) -> None:
    where = f"{MESH}:{axes_label(ax)}"
    group = f"lax/mixed/{where}"
    # JAX numbers ppermute's perm over ("y", "x") in mesh order (a quirk that
    # conf_programs_lax's ppermute programs cover): left out here.
    skip = {"identity"} | ({"ppermute"} if ax == ("y", "x") else set())
    for st, state in STATES.items():
        mixed = _mixed(state, ax)
        already = set(_names(ax)) <= set(state)

        def takes(op, check, mixed=mixed, already=already):
            return op not in skip and not (check and op in ALL_OR_NONE and mixed) \
                and not (check and op == "pvary" and already)
        for check in (True, False):
            accepted = [op for op in OPS if takes(op, check)]
            mode = "checked" if check else "unchecked"
            _register(f"{group}/{mode}/values:{st}", check, _values(accepted, state, ax),
                      _inputs(accepted, state, ax, with_w=False), group)
        grads = [op for op in DIFFERENTIABLE if takes(op, True)]
        _register(f"{group}/checked/outside:{st}", True, _outside(grads, state, ax),
                  _inputs(grads, state, ax, with_w=True), group)
        if mixed:  # refused by JAX while tracing: one program each, alone
            for op in ALL_OR_NONE:
                _register(f"lax/mixed_refused/{where}/checked/{op}:{st}", True, _values([op], state, ax),
                          _inputs([op], state, ax, with_w=False), None)
        if already:  # pvary of a varying value: JAX refuses, fshard returns it (docs/jax.md)
            seed = f"{group}/pvary_varying:{st}"
            ref = _register(f"lax/mixed/{where}/checked/pvary_varying.ref:{st}", True,
                            _values(["identity"], state, ax, keys=["pvary"]),
                            _inputs(["identity"], state, ax, with_w=False), group, seed)
            _register(f"diff/{PVARY_ALREADY_VARYING}/{where}/checked/pvary:{st}", True,
                      _values(["pvary"], state, ax), _inputs(["pvary"], state, ax, with_w=False), None, seed,
                      differs=PVARY_ALREADY_VARYING, oracle=ref.name)


for _ax in AXES:
    _register_config(_ax)


# --- unchecked mode: an invariant value meets a varying one with no explicit pvary --------
# ``(x + psum(x)) * w``, x and w split over x4: JAX's gradient w.r.t. x is ``w + psum(w)``
# in both modes (checked: the implicit pvary of psum(x) transposes to a psum; unchecked:
# psum transposes to psum). fshard's unchecked mode inserts no pvary and psum's backward is
# the identity: ``2 w``, so it differs from both JAX modes (docs/jax.md). With an explicit
# pvary the three agree (``lax/unchecked_meeting/...``, parity-tested).
NO_IMPLICIT_PVARY = "unchecked_invariant_meets_varying"
UNCHECKED_MEETING_ROWS, UNCHECKED_MEETING_COLS = 4, 2


def _meeting(explicit_pvary: bool):
    def term(ops, x):
        s = ops.psum(x, "x")
        return ops.pvary(s, "x") if explicit_pvary else s
    return term


def _meeting_inside(term):
    def fn(ops, x, w):
        def per_device(x, w):
            return ops.grad(lambda x: ((x + term(ops, x)) * w).sum())(x)
        return {"dx": ops.shard_map(per_device, in_specs=(ops.P("x"), ops.P("x")), out_specs=ops.P("x"))(x, w)}
    return fn


def _meeting_outside(term):
    def fn(ops, x, w):
        sm = ops.shard_map(lambda x, w: (x + term(ops, x)) * w, in_specs=(ops.P("x"), ops.P("x")),
                           out_specs=ops.P("x"))
        value, dx = ops.value_and_grad(lambda x: sm(x, w).sum())(x)
        return {"loss": value, "dx": dx}
    return fn


def _register_meeting() -> None:
    shape = (4 * UNCHECKED_MEETING_ROWS, UNCHECKED_MEETING_COLS)
    for where, make in (("inside", _meeting_inside), ("outside", _meeting_outside)):
        seed = f"unchecked_meeting/x4/{where}"
        g = f"diff/{NO_IMPLICIT_PVARY}/x4/{where}"
        twin = register(Program(f"{g}/checked-twin", "x4", True, make(_meeting(False)), normals(shape, shape), seed,
                                group=g))
        register(Program(f"{g}/unchecked", "x4", False, make(_meeting(False)), normals(shape, shape), seed,
                         group=g, differs=NO_IMPLICIT_PVARY, oracle=twin.name))
        for check in (True, False):
            register(Program(f"lax/unchecked_meeting/x4/{where}_pvary/{'checked' if check else 'unchecked'}", "x4",
                             check, make(_meeting(True)), normals(shape, shape), seed, group=g))


_register_meeting()
