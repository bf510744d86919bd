"""The two interpreters: a program's data becomes JAX source or fshard source.

Both sides are generated from the same op list by one table (``ops_src.OPS``), and what
runs is exactly that source (``exec``), so the standalone repro scripts printed for a
mismatch are the code that ran. ``run(*inputs)`` returns ``{"out": (...)}`` (values only)
or ``{"value": v, "grads": (...)}`` with ``grad`` / ``value_and_grad``.

Gradient wrappings (``prog["grad"]["mode"]``):
  - ``inside``: ``shard_map(value_and_grad(loss))``; the loss is the local sum of the
    outputs, or its ``psum`` over every mesh axis (``loss == "psum"``);
  - ``outside``: ``value_and_grad(global sum of shard_map(body)'s outputs)``;
  - ``nested_*``: the same with ``loss`` replaced by the squared norm of its gradient
    (grad of grad).
"""

from __future__ import annotations

import numpy as np

from .ops_src import OPS, axes_src, val

FW = ("jax", "fshard")


def make_inputs(prog: dict) -> list[np.ndarray]:
    """The global inputs: each from its own seed (dropping one keeps the others' values)."""
    return [np.random.default_rng([prog["seed"], int(name[1:])]).standard_normal(tuple(shape))
            for name, shape, _ in prog["inputs"]]


def spec_src(spec: list) -> str:
    return "P(" + ", ".join(axes_src(e) if e is not None else "None" for e in spec) + ")"


def _body(prog: dict, fw: str) -> list[str]:
    names = [n for n, _, _ in prog["inputs"]]
    lines = [f"def body({', '.join(names)}):"]
    for out, op, args, attrs in prog["ops"]:
        for line in OPS[op](fw, out, [val(a) for a in args], attrs).split("\n"):
            lines.append("    " + line)
    lines.append(f"    return ({''.join(o + ', ' for o, _ in prog['outputs'])})")
    if prog.get("remat"):
        pol = prog["remat"]
        if fw == "jax":
            p = "None" if pol == "default" else f"jax.checkpoint_policies.{pol}"
            lines.append(f"body = jax.checkpoint(body, policy={p})")
        else:
            lines.append("body = fs.remat(body" + ("" if pol == "default" else f", policy={pol!r}") + ")")
    return lines


def _sum(outs: str, n: int) -> str:
    return " + ".join(f"{outs}[{i}].sum()" for i in range(n))


def program_source(prog: dict, fw: str) -> str:
    """``body`` and ``run`` for framework ``fw``; needs ``mesh`` and the framework's
    imports (``preamble``) in its namespace."""
    names = [n for n, _, _ in prog["inputs"]]
    sig = ", ".join(names)
    check = bool(prog["check"])
    smap = ("jax.shard_map({f}, mesh=mesh, in_specs={i}, out_specs={o}, check_vma=" + str(check) + ")"
            if fw == "jax" else "fs.shard_map({f}, mesh=mesh, in_specs={i}, out_specs={o}, check=" + str(check) + ")")
    in_specs = "(" + "".join(spec_src(s) + ", " for _, _, s in prog["inputs"]) + ")"
    out_specs = "(" + "".join(spec_src(s) + ", " for _, s in prog["outputs"]) + ")"
    lines = _body(prog, fw)
    g = prog["grad"]
    n_out = len(prog["outputs"])
    vg = "jax.value_and_grad" if fw == "jax" else "fs.value_and_grad"
    gr = "jax.grad" if fw == "jax" else "fs.grad"
    mode = g["mode"]
    if mode == "none":
        lines += [f"f = {smap.format(f='body', i=in_specs, o=out_specs)}",
                  f"def run({sig}):", f"    return {{'out': glob(f({sig}))}}"]
        return "\n".join(lines) + "\n"
    argnums = "(" + "".join(f"{names.index(w)}, " for w in g["wrt"]) + ")"
    all_axes = axes_src([a for a, _ in prog["mesh"]])
    inside = mode.endswith("inside")
    if inside:
        loss = f"({_sum('outs', n_out)})"
        if g["loss"] == "psum":
            loss = f"{'jax.lax' if fw == 'jax' else 'fs.lax'}.psum({loss}, {all_axes})"
        lines += [f"def loss({sig}):", f"    outs = body({sig})", f"    return {loss}"]
    else:
        lines += [f"f = {smap.format(f='body', i=in_specs, o=out_specs)}",
                  f"def loss({sig}):", f"    outs = glob(f({sig}))", f"    return {_sum('outs', n_out)}"]
    target = "loss"
    if mode.startswith("nested"):
        sq = " + ".join(f"(gs[{i}] * gs[{i}]).sum()" for i in range(len(g["wrt"])))
        lines += [f"def gnorm({sig}):", f"    gs = {gr}(loss, argnums={argnums})({sig})", f"    return {sq}"]
        target = "gnorm"
    call = f"{vg if g['vg'] else gr}({target}, argnums={argnums})({sig})"
    if inside:
        grad_specs = "(" + "".join(spec_src(prog["inputs"][names.index(w)][2]) + ", " for w in g["wrt"]) + ")"
        loss_spec = "P()" if (g["loss"] == "psum" and mode == "inside") else f"P({all_axes})"
        if g["vg"]:
            lines += [f"def inner({sig}):", f"    v, gs = {call}", "    return v.reshape((1,)), gs"]
            o = f"({loss_spec}, {grad_specs})"
        else:
            lines += [f"def inner({sig}):", f"    return {call}"]
            o = grad_specs
        lines += [f"f2 = {smap.format(f='inner', i=in_specs, o=o)}", f"def run({sig}):", f"    r = f2({sig})"]
        lines += (["    return {'value': glob((r[0],))[0], 'grads': glob(r[1])}"] if g["vg"]
                  else ["    return {'grads': glob(r)}"])
    else:
        lines += [f"def run({sig}):"]
        lines += ([f"    v, gs = {call}", "    return {'value': v, 'grads': gs}"] if g["vg"]
                  else [f"    return {{'grads': {call}}}"])
    return "\n".join(lines) + "\n"


PREAMBLE = {
    "jax": ("import jax\nimport jax.numpy as jnp\nfrom jax.sharding import PartitionSpec as P\n"
            "def glob(outs):\n    return tuple(outs)\n"),
    "fshard": ("import torch\nimport torch.nn.functional as F\nimport fshard as fs\nfrom fshard import P\n"
               "from torch.distributed.tensor import DTensor\n"
               "def glob(outs):\n    return tuple(o.full_tensor() if isinstance(o, DTensor) else o for o in outs)\n"),
}


def compile_program(prog: dict, fw: str, mesh) -> object:
    """``run`` for framework ``fw`` on ``mesh`` (exec of the emitted source)."""
    ns: dict = {"mesh": mesh, "__name__": f"fuzz_program_{prog['seed']}"}
    exec(compile(  # noqa: S102 - the emitted program is the interpreter (see the module doc)
        PREAMBLE[fw] + program_source(prog, fw), f"<fuzz seed {prog['seed']} {fw}>", "exec"), ns)
    return ns["run"]
