"""Random per-device programs from a seed, in a neutral form (plain, JSON-able data).

A program is a dict::

    {"seed": 7, "mesh": [["x", 2], ["y", 2]], "check": True,
     "inputs": [["a0", [8, 2], ["x", None]], ...],          # name, global shape, in_spec
     "ops": [["v0", "bin", ["a0", {"c": 2.0}], {"op": "-"}], ...],  # out, op, args, attrs
     "outputs": [["v3", ["x", None]], ...],                   # var, out_spec
     "grad": {"mode": "inside", "wrt": ["a0"], "loss": "psum", "vg": True},
     "remat": None}

An argument is a variable's name or ``{"c": constant}``. Ops are described in
``emit.py``; the generator tracks each variable's kind (``f`` float tensor, ``i`` integer
tensor, ``ai`` an ``axis_index`` value, ``s`` a float scalar made from one), its local
shape and its varying axes (JAX's rules), so that most programs are valid; a few break a
rule on purpose (mixed-type collectives, a replication promise the types do not prove),
which both frameworks must then refuse alike.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any

# Meshes of 4 devices, 1 to 3 axes (size-1 axes included): name -> ((axis, size), ...).
MESHES: dict[str, tuple[tuple[str, int], ...]] = {
    "x4": (("x", 4),),
    "2x2": (("x", 2), ("y", 2)),
    "x4y1": (("x", 4), ("y", 1)),
    "1x2x2": (("z", 1), ("x", 2), ("y", 2)),
    "2x1x2": (("x", 2), ("z", 1), ("y", 2)),
}
MODES = (("none", 3), ("inside", 3), ("outside", 3), ("nested_inside", 1), ("nested_outside", 1))
POLICIES = (None, "nothing_saveable", "dots_saveable")


@dataclasses.dataclass
class Val:
    kind: str  # "f", "i", "ai", "s"
    shape: tuple[int, ...]
    vma: frozenset
    deps: frozenset  # the input names it depends on


class Ctx:
    """The generator's state: the program so far and every variable's type."""

    def __init__(self, seed: int, rng: random.Random, mesh: str, check: bool) -> None:
        self.rng, self.mesh_name, self.check = rng, mesh, check
        self.axes = dict(MESHES[mesh])
        self.prog: dict[str, Any] = {"id": str(seed), "seed": seed, "mesh": [list(a) for a in MESHES[mesh]], "check": check,
                                     "inputs": [], "ops": [], "outputs": [], "grad": {"mode": "none"},
                                     "remat": None}
        self.vals: dict[str, Val] = {}
        self.n = 0

    # --- variables ---
    def fresh(self) -> str:
        self.n += 1
        return f"v{self.n}"

    def add(self, op: str, args: list, attrs: dict, kind: str, shape, vma, deps=None) -> str:
        out = self.fresh()
        if deps is None:
            deps = frozenset().union(*[self.vals[a].deps for a in args if isinstance(a, str)])
        self.prog["ops"].append([out, op, args, attrs])
        self.vals[out] = Val(kind, tuple(shape), frozenset(vma), deps)
        if self._meets(op, args, attrs):
            self.prog["meets"] = True
        return out

    def _meets(self, op: str, args: list, attrs: dict) -> bool:
        """Whether checked mode would insert an implicit pvary here (JAX's rules): a float
        operand missing some of the axes its op's operands vary over, or a collective's
        operand missing some of the collective's axes (pmax/pmin excepted). Unchecked
        programs with one differ from both JAX modes (docs/jax.md)."""
        vals = [self.vals[a] for a in args if isinstance(a, str)]
        union = frozenset().union(*[v.vma for v in vals])
        if any(v.kind == "f" and v.vma != union for v in vals):
            return True
        axes = attrs.get("axes")
        if axes is None or op in ("pmax", "pmin", "pvary", "axis_index") or not vals:
            return False
        return not set([axes] if isinstance(axes, str) else axes) <= vals[0].vma

    def vma(self, *args) -> frozenset:
        return frozenset().union(*[self.vals[a].vma for a in args if isinstance(a, str)])

    def size(self, axes) -> int:
        return math.prod(self.axes[a] for a in ((axes,) if isinstance(axes, str) else axes))

    def pick(self, kind: str = "f", pred: Callable[[Val], bool] = lambda v: True) -> str | None:
        names = [n for n, v in self.vals.items() if v.kind == kind and pred(v)]
        if not names:
            return None
        # Recent values more often: programs grow chains, not only fans of inputs.
        return names[-1] if self.rng.random() < 0.5 else self.rng.choice(names)

    def float_of(self, shape=None, ndim=None, pred=lambda v: True) -> str:
        """A float tensor of this local shape (or rank), an input made for it if none exists."""
        def ok(v):
            return ((shape is None or v.shape == tuple(shape)) and (ndim is None or len(v.shape) == ndim)
                    and pred(v))
        name = self.pick("f", ok)
        if name is None or self.rng.random() < 0.2:
            if shape is None:
                shape = [self.rng.choice((2, 4)) for _ in range(ndim if ndim is not None else self.rng.randint(1, 2))]
            name = self.new_input(tuple(shape))
        return name

    def new_input(self, local: tuple[int, ...]) -> str:
        """An input of this local shape, under a random in_spec (its global shape follows)."""
        spec, free = [], [a for a in self.axes if self.rng.random() < 0.6]
        self.rng.shuffle(free)
        for _ in local:
            if free and self.rng.random() < 0.6:
                k = 2 if len(free) >= 2 and self.rng.random() < 0.25 else 1
                spec.append(free[0] if k == 1 else free[:2])
                free = free[k:]
            else:
                spec.append(None)
        glob = [d * (self.size(tuple(e) if isinstance(e, list) else e) if e else 1) for d, e in zip(local, spec)]
        name = f"a{len(self.prog['inputs'])}"
        self.prog["inputs"].append([name, glob, spec])
        named = [a for e in spec if e for a in ([e] if isinstance(e, str) else e)]
        self.vals[name] = Val("f", local, frozenset(named), frozenset([name]))
        return name

    def axes_choice(self, x_vma: frozenset, mesh_order: bool = False):
        """Axes for a collective: mostly those ``x`` varies over (or none of them); sometimes mixed."""
        names = list(self.axes)
        r = self.rng.random()
        pool = [a for a in names if a in x_vma] if r < 0.6 else [a for a in names if a not in x_vma]
        if r > 0.9 or not pool:
            pool = names
        k = 2 if len(pool) >= 2 and self.rng.random() < 0.35 else 1
        chosen = self.rng.sample(pool, k)
        if mesh_order:
            chosen.sort(key=names.index)
        return chosen[0] if k == 1 else chosen


def generate(seed: int) -> dict:
    """The program of ``seed`` (deterministic)."""
    from . import grammar

    rng = random.Random(seed)
    mesh = rng.choice(list(MESHES))
    ctx = Ctx(seed, rng, mesh, check=rng.random() < 0.75)
    ctx.new_input(tuple(rng.choice((2, 4)) for _ in range(rng.randint(1, 2))))
    for _ in range(rng.randint(2, 7)):
        for _attempt in range(5):
            if grammar.step(ctx):
                break
    _outputs(ctx)
    _grad(ctx)
    return ctx.prog


def _outputs(ctx: Ctx) -> None:
    rng = ctx.rng
    floats = [n for n, v in ctx.vals.items() if v.kind == "f" and not n.startswith("a")]
    if not floats:
        floats = [n for n, v in ctx.vals.items() if v.kind == "f"]
    chosen = [floats[-1]] + ([rng.choice(floats[:-1])] if len(floats) > 1 and rng.random() < 0.4 else [])
    for name in chosen:
        v = ctx.vals[name]
        if not v.shape:
            name = ctx.add("reshape", [name], {"shape": [1]}, "f", (1,), v.vma, v.deps)
            v = ctx.vals[name]
        ctx.prog["outputs"].append([name, out_spec(ctx, v)])
        # The generator's type of each output (JAX's rules), for known-bug classifiers only.
        ctx.prog.setdefault("out_vma", {})[name] = sorted(v.vma)


def out_spec(ctx: Ctx, v: Val) -> list:
    """An out_spec naming every axis the value varies over (rarely one fewer, in checked
    mode: a promise the types do not prove), and sometimes an invariant axis too."""
    rng = ctx.rng
    axes = [a for a in ctx.axes if a in v.vma]
    if ctx.check and axes and rng.random() < 0.1:
        axes.remove(rng.choice(axes))
    extra = [a for a in ctx.axes if a not in v.vma and rng.random() < 0.15]
    axes += extra
    rng.shuffle(axes)
    spec: list = [None] * len(v.shape)
    for a in axes:
        d = rng.randrange(len(v.shape))
        spec[d] = a if spec[d] is None else ([spec[d]] if isinstance(spec[d], str) else spec[d]) + [a]
    return spec


def _grad(ctx: Ctx) -> None:
    rng = ctx.rng
    deps = sorted(frozenset().union(*[ctx.vals[n].deps for n, _ in ctx.prog["outputs"]]))
    mode = rng.choices([m for m, _ in MODES], [w for _, w in MODES])[0]
    if rng.random() < 0.15:
        ctx.prog["remat"] = rng.choice(POLICIES) or "default"
    if not deps or mode == "none":
        return
    wrt = rng.sample(deps, min(len(deps), rng.randint(1, 2)))
    ctx.prog["grad"] = {"mode": mode, "wrt": sorted(wrt), "loss": rng.choice(("local", "psum")),
                        "vg": rng.random() < 0.7}
