"""Checkpoints in a model's own format: Hugging Face safetensors (``load_hf`` / ``save_hf``).

DCP (:func:`fshard.checkpoint.save`) stays the format for resumable training state; this
is the format the model came in and that ``transformers`` reads back::

    params = fs.checkpoint.load_hf("gpt2-small/", like=fs.shard(params, specs, mesh))
    ...
    fs.checkpoint.save_hf("out/", params, config=model.config)
    transformers.AutoModelForCausalLM.from_pretrained("out/")

Names: the tree from ``fs.nn.functionalize(model)`` is keyed by
``model.named_parameters()`` names (``transformer.h.0.mlp.c_fc.weight``), which are the
names ``model.save_pretrained`` writes; a tied tensor appears once, under its first name,
and so it is written once, as ``save_pretrained`` does. Checkpoints of the bare base model
(``h.0.mlp.c_fc.weight``, as GPT-2's on the hub) are read too, by one rule: only when *no*
template name is in the checkpoint as it is, every name is looked up without its first
component, and that component must be the same for all of them (the model's base-model
prefix, ``transformer.``). A name that would match only without its prefix while others
match as they are (``encoder.embed.weight`` against the file's ``embed.weight``), or
names that match only with different prefixes dropped, are errors naming both names,
with ``strict`` or without: such a match would be a guess, and a wrong one loads the wrong
tensor without a word.

Reading: each rank opens the files with ``safetensors.safe_open`` and reads only the block
of each tensor its DTensor holds (``get_slice``); nothing is communicated. Writing: each
tensor is gathered in turn and rank 0 writes files of at most ``max_shard_size`` bytes
(``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and the index
``model.safetensors.index.json``) into a temporary directory that is renamed into place
when complete.

``safetensors`` (and, for ``config=``, ``transformers``) is the optional extra ``fshard[hf]``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import torch
from torch.distributed.tensor import DTensor

from fshard import tree as tree_util
from fshard.checkpoint import _dirs, _lock, _space
from fshard.checkpoint._common import (
    CheckpointError,
    CheckpointNotFoundError,
    agree,
    agree_on_path,
    flatten,
    group,
    rank_of,
)
from fshard.mesh.placement import local_block
from fshard.mesh.sharding import _mesh_of, make_dtensor, spec_of
from fshard.runtime import simulation

__all__ = ["load_hf", "save_hf"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_OURS = (".safetensors", INDEX, "config.json", "generation_config.json")


def _safetensors():
    try:
        import safetensors
        import safetensors.torch  # noqa: F401
    except ImportError as e:  # pragma: no cover - the extra is installed in CI
        raise ImportError("fs.checkpoint.load_hf/save_hf need safetensors: pip install 'fshard[hf]'.") from e
    return safetensors


def _files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: a file, or a directory (index or every file)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"load_hf: no safetensors file or directory at '{path}'.")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return [os.path.join(path, n) for n in dict.fromkeys(weight_map.values())]
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not found:
        raise CheckpointNotFoundError(f"load_hf: the directory '{path}' holds no .safetensors file.")
    return [os.path.join(path, n) for n in found]


class _Source:
    """Names -> (shape, reader) over a state dict or safetensors files."""

    def __init__(self, src: Any) -> None:
        self._handles = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._where: dict[str, Any] = {}
        if isinstance(src, Mapping):
            self.what = "the state dict"
            for k, v in src.items():
                if isinstance(v, torch.Tensor):
                    self.shapes[k] = tuple(v.shape)
                    self._where[k] = v
            return
        path = os.path.abspath(os.fspath(src))
        self.what = f"the checkpoint '{path}'"
        st = _safetensors()
        for file in _files(path):
            h = st.safe_open(file, framework="pt")
            self._handles.append(h)
            for k in h.keys():
                self.shapes[k] = tuple(h.get_slice(k).get_shape())
                self._where[k] = h

    def read(self, key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        w = self._where[key]
        if isinstance(w, torch.Tensor):
            return w.detach()[index] if index is not None else w.detach()
        if index is None or not index:
            return w.get_tensor(key)
        return w.get_slice(key)[index]


def _first(items: list[str], n: int = 5) -> str:
    shown = ", ".join(items[:n])
    return shown + (f" (and {len(items) - n} more)" if len(items) > n else "")


def load_hf(path_or_state_dict: Any, like: Any, *, strict: bool = True) -> Any:
    """Reads a Hugging Face checkpoint into the layout of ``like``.

    Each rank reads only the blocks its DTensors hold (``safe_open(...).get_slice``);
    plain tensor leaves are read whole. Values are cast to the template's dtype and keep
    its ``requires_grad``.

    Args:
      path_or_state_dict: a ``.safetensors`` file, a directory of them (with or without
        ``model.safetensors.index.json``), or a ``{name: tensor}`` dict.
      like: the template: e.g. ``fs.shard(params, specs, mesh)`` with ``params`` from
        ``fs.nn.functionalize(model)`` (any mesh and layout).
      strict: reject checkpoint names the template lacks (default True). GPT-2's hub
        checkpoints carry old attention-mask buffers (``h.0.attn.bias``): pass False.

    Returns:
      A pytree like ``like``.

    Raises:
      CheckpointNotFoundError: no such file or directory, or no safetensors in it.
      CheckpointError: template names the checkpoint lacks, checkpoint names the template
        lacks (``strict``), or shapes that differ: the first ones of each are named.
    """
    keys, leaves, treedef = flatten(like, what="fs.checkpoint.load_hf", path="<template>")
    src = _Source(path_or_state_dict)
    names, problems = _match_names(keys, src.shapes)
    missing = [k for k in keys if k not in names]
    used = set(names.values())
    extra = [k for k in src.shapes if k not in used] if strict else []
    if missing:
        problems.append(
            f"the template's {_first(missing)} {'is' if len(missing) == 1 else 'are'} missing "
            f"({len(missing)} of {len(keys)})"
        )
    if extra:
        problems.append(
            f"{_first(extra)} {'is' if len(extra) == 1 else 'are'} not in the template "
            f"({len(extra)} names; pass strict=False to skip them)"
        )
    if problems:
        raise CheckpointError(f"load_hf: {src.what} does not match the template: {'; '.join(problems)}.")
    bad = [
        f"'{k}': checkpoint {src.shapes[names[k]]}, template {tuple(x.shape)}"
        for k, x in zip(keys, leaves)
        if isinstance(x, torch.Tensor) and src.shapes[names[k]] != tuple(x.shape)
    ]
    if bad:
        raise CheckpointError(f"load_hf: shapes in {src.what} differ from the template's: {_first(bad, 3)}.")
    out = []
    for k, x in zip(keys, leaves):
        if isinstance(x, DTensor):
            spec, mesh = spec_of(x), _mesh_of(x)
            # per rank: under fs.simulate each simulated rank reads its own block
            local = simulation.per_rank(_read_block)(
                src, names[k], k, spec, x.shape, mesh, mesh.coordinate(), x.to_local()
            )
            v = make_dtensor(local, spec, mesh, x.shape)
        elif isinstance(x, torch.Tensor):
            v = simulation.per_rank(_read_whole)(src, names[k], x)
        else:
            out.append(x)
            continue
        out.append(v.requires_grad_(x.requires_grad) if x.requires_grad else v)
    return tree_util.tree_unflatten(treedef, out)


def _read_block(
    src: _Source, name: str, k: str, spec: Any, shape: Any, mesh: Any, coord: dict[str, int], block: torch.Tensor
) -> torch.Tensor:
    """One rank's block of ``name`` (the rank at ``coord``, whose template block is ``block``)."""
    index = local_block(spec, shape, mesh, coord, uneven=True)
    local = src.read(name, index).to(device=block.device, dtype=block.dtype).contiguous()
    if local.shape != block.shape:
        raise CheckpointError(
            f"load_hf: '{k}': this rank's block of {tuple(shape)} under {spec} is "
            f"{tuple(block.shape)}, but the slice read is {tuple(local.shape)}."
        )
    return local


