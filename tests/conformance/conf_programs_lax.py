"""Conformance programs for every fs.lax collective and option, on 1-D and 2-D meshes.

Each family (psum/pmean, all_gather, all_gather(to="invarying"), psum_scatter, ppermute,
pshuffle, all_to_all, pswapaxes, pbroadcast, axis_index, pvary/pcast, pmax/pmin) is a list of cases; a case is one collective call ``body(ops, x, ax)`` on a
local block, with its local input/output shapes and whether its input and output are
sharded over ``ax`` (``"S"``: ``P(ax)`` on dim 0, so the global value stacks the per-device
blocks) or replicated (``"R"``: ``P()``). Each family runs on every axis configuration
below, in three templates:

- ``outside``: the mapped values, and ``value_and_grad`` of ``sum(y_k * W_k)`` taken
  outside shard_map (JAX: ``grad(shard_map(f))``), w.r.t. every case's global input;
- ``inside_local``: ``shard_map(grad(local loss))``, the loss not reduced over ``ax``;
- ``inside_psum``: ``shard_map(value_and_grad(psum(local loss, ax)))``.

Each case has its own input (tuple ``argnums``), so a wrong gradient names its case.

Unchecked mode (JAX ``check_vma=False``): the same programs, except that an invariant
input is made varying by an explicit ``pvary`` (Megatron style: fshard's unchecked mode
inserts none). Where JAX's unchecked mode transposes differently on purpose (psum ->
psum, pvary -> no-op), the program is registered with ``differs`` and a checked twin
(same function and inputs, checked mode): fshard's unchecked result must equal JAX's
checked one (see docs/jax.md and ``_UNCHECKED_INSIDE``).

Where JAX 0.10.2 itself is wrong (``jax_quirk``: untiled all_to_all gradients, negative
scatter dimensions and pswapaxes axes, ppermute and pshuffle over a tuple of axes not in
mesh order, pbroadcast with no CPU lowering), the oracle is JAX
on an equivalent formulation, registered as ``<family>.ref``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from conf_programs import MESHES, Program, axes_label, axis_size, mesh_order_index, mode_name, normals, register

M, K = 3, 2  # local block rows / cols


@dataclasses.dataclass(frozen=True)
class Case:
    tag: str
    body: Callable[[Any, Any, Any], Any]  # (ops, x, ax) -> local y
    x_shape: Callable[[int], tuple]      # local input shape, given n = axis size
    y_shape: Callable[[int], tuple]      # local output shape
    ins: str = "S"
    outs: str = "S"


def _c(tag, body, x_shape, y_shape, ins="S", outs="S"):
    return Case(tag, body, x_shape, y_shape, ins, outs)


def _shift(n, d):
    return [(i, (i + d) % n) for i in range(n)]


def _partial_two(n):
    # n=2: only 1 -> 0 (rank 1 receives nothing); n=4: a swap of 0 and 1 (2 and 3 get zeros)
    return [(1, 0)] if n == 2 else [(0, 1), (1, 0)]


def _ppermute_cases(perm_of):
    """``perm_of(pairs, ax)`` maps the perm the program means to the one passed to ppermute."""
    def pp(pairs_of_n, scale=1.0):
        return lambda o, x, ax: o.ppermute(x * scale, ax, perm_of(pairs_of_n(o.axis_size(ax)), ax))
    return [
        _c("shift+1", pp(lambda n: _shift(n, 1)), _mk(M, K), _mk(M, K)),
        _c("shift-1", pp(lambda n: _shift(n, -1), 2.0), _mk(M, K), _mk(M, K)),
        _c("partial_0_to_last", pp(lambda n: [(0, n - 1)]), _mk(M, K), _mk(M, K)),
        _c("partial_two", pp(_partial_two), _mk(M, K), _mk(M, K)),
        _c("inv_shift+1", pp(lambda n: _shift(n, 1)), _mk(M, K), _mk(M, K), ins="R"),
    ]


_mk = lambda *s: (lambda n: tuple(d(n) if callable(d) else d for d in s))  # noqa: E731
_n = lambda n: n  # noqa: E731
_nm = lambda n: n * M  # noqa: E731
_nk = lambda n: n * K  # noqa: E731

FAMILIES: dict[str, list[Case]] = {
    "psum_pmean": [
        _c("psum", lambda o, x, ax: o.psum(x, ax), _mk(M, K), _mk(M, K), outs="R"),
        _c("pmean_sq", lambda o, x, ax: o.pmean(x * x, ax), _mk(M, K), _mk(M, K), outs="R"),
        _c("psum_tuple_tree", lambda o, x, ax: (lambda t: t[0] * t[1])(o.psum((x, x * x), ax)),
           _mk(M, K), _mk(M, K), outs="R"),
        _c("psum_inv", lambda o, x, ax: o.psum(x, ax), _mk(M, K), _mk(M, K), ins="R", outs="R"),
        _c("pmean_inv", lambda o, x, ax: o.pmean(x * x, ax), _mk(M, K), _mk(M, K), ins="R", outs="R"),
    ],
    "all_gather": [
        _c("untiled_axis0", lambda o, x, ax: o.all_gather(x, ax), _mk(M, K), _mk(_n, M, K)),
        _c("untiled_axis1", lambda o, x, ax: o.all_gather(x, ax, axis=1), _mk(M, K), _mk(M, _n, K)),
        _c("untiled_axis-1", lambda o, x, ax: o.all_gather(x, ax, axis=-1), _mk(M, K), _mk(M, K, _n)),
        _c("tiled_axis0", lambda o, x, ax: o.all_gather(x, ax, tiled=True), _mk(M, K), _mk(_nm, K)),
        _c("tiled_axis1", lambda o, x, ax: o.all_gather(x, ax, axis=1, tiled=True), _mk(M, K), _mk(M, _nk)),
        _c("tiled_axis-1", lambda o, x, ax: o.all_gather(x, ax, axis=-1, tiled=True), _mk(M, K), _mk(M, _nk)),
        _c("inv_untiled", lambda o, x, ax: o.all_gather(x, ax), _mk(M, K), _mk(_n, M, K), ins="R"),
        _c("inv_tiled_axis1", lambda o, x, ax: o.all_gather(x, ax, axis=1, tiled=True), _mk(M, K), _mk(M, _nk),
           ins="R"),
    ],
    "psum_scatter": [
        _c("untiled_dim0", lambda o, x, ax: o.psum_scatter(x, ax), _mk(_n, K), _mk(K)),
        _c("untiled_dim1", lambda o, x, ax: o.psum_scatter(x, ax, scatter_dimension=1), _mk(M, _n), _mk(M)),
        _c("tiled_dim0", lambda o, x, ax: o.psum_scatter(x, ax, tiled=True), _mk(_nm, K), _mk(M, K)),
        _c("tiled_dim1", lambda o, x, ax: o.psum_scatter(x, ax, scatter_dimension=1, tiled=True),
           _mk(M, _nk), _mk(M, K)),
        _c("inv_tiled_dim0", lambda o, x, ax: o.psum_scatter(x, ax, tiled=True), _mk(_nm, K), _mk(M, K), ins="R"),
    ],
    "ppermute": _ppermute_cases(lambda pairs, ax: pairs),
    "all_to_all": [
        _c("tiled_s0_c0", lambda o, x, ax: o.all_to_all(x, ax, 0, 0, tiled=True), _mk(_nm, K), _mk(_nm, K)),
        _c("tiled_s0_c1", lambda o, x, ax: o.all_to_all(x, ax, 0, 1, tiled=True), _mk(_nm, K), _mk(M, _nk)),
        _c("tiled_s1_c0", lambda o, x, ax: o.all_to_all(x, ax, 1, 0, tiled=True), _mk(M, _nk), _mk(_nm, K)),
        _c("untiled_s0_c0", lambda o, x, ax: o.all_to_all(x, ax, 0, 0), _mk(_n, K), _mk(_n, K)),
        _c("untiled_3d_s1_c1", lambda o, x, ax: o.all_to_all(x, ax, 1, 1), _mk(M, _n, K), _mk(M, _n, K)),
        _c("inv_tiled_s0_c1", lambda o, x, ax: o.all_to_all(x, ax, 0, 1, tiled=True), _mk(_nm, K), _mk(M, _nk),
           ins="R"),
    ],
    "axis_index": [
        _c("times_index", lambda o, x, ax: x * (o.axis_index(ax) + 1), _mk(M, K), _mk(M, K)),
        _c("index_and_size", lambda o, x, ax: x * o.axis_size(ax) + o.axis_index(ax), _mk(M, K), _mk(M, K)),
        _c("inv_times_index", lambda o, x, ax: x * (o.axis_index(ax) + 1), _mk(M, K), _mk(M, K), ins="R"),
    ],
    "pvary": [
        _c("pvary", lambda o, x, ax: o.pvary(x, ax), _mk(M, K), _mk(M, K), ins="R"),
        _c("pvary_squared", lambda o, x, ax: (lambda v: v * v)(o.pvary(x, ax)), _mk(M, K), _mk(M, K), ins="R"),
        _c("pcast_varying", lambda o, x, ax: o.pcast(x, ax, to="varying") * 2.0, _mk(M, K), _mk(M, K), ins="R"),
    ],
    # JAX's all_gather_invariant: the result is invariant (out_specs=P() in checked mode),
    # its transpose this device's slice of the cotangent.
    "all_gather_invarying": [
        _c("untiled_axis0", lambda o, x, ax: o.all_gather(x, ax, to="invarying"), _mk(M, K), _mk(_n, M, K), outs="R"),
        _c("untiled_axis1", lambda o, x, ax: o.all_gather(x * x, ax, axis=1, to="invarying"), _mk(M, K),
           _mk(M, _n, K), outs="R"),
        _c("tiled_axis0", lambda o, x, ax: o.all_gather(x, ax, tiled=True, to="invarying"), _mk(M, K), _mk(_nm, K),
           outs="R"),
        _c("tiled_axis-1", lambda o, x, ax: o.all_gather(x, ax, axis=-1, tiled=True, to="invarying"), _mk(M, K),
           _mk(M, _nk), outs="R"),
        _c("inv_untiled", lambda o, x, ax: o.all_gather(x, ax, to="invarying"), _mk(M, K), _mk(_n, M, K), ins="R",
           outs="R"),
    ],
    "pswapaxes": [
        _c("axis0", lambda o, x, ax: o.pswapaxes(x, ax, 0), _mk(_n, K), _mk(_n, K)),
        _c("3d_axis1", lambda o, x, ax: o.pswapaxes(x * 2.0, ax, 1), _mk(M, _n, K), _mk(M, _n, K)),
        _c("inv_axis0", lambda o, x, ax: o.pswapaxes(x, ax, 0), _mk(_n, K), _mk(_n, K), ins="R"),
    ],
}

# JAX 0.10.2 cannot differentiate an untiled all_to_all whose split and concat axes differ
# ("Expected cotangent type float64[4,2,1] but got float64[4,1,2]" while transposing). Its
# gradient's oracle is JAX on the equivalent moveaxis(all_to_all(x, s, s, tiled=True), s, c).
_UNTILED = [("s0_c1", 0, 1, _mk(_n, K), _mk(K, _n)), ("s1_c0", 1, 0, _mk(M, _n), _mk(_n, M)),
            ("3d_s1_c2", 1, 2, _mk(M, _n, K), _mk(M, K, _n)), ("3d_s2_c0", 2, 0, _mk(M, K, _n), _mk(_n, M, K))]
ALL_TO_ALL_UNTILED = [
    _c(f"untiled_{t}", lambda o, x, ax, s=s, c=c: o.all_to_all(x, ax, s, c), xs, ys) for t, s, c, xs, ys in _UNTILED]
ALL_TO_ALL_UNTILED_REF = [
    _c(f"untiled_{t}", lambda o, x, ax, s=s, c=c: o.moveaxis(o.all_to_all(x, ax, s, s, tiled=True), s, c), xs, ys)
    for t, s, c, xs, ys in _UNTILED]
JAX_UNTILED_A2A_BUG = "jax 0.10.2 fails to transpose an untiled all_to_all with split_axis != concat_axis"

# JAX 0.10.2 fails to lower a negative psum_scatter scatter_dimension ("'stablehlo.reduce_scatter'
# op attribute 'scatter_dimension' failed to satisfy constraint: ... non-negative"); fshard
# normalizes it like every other dim argument. Oracle: the same program with the dim spelled positive.
PSUM_SCATTER_NEG = [
    _c("tiled_dim-1", lambda o, x, ax: o.psum_scatter(x, ax, scatter_dimension=-1, tiled=True), _mk(M, _nk), _mk(M, K)),
    _c("untiled_dim-1", lambda o, x, ax: o.psum_scatter(x, ax, scatter_dimension=-1), _mk(M, _n), _mk(M)),
]
PSUM_SCATTER_NEG_REF = [
    _c("tiled_dim-1", lambda o, x, ax: o.psum_scatter(x, ax, scatter_dimension=1, tiled=True), _mk(M, _nk), _mk(M, K)),
    _c("untiled_dim-1", lambda o, x, ax: o.psum_scatter(x, ax, scatter_dimension=1), _mk(M, _n), _mk(M)),
]
JAX_NEG_DIM_BUG = "jax 0.10.2 fails to lower psum_scatter with a negative scatter_dimension"

# The same for pswapaxes (an untiled all_to_all): a negative axis fails to lower in JAX 0.10.2
# ("MLIRError: Operation creation failed"); fshard normalizes it. Oracle: the axis spelled positive.
PSWAPAXES_NEG = [_c("axis-1", lambda o, x, ax: o.pswapaxes(x, ax, -1), _mk(M, _n), _mk(M, _n))]
PSWAPAXES_NEG_REF = [_c("axis-1", lambda o, x, ax: o.pswapaxes(x, ax, 1), _mk(M, _n), _mk(M, _n))]
JAX_NEG_SWAP_BUG = "jax 0.10.2 fails to lower pswapaxes with a negative axis"

# JAX 0.10.2 numbers ppermute's perm over a tuple of axes in MESH order, while its
# axis_index and all_gather (and fshard everywhere) number positions in the tuple's order:
# over ("y", "x") on the x-major 2x2 mesh, JAX's perm (0, 1) means axis_index 0 -> 2.
# fshard follows axis_index. The oracle translates each pair into JAX's mesh-order numbering.
JAX_PPERMUTE_ORDER_QUIRK = ("jax 0.10.2 reads ppermute's perm over a tuple of axes in mesh order, "
                            "not in the order of axis_index over that tuple")


def _ppermute_mesh_order_cases(mesh: str):
    return _ppermute_cases(lambda pairs, ax: [(mesh_order_index(mesh, ax, s), mesh_order_index(mesh, ax, d))
                                              for s, d in pairs])


def _pshuffle_cases(perm_of):
    """``perm_of(perm, ax)``: the sources list the program means -> the one passed to pshuffle."""
    def ps(perm_of_n, scale=1.0):
        return lambda o, x, ax: o.pshuffle(x * scale, ax, perm_of(perm_of_n(o.axis_size(ax)), ax))
    return [
        _c("next", ps(lambda n: [(i + 1) % n for i in range(n)]), _mk(M, K), _mk(M, K)),
        _c("reverse", ps(lambda n: list(reversed(range(n))), 2.0), _mk(M, K), _mk(M, K)),
        _c("inv_next", ps(lambda n: [(i + 1) % n for i in range(n)]), _mk(M, K), _mk(M, K), ins="R"),
    ]


def _pshuffle_mesh_order_cases(mesh: str):
    # pshuffle is JAX's ppermute with (perm[i], i) pairs: the same mesh-order quirk.
    def translate(perm, ax):
        g = [mesh_order_index(mesh, ax, u) for u in range(len(perm))]
        out = [0] * len(perm)
        for i, src in enumerate(perm):
            out[g[i]] = g[src]
        return out
    return _pshuffle_cases(translate)


# pbroadcast: JAX 0.10.2 has no CPU lowering for it ("MLIR translation rule for primitive
# 'pbroadcast' not found for platform cpu"). The oracle is JAX on pbroadcast's documented
# equivalent, made varying again (pbroadcast keeps its input's type): same values, and the
# same transpose in both modes (mask * psum(ct)).
def _pbroadcast_cases(bcast):
    return [
        _c("source0", lambda o, x, ax: bcast(o, x, ax, 0), _mk(M, K), _mk(M, K)),
        _c("source_last", lambda o, x, ax: bcast(o, x * 2.0, ax, o.axis_size(ax) - 1), _mk(M, K), _mk(M, K)),
        _c("source1_sq", lambda o, x, ax: (lambda v: v * v)(bcast(o, x, ax, 1)), _mk(M, K), _mk(M, K)),
    ]


PBROADCAST = _pbroadcast_cases(lambda o, x, ax, s: o.pbroadcast(x, ax, s))
PBROADCAST_REF = _pbroadcast_cases(
    lambda o, x, ax, s: o.pvary(o.psum(o.where(o.axis_index(ax) == s, x, x * 0.0), ax), ax))
JAX_PBROADCAST_CPU = "jax 0.10.2 has no CPU lowering for pbroadcast"


# pmax/pmin have no gradient in either framework: values, and a gradient both must refuse.
PMAX_PMIN = [
    _c("pmax", lambda o, x, ax: o.pmax(x, ax), _mk(M, K), _mk(M, K), outs="R"),
    _c("pmin", lambda o, x, ax: o.pmin(x, ax), _mk(M, K), _mk(M, K), outs="R"),
]

CONFIGS: list[tuple[str, str | tuple[str, ...]]] = [
    ("x4", "x"), ("2x2", "x"), ("2x2", "y"), ("2x2", ("x", "y")), ("2x2", ("y", "x")),
]

REDUCING = {"psum_pmean"}  # families whose bodies psum: their inside gradients differ in unchecked JAX
# The unchecked inside templates pin designed differences, not the ops: two configs suffice.
DIFFERENCE_CONFIGS = {("x4", "x"), ("2x2", ("y", "x"))}


def _spec(ops, code: str, ax):
    return {"S": ops.P(ax), "R": ops.P()}[code]


def _global(shape: tuple, code: str, n: int) -> tuple:
    return (shape[0] * n, *shape[1:]) if code == "S" else shape


def _dot(ys, ws):
    return sum((y * w).sum() for y, w in zip(ys, ws))


def _bodies(cases, ax, explicit_pvary: bool):
    """The per-case bodies; ``explicit_pvary`` makes invariant inputs varying first (unchecked mode)."""
    def one(c):
        if explicit_pvary and c.ins == "R" and "pvary" not in c.tag and "pcast" not in c.tag:
            return lambda o, x: c.body(o, o.pvary(x, ax), ax)
        return lambda o, x: c.body(o, x, ax)
    return [one(c) for c in cases]


def _outside(cases, ax, explicit_pvary):
    k, tags, bodies = len(cases), [c.tag for c in cases], _bodies(cases, ax, explicit_pvary)

    def fn(ops, *a):
        xs, ws = a[:k], a[k:]
        sm = ops.shard_map(lambda *xs: tuple(b(ops, x) for b, x in zip(bodies, xs)),
                           in_specs=tuple(_spec(ops, c.ins, ax) for c in cases),
                           out_specs=tuple(_spec(ops, c.outs, ax) for c in cases))
        value, grads = ops.value_and_grad(lambda *xs: _dot(sm(*xs), ws), argnums=tuple(range(k)))(*xs)
        return {"y": dict(zip(tags, sm(*xs))), "loss": value, "dx": dict(zip(tags, grads))}
    return fn


def _values(cases, ax, explicit_pvary):
    bodies = _bodies(cases, ax, explicit_pvary)

    def fn(ops, *xs):
        sm = ops.shard_map(lambda *xs: tuple(b(ops, x) for b, x in zip(bodies, xs)),
                           in_specs=tuple(_spec(ops, c.ins, ax) for c in cases),
                           out_specs=tuple(_spec(ops, c.outs, ax) for c in cases))
        return {"y": dict(zip([c.tag for c in cases], sm(*xs)))}
    return fn


def _inside(cases, ax, explicit_pvary, reduce_loss: bool):
    k, tags, bodies = len(cases), [c.tag for c in cases], _bodies(cases, ax, explicit_pvary)

    def fn(ops, *a):
        def per_device(*a):
            xs, ws = a[:k], a[k:]
            def local(*xs):
                return _dot([b(ops, x) for b, x in zip(bodies, xs)], ws)
            if reduce_loss:
                return ops.value_and_grad(lambda *xs: ops.psum(local(*xs), ax), argnums=tuple(range(k)))(*xs)
            return ops.grad(local, argnums=tuple(range(k)))(*xs)
        in_specs = tuple(_spec(ops, c.ins, ax) for c in cases) + tuple(_spec(ops, c.outs, ax) for c in cases)
        g_specs = tuple(_spec(ops, c.ins, ax) for c in cases)
        sm = ops.shard_map(per_device, in_specs=in_specs, out_specs=(ops.P(), g_specs) if reduce_loss else g_specs)
        out = sm(*a)
        if reduce_loss:
            return {"loss": out[0], "dx": dict(zip(tags, out[1]))}
        return {"dx": dict(zip(tags, out))}
    return fn


def _inputs(cases, n, with_w=True):
    shapes = [_global(c.x_shape(n), c.ins, n) for c in cases]
    if with_w:
        shapes += [_global(c.y_shape(n), c.outs, n) for c in cases]
    return normals(*shapes)


def _register_family(family: str, cases: list[Case], mesh: str, ax) -> None:
    """Every template in both modes; unchecked inside templates are split by input kind,
    so that each program either conforms or shows one designed difference."""
    n = axis_size(mesh, ax)
    where = f"{mesh}:{axes_label(ax)}"
    group = f"lax/{family}/{where}"
    for template in ("outside", "inside_local", "inside_psum"):
        seed = f"{group}/{template}"
        make = _TEMPLATES[template]
        register(Program(f"{group}/checked/{template}", mesh, True, make(cases, ax, False), _inputs(cases, n),
                         seed, group=group))
        override = _UNCHECKED_OVERRIDE.get(family, {})
        if template == "outside":
            differs = override.get(("outside", None))
            register(Program(f"{group}/unchecked/{template}", mesh, False, make(cases, ax, True),
                             _inputs(cases, n), seed, group=group, differs=differs,
                             tags=(f"n={n}",) if differs else ()))
            continue
        for kind, sub in (("varying", [c for c in cases if c.ins == "S"]),
                          ("invariant", [c for c in cases if c.ins == "R"])):
            default = _UNCHECKED_INSIDE.get((template, kind, family in REDUCING), "skip")
            differs = override.get((template, kind), default)
            if not sub or differs == "skip" or (differs and (mesh, ax) not in DIFFERENCE_CONFIGS):
                continue
            fn, sub_seed, twin = make(sub, ax, True), f"{seed}:{kind}", None
            if differs:
                # The checked twin: the same function and inputs, in checked mode.
                twin = f"{group}/checked-twin/{template}:{kind}"
                register(Program(twin, mesh, True, fn, _inputs(sub, n), sub_seed, group=group))
            register(Program(f"{group}/unchecked/{template}:{kind}", mesh, False, fn, _inputs(sub, n), sub_seed,
                             differs=differs, group=group, oracle=twin))


# Unchecked inside templates, by (template, input kind, family reduces): None = JAX's
# unchecked mode and fshard's agree (parity); a row of docs/jax.md = fshard's unchecked result
# equals JAX's checked one and JAX's unchecked one differs; "skip" = a program that mixes
# an invariant loss term with varying ones, where checked mode's implicit pvary (absent from
# both unchecked modes) changes the math, so neither relation holds.
_UNCHECKED_INSIDE = {
    ("inside_local", "varying", False): None,
    ("inside_local", "varying", True): "unchecked_psum_transpose",
    ("inside_psum", "varying", False): "unchecked_psum_transpose",
    ("inside_local", "invariant", False): "unchecked_pvary",
}


# Families whose unchecked programs follow other rules than _UNCHECKED_INSIDE's. The
# invariant all_gather's result is replicated by value and its loss term invariant:
# - outside, JAX's unchecked mode divides the cotangent of its P() output by n, fshard keeps
#   it whole (docs/jax.md, "Unchecked mode: replicated outputs"): fshard's gradient is n
#   times JAX's unchecked one (and equals JAX's checked one);
# - inside_local with a varying input: no psum, no pvary: both unchecked modes agree;
# - inside_psum: the psum of an invariant loss term, where checked mode's implicit pvary
#   changes the math (as the reducing families): neither relation holds.
_UNCHECKED_OVERRIDE: dict[str, dict[tuple[str, str | None], str | None]] = {
    "all_gather_invarying": {("outside", None): "unchecked_replicated_output",
                             ("inside_local", "varying"): None, ("inside_psum", "varying"): "skip"},
}


def _register_with_oracle(family: str, cases: list[Case], ref_cases: list[Case], mesh: str, ax,
                          jax_quirk: str, templates: tuple[str, ...], ref_means_the_same: bool = True) -> None:
    """Programs whose JAX result is not the oracle (``jax_quirk``: JAX raises or contradicts
    itself), each checked against JAX on an equivalent formulation (``ref_cases``, same
    shapes and inputs), registered as ``<family>.ref``. ``ref_means_the_same``: fshard
    computes the same values on the reference too (then it is parity-tested as well)."""
    n = axis_size(mesh, ax)
    where = f"{mesh}:{axes_label(ax)}"
    group, ref_group = f"lax/{family}/{where}", f"lax/{family}.ref/{where}"
    for template in templates:
        for check in (True, False):
            if check is False and template != "outside":
                continue  # the unchecked inside differences are pinned on the other families
            mode, seed, make = mode_name(check), f"{group}/{template}", _TEMPLATES[template]
            inputs = _inputs(cases, n, with_w=template != "values")
            ref = register(Program(f"{ref_group}/{mode}/{template}", mesh, check, make(ref_cases, ax, not check),
                                   inputs, seed, group=ref_group,
                                   tags=() if ref_means_the_same else ("jax_only",)))
            register(Program(f"{group}/{mode}/{template}", mesh, check, make(cases, ax, not check),
                             inputs, seed, oracle=ref.name, jax_quirk=jax_quirk))


def _register_pmax_pmin(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    where = f"{mesh}:{axes_label(ax)}"
    group = f"lax/pmax_pmin/{where}"
    for check in (True, False):
        register(Program(f"{group}/{mode_name(check)}/values", mesh, check, _values(PMAX_PMIN, ax, False),
                         _inputs(PMAX_PMIN, n, with_w=False), f"{group}/values", group=group))
    # Both frameworks refuse to differentiate pmax/pmin (the parity test accepts "both raise").
    register(Program(f"{group}/checked/outside", mesh, True, _outside(PMAX_PMIN, ax, False),
                     _inputs(PMAX_PMIN, n), f"{group}/outside"))
    register(Program(f"{group}/checked/inside_local", mesh, True,
                     _inside(PMAX_PMIN, ax, False, reduce_loss=False), _inputs(PMAX_PMIN, n), f"{group}/inside"))


_TEMPLATES = {
    "outside": lambda cs, ax, pv: _outside(cs, ax, pv),
    "values": lambda cs, ax, pv: _values(cs, ax, pv),
    "inside_local": lambda cs, ax, pv: _inside(cs, ax, pv, reduce_loss=False),
    "inside_psum": lambda cs, ax, pv: _inside(cs, ax, pv, reduce_loss=True),
}

def _in_mesh_order(mesh: str, ax) -> bool:
    names = [a for a, _ in MESHES[mesh]]
    return isinstance(ax, str) or list(ax) == [a for a in names if a in ax]


for _mesh, _ax in CONFIGS:
    for _family, _cases in FAMILIES.items():
        if _family == "ppermute" and not _in_mesh_order(_mesh, _ax):
            _register_with_oracle("ppermute", _cases, _ppermute_mesh_order_cases(_mesh), _mesh, _ax,
                                  JAX_PPERMUTE_ORDER_QUIRK, ("outside", "inside_local", "inside_psum"),
                                  ref_means_the_same=False)
            continue
        _register_family(_family, _cases, _mesh, _ax)
    if _in_mesh_order(_mesh, _ax):
        _register_family("pshuffle", _pshuffle_cases(lambda perm, ax: perm), _mesh, _ax)
    else:
        _register_with_oracle("pshuffle", _pshuffle_cases(lambda perm, ax: perm), _pshuffle_mesh_order_cases(_mesh),
                              _mesh, _ax, JAX_PPERMUTE_ORDER_QUIRK, ("outside", "inside_local", "inside_psum"),
                              ref_means_the_same=False)
    _register_with_oracle("pbroadcast", PBROADCAST, PBROADCAST_REF, _mesh, _ax, JAX_PBROADCAST_CPU,
                          ("values", "outside", "inside_local", "inside_psum"))
    _register_with_oracle("pswapaxes_negdim", PSWAPAXES_NEG, PSWAPAXES_NEG_REF, _mesh, _ax, JAX_NEG_SWAP_BUG,
                          ("values", "outside", "inside_local"))
    _register_pmax_pmin(_mesh, _ax)
    _where = f"{_mesh}:{axes_label(_ax)}"
    # JAX runs the untiled values itself; only their gradients need the equivalent formulation.
    register(Program(f"lax/all_to_all_untiled/{_where}/checked/values", _mesh, True,
                     _values(ALL_TO_ALL_UNTILED, _ax, False),
                     _inputs(ALL_TO_ALL_UNTILED, axis_size(_mesh, _ax), with_w=False),
                     f"lax/all_to_all_untiled/{_where}/values"))
    _register_with_oracle("all_to_all_untiled", ALL_TO_ALL_UNTILED, ALL_TO_ALL_UNTILED_REF, _mesh, _ax,
                          JAX_UNTILED_A2A_BUG, ("outside", "inside_local"))
    _register_with_oracle("psum_scatter_negdim", PSUM_SCATTER_NEG, PSUM_SCATTER_NEG_REF, _mesh, _ax,
                          JAX_NEG_DIM_BUG, ("values", "outside"))
    # Inside grad, JAX only lowers the transpose (an all_gather): it runs, and is the oracle.
    register(Program(f"lax/psum_scatter_negdim/{_where}/checked/inside_local", _mesh, True,
                     _inside(PSUM_SCATTER_NEG, _ax, False, reduce_loss=False),
                     _inputs(PSUM_SCATTER_NEG, axis_size(_mesh, _ax)),
                     f"lax/psum_scatter_negdim/{_where}/inside_local"))


# Refusals of JAX 0.10.2's newer surface, each refused by both frameworks while tracing
# (test_conformance_lax.py::test_new_surface_refusals checks both messages).
def _refused(body, in_spec_code: str, shape: tuple):
    def fn(ops, x):
        ax = "x"
        sm = ops.shard_map(lambda x: body(ops, x, ax), in_specs=_spec(ops, in_spec_code, ax),
                           out_specs=ops.P(ax))
        return {"y": sm(x)}
    return fn


NEW_REFUSED = {
    # JAX binds pbroadcast with no implicit pvary: an invariant value is refused.
    "pbroadcast_invariant": (lambda o, x, ax: o.pbroadcast(x, ax, 0), "R", (M, K), True),
    "pcast_bad_to": (lambda o, x, ax: o.pcast(x, ax, to="invariant"), "R", (M, K), True),
    "pcast_set": (lambda o, x, ax: o.pcast(x, {ax}, to="varying"), "R", (M, K), True),
    "all_gather_bad_to": (lambda o, x, ax: o.all_gather(x, ax, to="invariant")[0], "S", (4 * M, K), True),
    "pshuffle_not_a_perm": (lambda o, x, ax: o.pshuffle(x, ax, [0, 0, 1, 2]), "S", (4 * M, K), False),
    "pswapaxes_bad_size": (lambda o, x, ax: o.pswapaxes(x, ax, 0), "S", (4 * M, K), False),
}
for _what, (_body, _ins, _shape, _check) in NEW_REFUSED.items():
    register(Program(f"lax/new_refused/x4:x/{mode_name(_check)}/{_what}", "x4", _check, _refused(_body, _ins, _shape),
                     normals(_shape), f"lax/new_refused/{_what}"))
