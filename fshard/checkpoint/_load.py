"""``load``: a DCP checkpoint into the layout of a template pytree, on any mesh.

Everything that can be checked before reading is checked first, on every rank, and
the ranks agree on the outcome, so that a bad checkpoint or template stops every rank
with the same error instead of leaving some waiting in a collective.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from fshard import tree as tree_util
from fshard.checkpoint import _dirs, _simulated
from fshard.checkpoint._checksums import VerifyingReader, read_checksums
from fshard.checkpoint._common import (
    CheckpointError,
    CheckpointException,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    agree,
    agree_on_path,
    describe_failure,
    flatten,
    group,
    is_tensor,
    short_list,
    single_process_quiet,
)
from fshard.checkpoint._save import wait
from fshard.checkpoint._verify import incomplete_keys as _incomplete_keys
from fshard.runtime import simulation

__all__ = ["load", "read_metadata"]


def read_metadata(path: str | os.PathLike, *, needed: Sequence[str] | None = None) -> Metadata:
    """Reads DCP's metadata of the checkpoint at ``path`` (which keys, shapes, dtypes, files).

    Args:
      path: the checkpoint directory.
      needed: keys the caller wants, named in the error when the checkpoint is partial.

    Returns:
      The ``torch.distributed.checkpoint.metadata.Metadata``; ``.state_dict_metadata``
      maps each key to ``TensorStorageMetadata`` (``size``, ``properties.dtype``) or
      ``BytesStorageMetadata`` (a Python value).

    Raises:
      CheckpointNotFoundError: no directory at ``path``.
      CheckpointError: the directory has no metadata (an unfinished save) or it cannot
        be read (corrupt).
    """
    path = os.path.abspath(os.fspath(path))
    src = _dirs.resolve(path)
    return _read_metadata(src, path, needed)


def _needed_text(needed: Sequence[str] | None) -> str:
    if not needed:
        return ""
    return f" None of the {len(needed)} keys asked for can be read: {short_list(list(needed))}."


def _read_metadata(src: str, path: str, needed: Sequence[str] | None) -> Metadata:
    if not os.path.isdir(src):
        unfinished = _dirs.unfinished_saves(path)
        hint = (
            f" An unfinished save to it was found at {short_list(unfinished, 3)}: it was interrupted before completing."
            if unfinished
            else ""
        )
        what = "no checkpoint" if not os.path.lexists(src) else "not a checkpoint directory"
        raise CheckpointNotFoundError(f"{what} at '{path}'.{hint}{_needed_text(needed)}")
    meta_file = os.path.join(src, _dirs.METADATA)
    if not os.path.isfile(meta_file):
        raise CheckpointError(
            f"'{src}' is not a complete checkpoint: it has no {_dirs.METADATA} file, which a save "
            f"writes last (the save was interrupted, or this is not a checkpoint).{_needed_text(needed)}"
        )
    try:
        return dcp.FileSystemReader(src).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"'{src}' is corrupt: its {_dirs.METADATA} cannot be read ({type(e).__name__}: {e}).{_needed_text(needed)}"
        ) from e


def _check(src: str, path: str, md: Metadata, keys: Sequence[str], leaves: Sequence[Any]) -> None:
    stored = md.state_dict_metadata
    missing = [k for k in keys if k not in stored]
    if missing:
        raise CheckpointError(
            f"the checkpoint '{path}' lacks {len(missing)} of the {len(keys)} keys of the template: "
            f"{short_list(missing)}. It holds {len(stored)} keys: {short_list(sorted(stored))}."
        )
    bad, reasons = _incomplete_keys(src, md, keys)
    if bad:
        raise CheckpointError(
            f"the checkpoint '{src}' is incomplete or corrupt: the data of {len(bad)} keys is "
            f"missing: {short_list(bad)}. Found: {'; '.join(reasons[:5])}."
        )
    mismatches: list[str] = []
    dtypes: dict[tuple[Any, Any], list[str]] = {}
    for k, x in zip(keys, leaves):
        meta = stored[k]
        if isinstance(meta, BytesStorageMetadata):
            if is_tensor(x):
                mismatches.append(
                    f"'{k}': the checkpoint holds a Python value, the template a tensor of shape {tuple(x.shape)}"
                )
        elif not is_tensor(x):
            mismatches.append(
                f"'{k}': the checkpoint holds a tensor of shape {tuple(meta.size)}, the "
                f"template a {type(x).__name__} ({x!r:.40})"
            )
        elif tuple(meta.size) != tuple(x.shape):
            mismatches.append(f"'{k}': checkpoint shape {tuple(meta.size)}, template shape {tuple(x.shape)}")
        elif meta.properties.dtype != x.dtype:
            dtypes.setdefault((meta.properties.dtype, x.dtype), []).append(k)
            mismatches.append(
                f"'{k}': checkpoint dtype {meta.properties.dtype}, template dtype {x.dtype} "
                f"(load with the saved dtype, then cast)"
            )
    if dtypes and len(mismatches) == sum(map(len, dtypes.values())):
        raise CheckpointMismatchError(_dtype_message(path, dtypes))
    if mismatches:
        lines = "\n  ".join(mismatches[:20])
        more = f"\n  ... and {len(mismatches) - 20} more" if len(mismatches) > 20 else ""
        raise CheckpointMismatchError(f"the template does not match the checkpoint '{path}':\n  {lines}{more}")


def _dtype_message(path: str, dtypes: dict[tuple[Any, Any], list[str]]) -> str:
    """One line for templates that differ from the checkpoint in dtype only (a resume in another dtype)."""
    parts = "; ".join(
        f"{len(ks)} keys hold {a} where the template has {b} (e.g. {short_list(ks, 2)})"
        for (a, b), ks in dtypes.items()
    )
    return (
        f"the checkpoint '{path}' was saved in another dtype: {parts}. Load with a template in the "
        f"saved dtype (resume with the dtype it was trained in), then cast."
    )


def _empty_like(x: Any) -> Any:
    """A fresh buffer laid out like the template leaf, for DCP to read into."""
    if isinstance(x, DTensor):
        local = torch.empty_like(x.to_local(), requires_grad=False)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=x.stride())
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x, requires_grad=False)
    return x


def load(path: str | os.PathLike, like: Any = None) -> Any:
    """Reads the checkpoint at ``path`` into the structure and layout of ``like``.

    Each leaf of ``like`` names, by its pytree path, the entry to read: a DTensor leaf
    gets the saved values laid out on its own mesh and placements (which may differ
    from those at save time, on another world size: the shards are cut and read as
    needed, exactly), a plain tensor leaf gets the full value, and any other leaf (a
    Python number, a string) is replaced by the saved value. Only the template's
    leaves are read, so ``like`` may be part of what was saved. The template's values
    are not used or changed; the results are fresh tensors that require grad where
    the template's leaves do.

    Collective when a process group exists and ``like`` is given: every rank calls it.
    Without ``like``, every entry is read in full as plain tensors on this process
    alone, as a flat ``{key: value}`` dict (for inspection and conversion).

    Args:
      path: the checkpoint directory written by :func:`fshard.checkpoint.save`.
      like: the template pytree (e.g. freshly initialised and sharded params and
        optimizer state); ``None`` for the flat dict.

    Returns:
      A pytree like ``like`` with the saved values, or the flat dict.

    Raises:
      CheckpointNotFoundError: no checkpoint at ``path`` (the message mentions an
        unfinished save there, if any).
      CheckpointError: the checkpoint is partial or corrupt, or lacks keys of the
        template; the message names the path and the keys.
      CheckpointMismatchError: (a ``ValueError`` and a ``CheckpointError``) a template
        leaf's shape, dtype or kind (tensor or value) differs from the saved one; the
        message names each key with both shapes; a dtype-only difference is one line.
      CheckpointError: the ranks passed different paths (every rank raises, naming them),
        or the checkpoint records checksums (its manifest) whose file is missing.
    """
    path = os.path.abspath(os.fspath(path))
    wait()
    if like is None:
        return _load_flat(path)
    keys, leaves, treedef = flatten(like, what="fs.checkpoint.load", path=path)
    g = group()
    agree_on_path(path, g, "fs.checkpoint.load")
    src, error, checksums = path, None, None
    try:
        src = _dirs.resolve(path)
        md = _read_metadata(src, path, keys)
        _check(src, path, md, keys, leaves)
        checksums = read_checksums(src, md)
    except (CheckpointError, ValueError) as e:
        error = e
    agree(error, g)
    if _simulated.active():  # fs.simulate: DCP reads once per simulated rank
        per_rank = _simulated.empty_per_rank(keys, leaves)
        _read(per_rank, src, path, g, checksums)
        state_dict = {k: _simulated.combine(k, x, per_rank) for k, x in zip(keys, leaves)}
    else:
        state_dict = {k: _empty_like(x) for k, x in zip(keys, leaves)}
        _read(state_dict, src, path, g, checksums)
    out = []
    for k, x in zip(keys, leaves):
        v = state_dict[k]
        if isinstance(x, torch.Tensor) and x.requires_grad:
            v.requires_grad_(True)
        out.append(v)
    return tree_util.tree_unflatten(treedef, out)


def _read(state_dict: Any, src: str, path: str, g: Any, checksums: dict[str, dict[str, int]] | None) -> None:
    """DCP's read into ``state_dict`` (under ``fs.simulate`` a list: every rank's)."""
    try:
        if isinstance(state_dict, list):
            _simulated.load_per_rank(state_dict, [VerifyingReader(src, checksums) for _ in state_dict])
            return
        with single_process_quiet(g):
            dcp.load(state_dict, storage_reader=VerifyingReader(src, checksums), process_group=g, no_dist=g is None)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(f"reading the checkpoint '{path}' failed: {describe_failure(e)}") from e


def _load_flat(path: str) -> dict[str, Any]:
    if _simulated.active():  # full values, the same on every rank: plain tensors
        with simulation.outside():
            return _load_flat_here(path)
    return _load_flat_here(path)


def _load_flat_here(path: str) -> dict[str, Any]:
    src = _dirs.resolve(path)
    md = _read_metadata(src, path, None)
    keys = list(md.state_dict_metadata)
    bad, reasons = _incomplete_keys(src, md, keys)
    if bad:
        raise CheckpointError(
            f"the checkpoint '{src}' is incomplete or corrupt: the data of {len(bad)} keys is "
            f"missing: {short_list(bad)}. Found: {'; '.join(reasons[:5])}."
        )
    state_dict: dict[str, Any] = {}
    for k, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            state_dict[k] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        else:
            state_dict[k] = None  # replaced by the saved value
    _read(state_dict, src, path, None, read_checksums(src, md))
    return state_dict