def _read_whole(src: _Source, name: str, x: torch.Tensor) -> torch.Tensor:
    return src.read(name, None).to(device=x.device, dtype=x.dtype, copy=True)


def _split_first(name: str) -> tuple[str, str] | None:
    return tuple(name.split(".", 1)) if "." in name else None  # type: ignore[return-value]


def _match_names(keys: list[str], available: Mapping[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Template name -> checkpoint name, by the module docstring's rule, and the ambiguities found.

    Returns:
      ``(names, problems)``: the names matched, and one message per unsafe match refused
      (each naming the template's name and the checkpoint's).
    """
    direct = {k: k for k in keys if k in available}
    stripped = {
        k: parts for k in keys if k not in direct and (parts := _split_first(k)) is not None and parts[1] in available
    }
    if direct:
        problems = [
            f"the template's '{k}' is not in the checkpoint, and its '{rest}' would match it only "
            f"with the prefix '{head}.' dropped while other names match as they are: a guess, "
            f"so it is not made (rename one of them)"
            for k, (head, rest) in stripped.items()
        ]
        return direct, problems
    heads: dict[str, str] = {}
    for k, (head, _) in stripped.items():
        heads.setdefault(head, k)
    if len(heads) > 1:  # no one base-model prefix: which of these is the file's name for?
        shown = ", ".join(f"'{k}' -> '{stripped[k][1]}' (prefix '{h}.')" for h, k in list(heads.items())[:4])
        return {}, [
            f"the template's names match the checkpoint only with different prefixes dropped "
            f"({shown}): a base-model checkpoint lacks one prefix for every name, so this is not "
            f"one (rename the template's names)"
        ]
    return {k: rest for k, (_, rest) in stripped.items()}, []


def save_hf(path: str | os.PathLike, params: Any, *, config: Any = None, max_shard_size: int = 5 * 2**30) -> None:
    """Writes ``params`` as a Hugging Face safetensors checkpoint directory.

    Collective when ``params`` holds DTensors: every rank calls it; each tensor is gathered
    in turn (one full tensor at a time beyond the file being filled) and rank 0 writes.

    Args:
      path: the directory (created; an existing one holding only checkpoint files is
        replaced when the new one is complete).
      params: the tree from ``fs.nn.functionalize`` (sharded or not), named like the
        module's ``named_parameters()``.
      config: a ``transformers`` config (``model.config``), written as ``config.json`` so
        that ``AutoModelForCausalLM.from_pretrained(path)`` can build the model.
      max_shard_size: bytes per file before starting the next (default 5 GiB).

    Raises:
      CheckpointError: ``path`` is a file, or a directory with other files (they would be
        lost); the ranks passed different paths; another save to ``path`` is in progress
        (:class:`~fshard.checkpoint.CheckpointLockedError`, the lock of
        :func:`fshard.checkpoint.save`); or the write failed. Every rank raises it,
        whatever rank 0's writer raised (a full disk says "no space left", with the
        bytes needed), and the temporary directory is removed.
    """
    st = _safetensors()
    path = os.path.abspath(os.fspath(path))
    keys, leaves, _ = flatten(params, what="fs.checkpoint.save_hf", path=path)
    g = group()
    rank = rank_of(g)
    agree_on_path(path, g, "fs.checkpoint.save_hf")
    needed = _space.estimate_bytes(leaves)
    lock, tmp, error = _begin_hf(path) if rank == 0 else (None, None, None)
    try:
        agree(error, g)
        files, error = _gather(keys, leaves, rank, max_shard_size)
        if rank == 0 and error is None:
            error = _write_hf(st, tmp, path, files, config, needed)
        agree(error, g)  # every rank raises rank 0's error: none is left waiting
    finally:
        if lock is not None:
            lock.release()


def _begin_hf(path: str) -> tuple[Any, str | None, CheckpointError | None]:
    """Rank 0: the path's save lock, the target check, leftovers cleared; nothing held on error."""
    lock = None
    try:
        lock = _lock.acquire(path)
        error = _check_target(path)
        if error is None:
            _dirs.clear_leftovers(path, lock.token)
            return lock, _dirs.temp_dir_for(path, lock.token), None
    except (OSError, CheckpointError) as e:
        error = e if isinstance(e, CheckpointError) else CheckpointError(f"save_hf: cannot save to '{path}': {e}")
    if lock is not None:
        lock.release()
    return None, None, error


def _gather(
    keys: list[str], leaves: list[Any], rank: int, max_shard_size: int
) -> tuple[list[dict[str, torch.Tensor]], CheckpointError | None]:
    """Every tensor gathered in turn (collective); rank 0 keeps them, cut into files.

    Returns:
      ``(files, error)``: rank 0's error copying a tensor (it takes part in the remaining
      gathers anyway, so that no rank is left waiting in one), to be agreed on.

    Raises:
      CheckpointError: a leaf is not a tensor (on every rank alike: the trees match).
    """
    files: list[dict[str, torch.Tensor]] = [{}]
    size, error = 0, None
    for k, x in zip(keys, leaves):
        if not isinstance(x, torch.Tensor):
            raise CheckpointError(f"save_hf: '{k}' is a {type(x).__name__}; a safetensors file holds tensors only.")
        full = x.full_tensor() if isinstance(x, DTensor) else x
        if rank != 0 or error is not None:
            continue
        try:
            t = _rank0_block(full.detach()).to("cpu").contiguous()
        except Exception as e:  # e.g. out of host memory
            error = CheckpointError(
                f"save_hf: '{k}' could not be copied to CPU memory on rank 0: "
                f"{type(e).__name__}: {e}. Nothing was written."
            )
            continue
        nbytes = t.numel() * t.element_size()
        if files[-1] and size + nbytes > max_shard_size:
            files.append({})
            size = 0
        files[-1][k] = t
        size += nbytes
    return files, error


def _rank0_block(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of ``t``: under ``fs.simulate``, its block (a file holds plain tensors)."""
    blocks = getattr(t, "_local_tensors", None)
    return blocks[0] if blocks is not None else t


def _write_hf(
    st: Any, tmp: str, path: str, files: list[dict[str, torch.Tensor]], config: Any, needed: int
) -> CheckpointError | None:
    """Rank 0: writes and commits; on any failure removes ``tmp`` and returns the error to agree on.

    Any exception, not only ``OSError``: safetensors reports a full disk as its own
    ``SafetensorError``, and an error that escaped here would leave the other ranks waiting.
    """
    try:
        os.makedirs(tmp)
        _write(st, tmp, files)
        if config is not None:
            config.save_pretrained(tmp)
        _dirs.commit(tmp, path)
        return None
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _space.is_no_space(e, os.path.dirname(path), needed):
            return CheckpointError(
                "save_hf: " + _space.no_space_message("writing", path, needed) + f" ({type(e).__name__}: {e})"
            )
        return CheckpointError(
            f"save_hf: writing '{path}' failed: {type(e).__name__}: {e}; what was there is unchanged."
        )


def _check_target(path: str) -> CheckpointError | None:
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path) or os.path.islink(path):
        return CheckpointError(f"save_hf: '{path}' exists and is not a directory.")
    foreign = [n for n in os.listdir(path) if not n.endswith(_OURS)]
    if foreign:
        return CheckpointError(
            f"save_hf: '{path}' holds other files ({sorted(foreign)[:5]}), which replacing the "
            f"directory would delete; choose another path."
        )
    return None


def _write(st: Any, tmp: str, files: list[dict[str, torch.Tensor]]) -> None:
    meta = {"format": "pt"}
    if len(files) == 1:
        st.torch.save_file(files[0], os.path.join(tmp, SINGLE), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, part in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        st.torch.save_file(part, os.path.join(tmp, name), metadata=meta)
        for k, t in part.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
