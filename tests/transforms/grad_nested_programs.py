"""Higher-order gradient programs, written once against a shim ``o`` and run by JAX and fshard.

``o`` is ``test_grad_nested.FshardOps`` or :class:`JaxOps` below: ``grad``,
``value_and_grad``, ``jvp``, ``vjp``, ``jacfwd``, ``jacrev``, ``vmap``, ``remat``,
``shard_map`` (on the 4-device mesh ``{"x": 4}``, results as global arrays), the
collectives with jax.lax's signatures, and ``sin``/``tanh``/``stack``. This module imports
numpy only, so that the JAX process (``python grad_nested_programs.py OUT.pkl``: float64,
4 forced host devices, its own process so that XLA never touches the pytest process or
the gloo ranks) imports no torch.

Two families:

- ``LOCAL``: no ``shard_map``: ``fn(o, x, v)``, ``x`` and ``v`` of shape (4,).
- ``SHARDED``: an HVP ``H(w) v`` of a body loss ``loss(o, w, x, check)`` (``w``, ``v``
  replicated, shape (4,); ``x`` split over ``"x"``, shape (16,)), in each composition of
  :data:`COMPOSITIONS`. The unchecked form places ``pvary`` where ``w`` meets ``x``
  (Megatron style); its oracle is JAX's checked mode (that is what fshard's unchecked
  mode promises, ``docs/jax.md``), so JAX runs the checked form only.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

WORLD = 4
_PERM = [(i, (i + 1) % WORLD) for i in range(WORLD)]


def inputs() -> dict[str, np.ndarray]:
    """The programs' float64 inputs (one draw, shared by both frameworks)."""
    rng = np.random.default_rng(29)
    return {"w": rng.normal(size=4), "x": rng.normal(size=16), "v": rng.normal(size=4),
            "a": rng.normal(size=4), "b": rng.normal(size=4)}


# --- no shard_map: fn(o, a, b) -----------------------------------------------------------
def _f(o, y):
    return (o.sin(y) * y ** 2).sum()


def _maml(o, p, b):
    def inner(q):
        return ((q * b - 1.0) ** 2).sum()
    fast = p - 0.1 * o.grad(inner)(p)  # one inner step; the outer loss differentiates through it
    return (o.tanh(fast * b) ** 2).sum()


def _value_and_grad_loss(o, y, b):
    value, g = o.value_and_grad(lambda z: _f(o, z))(y)
    return value + (g * b).sum()


def _aux_loss(o, y):
    g, aux = o.grad(lambda z: ((z ** 3).sum(), o.sin(z) * z), has_aux=True)(y)
    return (g * aux).sum()


LOCAL: dict[str, Callable[..., Any]] = {
    # the program: grad of grad of a cube is 6x
    "grad_grad_cube": lambda o, a, b: o.grad(lambda y: o.grad(lambda z: (z ** 3).sum())(y).sum())(a),
    # the inner function closes over the outer variable
    "closure": lambda o, a, b: o.grad(lambda w: o.grad(lambda y: (y * w ** 2 * o.sin(y)).sum())(b).sum())(a),
    # the inner value and gradient both feed the outer loss
    "value_and_grad": lambda o, a, b: o.grad(lambda y: _value_and_grad_loss(o, y, b))(a),
    "third_order": lambda o, a, b: o.grad(
        lambda y: o.grad(lambda z: o.grad(lambda u: (u ** 4 * o.sin(u)).sum())(z).sum())(y).sum())(a),
    "hvp_rev_rev": lambda o, a, b: o.grad(lambda y: (o.grad(lambda z: _f(o, z))(y) * b).sum())(a),
    "hvp_fwd_rev": lambda o, a, b: o.jvp(o.grad(lambda z: _f(o, z)), (a,), (b,))[1],
    "hessian_jacfwd": lambda o, a, b: o.jacfwd(o.grad(lambda z: _f(o, z)))(a),
    "hessian_jacrev": lambda o, a, b: o.jacrev(o.grad(lambda z: _f(o, z)))(a),
    "vjp_of_grad": lambda o, a, b: o.vjp(o.grad(lambda z: _f(o, z)), a)[1](b)[0],
    "vmap_grad_grad": lambda o, a, b: o.vmap(o.grad(lambda y: o.grad(lambda z: _f(o, z))(y).sum()))(
        o.stack([a, b])),
    "remat_inner": lambda o, a, b: o.grad(lambda y: (o.grad(o.remat(lambda z: _f(o, z)))(y) * b).sum())(a),
    "remat_outer": lambda o, a, b: o.grad(o.remat(lambda y: (o.grad(lambda z: _f(o, z))(y) * b).sum()))(a),
    "remat_fwd_rev": lambda o, a, b: o.jvp(o.grad(o.remat(lambda z: _f(o, z))), (a,), (b,))[1],
    "maml": lambda o, a, b: o.grad(lambda p: _maml(o, p, b))(a),
    # the aux of the inner call is differentiable by the outer one, as in JAX
    "has_aux": lambda o, a, b: o.grad(lambda y: _aux_loss(o, y))(a),
    "argnums": lambda o, a, b: o.grad(
        lambda y: o.grad(lambda p, q: (p ** 2 * q ** 3).sum(), argnums=(0, 1))(y, b)[1].sum())(a),
}


# --- shard_map: H(w) v of a body loss, in four compositions ------------------------------
def _lift(o, w, check):
    return w if check else o.pvary(w, "x")  # unchecked mode: Megatron's explicit "f"


