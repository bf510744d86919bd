"""nn.Module interop: run a module as a pure function of a parameter pytree.

``functionalize`` splits a module into a function and its state::

    apply, params, buffers = fshard.nn.functionalize(model)
    logits = apply(params, tokens)                    # buffers default to the module's
    grads = torch.func.grad(lambda p: loss(apply(p, tokens), targets))(params)

    # A forward that updates buffers (BatchNorm in train mode) hands the update back:
    out, buffers = apply(params, x, buffers=buffers, return_buffers=True)

``params`` (and ``buffers``) mirror the module tree: submodules are dicts, and the
children of ``nn.ModuleList`` / ``nn.Sequential`` are lists, so the leaf under
``params["layers"][0]["attention"]["wq"]["weight"]`` has the key path
``layers.0.attention.wq.weight``, which is its name in ``module.state_dict()``.
:func:`to_state_dict` and :func:`from_state_dict` convert between the two forms, and
:func:`load_state` copies a tree back into a module.

Parameters registered under several names (tied weights) appear once, under the name
``module.named_parameters()`` gives first; ``apply`` binds that one tensor to every
name, so the tie holds and its gradient is the sum over all uses.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Protocol, overload

import torch
from torch import nn
from torch.func import functional_call

__all__ = [
    "ApplyFn",
    "FunctionalModule",
    "from_state_dict",
    "functionalize",
    "load_state",
    "to_state_dict",
]

Tree = Any

_MSG_BUFFERS_UPDATED = (
    "{module}: the forward updated buffers of {owners} (seen: {names}), but apply() was called without "
    "return_buffers=True, so the update would be lost. BatchNorm in train mode does this "
    "(running statistics). Either take the new buffers:\n"
    "    out, buffers = apply(params, x, buffers=buffers, return_buffers=True)\n"
    "or run the module in eval mode (module.eval()) when the statistics must not change."
)


# ---------------------------------------------------------------------------
# Nested trees <-> flat state-dict names
# ---------------------------------------------------------------------------


def to_state_dict(tree: Tree) -> dict[str, Any]:
    """Flattens a nested tree into ``{"layers.0.attention.wq.weight": leaf, ...}``.

    Dict keys and list indices are joined with dots, in insertion order (the module's
    registration order for trees from :func:`functionalize`). Empty dicts (the holes
    left by parameterless list children such as a ReLU in a ``Sequential``) and
    ``None`` give no names.

    Args:
      tree: nested dicts, lists and tuples with tensor leaves.

    Returns:
      A flat dict from dotted name to leaf.

    Raises:
      TypeError: a dict key is not a string.
      ValueError: a dict key is empty or contains ``"."`` (the name would be ambiguous).
    """
    flat: dict[str, Any] = {}
    _flatten_into(tree, "", flat)
    return flat


def _flatten_into(node: Tree, prefix: str, flat: dict[str, Any]) -> None:
    if node is None:
        return
    if isinstance(node, Mapping):
        for key, child in node.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"to_state_dict: key {key!r} under '{prefix or '<root>'}' is a "
                    f"{type(key).__name__}; state-dict names are built from string keys."
                )
            if not key or "." in key:
                raise ValueError(
                    f"to_state_dict: key {key!r} under '{prefix or '<root>'}' is empty or "
                    f"contains '.', which would make the dotted name ambiguous."
                )
            _flatten_into(child, f"{prefix}.{key}" if prefix else key, flat)
    elif isinstance(node, (list, tuple)):
        for i, child in enumerate(node):
            _flatten_into(child, f"{prefix}.{i}" if prefix else str(i), flat)
    else:
        flat[prefix] = node


def from_state_dict(flat: Mapping[str, Any]) -> Tree:
    """Nests ``{"layers.0.wq": t, ...}`` into ``{"layers": [{"wq": t}, ...]}``.

    A level whose keys are all decimal integers becomes a list (``ModuleList`` and
    ``Sequential`` children); an index with no entry becomes ``{}``. Every other
    level is a dict in the order the names first appear. So
    ``from_state_dict(to_state_dict(params))`` rebuilds any tree from
    :func:`functionalize`.

    Args:
      flat: dotted names to leaves, e.g. ``module.state_dict()``.

    Returns:
      The nested tree.

    Raises:
      TypeError: a name is not a string.
      ValueError: a name has an empty part, or one name is both a leaf and the prefix of
        another (``"a"`` and ``"a.b"``); the message names both.
    """
    root: dict[str, Any] = {}
    for name, leaf in flat.items():
        if not isinstance(name, str):
            raise TypeError(f"from_state_dict: name {name!r} is a {type(name).__name__}, not a str.")
        parts = name.split(".")
        if not all(parts):
            raise ValueError(f"from_state_dict: name {name!r} has an empty part.")
        node = root
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(
                    f"from_state_dict: '{'.'.join(parts[: depth + 1])}' is a leaf, but {name!r} puts entries below it."
                )
            node = child
        if parts[-1] in node:
            raise ValueError(f"from_state_dict: {name!r} is a leaf, but other names put entries below it.")
        node[parts[-1]] = leaf
    return _listify(root)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    children = {k: _listify(v) for k, v in node.items()}
    if children and all(k.isdecimal() for k in children):
        # Holes are empty dicts, not None: torch.func's pytrees take None for a leaf.
        out: list[Any] = [{} for _ in range(max(int(k) for k in children) + 1)]
        for k, v in children.items():
            out[int(k)] = v
        return out
    return children


# ---------------------------------------------------------------------------
# functionalize
# ---------------------------------------------------------------------------


class ApplyFn(Protocol):
    """The type of ``apply`` from :func:`functionalize`."""

    @overload
    def __call__(
        self,
        params: Tree,
        *args: Any,
        buffers: Tree | None = None,
        return_buffers: Literal[False] = False,
        **kwargs: Any,
    ) -> Any: ...

    @overload
    def __call__(
        self, params: Tree, *args: Any, buffers: Tree | None = None, return_buffers: Literal[True], **kwargs: Any
    ) -> tuple[Any, Tree]: ...


class FunctionalModule:
    """``apply(params, *args, buffers=None, return_buffers=False, **kwargs)``.

    Runs ``module(*args, **kwargs)`` through ``torch.func.functional_call`` with the
    module's parameters and buffers replaced by the given trees. Works under
    ``torch.func.grad``/``vmap`` and autograd; the module's own tensors are neither
    read nor written (only its structure and its train/eval flags are, at call time).

    Buffers: each call copies ``buffers`` and lets the forward update the copies, so
    the caller's tensors never change (the copy is the price of that: buffers are
    usually small running statistics). With ``return_buffers=True`` the result is
    ``(out, new_buffers)``, a tree like ``buffers`` holding the copies after the
    forward. With the default ``return_buffers=False`` the result is ``out``, and a
    forward seen to update a buffer raises ``ValueError`` instead of dropping the update
    (flax's rule for ``mutable``). "Seen" means re-assigned or bumped in version by an
    in-place op; BatchNorm in train mode is caught through ``num_batches_tracked``.

    Args:
      params: the tree from :func:`functionalize`, with any tensor values (DTensors,
        ``torch.func`` wrappers, other dtypes).
      *args: positional arguments of ``module.forward``.
      buffers: the buffer tree (default: the one :func:`functionalize` returned).
      return_buffers: also return the buffers after the forward.
      **kwargs: keyword arguments of ``module.forward`` (except ``buffers`` and
        ``return_buffers``, which ``apply`` takes for itself).

    Returns:
      The module's output, or ``(output, new_buffers)`` with ``return_buffers=True``.

    Raises:
      ValueError: ``params`` or ``buffers`` lack names the module has or have names it
        lacks (all listed); or buffers changed without ``return_buffers=True``.
      TypeError: ``params`` or ``buffers`` is not a nested dict/list tree.
    """

    def __init__(self, module: nn.Module, buffers: Tree) -> None:
        self.module = module
        self._default_buffers = buffers
        self._param_names = frozenset(n for n, _ in module.named_parameters())
        self._buffer_names = frozenset(n for n, _ in module.named_buffers())
        # functional_call binds names, not objects: give every alias of a tied tensor
        # the canonical entry's value so the tie survives the swap.
        self._aliases = _tied_aliases(module)

    def __repr__(self) -> str:
        return f"FunctionalModule({type(self.module).__name__}, {len(self._param_names)} params)"

    def __call__(
        self, params: Tree, *args: Any, buffers: Tree | None = None, return_buffers: bool = False, **kwargs: Any
    ) -> Any:
        flat_params = self._flat("params", params, self._param_names)
        given = self._default_buffers if buffers is None else buffers
        flat_buffers = self._flat("buffers", given, self._buffer_names)
        copies = {name: b.clone() for name, b in flat_buffers.items()}
        # Change detection for the error below: re-assignment, or an in-place op that
        # bumps the version counter (BatchNorm's num_batches_tracked.add_ does).
        versions = {name: _version(b) for name, b in copies.items()}
        bound = {**flat_params, **copies}
        for canonical, aliases in self._aliases.items():
            for alias in aliases:
                bound[alias] = bound[canonical]
        # functional_call writes tensors the forward re-assigned back into `bound`.
        out = functional_call(self.module, bound, args, kwargs, tie_weights=False)
        changed = [name for name, c in copies.items() if bound[name] is not c or _version(c) != versions[name]]
        if not return_buffers:
            if changed:
                owners = sorted({n.rpartition(".")[0] or "<root>" for n in changed})
                raise ValueError(
                    _MSG_BUFFERS_UPDATED.format(
                        module=type(self.module).__name__, owners=owners, names=", ".join(changed)
                    )
                )
            return out
        # Every copy is returned, changed or not: some kernels (batch_norm's running
        # statistics) write without bumping the version counter, so "unchanged" is
        # not something we can know.
        return out, from_state_dict({name: bound[name] for name in copies})

    def _flat(self, what: str, tree: Tree, expected: frozenset[str]) -> dict[str, torch.Tensor]:
        if tree is not None and not isinstance(tree, (Mapping, list, tuple)):
            raise TypeError(
                f"{type(self.module).__name__}: {what} must be the nested tree from "
                f"functionalize, got {type(tree).__name__}."
            )
        flat = to_state_dict(tree)
        if flat.keys() != expected:
            raise ValueError(_mismatch_message(f"{type(self.module).__name__}: {what}", flat.keys(), expected))
        return flat


def _version(t: torch.Tensor) -> int:
    # In-place updates bump the version counter; tensors that have none (some
    # torch.func wrappers) are compared by identity only.
    try:
        return t._version
    except (RuntimeError, NotImplementedError):
        return -1


def _tied_aliases(module: nn.Module) -> dict[str, list[str]]:
    aliases: dict[str, list[str]] = {}
    for named in (module.named_parameters, module.named_buffers):
        canonical = {id(t): n for n, t in named()}
        for name, t in named(remove_duplicate=False):
            first = canonical[id(t)]
            if name != first:
                aliases.setdefault(first, []).append(name)
    return aliases


def _mismatch_message(headline: str, given: Any, expected: frozenset[str]) -> str:
    missing = sorted(expected - set(given))
    unexpected = sorted(set(given) - expected)
    lines = [f"{headline} do not match the module's names."]
    if missing:
        lines.append(f"  missing:    {', '.join(missing)}")
    if unexpected:
        lines.append(f"  unexpected: {', '.join(unexpected)}")
    lines.append("Pass the tree functionalize returned (or one with the same names).")
    return "\n".join(lines)


def functionalize(module: nn.Module) -> tuple[ApplyFn, Tree, Tree]:
    """Splits ``module`` into ``(apply, params, buffers)``.

    Args:
      module: any ``nn.Module``. It stays the skeleton that ``apply`` runs; only its
        structure and train/eval flags matter from now on.

    Returns:
      ``apply``: a :class:`FunctionalModule`, called as
        ``apply(params, *args, buffers=None, return_buffers=False, **kwargs)``.
      ``params``: nested tree of the module's parameters, each tied tensor once.
        Leaves are new tensors sharing storage with the module's parameters
        (``detach()``) with the same ``requires_grad``, so plain autograd works on them
        as on the module, and an in-place update of a leaf also changes the module.
      ``buffers``: nested tree of all buffers (non-persistent ones included), detached
        and sharing storage; ``{}`` when there are none.

    Raises:
      TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize expects an nn.Module, got {type(module).__name__}.")
    params = from_state_dict({n: p.detach().requires_grad_(p.requires_grad) for n, p in module.named_parameters()})
    buffers = from_state_dict({n: b.detach() for n, b in module.named_buffers()})
    return FunctionalModule(module, buffers), params, buffers


def load_state(module: nn.Module, params: Tree, buffers: Tree | None = None) -> nn.Module:
    """Copies ``params`` (and ``buffers``) into ``module``'s own tensors, in place.

    The trees use :func:`functionalize`'s layout: each tied parameter once, under its
    first name; copying it updates every name it is tied to.

    Args:
      module: the module to update.
      params: nested parameter tree with exactly the module's parameter names.
      buffers: nested buffer tree with exactly its buffer names (default: leave the
        buffers as they are).

    Returns:
      ``module``, for chaining.

    Raises:
      ValueError: missing or unexpected names (all listed), or a shape that differs
        (each listed with its path and both shapes).
    """
    targets: list[tuple[str, Any, dict[str, torch.Tensor]]] = [("params", params, dict(module.named_parameters()))]
    if buffers is not None:
        targets.append(("buffers", buffers, dict(module.named_buffers())))
    for what, tree, own in targets:
        flat = to_state_dict(tree)
        if flat.keys() != own.keys():
            raise ValueError(
                _mismatch_message(f"load_state({type(module).__name__}): {what}", flat.keys(), frozenset(own))
            )
        bad = [
            f"  {n}: given {tuple(v.shape)}, module has {tuple(own[n].shape)}"
            for n, v in flat.items()
            if tuple(v.shape) != tuple(own[n].shape)
        ]
        if bad:
            raise ValueError(f"load_state({type(module).__name__}): {what} shapes differ:\n" + "\n".join(bad))
        with torch.no_grad():
            for name, value in flat.items():
                own[name].copy_(value)
    return module
