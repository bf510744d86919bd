"""The grammar: one rule per op family, each appending one op (or a few) to the program.

A rule reads the variables' types in the context, picks operands that fit (making new
inputs when none do) and records the result's type by JAX's rules: elementwise ops and
indexing vary over the union of their operands' axes; ``psum``/``pmean``/``pmax``/``pmin``
drop the reduced axes; ``all_gather``, ``psum_scatter``, ``ppermute``, ``all_to_all`` and
``pvary`` add them; ``axis_index`` varies over its axes.
"""

from __future__ import annotations

from .gen import Ctx


def _bin(ctx: Ctx) -> bool:
    """``a op b`` with tensors, Python scalars and axis_index values, in both orders."""
    rng = ctx.rng
    op = rng.choice(["+", "-", "*", "/", "**"])
    a = ctx.float_of()
    v = ctx.vals[a]
    if op == "**":
        args = [a, {"c": rng.choice((2, 3))}] if rng.random() < 0.7 else [{"c": 1.5}, a]
    else:
        r = rng.random()
        if r < 0.35:
            other = ctx.float_of(shape=v.shape)
        elif r < 0.7:
            other = {"c": rng.choice((2.0, -0.5, 3, 1.25))}
        else:
            other = ctx.pick("ai") or ctx.pick("s") or _axis_index(ctx, ret=True)
        args = [a, other] if rng.random() < 0.5 else [other, a]
        if op == "/" and isinstance(args[1], str):
            args = [args[0], _positive(ctx, args[1])]
    ctx.add("bin", args, {"op": op}, "f", v.shape, ctx.vma(*args))
    return True


def _positive(ctx: Ctx, d: str) -> str:
    """A denominator made from ``d`` that is at least 1: ``d * d + 1`` (axis_index arithmetic
    may be 0 or negative too)."""
    v = ctx.vals[d]
    d = ctx.add("bin", [d, d], {"op": "*"}, v.kind, v.shape, v.vma)
    return ctx.add("bin", [d, {"c": 1}], {"op": "+"}, v.kind, v.shape, v.vma)


def _unary(ctx: Ctx) -> bool:
    a = ctx.float_of()
    v = ctx.vals[a]
    ctx.add("unary", [a], {"fn": ctx.rng.choice(["neg", "tanh", "sin", "relu", "exp_tanh"])}, "f", v.shape, v.vma)
    return True


def _reduce(ctx: Ctx) -> bool:
    rng = ctx.rng
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
    v = ctx.vals[a]
    fn = rng.choice(["sum", "mean", "max"])
    dim = rng.randrange(len(v.shape)) if fn == "max" or rng.random() < 0.6 else None
    shape = () if dim is None else v.shape[:dim] + v.shape[dim + 1:]
    ctx.add("reduce", [a], {"fn": fn, "dim": dim}, "f", shape, v.vma)
    return True


def _matmul(ctx: Ctx) -> bool:
    a = ctx.float_of(ndim=2)
    k = ctx.vals[a].shape[1]
    b = ctx.float_of(pred=lambda v: len(v.shape) in (1, 2) and v.shape[0] == k,
                     shape=(k, ctx.rng.choice((2, 4))) if ctx.rng.random() < 0.8 else (k,))
    shape = ctx.vals[a].shape[:1] + ctx.vals[b].shape[1:]
    ctx.add("matmul", [a, b], {}, "f", shape, ctx.vma(a, b))
    return True