LOSSES: dict[str, Callable[..., Any]] = {
    # pvary's transpose (psum) in the second order too
    "pvary": lambda o, w, x, c: o.psum((x * _lift(o, w, c) ** 3).sum(), "x"),
    # psum's transpose (pvary) in the second order: the cotangent of psum's result depends on w
    "psum_sq": lambda o, w, x, c: (o.psum(x * _lift(o, w, c), "x") ** 2).sum(),
    "all_gather": lambda o, w, x, c: o.pmean(
        (o.all_gather(x * _lift(o, w, c) ** 2, "x", tiled=True) ** 2).sum(), "x"),
    "psum_scatter": lambda o, w, x, c: o.psum(
        (o.psum_scatter(x * _lift(o, w, c) ** 2, "x", tiled=True) ** 2).sum(), "x"),
    "ppermute": lambda o, w, x, c: o.psum(
        (o.ppermute(x * _lift(o, w, c) ** 2, "x", _PERM) * x * o.tanh(_lift(o, w, c))).sum(), "x"),
    "all_to_all": lambda o, w, x, c: o.psum(
        (o.all_to_all(x * _lift(o, w, c) ** 2, "x", 0, 0, tiled=True) ** 2 * _lift(o, w, c)).sum(), "x"),
}


def _inside(o, loss, c):
    """``shard_map(grad(grad))``: the HVP by reverse over reverse inside the body."""
    def body(w, x, v):
        return o.grad(lambda u: (o.grad(lambda t: loss(o, t, x, c))(u) * v).sum())(w)
    return o.shard_map(body, (o.P(), o.P("x"), o.P()), o.P())


def _inside_fwd_rev(o, loss, c):
    """``shard_map(jvp(grad))``: forward over reverse inside the body."""
    def body(w, x, v):
        return o.jvp(lambda u: o.grad(lambda t: loss(o, t, x, c))(u), (w,), (v,))[1]
    return o.shard_map(body, (o.P(), o.P("x"), o.P()), o.P())


def _inside_remat(o, loss, c):
    """``shard_map(grad(grad(remat)))``."""
    def body(w, x, v):
        return o.grad(lambda u: (o.grad(o.remat(lambda t: loss(o, t, x, c)))(u) * v).sum())(w)
    return o.shard_map(body, (o.P(), o.P("x"), o.P()), o.P())


def _grad_sm_grad(o, loss, c):
    """``grad(shard_map(grad))``."""
    sm = o.shard_map(lambda w, x: o.grad(lambda t: loss(o, t, x, c))(w), (o.P(), o.P("x")), o.P())
    return lambda w, x, v: o.grad(lambda u: (sm(u, x) * v).sum())(w)


def _grad_grad_sm(o, loss, c):
    """``grad(grad(shard_map))``."""
    sm = o.shard_map(lambda w, x: loss(o, w, x, c), (o.P(), o.P("x")), o.P())
    return lambda w, x, v: o.grad(lambda u: (o.grad(sm)(u, x) * v).sum())(w)


COMPOSITIONS: dict[str, Callable[..., Any]] = {
    "inside": _inside, "inside_fwd_rev": _inside_fwd_rev, "inside_remat": _inside_remat,
    "grad_sm_grad": _grad_sm_grad, "grad_grad_sm": _grad_grad_sm,
}


def sharded(o, loss_name: str, composition: str, check: bool) -> Callable[..., Any]:
    """``(w, x, v) -> H(w) v`` for one loss and composition."""
    return COMPOSITIONS[composition](o, LOSSES[loss_name], check)


# --- the JAX side -----------------------------------------------------------------------
class JaxOps:
    """``o`` for JAX: jax / jax.lax, ``shard_map`` on the 4-device mesh, checked mode."""

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import AxisType, Mesh, PartitionSpec

        self.jax, self.jnp = jax, jnp
        self.mesh = Mesh(np.array(jax.devices()[:WORLD]), ("x",), axis_types=(AxisType.Auto,))
        self.P = PartitionSpec
        for name in ("psum", "pmean", "all_gather", "psum_scatter", "ppermute", "all_to_all"):
            setattr(self, name, getattr(jax.lax, name))
        for name in ("grad", "value_and_grad", "jvp", "vjp", "jacfwd", "jacrev", "vmap"):
            setattr(self, name, getattr(jax, name))
        self.sin, self.tanh, self.stack = jnp.sin, jnp.tanh, jnp.stack

    def pvary(self, x, ax):
        return self.jax.lax.pcast(x, ax, to="varying")

    def remat(self, f):
        return self.jax.checkpoint(f)

    def shard_map(self, f, in_specs, out_specs):
        return self.jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def run_jax() -> dict[str, Any]:
    """Every program's JAX result (an array, or ``"error: ..."``), by name."""
    import jax

    jax.config.update("jax_enable_x64", True)
    o, ins = JaxOps(), inputs()
    out: dict[str, Any] = {}
    for name, fn in LOCAL.items():
        out[f"local/{name}"] = _attempt(lambda fn=fn: fn(o, ins["a"], ins["b"]))
    for loss in LOSSES:
        for comp in COMPOSITIONS:
            # The oracle of both fshard modes: the unchecked form's explicit pvary of the
            # invariant w is what checked mode inserts.
            out[f"sharded/{loss}/{comp}"] = _attempt(
                lambda loss=loss, comp=comp: jax.jit(sharded(o, loss, comp, True))(ins["w"], ins["x"], ins["v"]))
    return out


def _attempt(thunk: Callable[[], Any]) -> Any:
    try:
        return np.asarray(thunk())
    except Exception as e:  # noqa: BLE001 - recorded: the test shows JAX's refusal next to fshard's
        return f"error: {type(e).__name__}: {e}"[:500]


def main(argv: list[str]) -> int:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={WORLD}"
                               " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["JAX_ENABLE_X64"] = "1"
    results = run_jax()
    with open(argv[1], "wb") as f:
        pickle.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
