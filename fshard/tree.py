"""Pytree utilities: optree underneath, key paths rendered as ``layers.0.wq``.

fshard's trees are optree trees (dicts, lists, tuples, namedtuples, ``None`` as an
empty node). Tensors, DTensors, Python scalars and :class:`fshard.P` specs are leaves.

The one rule that matters for specs is JAX's *prefix* rule: a spec tree may stop
early, and a spec leaf then applies to every leaf of the value subtree below it.
:func:`broadcast_prefix` implements it and, on a mismatch, names the first path
where the two structures disagree and shows both.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import optree

__all__ = [
    "KeyPath",
    "broadcast_prefix",
    "keystr",
    "leaves",
    "leaves_with_path",
    "structure",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map",
    "tree_map_with_path",
    "tree_unflatten",
]

KeyPath = tuple[Any, ...]
Tree = Any


def keystr(path: Iterable[Any], prefix: str = "") -> str:
    """Renders a key path as ``layers.0.wq`` (or ``prefix`` alone for the root).

    Args:
      path: the keys from the root down (dict keys, sequence indices, namedtuple
        field names).
      prefix: text placed before the path, e.g. ``"in_specs[0]"``.

    Returns:
      The dotted path; ``prefix`` when ``path`` is empty.
    """
    parts = [str(k) for k in path]
    if not parts:
        return prefix or "<root>"
    body = ".".join(parts)
    return f"{prefix}.{body}" if prefix else body


def tree_flatten(tree: Tree, is_leaf: Callable[[Any], bool] | None = None):
    """Flattens ``tree``; returns ``(leaves, treespec)``."""
    return optree.tree_flatten(tree, is_leaf=is_leaf)


def tree_flatten_with_path(tree: Tree, is_leaf: Callable[[Any], bool] | None = None):
    """Flattens ``tree``; returns ``(paths, leaves, treespec)`` with paths as key tuples."""
    return optree.tree_flatten_with_path(tree, is_leaf=is_leaf)


def tree_unflatten(treespec: Any, leaves: Iterable[Any]) -> Tree:
    """Inverse of :func:`tree_flatten`."""
    return optree.tree_unflatten(treespec, leaves)


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree, is_leaf=None) -> Tree:
    """Maps ``fn`` over the leaves of ``tree`` (and of ``rest``, which share its structure)."""
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf)


def tree_map_with_path(fn: Callable[..., Any], tree: Tree, *rest: Tree, is_leaf=None) -> Tree:
    """Maps ``fn(path_str, leaf, *rest_leaves)`` over ``tree``; paths render as ``layers.0.wq``."""
    paths, leaves_, spec = zip_with_path(tree, is_leaf=is_leaf)
    others = [spec.flatten_up_to(r) for r in rest]
    return optree.tree_unflatten(
        spec, [fn(p, x, *(o[i] for o in others)) for i, (p, x) in enumerate(zip(paths, leaves_))]
    )


def leaves(tree: Tree, is_leaf=None) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    return optree.tree_leaves(tree, is_leaf=is_leaf)


def leaves_with_path(tree: Tree, is_leaf=None) -> list[tuple[str, Any]]:
    """``[(path_str, leaf), ...]`` in flattening order."""
    paths, lvs, _ = zip_with_path(tree, is_leaf=is_leaf)
    return list(zip(paths, lvs))


def structure(tree: Tree, is_leaf=None) -> Any:
    """The treespec of ``tree`` (prints as ``PyTreeSpec({'a': *, ...})``)."""
    return optree.tree_structure(tree, is_leaf=is_leaf)


def _describe(node: Any, is_leaf) -> str:
    spec = optree.tree_structure(node, is_leaf=is_leaf)
    text = str(spec)
    if text.startswith("PyTreeSpec(") and text.endswith(")"):
        text = text[len("PyTreeSpec(") : -1]
    return text if len(text) < 300 else text[:297] + "..."


def broadcast_prefix(
    prefix: Tree,
    full: Tree,
    *,
    is_prefix_leaf: Callable[[Any], bool],
    name: str = "specs",
    full_name: str = "values",
    full_is_leaf: Callable[[Any], bool] | None = None,
) -> list[Any]:
    """Expands a prefix tree against ``full``: one prefix leaf per leaf of ``full``.

    JAX's rule: wherever ``prefix`` has a leaf (as decided by ``is_prefix_leaf``), that
    leaf applies to the whole subtree of ``full`` under it. Elsewhere both trees must
    have the same node type and the same keys.

    Args:
      prefix: the prefix tree (e.g. a pytree of ``P``).
      full: the value tree.
      is_prefix_leaf: decides which prefix nodes are leaves.
      name: how the prefix is called in errors (``"in_specs[0]"``).
      full_name: how the value tree is called in errors.
      full_is_leaf: optional leaf predicate for ``full``.

    Returns:
      A list with one prefix leaf per leaf of ``full``, in ``full``'s flattening order.

    Raises:
      ValueError: the prefix is not a prefix of ``full``; the message names the first
        path where they differ and shows both subtrees.
      TypeError: where a single spec is needed, the prefix holds something else (a
        string, a tuple of axis names instead of ``P(...)``).
    """
    try:  # optree's C walk (every step of every shard_map calls this); errors come from the Python walk
        leaves, spec = optree.tree_flatten(prefix, is_leaf=is_prefix_leaf)
        subtrees = spec.flatten_up_to(full)
    except (ValueError, TypeError):
        pass
    else:
        if all(is_prefix_leaf(x) for x in leaves):
            fast: list[Any] = []
            for leaf, sub in zip(leaves, subtrees):
                fast.extend([leaf] * len(optree.tree_leaves(sub, is_leaf=full_is_leaf)))
            return fast
    out: list[Any] = []
    _broadcast(prefix, full, (), out, is_prefix_leaf, name, full_name, full_is_leaf)
    return out


def _broadcast(pre, val, path, out, is_prefix_leaf, name, full_name, full_is_leaf) -> None:
    if is_prefix_leaf(pre):
        out.extend([pre] * len(optree.tree_leaves(val, is_leaf=full_is_leaf)))
        return
    pre_leaf = optree.tree_is_leaf(pre)
    val_leaf = (full_is_leaf is not None and full_is_leaf(val)) or optree.tree_is_leaf(val)
    mismatch = None
    kind: type[Exception] = ValueError
    if pre_leaf or val_leaf:
        kind = TypeError  # a wrong kind of spec (a str, a tuple) rather than a wrong shape of tree
    if pre_leaf:
        mismatch = f"{name} has a non-spec leaf {pre!r} of type {type(pre).__name__}"
    elif val_leaf:
        mismatch = (
            f"{name} has {pre!r} where {full_name} has a leaf of type "
            f"{type(val).__name__}; a leaf needs a single spec (e.g. P(...))"
        )
    else:
        p1 = optree.tree_flatten_one_level(pre)
        v1 = optree.tree_flatten_one_level(val, is_leaf=full_is_leaf)
        if type(pre) is not type(val) and not (
            isinstance(pre, (list, tuple)) and isinstance(val, (list, tuple)) and _plain_seq(pre) and _plain_seq(val)
        ):
            mismatch = f"node types differ: {name} has {type(pre).__name__}, {full_name} has {type(val).__name__}"
        elif tuple(p1.entries) != tuple(v1.entries):
            mismatch = f"keys differ: {name} has {list(p1.entries)}, {full_name} has {list(v1.entries)}"
        else:
            for key, pc, vc in zip(p1.entries, p1.children, v1.children):
                _broadcast(pc, vc, path + (key,), out, is_prefix_leaf, name, full_name, full_is_leaf)
            return
    raise kind(
        f"{name} is not a pytree prefix of {full_name}: they first differ at "
        f"'{keystr(path)}': {mismatch}.\n"
        f"  {name} at '{keystr(path)}':  {_describe(pre, is_prefix_leaf)}\n"
        f"  {full_name} at '{keystr(path)}':  {_describe(val, full_is_leaf)}\n"
        f"Give {name} the structure of {full_name}, or a single spec for the whole subtree."
    )


def _plain_seq(x: Any) -> bool:
    # A list spec for a tuple of values (or the reverse) is harmless; namedtuples are not.
    return type(x) in (list, tuple)


def zip_with_path(tree: Tree, is_leaf=None) -> tuple[Sequence[str], list[Any], Any]:
    """``(path_strs, leaves, treespec)`` for ``tree``.

    Namedtuple fields render by name (``opt.mu.layers.0.wq``), as checkpoint keys do.
    """
    accessors, lvs, spec = optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf)
    return [keystr(_entry_key(e) for e in a) for a in accessors], lvs, spec


def _entry_key(entry: Any) -> Any:
    field = getattr(entry, "field", None)
    return field if field is not None else entry.entry