def _shape_op(ctx: Ctx) -> bool:
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
    v = ctx.vals[a]
    if len(v.shape) == 2 and ctx.rng.random() < 0.5:
        ctx.add("transpose", [a], {}, "f", v.shape[::-1], v.vma)
    elif len(v.shape) == 2:
        ctx.add("reshape", [a], {"shape": [-1]}, "f", (v.shape[0] * v.shape[1],), v.vma)
    elif len(v.shape) == 1 and v.shape[0] % 2 == 0:
        ctx.add("reshape", [a], {"shape": [2, -1]}, "f", (2, v.shape[0] // 2), v.vma)
    else:
        return False
    return True


def _axis_index(ctx: Ctx, ret: bool = False):
    """``axis_index`` and integer arithmetic on it (and sometimes ``/``: a float scalar)."""
    rng = ctx.rng
    axes = rng.choice(list(ctx.axes)) if rng.random() < 0.7 else rng.sample(list(ctx.axes), min(2, len(ctx.axes)))
    ai = ctx.add("axis_index", [], {"axes": axes}, "ai", (), [axes] if isinstance(axes, str) else axes,
                 frozenset())
    r = rng.random()
    if r < 0.3:
        ai = ctx.add("bin", [ai, {"c": rng.choice((1, 2, 3))}], {"op": rng.choice(["+", "*", "-"])}, "ai", (),
                     ctx.vals[ai].vma)
    elif r < 0.5:
        ai = ctx.add("bin", [ai, {"c": rng.choice((4, 2.0))}], {"op": "/"}, "s", (), ctx.vals[ai].vma)
    return ai if ret else True


def _small_index(ctx: Ctx, n: int):
    """An index into a dim of size ``n``: a constant, or axis_index arithmetic (varying)."""
    if ctx.rng.random() < 0.5:
        return {"c": ctx.rng.randrange(n)}
    ai = ctx.pick("ai") if ctx.rng.random() < 0.5 else None
    ai = ai or _axis_index(ctx, ret=True)
    if ctx.vals[ai].kind != "ai":
        first = next(iter(ctx.axes))
        ai = ctx.add("axis_index", [], {"axes": first}, "ai", (), [first], frozenset())
    return ctx.add("bin", [ai, {"c": n}], {"op": "%"}, "ai", (), ctx.vals[ai].vma)


def _int_of(ctx: Ctx, shape) -> str:
    """An integer tensor in {0, 1} of this shape, computed from a float value (often varying)."""
    u = ctx.float_of(shape=shape)
    return ctx.add("gt0", [u], {}, "i", shape, ctx.vals[u].vma)


def _index(ctx: Ctx) -> bool:
    """``x[i]`` (constant or axis_index), ``x[idx]`` (integer tensor), gather, embedding."""
    rng = ctx.rng
    r = rng.random()
    # Integer indices are in {0, 1}: the indexed dims need size >= 2 (JAX clamps an index
    # out of bounds silently, torch raises).
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1 and (r < 0.35 or min(v.shape) >= 2))
    v = ctx.vals[a]
    if r < 0.35:
        i = _small_index(ctx, v.shape[0])
        ctx.add("index", [a, i], {}, "f", v.shape[1:], ctx.vma(a, i))
    elif r < 0.6:
        idx = _int_of(ctx, (rng.choice((2, 4)),))
        ctx.add("index", [a, idx], {}, "f", ctx.vals[idx].shape + v.shape[1:], ctx.vma(a, idx))
    elif r < 0.8:
        d = rng.randrange(len(v.shape))
        idx = _int_of(ctx, v.shape)
        ctx.add("gather", [a, idx], {"dim": d}, "f", v.shape, ctx.vma(a, idx))
    else:
        table = ctx.float_of(ndim=2, pred=lambda v: v.shape[0] >= 2)
        idx = _int_of(ctx, (rng.choice((2, 4)),))
        ctx.add("embed", [table, idx], {}, "f", ctx.vals[idx].shape + ctx.vals[table].shape[1:],
                ctx.vma(table, idx))
    return True


def _where_softmax(ctx: Ctx) -> bool:
    rng = ctx.rng
    r = rng.random()
    if r < 0.4:
        a = ctx.float_of()
        v = ctx.vals[a]
        u = ctx.float_of(shape=v.shape)
        b = ctx.float_of(shape=v.shape) if rng.random() < 0.6 else {"c": 0.5}
        ctx.add("where", [u, a, b], {}, "f", v.shape, ctx.vma(u, a, b))
    elif r < 0.7:
        a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
        v = ctx.vals[a]
        ctx.add(rng.choice(["softmax", "log_softmax"]), [a], {}, "f", v.shape, v.vma)
    else:
        logits = ctx.float_of(ndim=2, pred=lambda v: v.shape[1] >= 2)
        t = _int_of(ctx, ctx.vals[logits].shape[:1])
        ctx.add("xent", [logits, t], {}, "f", (), ctx.vma(logits, t))
    return True


def _inplace(ctx: Ctx) -> bool:
    """``y = a * 1.0; y += b`` (and ``*=``), ``y[i] = b``: JAX's functional forms on its side."""
    rng = ctx.rng
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
    v = ctx.vals[a]
    if rng.random() < 0.6:
        b = ctx.float_of(shape=v.shape) if rng.random() < 0.6 else (ctx.pick("ai") or {"c": 2.0})
        ctx.add("iop", [a, b], {"op": rng.choice(["+=", "-=", "*="])}, "f", v.shape, ctx.vma(a, b))
    else:
        i = _small_index(ctx, v.shape[0])
        b = ctx.float_of(shape=v.shape[1:]) if len(v.shape) > 1 or rng.random() < 0.5 else {"c": 0.25}
        ctx.add("setitem", [a, i, b], {}, "f", v.shape, ctx.vma(a, i, b))
    return True


RULES = [(_bin, 6), (_unary, 2), (_reduce, 2), (_matmul, 2), (_shape_op, 1), (_axis_index, 1), (_index, 3),
         (_where_softmax, 2), (_inplace, 2)]


def step(ctx: Ctx) -> bool:
    """Appends one op family's ops; False when the chosen rule did not fit."""
    from .grammar_lax import LAX_RULES

    rules = RULES + LAX_RULES
    fn = ctx.rng.choices([r for r, _ in rules], [w for _, w in rules])[0]
    return bool(fn(ctx))
