"""What the commit and the load check before trusting a checkpoint directory's files.

The commit runs :func:`check_written` on the temporary directory before renaming it into
place: a directory whose files another process deleted, or that a failed write left
short, is never committed, whatever the save's own bookkeeping says.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Any, Sequence

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fshard.checkpoint._common import CheckpointError, short_list

__all__ = ["check_written", "incomplete_keys"]


def incomplete_keys(src: str, md: Metadata, keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """Keys whose data is missing: ``(keys, reasons)``, a reason per bad file or chunk list."""
    entries: dict[str, list[Any]] = defaultdict(list)
    for index, info in (md.storage_data or {}).items():
        entries[index.fqn].append(info)
    sizes: dict[str, int | None] = {}
    short: dict[str, int] = {}  # truncated file -> bytes the keys need
    bad_keys: list[str] = []
    reasons: dict[str, str] = {}
    for k in keys:
        meta = md.state_dict_metadata[k]
        infos = entries.get(k, [])
        want_chunks = len(meta.chunks) if isinstance(meta, TensorStorageMetadata) else 1
        bad = False
        if len(infos) < want_chunks:
            reasons.setdefault("chunks", f"the metadata lists no data for some chunks (e.g. of '{k}')")
            bad = True
        elif isinstance(meta, TensorStorageMetadata):
            covered = sum(math.prod(c.sizes) for c in meta.chunks)
            if covered < math.prod(meta.size):
                reasons.setdefault("cover", f"the chunks of '{k}' cover {covered} of {math.prod(meta.size)} elements")
                bad = True
        for info in infos:
            rel = info.relative_path
            if rel not in sizes:
                try:
                    sizes[rel] = os.path.getsize(os.path.join(src, rel))
                except OSError:
                    sizes[rel] = None
            if sizes[rel] is None:
                reasons.setdefault(rel, f"data file '{rel}' is missing")
                bad = True
            elif sizes[rel] < info.offset + info.length:
                short[rel] = max(short.get(rel, 0), info.offset + info.length)
                bad = True
        if bad:
            bad_keys.append(k)
    for rel, need in short.items():
        reasons[rel] = f"data file '{rel}' is truncated ({sizes[rel]} bytes, needs at least {need})"
    return bad_keys, list(reasons.values())


def check_written(directory: str, checksums: dict[str, dict[str, int]], path: str) -> None:
    """Rank 0, before the commit: every item the metadata lists is on disk, whole, with a checksum.

    Args:
      directory: the temporary directory the save wrote.
      checksums: every rank's item checksums, merged (``{file: {offset: crc}}``).
      path: the checkpoint path, for the message.

    Raises:
      CheckpointError: the metadata is missing or unreadable, data files are missing or
        short, or items lack a checksum; the message names the files and keys.
    """
    try:
        md = dcp.FileSystemReader(directory).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"the save to '{path}' is not committed: its temporary directory '{directory}' has no "
            f"readable .metadata ({type(e).__name__}: {e}); was it deleted by another process? The "
            f"previous checkpoint at '{path}', if any, is unchanged."
        ) from e
    keys = list(md.state_dict_metadata)
    bad, reasons = incomplete_keys(directory, md, keys)
    unsummed = [
        index.fqn
        for index, info in (md.storage_data or {}).items()
        if str(info.offset) not in checksums.get(info.relative_path, {})
    ]
    if bad or unsummed:
        found = "; ".join(reasons[:5]) or f"no checksum for {short_list(unsummed)}"
        raise CheckpointError(
            f"the save to '{path}' is not committed: {len(bad) or len(unsummed)} keys of its temporary "
            f"directory '{directory}' are incomplete ({short_list(bad or unsummed)}): {found}. Another "
            f"process may have deleted its files. The previous checkpoint at '{path}', if any, is unchanged."
        )
