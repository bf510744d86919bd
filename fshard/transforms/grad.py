"""``value_and_grad`` / ``grad`` with JAX's signatures, over pytrees of tensors or DTensors.

Built on ``torch.autograd.grad`` (not ``torch.func.grad``): it composes with the
collectives' autograd functions and with DTensor, and avoids ``torch.func.grad``'s
fixed cost per call (``bench/README.md``, "Host costs behind the code"). The fshard
collectives also work under ``torch.func`` (their autograd functions use
``setup_context``), for users who want ``vmap(grad(...))``.

Higher-order gradients: a call made while another ``fs.grad`` / ``fs.value_and_grad``
runs its function (a contextvar counts them) keeps its arguments attached to the
enclosing graph and differentiates with ``create_graph=True``, so grad of grad is JAX's.
A call that nothing encloses pays what a first-order step pays: detached leaves, no
``create_graph`` (see :func:`value_and_grad` for the rule and ``create_graph=True``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fshard import meta as meta_util
from fshard import tree as tree_util

__all__ = ["grad", "value_and_grad"]

# How many fs.value_and_grad calls are running their function on this thread (or, through
# fs.remat's replay, were when a recomputed region first ran): >0 means an enclosing
# gradient may differentiate what this call returns.
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("fshard_grad_depth", default=0)
# Whether the innermost of those keeps its graph (create_graph): what its function computes
# is then differentiated more than once (fs.remat's selective checkpointing allows one).
_KEEPS_GRAPH: contextvars.ContextVar[bool] = contextvars.ContextVar("fshard_grad_keeps_graph", default=False)

_functorch = torch._C._functorch


def value_and_grad(
    f: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, *, create_graph: bool = False
) -> Callable[..., Any]:
    """Returns ``g(*args) -> (value, grads)`` (or ``((value, aux), grads)`` with ``has_aux``).

    Args:
      f: returns a scalar tensor (a plain tensor or a one-element DTensor), or
        ``(scalar, aux)`` when ``has_aux``.
      argnums: which positional argument(s) to differentiate; each may be a pytree of
        floating tensors (other leaves get ``None``).
      has_aux: ``f`` returns ``(value, aux)``; aux is returned, not differentiated.
      create_graph: make the results differentiable by torch's own autograd
        (``loss.backward()``) even where no enclosing ``fs.grad`` asks for it, as
        ``torch.autograd.grad(..., create_graph=True)`` does (not in JAX's signature).

    Returns:
      ``grads`` has the structure of ``args[argnums]`` (a tuple of them when
      ``argnums`` is a sequence). Leaves that do not influence the value get zeros,
      as in JAX.

    Higher-order gradients. The gradients (and the value) are differentiable functions
    of the arguments, and of any tensor ``f`` closes over, when either

    - this call runs inside the function of another ``fs.grad`` / ``fs.value_and_grad``
      (any depth, ``shard_map`` or ``fs.remat`` in between): grad of grad, HVPs and MAML
      give JAX's values; or
    - ``create_graph=True``;

    and torch's grad mode is on. Then each differentiated argument that requires grad
    enters ``f`` as an alias attached to its graph, and ``torch.autograd.grad`` runs
    with ``create_graph=True``. Otherwise (a training step, which nothing encloses)
    the leaves are detached copies and the graph is not kept: no extra time or memory,
    and the value and gradients are detached, whatever ``requires_grad`` the arguments
    have (``fs.nn.functionalize``'s and ``fs.shard``'s parameters do require grad).
    So a gradient penalty that torch's ``backward`` differentiates needs
    ``fs.grad(D, create_graph=True)``, as with ``torch.autograd.grad``; written as
    ``fs.grad(lambda p: loss(p) + penalty(fs.grad(D)(x)))`` it needs nothing.
    Under ``torch.func`` transforms (``vmap``, ``jvp``, ``vjp``, ``jacrev``,
    ``hessian``) the call is ``torch.func.grad_and_value``, which nests by itself.
    The gradients are computed under torch's ``no_grad`` too (as ``jax.grad``); they
    are then constants.

    Inside a shard_map body (JAX's usual ``shard_map(grad(f))``), leaves keep their
    per-device metadata (:mod:`fshard.meta`) and each gradient has its primal's varying
    axes and layout; ``torch.autograd.grad`` is called as is, so the collectives'
    transposes alone decide the reductions (the same values as ``grad(shard_map(f))``).

    Raises:
      TypeError: the value is not a scalar tensor; ``argnums`` names a missing
        argument; a differentiated leaf is an integer or bool tensor (its path named).
    """
    multi = not isinstance(argnums, int)
    nums = tuple(argnums) if multi else (argnums,)
    name = getattr(f, "__name__", "f")

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any):
        if _under_functorch(args):
            # torch.func transforms (vmap(fs.grad(f)), jvp of fs.grad: forward-over-reverse)
            # cannot take autograd leaves: torch.func's own grad computes the same values and
            # nests with the enclosing transforms.
            (g_out, out) = torch.func.grad_and_value(f, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
            return out, g_out
        attach = (create_graph or _DEPTH.get() > 0) and torch.is_grad_enabled()
        if torch.is_grad_enabled():
            return _value_and_grad(f, name, nums, multi, has_aux, attach, args, kwargs)
        with torch.enable_grad():  # a gradient, as jax.grad's, whatever torch's grad mode
            return _value_and_grad(f, name, nums, multi, has_aux, False, args, kwargs)

    return wrapped


def _under_functorch(args: tuple) -> bool:
    """Whether a torch.func transform is running, or an argument is one of its wrappers."""
    if _functorch.peek_interpreter_stack() is not None:
        return True
    return any(
        isinstance(x, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(x) for x in tree_util.leaves(args)
    )


def _value_and_grad(
    f: Callable[..., Any],
    name: str,
    nums: tuple[int, ...],
    multi: bool,
    has_aux: bool,
    attach: bool,
    args: tuple,
    kwargs: dict,
) -> tuple[Any, Any]:
    """One call of ``value_and_grad(f)``; ``attach``: keep the graph (higher order)."""
    args = list(args)
    # Flatten each differentiated argument once and keep its fresh leaves: the grads
    # are taken w.r.t. exactly these (a second flatten after the call would cost host
    # time per leaf and step).
    fresh: dict[int, tuple[list[Any], Any]] = {}
    for i in nums:
        if not -len(args) <= i < len(args):
            raise TypeError(
                f"value_and_grad({name}): argnums={nums if multi else nums[0]} asks for argument {i}, "
                f"but only {len(args)} positional argument(s) were given."
            )
        i = i % len(args)
        if i not in fresh:  # an index listed twice gets the same leaves (and grads) twice
            leaves, d = tree_util.tree_flatten(args[i])
            leaves = [_fresh_leaf(x, name, i, args[i], k, attach) for k, x in enumerate(leaves)]
            args[i] = tree_util.tree_unflatten(d, leaves)
            fresh[i] = (leaves, d)
    flat, defs = [fresh[i % len(args)][0] for i in nums], [fresh[i % len(args)][1] for i in nums]
    token, keeps = _DEPTH.set(_DEPTH.get() + 1), _KEEPS_GRAPH.set(attach)
    try:
        out = f(*args, **kwargs)
    finally:
        _KEEPS_GRAPH.reset(keeps)
        _DEPTH.reset(token)
    value, aux = out if has_aux else (out, None)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(
            f"value_and_grad({name}): the function must return a scalar tensor"
            f"{' as the first element of (value, aux)' if has_aux else ''}; got "
            f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}."
        )
    wrt = [x for leaves in flat for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = (
        torch.autograd.grad(value, wrt, allow_unused=True, create_graph=attach)
        if wrt and value.requires_grad
        else [None] * len(wrt)
    )
    g_out = _grad_trees(flat, defs, grads)
    if not attach:
        value = meta_util.copy_meta(value, value.detach())
    return ((value, aux) if has_aux else value), (tuple(g_out) if multi else g_out[0])


def _grad_trees(flat: list[list[Any]], defs: list[Any], grads: Sequence[torch.Tensor | None]) -> list[Any]:
    """The gradient trees, one per differentiated argument; ``grads`` by requiring leaf."""
    it = iter(grads)
    results = []
    for leaves, d in zip(flat, defs):
        g_leaves = []
        for x in leaves:
            if isinstance(x, torch.Tensor) and x.requires_grad:
                g = next(it)
                # A cotangent has its primal's type (varying axes, layout), as in JAX.
                g_leaves.append(meta_util.copy_meta(x, torch.zeros_like(x) if g is None else g))
            else:
                g_leaves.append(None)
        results.append(tree_util.tree_unflatten(d, g_leaves))
    return results


def grad(
    f: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False, *, create_graph: bool = False
) -> Callable[..., Any]:
    """Like :func:`value_and_grad` but returns only the gradients (and aux with ``has_aux``)."""
    vg = value_and_grad(f, argnums, has_aux, create_graph=create_graph)

    @functools.wraps(f)
    def wrapped(*args: Any, **kwargs: Any):
        (value_aux, g) = vg(*args, **kwargs)
        return (g, value_aux[1]) if has_aux else g

    return wrapped


def depth() -> tuple[int, bool]:
    """How many ``fs.value_and_grad`` calls enclose this point, and whether the innermost
    keeps its graph (``fs.remat`` replays both)."""
    return _DEPTH.get(), _KEEPS_GRAPH.get()


def set_depth(state: tuple[int, bool]) -> tuple[contextvars.Token, contextvars.Token]:
    """Sets :func:`depth` (``fs.remat``'s recomputation, which runs in backward); returns the
    tokens that :func:`reset_depth` takes."""
    return _DEPTH.set(state[0]), _KEEPS_GRAPH.set(state[1])


def reset_depth(tokens: tuple[contextvars.Token, contextvars.Token]) -> None:
    """Undoes a :func:`set_depth`."""
    _KEEPS_GRAPH.reset(tokens[1])
    _DEPTH.reset(tokens[0])


def _fresh_leaf(x: Any, name: str, argnum: int, tree: Any, k: int, attach: bool) -> Any:
    """The leaf that ``f`` gets for ``x`` (leaf ``k`` of argument ``argnum``, ``tree``, named
    only in an error), with ``x``'s value and metadata (see :mod:`fshard.meta`).

    ``attach`` and ``x`` requires grad: an alias in ``x``'s graph, so that an enclosing
    gradient flows through this one. Otherwise a new autograd leaf (detached).
    """
    if not isinstance(x, torch.Tensor):
        return x  # static leaves (None, numbers, strings) get a None gradient
    if not (x.is_floating_point() or x.is_complex()):
        p = tree_util.zip_with_path(tree)[0][k]
        path = f"args[{argnum}]" + ("" if p == "<root>" else f".{p}")
        raise TypeError(
            f"value_and_grad({name}): {path} has dtype {x.dtype} and shape {tuple(x.shape)}; gradients "
            f"need floating or complex leaves (as jax.grad). Pass integer data through an argument "
            f"not in argnums."
        )
    if attach and x.requires_grad:
        return meta_util.copy_meta(x, x.view_as(x))
    spec = getattr(x, "_spec", None)
    if isinstance(x, DTensor) and spec is not None:
        # DTensor.detach() runs DTensor's dispatch (sharding propagation) for a metadata
        # change; the new leaf shares x's spec as fs.optim's wrap_like does (much cheaper).
        leaf = DTensor(x._local_tensor.detach(), spec, requires_grad=True)
    else:
        leaf = x.detach().requires_grad_(True)
    return meta_util.copy_meta(x, leaf)
