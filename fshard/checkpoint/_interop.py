"""Plain ``state_dict`` interop: to and from ``torch.save`` files named like the nn.Module.

A parameter tree from :func:`fshard.nn.functionalize` or a model's ``*_init`` has the
key paths of the module's ``state_dict()`` (``layers.0.attention.wq.weight``), so the
checkpoint keys under ``params.`` are the module's names with a prefix. DCP's own
converter (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``) also reads
these checkpoints; it keeps the full keys (``params.layers.0...``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch.distributed.tensor import DTensor

from fshard import tree as tree_util
from fshard.checkpoint._common import CheckpointError, flatten, short_list
from fshard.checkpoint._load import load
from fshard.mesh.sharding import _mesh_of, gather, shard, spec_of

__all__ = ["export_state_dict", "import_state_dict", "to_torch_save"]


def export_state_dict(tree: Any) -> dict[str, Any]:
    """A flat ``{name: full tensor}`` dict of ``tree``, as ``module.state_dict()`` names it.

    Names are the pytree paths (the names :func:`fshard.nn.to_state_dict` gives a tree
    of dicts and lists); DTensors are gathered into full plain tensors, other leaves are
    kept. ``torch.save`` it, or ``module.load_state_dict`` it.

    Collective when ``tree`` holds DTensors: every rank of their meshes calls it.

    Args:
      tree: e.g. sharded params.

    Returns:
      ``{name: tensor_or_value}`` in flattening order, tensors detached.

    Raises:
      ValueError: two leaves have the same name.
    """
    keys, leaves, _ = flatten(tree, what="fs.checkpoint.export_state_dict", path="<memory>")
    full = gather(leaves)
    return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in zip(keys, full)}


def import_state_dict(state_dict: Mapping[str, Any], like: Any, *, strict: bool = True) -> Any:
    """Lays out a plain ``{name: full tensor}`` dict like the template pytree ``like``.

    The counterpart of :func:`export_state_dict`: ``state_dict`` may be
    ``module.state_dict()`` or ``torch.load(file)``. Each template leaf picks the
    entry of its path; a DTensor leaf gets that full value cut into its own mesh and
    placements (each rank keeps its block; no communication), a plain tensor leaf a
    copy. Values are cast to the template's dtype, as ``nn.Module.load_state_dict``
    does.

    Args:
      state_dict: names to full tensors (and values).
      like: the template, e.g. ``fs.shard(init(cfg, seed), specs, mesh)``.
      strict: also reject names that the template does not have (default True).

    Returns:
      A pytree like ``like``.

    Raises:
      ValueError: names are missing (or, with ``strict``, unexpected), or a shape
        differs; the message lists the names, with both shapes.
    """
    keys, leaves, treedef = flatten(like, what="fs.checkpoint.import_state_dict", path="<memory>")
    missing = [k for k in keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(keys)] if strict else []
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} names of the template: {short_list(missing)}")
        if unexpected:
            parts.append(
                f"{len(unexpected)} names the template lacks: {short_list(unexpected)} "
                f"(pass strict=False to ignore them)"
            )
        raise ValueError(f"import_state_dict: {'; '.join(parts)}.")
    bad = [
        f"'{k}': state_dict shape {tuple(state_dict[k].shape)}, template shape {tuple(x.shape)}"
        for k, x in zip(keys, leaves)
        if isinstance(x, torch.Tensor)
        and (not isinstance(state_dict[k], torch.Tensor) or tuple(state_dict[k].shape) != tuple(x.shape))
    ]
    if bad:
        raise ValueError("import_state_dict: shapes differ from the template:\n  " + "\n  ".join(bad))
    out = []
    for k, x in zip(keys, leaves):
        value = state_dict[k]
        if isinstance(x, DTensor):
            v = shard(value.detach().to(x.dtype), spec_of(x), _mesh_of(x))
        elif isinstance(x, torch.Tensor):
            v = value.detach().to(device=x.device, dtype=x.dtype, copy=True)
        else:
            v = value
        if isinstance(x, torch.Tensor) and x.requires_grad:
            v.requires_grad_(True)
        out.append(v)
    return tree_util.tree_unflatten(treedef, out)


def to_torch_save(path: str | os.PathLike, file: str | os.PathLike, *, prefix: str | None = "params") -> dict[str, Any]:
    """Converts a checkpoint into a ``torch.save`` file of full tensors, named like the module.

    Reads on this process alone (call it on one rank, or outside any job). Keeps the
    entries under ``prefix`` with the prefix removed, so that ``prefix="params"`` turns
    ``params.layers.0.wq.weight`` into the module's ``layers.0.wq.weight``.

    Args:
      path: the checkpoint directory.
      file: the ``.pt`` file to write.
      prefix: the subtree to keep (``None`` or ``""``: every entry, full keys).

    Returns:
      The state dict that was written.

    Raises:
      CheckpointNotFoundError, CheckpointError: as :func:`fshard.checkpoint.load`.
      CheckpointError: no entry lies under ``prefix``; the message lists the top-level
        names there are.
    """
    flat = load(path)
    if prefix:
        head = prefix + "."
        out = {k[len(head) :]: v for k, v in flat.items() if k.startswith(head)}
        if not out:
            tops = sorted({k.split(".", 1)[0] for k in flat})
            raise CheckpointError(
                f"the checkpoint '{os.path.abspath(os.fspath(path))}' has no entries under "
                f"'{prefix}'; its top-level names are {tops}."
            )
    else:
        out = dict(flat)
    torch.save(out, os.fspath(file))
    return out
