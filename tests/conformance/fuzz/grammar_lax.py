"""The grammar's collectives: every ``fs.lax`` op with jax.lax's signature and options.

Shapes follow jax.lax: untiled ``all_gather`` inserts a dim of the axis size at ``axis``;
untiled ``psum_scatter`` removes ``scatter_dimension`` (whose size must be the axis size);
untiled ``all_to_all`` removes ``split_axis`` (of the axis size) and inserts one at
``concat_axis``; tiled forms divide / multiply the dim instead. ``ppermute`` over a tuple
of axes keeps mesh order (JAX numbers ``perm`` in mesh order otherwise: a docs/jax.md
"not the oracle" row, not fuzzed), and so does ``pshuffle`` (a ``ppermute``). ``all_gather``
draws ``to="invarying"`` too; ``pswapaxes`` a non-negative axis; ``pbroadcast`` runs in JAX
as its documented equivalent (JAX 0.10.2 has no CPU lowering for it, see ops_src.py).
``ragged_all_to_all`` draws a per-rank plan (a constant table indexed by ``axis_index``);
JAX runs it on the CPU lowering of ``conf_ops_jax.py`` (its docstring's rule).
"""

from __future__ import annotations

from .gen import Ctx


def _ax(axes) -> list[str]:
    return [axes] if isinstance(axes, str) else list(axes)


def _reduce(ctx: Ctx) -> bool:
    a = ctx.float_of()
    v = ctx.vals[a]
    op = ctx.rng.choice(["psum", "psum", "pmean", "pmax", "pmin"])
    axes = ctx.axes_choice(v.vma)
    ctx.add(op, [a], {"axes": axes}, "f", v.shape, v.vma - set(_ax(axes)))
    return True


def _pvary(ctx: Ctx) -> bool:
    a = ctx.float_of()
    v = ctx.vals[a]
    axes = ctx.axes_choice(frozenset(ctx.axes) - v.vma)  # mostly axes it does not vary over yet
    ctx.add("pvary", [a], {"axes": axes}, "f", v.shape, v.vma | set(_ax(axes)))
    return True


def _all_gather(ctx: Ctx) -> bool:
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
    v = ctx.vals[a]
    axes = ctx.axes_choice(v.vma)
    n, tiled = ctx.size(axes), ctx.rng.random() < 0.5
    d = ctx.rng.randrange(len(v.shape) + (0 if tiled else 1))
    shape = list(v.shape)
    if tiled:
        shape[d] *= n
    else:
        shape.insert(d, n)
    # to="invarying" (JAX's all_gather_invariant): invariant over the axes, a slice as transpose.
    to = "invarying" if ctx.rng.random() < 0.3 else "varying"
    vma = v.vma - set(_ax(axes)) if to == "invarying" else v.vma | set(_ax(axes))
    ctx.add("all_gather", [a], {"axes": axes, "axis": d, "tiled": tiled, "to": to}, "f", shape, vma)
    return True


def _fitting_dims(shape: tuple, n: int, tiled: bool) -> list[int]:
    """The dims a collective can split over n ranks: divisible by n (tiled), or equal to it."""
    return [d for d, s in enumerate(shape) if (s % n == 0 if tiled else s == n)]


def _psum_scatter(ctx: Ctx) -> bool:
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
    v = ctx.vals[a]
    axes = ctx.axes_choice(v.vma)
    n, tiled = ctx.size(axes), ctx.rng.random() < 0.6
    dims = _fitting_dims(v.shape, n, tiled)
    if not dims:
        return False
    d = ctx.rng.choice(dims)
    shape = list(v.shape)
    if tiled:
        shape[d] //= n
    else:
        del shape[d]
    ctx.add("psum_scatter", [a], {"axes": axes, "dim": d, "tiled": tiled}, "f", shape, v.vma | set(_ax(axes)))
    return True


def _ppermute(ctx: Ctx) -> bool:
    a = ctx.float_of()
    v = ctx.vals[a]
    axes = ctx.axes_choice(v.vma, mesh_order=True)
    n = ctx.size(axes)
    srcs = list(range(n))
    dsts = ctx.rng.sample(srcs, n)
    keep = [i for i in srcs if ctx.rng.random() < 0.8] or [0]
    perm = [[s, dsts[s]] for s in keep]
    ctx.add("ppermute", [a], {"axes": axes, "perm": perm}, "f", v.shape, v.vma | set(_ax(axes)))
    return True


