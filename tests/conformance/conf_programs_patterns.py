"""Conformance programs for gradient patterns: DP, FSDP, HSDP, Megatron TP (+SP, x DP),
MoE all_to_all, a ppermute ring, remat with policies, vmap of grad, has_aux, tuple argnums,
values closed over from the caller, and bad input.

Each pattern is a per-device loss ``loss(ops, *args)``; it runs as
``shard_map(value_and_grad(loss))`` ("inside", JAX's usual order) and as
``value_and_grad(shard_map(loss))`` ("outside"), in checked mode. Unchecked mode runs the
styles that are well defined there in both frameworks: explicit ``pvary`` of replicated
values before they meet varying ones, and gradients of an unreduced local loss, reduced
explicitly afterwards. The Megatron-style unchecked programs (explicit pvary plus a
reduced loss inside grad) are designed differences, pinned against their checked twins.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from conf_programs import Program, axis_size, normals, register

D, O, H, B = 4, 2, 8, 2  # features, outputs, hidden (divisible by 4), batch rows per device


def _mse(pred, y):
    return ((pred - y) ** 2).mean()


def _inside(loss: Callable, in_specs: Callable, grad_specs: Callable, argnums: Any = 0,
            has_aux: bool = False, aux_specs: Callable | None = None, pack: Callable = lambda a: a,
            value_psum: Any = None) -> Callable:
    """``shard_map(value_and_grad(loss))`` -> {"loss", "grads"(, "aux")}.

    ``value_psum``: axes to sum an unreduced local loss's value over after grad (the
    gradient is taken of the local loss itself).
    """
    def fn(ops, *arrays):
        def per_device(*a):
            value, grads = ops.value_and_grad(lambda *a: loss(ops, *a), argnums=argnums, has_aux=has_aux)(*a)
            return (ops.psum(value, value_psum) if value_psum is not None else value), grads
        value_spec = (ops.P(), aux_specs(ops)) if has_aux else ops.P()
        sm = ops.shard_map(per_device, in_specs=in_specs(ops), out_specs=(value_spec, grad_specs(ops)))
        value, grads = sm(*pack(arrays))
        if has_aux:
            return {"loss": value[0], "aux": value[1], "grads": grads}
        return {"loss": value, "grads": grads}
    return fn


def _outside(loss: Callable, in_specs: Callable, argnums: Any = 0, has_aux: bool = False,
             aux_specs: Callable | None = None, pack: Callable = lambda a: a) -> Callable:
    """``value_and_grad(shard_map(loss))`` -> {"loss", "grads"(, "aux")}."""
    def fn(ops, *arrays):
        out_specs = (ops.P(), aux_specs(ops)) if has_aux else ops.P()
        sm = ops.shard_map(lambda *a: loss(ops, *a), in_specs=in_specs(ops), out_specs=out_specs)
        value, grads = ops.value_and_grad(sm, argnums=argnums, has_aux=has_aux)(*pack(arrays))
        if has_aux:
            return {"loss": value[0], "aux": value[1], "grads": grads}
        return {"loss": value, "grads": grads}
    return fn


def _reg(name: str, mesh: str, check: bool, fn: Callable, inputs: Callable, *, seed: str | None = None,
         differs: str | None = None, group: str | None = None, tags: tuple = ()) -> Program:
    """Registers ``name``; a ``differs`` program also gets its checked twin (same fn and inputs)."""
    seed = seed or name
    oracle = None
    if differs:
        oracle = register(Program(name.replace("/unchecked", "/checked-twin"), mesh, True, fn, inputs, seed,
                                  group=group, tags=tags)).name
    return register(Program(name, mesh, check, fn, inputs, seed, differs=differs, group=group, oracle=oracle,
                            tags=tags))


# --- data parallel: w replicated, batch sharded --------------------------------------------
def _dp(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    inputs = normals((D, O), (n * B, D), (n * B, O))
    specs = lambda o: (o.P(), o.P(ax), o.P(ax))  # noqa: E731
    g = f"patterns/dp/{mesh}"

    def loss(o, w, x, y):                         # checked: the implicit pvary of w sums its grads
        return o.pmean(_mse(x @ w, y), ax)

    def loss_pvary(o, w, x, y):                   # unchecked, Megatron style: explicit pvary
        return o.pmean(_mse(x @ o.pvary(w, ax), y), ax)

    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, lambda o: o.P()), inputs, group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs), inputs, group=g)
    _reg(f"{g}/unchecked/outside_pvary", mesh, False, _outside(loss_pvary, specs), inputs, group=g)

    def explicit(ops, w, x, y):                   # unchecked: local loss, then pmean of grads
        def per_device(w, x, y):
            return ops.pmean(_mse(x @ w, y), ax), ops.pmean(ops.grad(lambda w: _mse(x @ w, y))(w), ax)
        v, gr = ops.shard_map(per_device, in_specs=specs(ops), out_specs=(ops.P(), ops.P()))(w, x, y)
        return {"loss": v, "grads": gr}
    _reg(f"{g}/unchecked/inside_explicit", mesh, False, explicit, inputs, group=g)
    _reg(f"{g}/unchecked/inside_pvary", mesh, False, _inside(loss_pvary, specs, lambda o: o.P()), inputs,
         differs="unchecked_psum_transpose", group=g)
    # Unchecked without any pvary: the gradient of a replicated input is not summed over the
    # batch axis in fshard (Megatron: place the pvary), while JAX's unchecked transpose sums
    # the cotangents of every P() input over the axes it does not name.
    _reg(f"{g}/unchecked/outside_no_pvary", mesh, False, _outside(loss, specs), inputs,
         seed=f"{g}/checked/outside", differs="unchecked_no_implicit_pvary")

    def local_grads(ops, w, x, y):                # each device's own gradient, stacked (checked)
        def per_device(w, x, y):
            return ops.grad(lambda wv: ops.pmean(_mse(x @ wv, y), ax))(ops.pvary(w, ax))[None]
        return {"local_grads": ops.shard_map(per_device, in_specs=specs(ops), out_specs=ops.P(ax))(w, x, y)}
    register(Program(f"{g}/checked/local_grads", mesh, True, local_grads, inputs, f"{g}/checked/outside", group=g))


# --- FSDP: the weight sharded on dim 0, gathered (tiled) before use ------------------------
def _fsdp_loss(ax):
    def loss(o, w, x, y):
        return o.pmean(_mse(x @ o.all_gather(w, ax, tiled=True).T, y), ax)
    return loss


def _fsdp(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    inputs = normals((2 * n, D), (n * B, D), (n * B, 2 * n))
    specs = lambda o: (o.P(ax), o.P(ax), o.P(ax))  # noqa: E731
    g = f"patterns/fsdp/{mesh}"
    loss = _fsdp_loss(ax)
    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, lambda o: o.P(ax)), inputs, group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs), inputs, group=g)
    _reg(f"{g}/unchecked/outside", mesh, False, _outside(loss, specs), inputs, group=g)

    def local(o, w, x, y):                        # unchecked: the unreduced local loss / n
        return _mse(x @ o.all_gather(w, ax, tiled=True).T, y) / n
    _reg(f"{g}/unchecked/inside_local", mesh, False, _inside(local, specs, lambda o: o.P(ax), value_psum=ax),
         inputs, group=g)
    _reg(f"{g}/unchecked/inside_pmean", mesh, False, _inside(loss, specs, lambda o: o.P(ax)), inputs,
         differs="unchecked_psum_transpose", group=g)

    # tuple argnums (0, 2): the weight and the targets, not the inputs
    _reg(f"{g}/checked/inside_argnums02", mesh, True,
         _inside(loss, specs, lambda o: (o.P(ax), o.P(ax)), argnums=(0, 2)), inputs, group=g)
    _reg(f"{g}/checked/outside_argnums02", mesh, True, _outside(loss, specs, argnums=(0, 2)), inputs, group=g)

    # has_aux: aux holds a reduced statistic and a sharded value
    def loss_aux(o, w, x, y):
        pred = x @ o.all_gather(w, ax, tiled=True).T
        return o.pmean(_mse(pred, y), ax), {"mean_pred": o.pmean(pred.mean(), ax), "pred": pred}
    aux_specs = lambda o: {"mean_pred": o.P(), "pred": o.P(ax)}  # noqa: E731
    _reg(f"{g}/checked/inside_has_aux", mesh, True,
         _inside(loss_aux, specs, lambda o: o.P(ax), has_aux=True, aux_specs=aux_specs), inputs, group=g)
    _reg(f"{g}/checked/outside_has_aux", mesh, True,
         _outside(loss_aux, specs, has_aux=True, aux_specs=aux_specs), inputs, group=g)

    # remat (jax.checkpoint) of the whole per-device loss and of the gathered matmul alone
    for policy in ("nothing_saveable", "dots_saveable", "save_collectives"):
        def loss_remat_block(o, w, x, y, policy=policy):
            block = o.remat(lambda w, x: x @ o.all_gather(w, ax, tiled=True).T, policy=policy)
            return o.pmean(_mse(o.tanh(block(w, x)), y), ax)
        rl = lambda o, *a, policy=policy: o.remat(lambda *a: loss(o, *a), policy=policy)(*a)  # noqa: E731
        _reg(f"{g}/checked/inside_remat_{policy}", mesh, True, _inside(rl, specs, lambda o: o.P(ax)), inputs,
             group=g)
        _reg(f"{g}/checked/outside_remat_{policy}", mesh, True, _outside(rl, specs), inputs, group=g)
        _reg(f"{g}/checked/inside_remat_block_{policy}", mesh, True,
             _inside(loss_remat_block, specs, lambda o: o.P(ax)), inputs, group=g)
        _reg(f"{g}/checked/outside_remat_block_{policy}", mesh, True, _outside(loss_remat_block, specs), inputs,
             group=g)
        rloc = lambda o, w, x, y, policy=policy: o.remat(  # noqa: E731
            lambda w, x, y: _mse(x @ o.all_gather(w, ax, tiled=True).T, y) / n, policy=policy)(w, x, y)
        _reg(f"{g}/unchecked/inside_local_remat_{policy}", mesh, False,
             _inside(rloc, specs, lambda o: o.P(ax), value_psum=ax), inputs, group=g)


# --- HSDP on 2x2: sharded over y ("fsdp"), replicated over x ("dp") --------------------------
def _hsdp() -> None:
    mesh, g = "2x2", "patterns/hsdp/2x2"
    inputs = normals((4, D), (4 * B, D), (4 * B, 4))
    specs = lambda o: (o.P("y"), o.P(("x", "y")), o.P(("x", "y")))  # noqa: E731

    def loss(o, w, x, y):
        return o.pmean(_mse(x @ o.all_gather(w, "y", tiled=True).T, y), ("x", "y"))

    def loss_pvary(o, w, x, y):
        return o.pmean(_mse(x @ o.all_gather(o.pvary(w, "x"), "y", tiled=True).T, y), ("x", "y"))

    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, lambda o: o.P("y")), inputs, group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs), inputs, group=g)
    _reg(f"{g}/unchecked/outside_pvary", mesh, False, _outside(loss_pvary, specs), inputs, group=g)

    def explicit(ops, w, x, y):                   # local grad, psum_scatter over y by the gather's
        def per_device(w, x, y):                  # transpose, then an explicit pmean over x
            local = lambda w: _mse(x @ ops.all_gather(w, "y", tiled=True).T, y) / 2  # noqa: E731
            return (ops.pmean(_mse(x @ ops.all_gather(w, "y", tiled=True).T, y), ("x", "y")),
                    ops.pmean(ops.grad(local)(w), "x"))
        v, gr = ops.shard_map(per_device, in_specs=specs(ops), out_specs=(ops.P(), ops.P("y")))(w, x, y)
        return {"loss": v, "grads": gr}
    _reg(f"{g}/unchecked/inside_explicit", mesh, False, explicit, inputs, group=g)
    for policy in ("nothing_saveable", "save_collectives"):
        rl = lambda o, *a, policy=policy: o.remat(lambda *a: loss(o, *a), policy=policy)(*a)  # noqa: E731
        _reg(f"{g}/checked/inside_remat_{policy}", mesh, True, _inside(rl, specs, lambda o: o.P("y")), inputs,
             group=g)
        _reg(f"{g}/checked/outside_remat_{policy}", mesh, True, _outside(rl, specs), inputs, group=g)


# --- Megatron TP MLP: w1 column-parallel, w2 row-parallel, x replicated ----------------------
def _tp_pack(a):
    return ({"w1": a[0], "w2": a[1]}, a[2], a[3])


def _tp(mesh: str, tp) -> None:
    inputs = normals((D, H), (H, D), (B, D), (B, D))
    pspecs = lambda o: {"w1": o.P(None, tp), "w2": o.P(tp, None)}  # noqa: E731
    specs = lambda o: (pspecs(o), o.P(), o.P())  # noqa: E731
    g = f"patterns/tp/{mesh}:{tp}"

    def mlp(o, p, x, explicit_pvary=False):
        xin = o.pvary(x, tp) if explicit_pvary else x  # Megatron's "f"; checked mode inserts it
        return o.psum(o.relu(xin @ p["w1"]) @ p["w2"], tp)  # Megatron's "g"

    def loss(o, p, x, y):
        return _mse(mlp(o, p, x), y)

    def loss_pvary(o, p, x, y):
        return _mse(mlp(o, p, x, explicit_pvary=True), y)

    gspecs = lambda o: (pspecs(o), o.P())  # noqa: E731
    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, gspecs, argnums=(0, 1), pack=_tp_pack), inputs,
         group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs, argnums=(0, 1), pack=_tp_pack), inputs,
         group=g)
    _reg(f"{g}/unchecked/outside_pvary", mesh, False, _outside(loss_pvary, specs, argnums=(0, 1), pack=_tp_pack),
         inputs, group=g)
    _reg(f"{g}/unchecked/inside_pvary", mesh, False, _inside(loss_pvary, specs, gspecs, argnums=(0, 1), pack=_tp_pack),
         inputs, differs="unchecked_psum_transpose", group=g)
    for policy in ("nothing_saveable", "dots_saveable", "save_collectives"):
        rl = lambda o, *a, policy=policy: o.remat(lambda *a: loss(o, *a), policy=policy)(*a)  # noqa: E731
        _reg(f"{g}/checked/inside_remat_{policy}", mesh, True,
             _inside(rl, specs, gspecs, argnums=(0, 1), pack=_tp_pack), inputs, group=g)
        _reg(f"{g}/checked/outside_remat_{policy}", mesh, True,
             _outside(rl, specs, argnums=(0, 1), pack=_tp_pack), inputs, group=g)


# --- TP with sequence parallelism: all_gather the sequence in, psum_scatter it out ----------
def _tp_sp(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    S = 2 * n
    inputs = normals((D, H), (H, D), (S, D), (S, D))
    pspecs = lambda o: {"w1": o.P(None, ax), "w2": o.P(ax, None)}  # noqa: E731
    specs = lambda o: (pspecs(o), o.P(ax), o.P(ax))  # noqa: E731
    gspecs = lambda o: (pspecs(o), o.P(ax))  # noqa: E731
    g = f"patterns/tp_sp/{mesh}"

    def local(o, p, x, y):
        xf = o.all_gather(x, ax, tiled=True)
        out = o.psum_scatter(o.relu(xf @ p["w1"]) @ p["w2"], ax, tiled=True)
        return ((out - y) ** 2).sum() / S

    def loss(o, p, x, y):
        return o.psum(local(o, p, x, y), ax)

    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, gspecs, argnums=(0, 1), pack=_tp_pack), inputs,
         group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs, argnums=(0, 1), pack=_tp_pack), inputs, group=g)
    _reg(f"{g}/unchecked/outside", mesh, False, _outside(loss, specs, argnums=(0, 1), pack=_tp_pack), inputs,
         group=g)
    _reg(f"{g}/unchecked/inside_local", mesh, False,
         _inside(local, specs, gspecs, argnums=(0, 1), pack=_tp_pack, value_psum=ax), inputs, group=g)


# --- DP x TP on 2x2: batch over x, tensor parallel over y -----------------------------------
def _dp_tp() -> None:
    mesh, g = "2x2", "patterns/dp_tp/2x2"
    inputs = normals((D, H), (H, D), (2 * B, D), (2 * B, D))
    pspecs = lambda o: {"w1": o.P(None, "y"), "w2": o.P("y", None)}  # noqa: E731
    specs = lambda o: (pspecs(o), o.P("x"), o.P("x"))  # noqa: E731

    def loss(o, p, x, y):
        return o.pmean(_mse(o.psum(o.relu(x @ p["w1"]) @ p["w2"], "y"), y), "x")

    def loss_pvary(o, p, x, y):
        p = {k: o.pvary(v, "x") for k, v in p.items()}
        return o.pmean(_mse(o.psum(o.relu(o.pvary(x, "y") @ p["w1"]) @ p["w2"], "y"), y), "x")

    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, pspecs, pack=_tp_pack), inputs, group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs, pack=_tp_pack), inputs, group=g)
    _reg(f"{g}/unchecked/outside_pvary", mesh, False, _outside(loss_pvary, specs, pack=_tp_pack), inputs, group=g)
    _reg(f"{g}/unchecked/inside_pvary", mesh, False, _inside(loss_pvary, specs, pspecs, pack=_tp_pack), inputs,
         differs="unchecked_psum_transpose", group=g)


# --- MoE-style all_to_all: tokens to experts and back -------------------------------------
def _moe(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    T = n  # tokens per device: one to each expert
    inputs = normals((n, D, D), (n * T, D), (n * T, D))
    specs = lambda o: (o.P(ax), o.P(ax), o.P(ax))  # noqa: E731
    gspecs = lambda o: (o.P(ax), o.P(ax))  # noqa: E731
    g = f"patterns/moe/{mesh}"

    def local(o, e, x, y):
        routed = o.all_to_all(x, ax, 0, 0, tiled=True)          # chunk j -> expert j
        back = o.all_to_all(o.tanh(routed @ e[0]), ax, 0, 0, tiled=True)
        return _mse(back, y) / n

    def loss(o, e, x, y):
        return o.psum(local(o, e, x, y), ax)

    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, gspecs, argnums=(0, 1)), inputs, group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs, argnums=(0, 1)), inputs, group=g)
    _reg(f"{g}/unchecked/outside", mesh, False, _outside(loss, specs, argnums=(0, 1)), inputs, group=g)
    _reg(f"{g}/unchecked/inside_local", mesh, False, _inside(local, specs, gspecs, argnums=(0, 1), value_psum=ax),
         inputs, group=g)


# --- a pipeline-like ring: stage weights sharded, activations passed on by ppermute ----------
def _ring(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    inputs = normals((n, D, D), (n * B, D), (n * B, D))
    specs = lambda o: (o.P(ax), o.P(ax), o.P(ax))  # noqa: E731
    gspecs = lambda o: (o.P(ax), o.P(ax))  # noqa: E731
    g = f"patterns/ring/{mesh}"

    def local(o, w, x, y):
        for _ in range(2):
            x = o.ppermute(o.tanh(x @ w[0]), ax, [(i, (i + 1) % n) for i in range(n)])
        return (x * y).sum()

    def loss(o, w, x, y):
        return o.psum(local(o, w, x, y), ax)

    _reg(f"{g}/checked/inside", mesh, True, _inside(loss, specs, gspecs, argnums=(0, 1)), inputs, group=g)
    _reg(f"{g}/checked/outside", mesh, True, _outside(loss, specs, argnums=(0, 1)), inputs, group=g)
    _reg(f"{g}/unchecked/outside", mesh, False, _outside(loss, specs, argnums=(0, 1)), inputs, group=g)
    _reg(f"{g}/unchecked/inside_local", mesh, False, _inside(local, specs, gspecs, argnums=(0, 1), value_psum=ax),
         inputs, group=g)


# --- values closed over from the caller: invariant, as in JAX -------------------------------
def _closure(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    inputs = normals((D, O), (n * B, D), (n * B, O))
    g = f"patterns/closure/{mesh}"

    def inside(ops, c, x, y):                     # grad w.r.t. a value the body closes over
        def per_device(x, y):
            return ops.value_and_grad(lambda c: ops.pmean(_mse(x @ c, y), ax))(c)
        v, gr = ops.shard_map(per_device, in_specs=(ops.P(ax), ops.P(ax)), out_specs=(ops.P(), ops.P()))(x, y)
        return {"loss": v, "grads": gr}

    def outside(ops, c, x, y):                    # the traced caller value closed over by the body
        def f(c):
            return ops.shard_map(lambda x, y: ops.pmean(_mse(x @ c, y), ax), in_specs=(ops.P(ax), ops.P(ax)),
                                 out_specs=ops.P())(x, y)
        v, gr = ops.value_and_grad(f)(c)
        return {"loss": v, "grads": gr}

    def replicated_out(ops, c, x, y):             # an untouched caller value returned as P()
        return {"y": ops.shard_map(lambda x: c * 2.0, in_specs=(ops.P(ax),), out_specs=ops.P())(x)}

    _reg(f"{g}/checked/inside", mesh, True, inside, inputs, group=g)
    _reg(f"{g}/checked/outside", mesh, True, outside, inputs, group=g)
    _reg(f"{g}/checked/replicated_out", mesh, True, replicated_out, inputs, group=g)


# --- vmap of grad inside shard_map (per-example gradients) ----------------------------------
def _vmap(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    inputs = normals((D, O), (n * B, D), (n * B, O))
    specs = lambda o: (o.P(), o.P(ax), o.P(ax))  # noqa: E731
    g = f"patterns/vmap/{mesh}"

    def per_example(grad_name: str, reduce_inside: bool, explicit_pvary: bool = False):
        def fn(ops, w, x, y):
            gr = getattr(ops, grad_name)

            def one(w, xi, yi):                   # one example; with reduce_inside, a collective inside
                loss = _mse(xi @ (ops.pvary(w, ax) if explicit_pvary else w), yi)
                return ops.psum(loss, ax) if reduce_inside else loss

            def per_device(w, x, y):
                pe = ops.vmap(gr(one), in_axes=(None, 0, 0))(w, x, y)   # (B, D, O) per-example grads
                return pe, ops.psum(ops.sum(pe, 0), ax)
            pe, total = ops.shard_map(per_device, in_specs=specs(ops), out_specs=(ops.P(ax), ops.P()))(w, x, y)
            return {"per_example": pe, "total": total}
        return fn

    for check in (True, False):
        mode = "checked" if check else "unchecked"
        _reg(f"{g}/{mode}/func_grad", mesh, check, per_example("func_grad", False), inputs, tags=("vmap",))
        _reg(f"{g}/{mode}/grad", mesh, check, per_example("grad", False), inputs, tags=("vmap",))
    _reg(f"{g}/checked/func_grad_collective", mesh, True, per_example("func_grad", True), inputs, tags=("vmap",))
    # Unchecked, Megatron style (explicit pvary, a psum inside the differentiated function):
    # fshard gives checked mode's per-example gradients, JAX's unchecked psum transpose n times them.
    _reg(f"{g}/unchecked/func_grad_collective_pvary", mesh, False, per_example("func_grad", True, True), inputs,
         tags=("vmap",), differs="unchecked_psum_transpose")

    def collectives(ops, x):                      # vmap over collectives, values only
        def per_device(x):
            xb = x.reshape(B, 1, D)
            return (ops.vmap(lambda r: ops.psum(r, ax))(xb),
                    ops.vmap(lambda r: ops.all_gather(r, ax, tiled=True))(xb),
                    ops.vmap(lambda r: ops.all_gather(r, ax, axis=1))(xb))
        out = ops.shard_map(per_device, in_specs=(ops.P(ax),), out_specs=(ops.P(), ops.P(ax), ops.P(ax)))(x)
        return {"psum": out[0], "all_gather_tiled": out[1], "all_gather_axis1": out[2]}
    _reg(f"{g}/checked/collectives", mesh, True, collectives, normals((n * B, D)), tags=("vmap",))


# --- replication promises: JAX proves them statically, fshard checks them at run time -------
def _replication(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    g = f"diff/replication/{mesh}"

    def gathered(ops, x, w):                      # all_gather's result is typed varying in both,
        sm = ops.shard_map(lambda x: ops.all_gather(x, ax, tiled=True),  # but its value is replicated
                           in_specs=(ops.P(ax),), out_specs=ops.P())
        v, gr = ops.value_and_grad(lambda x: (sm(x) * w).sum())(x)
        return {"y": sm(x), "loss": v, "grads": gr}

    def varying(ops, x, w):                       # a value that really differs across the axis
        return {"y": ops.shard_map(lambda x: x * 2.0, in_specs=(ops.P(ax),), out_specs=ops.P())(x)}

    for check in (True, False):
        mode = "checked" if check else "unchecked"
        register(Program(f"{g}/all_gather_to_P/{mode}", mesh, check, gathered,
                         normals((n * 3, 2), (n * 3, 2)), f"{g}/all_gather_to_P",
                         differs="static_replication_check" if check else "unchecked_replicated_output"))
    # (unchecked, both frameworks return some device's value without a word: no program)
    register(Program(f"{g}/varying_to_P/checked", mesh, True, varying, normals((n * 3, 2), (3, 2)),
                     f"{g}/varying_to_P", differs="static_replication_check"))


# --- bad input: both frameworks must refuse (the messages are checked in test_conformance_bad_input)
def _bad(mesh: str, ax) -> None:
    n = axis_size(mesh, ax)
    g = "bad"

    def int_leaf(ops, w, x):
        def per_device(w, x):
            step = ops.int32(x[:1, 0] * 0)
            return ops.grad(lambda p: ops.psum((x @ p["w"]).sum(), ax) + p["step"].sum())({"w": w, "step": step})["w"]
        return ops.shard_map(per_device, in_specs=(ops.P(), ops.P(ax)), out_specs=ops.P())(w, x)

    def argnums_out_of_range(ops, w, x):
        def per_device(w, x):
            return ops.grad(lambda w, x: ops.psum((x @ w).sum(), ax), argnums=2)(w, x)
        return ops.shard_map(per_device, in_specs=(ops.P(), ops.P(ax)), out_specs=ops.P())(w, x)

    def nonscalar_loss(ops, w, x):
        def per_device(w, x):
            return ops.grad(lambda w: ops.psum(x @ w, ax))(w)
        return ops.shard_map(per_device, in_specs=(ops.P(), ops.P(ax)), out_specs=ops.P())(w, x)

    inputs = normals((D, O), (n * B, D))
    for name, fn in (("int_leaf", int_leaf), ("argnums_out_of_range", argnums_out_of_range),
                     ("nonscalar_loss", nonscalar_loss)):
        register(Program(f"{g}/{name}/{mesh}/checked/inside", mesh, True, fn, inputs, f"{g}/{name}"))


for _mesh, _ax in (("x4", "x"), ("2x2", ("x", "y"))):
    _dp(_mesh, _ax)
    _fsdp(_mesh, _ax)
    _moe(_mesh, _ax)
    _ring(_mesh, _ax)
_tp("x4", "x")
_tp("2x2", "y")
_tp_sp("x4", "x")
_hsdp()
_dp_tp()
_closure("x4", "x")
_vmap("x4", "x")
_bad("x4", "x")
_replication("x4", "x")
