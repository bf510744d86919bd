"""Checksums of a checkpoint's data: a CRC32 per stored item, checked as the item is read.

DCP stores every tensor shard and Python value as one item, a byte range of a data file
(``__<rank>_<n>.distcp``), and keeps no checksum: a flipped bit inside a tensor's bytes
loads silently as a wrong value. So each rank, after DCP has written its files, reads its
items back and takes their CRC32; rank 0 writes them all to :data:`CHECKSUMS` in the
checkpoint directory before the commit. Loading checks every item it reads against it
(no extra I/O: the item is read once, then checked, then parsed), and a mismatch names
the data file, the key and the byte range.

The manifest: that a checkpoint has checksums must itself be recorded, or deleting the
checksum file would make a corrupt checkpoint load unchecked. So the save marks DCP's
``.metadata`` (which no checkpoint loads without) with :data:`MARK`, naming the manifest,
and rank 0 writes :data:`MANIFEST` at the commit: the checksum file's name and every
file's size. Loading a marked checkpoint requires both files and raises, naming the
missing one. Checkpoints with neither mark nor manifest (written before they existed, or
by plain DCP) load unchecked, as before: refusing them would strand every older
checkpoint, and there is nothing in them to say the checksums were ever there.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from typing import IO, Any

import torch.distributed.checkpoint as dcp

from fshard.checkpoint._common import CheckpointError

__all__ = [
    "CHECKSUMS",
    "MANIFEST",
    "ChecksumWriter",
    "VerifyingReader",
    "read_checksums",
    "write_checksums",
    "write_manifest",
]

CHECKSUMS = ".fshard-checksums.json"
MANIFEST = ".fshard-manifest.json"
MARK = "fshard_manifest"  # the attribute of DCP's Metadata that names the manifest
_CHUNK = 1 << 22


def _crc_of_range(path: str, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(_CHUNK, left))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return crc


class ChecksumWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that records the CRC32 of every item this rank wrote.

    Attributes:
      checksums: ``{data file: {offset: crc32}}`` for this rank's items, after the write.
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._root = os.fspath(path)
        self.checksums: dict[str, dict[str, int]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        fut = super().write_data(plan, planner)
        for result in fut.wait():  # the plain writer has finished when it returns
            info = result.storage_data
            crc = _crc_of_range(os.path.join(self._root, info.relative_path), info.offset, info.length)
            self.checksums.setdefault(info.relative_path, {})[str(info.offset)] = crc
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        # Rank 0, writing .metadata: record that this checkpoint has a manifest (and so
        # checksums), where deleting those files cannot erase the record.
        try:
            setattr(metadata, MARK, MANIFEST)
        except AttributeError:  # a future Metadata with __slots__: the manifest file alone
            pass
        super().finish(metadata, results)


def write_manifest(directory: str) -> None:
    """Rank 0, at the commit: writes :data:`MANIFEST` (checksum file, every file's size), synced."""
    files = {}
    for entry in sorted(os.listdir(directory)):
        full = os.path.join(directory, entry)
        if entry != MANIFEST and os.path.isfile(full):
            files[entry] = os.path.getsize(full)
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as f:
        json.dump({"version": 1, "checksums": CHECKSUMS, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())


def _expects_checksums(directory: str, metadata: Any) -> bool:
    """Whether the checkpoint says it has checksums (its .metadata mark or its manifest).

    Raises:
      CheckpointError: the .metadata names a manifest that is not there.
    """
    manifest = os.path.join(directory, MANIFEST)
    if os.path.exists(manifest):
        return True
    if metadata is not None and getattr(metadata, MARK, None):
        raise CheckpointError(
            f"'{directory}' is incomplete: its .metadata says the save wrote {MANIFEST} (the list of "
            f"its files and checksums), and that file is missing: files were deleted or not copied. "
            f"Copy the whole directory again, or load another checkpoint."
        )
    return False


def write_checksums(directory: str, per_rank: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Rank 0: writes every rank's item checksums into ``directory`` (synced); returns them merged."""
    merged: dict[str, dict[str, int]] = {}
    for part in per_rank:
        for rel, items in (part or {}).items():
            merged.setdefault(rel, {}).update(items)
    path = os.path.join(directory, CHECKSUMS)
    with open(path, "w") as f:
        json.dump({"version": 1, "algorithm": "crc32", "items": merged}, f)
        f.flush()
        os.fsync(f.fileno())
    return merged


def read_checksums(directory: str, metadata: Any = None) -> dict[str, dict[str, int]] | None:
    """The item checksums of the checkpoint in ``directory``; None where it has none.

    A checkpoint whose ``metadata`` (DCP's, read from ``directory``) or manifest records
    checksums must have them.

    Raises:
      CheckpointError: the checksum file exists but cannot be read, or it (or the
        manifest) is missing where the checkpoint records it; the message names the file.
    """
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(path):
        if _expects_checksums(directory, metadata):
            raise CheckpointError(
                f"'{directory}' is incomplete: its {CHECKSUMS} is missing, and its {MANIFEST} says the "
                f"save wrote it. Without it a corrupt byte would load unnoticed, so the checkpoint is "
                f"not read. Copy the whole directory again, or load another checkpoint."
            )
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("algorithm") != "crc32":
            raise ValueError(f"unknown algorithm {data.get('algorithm')!r}")
        return {rel: {str(k): int(v) for k, v in items.items()} for rel, items in data["items"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"'{directory}' is corrupt: its {CHECKSUMS} cannot be read ({type(e).__name__}: {e})."
        ) from e


class VerifyingReader(dcp.FileSystemReader):
    """``FileSystemReader`` that checks each item it reads against the saved CRC32.

    Args:
      path: the checkpoint directory.
      checksums: from :func:`read_checksums`; None reads unchecked.
    """

    def __init__(self, path: str | os.PathLike, checksums: dict[str, dict[str, int]] | None) -> None:
        super().__init__(path)
        self._dir = os.fspath(path)
        self._checksums = checksums
        self._keys: dict[tuple[str, int], str] = {}

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # Which key each byte range holds, for the error message.
        self._keys = {
            (info.relative_path, info.offset): index.fqn for index, info in (metadata.storage_data or {}).items()
        }

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        view = super()._slice_file(file, sinfo)
        if self._checksums is None:
            return view
        want = self._checksums.get(sinfo.relative_path, {}).get(str(sinfo.offset))
        if want is None:
            key = self._keys.get((sinfo.relative_path, sinfo.offset), "?")
            raise CheckpointError(
                f"data file '{sinfo.relative_path}' of '{self._dir}': {CHECKSUMS} has no checksum "
                f"for the item of key '{key}' at offset {sinfo.offset}: the metadata and the "
                f"checksums come from different saves."
            )
        data = view.read(sinfo.length)
        got = zlib.crc32(data)
        if len(data) != sinfo.length or got != want:
            key = self._keys.get((sinfo.relative_path, sinfo.offset), "?")
            raise CheckpointError(
                f"data file '{sinfo.relative_path}' of '{self._dir}' is corrupt: the bytes of key "
                f"'{key}' (offset {sinfo.offset}, {sinfo.length} bytes) have CRC32 {got:#010x}, "
                f"the save wrote {want:#010x}."
            )
        return io.BytesIO(data)
