"""One source template per op, for both frameworks: ``OPS[op](fw, out, args, attrs) -> lines``.

Where PyTorch and JAX spell an op alike (Python operators, ``@``, ``.T``, ``.reshape``,
indexing, ``+=`` on a copy) both sides get the same text: that is the point, ordinary
PyTorch code. Elsewhere each side gets its idiom (``F.cross_entropy`` against
``log_softmax`` + ``take_along_axis``, ``y[i] = b`` against ``y.at[i].set(b)``,
``F.embedding`` against ``jnp.take``).
"""

from __future__ import annotations

from collections.abc import Callable


def val(a) -> str:
    """An argument's source: a variable name or a constant's literal."""
    return a if isinstance(a, str) else repr(a["c"])


def axes_src(axes) -> str:
    return repr(axes) if isinstance(axes, str) else "(" + "".join(f"{a!r}, " for a in axes) + ")"


def _by_fw(jax_src: str, fshard_src: str) -> Callable:
    def emit(fw, out, args, attrs):
        return (jax_src if fw == "jax" else fshard_src).format(*args, out=out, **attrs)
    return emit


def _bin(fw, out, args, attrs):
    return f"{out} = {args[0]} {attrs['op']} {args[1]}"


_UNARY = {"neg": ("-{0}", "-{0}"), "tanh": ("jnp.tanh({0})", "torch.tanh({0})"),
          "sin": ("jnp.sin({0})", "torch.sin({0})"), "relu": ("jax.nn.relu({0})", "torch.relu({0})"),
          "exp_tanh": ("jnp.exp(jnp.tanh({0}))", "torch.exp(torch.tanh({0}))")}


def _unary(fw, out, args, attrs):
    return f"{out} = " + _UNARY[attrs["fn"]][fw == "fshard"].format(*args)


def _reduce(fw, out, args, attrs):
    fn, dim = attrs["fn"], attrs["dim"]
    if fw == "jax":
        return f"{out} = jnp.{fn}({args[0]}" + ("" if dim is None else f", axis={dim}") + ")"
    if fn == "max":
        return f"{out} = torch.amax({args[0]}, dim={dim})"
    return f"{out} = {args[0]}.{fn}(" + ("" if dim is None else f"dim={dim}") + ")"


def _reshape(fw, out, args, attrs):
    return f"{out} = {args[0]}.reshape({tuple(attrs['shape'])!r})"


def _axis_index(fw, out, args, attrs):
    return f"{out} = {'jax.lax' if fw == 'jax' else 'fs.lax'}.axis_index({axes_src(attrs['axes'])})"


def _iop(fw, out, args, attrs):
    return f"{out} = {args[0]} * 1.0\n{out} {attrs['op']} {args[1]}"


def _setitem(fw, out, args, attrs):
    a, i, b = args
    if fw == "jax":
        return f"{out} = ({a} * 1.0).at[{i}].set({b})"
    return f"{out} = {a} * 1.0\n{out}[{i}] = {b}"


def _collective(name: str, extra: Callable[[dict], str] = lambda a: "") -> Callable:
    def emit(fw, out, args, attrs):
        mod = "jax.lax" if fw == "jax" else "fs.lax"
        return f"{out} = {mod}.{name}({args[0]}, {axes_src(attrs['axes'])}{extra(attrs)})"
    return emit


def _pvary(fw, out, args, attrs):
    if fw == "jax":
        return f"{out} = jax.lax.pcast({args[0]}, {axes_src(attrs['axes'])}, to='varying')"
    return f"{out} = fs.lax.pvary({args[0]}, {axes_src(attrs['axes'])})"


def _pbroadcast(fw, out, args, attrs):
    ax, s = axes_src(attrs["axes"]), attrs["source"]
    if fw == "jax":  # JAX's documented equivalent, varying again as pbroadcast's result is
        return (f"{out} = jax.lax.pcast(jax.lax.psum(jnp.where(jax.lax.axis_index({ax}) == {s}, {args[0]}, "
                f"jnp.zeros_like({args[0]})), {ax}), {ax}, to='varying')")
    return f"{out} = fs.lax.pbroadcast({args[0]}, {ax}, {s})"


def _ragged_all_to_all(fw, out, args, attrs):
    ax, a = axes_src(attrs["axes"]), args[0]
    if fw == "jax":
        plan, call = f"jnp.asarray({attrs['table']!r})[jax.lax.axis_index({ax})]", "jax.lax.ragged_all_to_all"
    else:
        plan, call = f"torch.tensor({attrs['table']!r})[fs.lax.axis_index({ax})]", "fs.lax.ragged_all_to_all"
    return (f"{out}_plan = {plan}\n"
            f"{out} = {call}({a}, {a} * 0.5, {out}_plan[0], {out}_plan[1], {out}_plan[2], {out}_plan[3], "
            f"axis_name={ax})")


OPS: dict[str, Callable] = {
    "bin": _bin,
    "unary": _unary,
    "reduce": _reduce,
    "matmul": _by_fw("{out} = {0} @ {1}", "{out} = {0} @ {1}"),
    "transpose": _by_fw("{out} = {0}.T", "{out} = {0}.T"),
    "reshape": _reshape,
    "axis_index": _axis_index,
    "gt0": _by_fw("{out} = ({0} > 0).astype(jnp.int32)", "{out} = ({0} > 0).long()"),
    "index": _by_fw("{out} = {0}[{1}]", "{out} = {0}[{1}]"),
    "gather": _by_fw("{out} = jnp.take_along_axis({0}, {1}, axis={dim})", "{out} = torch.gather({0}, {dim}, {1})"),
    "embed": _by_fw("{out} = jnp.take({0}, {1}, axis=0)", "{out} = F.embedding({1}, {0})"),
    "where": _by_fw("{out} = jnp.where({0} > 0, {1}, {2})", "{out} = torch.where({0} > 0, {1}, {2})"),
    "softmax": _by_fw("{out} = jax.nn.softmax({0}, axis=-1)", "{out} = torch.softmax({0}, dim=-1)"),
    "log_softmax": _by_fw("{out} = jax.nn.log_softmax({0}, axis=-1)", "{out} = torch.log_softmax({0}, dim=-1)"),
    "xent": _by_fw("{out} = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax({0}, axis=-1), {1}[:, None], axis=1))",
                   "{out} = F.cross_entropy({0}, {1})"),
    "iop": _iop,
    "setitem": _setitem,
    "psum": _collective("psum"),
    "pmean": _collective("pmean"),
    "pmax": _collective("pmax"),
    "pmin": _collective("pmin"),
    "pvary": _pvary,
    "all_gather": _collective("all_gather", lambda a: f", axis={a['axis']}, tiled={a['tiled']}"
                              + (f", to={a['to']!r}" if a.get("to", "varying") != "varying" else "")),
    "pshuffle": _collective("pshuffle", lambda a: f", perm={list(a['perm'])!r}"),
    "pswapaxes": _collective("pswapaxes", lambda a: f", {a['axis']}"),
    "pbroadcast": _pbroadcast,
    "psum_scatter": _collective("psum_scatter", lambda a: f", scatter_dimension={a['dim']}, tiled={a['tiled']}"),
    "ppermute": _collective("ppermute", lambda a: f", perm={[tuple(p) for p in a['perm']]!r}"),
    "all_to_all": _collective("all_to_all", lambda a: f", {a['split']}, {a['concat']}, tiled={a['tiled']}"),
    "ragged_all_to_all": _ragged_all_to_all,
}