def _all_to_all(ctx: Ctx) -> bool:
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
    v = ctx.vals[a]
    axes = ctx.axes_choice(v.vma)
    n, tiled = ctx.size(axes), ctx.rng.random() < 0.6
    splits = _fitting_dims(v.shape, n, tiled)
    if not splits:
        return False
    split = ctx.rng.choice(splits)
    shape = list(v.shape)
    if tiled:
        concat = ctx.rng.randrange(len(shape))
        shape[split] //= n
        shape[concat] *= n
    else:
        concat = ctx.rng.randrange(len(shape))
        del shape[split]
        shape.insert(concat, n)
    ctx.add("all_to_all", [a], {"axes": axes, "split": split, "concat": concat, "tiled": tiled}, "f", shape,
            v.vma | set(_ax(axes)))
    return True


def _pshuffle(ctx: Ctx) -> bool:
    a = ctx.float_of()
    v = ctx.vals[a]
    axes = ctx.axes_choice(v.vma, mesh_order=True)  # a ppermute: the same mesh-order rule
    perm = ctx.rng.sample(range(ctx.size(axes)), ctx.size(axes))
    ctx.add("pshuffle", [a], {"axes": axes, "perm": perm}, "f", v.shape, v.vma | set(_ax(axes)))
    return True


def _pswapaxes(ctx: Ctx) -> bool:
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1)
    v = ctx.vals[a]
    axes = ctx.axes_choice(v.vma)
    dims = _fitting_dims(v.shape, ctx.size(axes), False)
    if not dims:
        return False
    # A non-negative axis: JAX 0.10.2 fails to lower a negative one (docs/jax.md).
    ctx.add("pswapaxes", [a], {"axes": axes, "axis": ctx.rng.choice(dims)}, "f", v.shape, v.vma | set(_ax(axes)))
    return True


def _pbroadcast(ctx: Ctx) -> bool:
    # JAX binds pbroadcast with no implicit pvary: a value varying over all of the axes.
    a = ctx.float_of(pred=lambda v: bool(v.vma))
    v = ctx.vals[a]
    names = [n for n in ctx.axes if n in v.vma]
    if not names:
        return False
    k = 2 if len(names) >= 2 and ctx.rng.random() < 0.35 else 1
    chosen = ctx.rng.sample(names, k)
    axes = chosen[0] if k == 1 else chosen
    ctx.add("pbroadcast", [a], {"axes": axes, "source": ctx.rng.randrange(ctx.size(axes))}, "f", v.shape, v.vma)
    return True


def _ragged_plan(rng, n: int, per: int, rows: int) -> list:
    """``table[u] = [input_offsets, send_sizes, output_offsets, recv_sizes]`` for axis index
    ``u``: ``K = n * per`` slices of at most ``rows // K`` rows each, packed with random gaps
    on both sides (sent and received totals fit ``rows``), empty slices written at the output's
    end (offset ``rows``), input slices disjoint: JAX 0.10.2's transpose is wrong for an
    in-range empty slice that shares an offset with another slice, and for overlapping input
    slices (docs/jax.md "not the oracle"); neither is fuzzed."""
    k = n * per
    size = [[rng.randrange(rows // k + 1) for _ in range(k)] for _ in range(n)]
    table = [[[0] * k for _ in range(4)] for _ in range(n)]
    for s in range(n):
        at, room = 0, rows - sum(size[s])
        for i in range(k):
            gap = rng.randrange(room + 1) if room and rng.random() < 0.3 else 0
            at, room = at + gap, room - gap
            table[s][0][i], table[s][1][i], at = at, size[s][i], at + size[s][i]
    for d in range(n):
        got = [(s, j) for s in range(n) for j in range(per)]
        at, room = 0, rows - sum(size[s][d * per + j] for s, j in got)
        for s, j in got:
            z = size[s][d * per + j]
            gap = rng.randrange(room + 1) if room and rng.random() < 0.3 else 0
            at, room = at + gap, room - gap
            table[s][2][d * per + j] = at if z else rows
            table[d][3][s * per + j], at = z, at + z
    return table


def _ragged_all_to_all(ctx: Ctx) -> bool:
    # An operand varying over the axes (no implicit pvary: JAX types the result like
    # ``output``, and an invariant one is a "not the oracle" row); output = operand * 0.5.
    a = ctx.float_of(pred=lambda v: len(v.shape) >= 1 and bool(v.vma))
    v = ctx.vals[a]
    axes = ctx.axes_choice(v.vma, mesh_order=True)
    if not set(_ax(axes)) <= v.vma:
        return False
    n, per = ctx.size(axes), ctx.rng.choice([1, 1, 2])
    table = _ragged_plan(ctx.rng, n, per, v.shape[0])
    ctx.add("ragged_all_to_all", [a], {"axes": axes, "table": table}, "f", v.shape, v.vma)
    return True


LAX_RULES = [(_reduce, 4), (_pvary, 1), (_all_gather, 2), (_psum_scatter, 1), (_ppermute, 1),
             (_all_to_all, 1), (_pshuffle, 1), (_pswapaxes, 1), (_pbroadcast, 1), (_ragged_all_to_all, 1)]
