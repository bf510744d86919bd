"""Checkpoint directories: the temporary name, the atomic commit, recovery.

A save writes into ``<parent>/.<name>.tmp-<id>`` and, once every rank has finished,
rank 0 moves it to ``<parent>/<name>``. Where a checkpoint already exists there, the
two directories are swapped in one step with Linux's ``renameat2(RENAME_EXCHANGE)``
and the old one is deleted afterwards, so at every instant ``<name>`` is either the
old complete checkpoint or the new one. File systems without that call (NFS, macOS)
take two renames, ``<name> -> .<name>.old-<id>`` then the new one into place; a crash
between them leaves no ``<name>``, and :func:`resolve` then finds the old checkpoint
under its backup name.

Every step here runs under the path's save lock (:mod:`fshard.checkpoint._lock`), held
by rank 0 from before the temporary directory exists until the commit is done. The
temporary directory carries the lock's token in its name, so the holder can tell its
own from leftovers: a ``.tmp-<token>`` of another token belongs to a save that no longer
holds the lock, i.e. one that ended or whose process died, and only those are deleted.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import shutil
import uuid
import warnings

from fshard.checkpoint._common import CheckpointError

__all__ = ["temp_dir_for", "prepare_target", "commit", "resolve", "METADATA", "is_complete"]

METADATA = ".metadata"  # DCP writes it last, after every rank's data
# What DCP (and fshard's checksums) put in a checkpoint directory; only such directories
# are ever replaced, so that a save to a wrong path cannot delete a user's files.
_DCP_ENTRY = re.compile(
    r"^(\.metadata(\.tmp)?|__\d+_\d+\.distcp|__\d+\.metadata(\.tmp)?"
    r"|\.fshard-checksums\.json|\.fshard-manifest\.json)$"
)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _split(path: str) -> tuple[str, str]:
    parent, name = os.path.split(os.path.abspath(path))
    return parent, name


def temp_dir_for(path: str, token: str | None = None) -> str:
    """The temporary directory of the save holding lock ``token``, next to ``path`` (same file
    system, so rename works); a fresh random name without a token."""
    parent, name = _split(path)
    return os.path.join(parent, f".{name}.tmp-{token or uuid.uuid4().hex[:12]}")


def _backups(path: str) -> list[str]:
    parent, name = _split(path)
    found = glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*"))
    return sorted((p for p in found if is_complete(p)), key=os.path.getmtime, reverse=True)


def is_complete(path: str) -> bool:
    """Whether ``path`` is a directory holding DCP's metadata file."""
    return os.path.isfile(os.path.join(path, METADATA))


def prepare_target(path: str, token: str | None = None) -> None:
    """Rank 0, holding the save lock ``token``: makes the parent, recovers a backup, clears leftovers.

    Leftovers are the ``.tmp-*`` directories of other tokens and ``.old-*`` backups: under
    the lock no other save is writing them (see the module's docstring). Without a token
    (no lock: a caller that serializes saves itself) every temporary directory is a leftover.

    Raises:
      CheckpointError: ``path`` exists and is not a checkpoint directory (a file, or a
        directory with other files); it would be replaced, so it is left alone.
    """
    parent, name = _split(path)
    os.makedirs(parent, exist_ok=True)
    if not os.path.lexists(path):
        backups = _backups(path)
        if backups:  # a crash between the two renames of the portable commit
            os.rename(backups[0], path)
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise CheckpointError(
                f"cannot save to '{path}': it exists and is not a directory; a checkpoint is a "
                f"directory, and this path would be replaced. Choose another path or remove it."
            )
        foreign = [e for e in os.listdir(path) if not _DCP_ENTRY.match(e)]
        if foreign:
            raise CheckpointError(
                f"cannot save to '{path}': it is a directory with files that are not part of a "
                f"checkpoint ({sorted(foreign)[:5]}), and saving replaces the whole directory. "
                f"Choose another path."
            )
    clear_leftovers(path, token)


def clear_leftovers(path: str, token: str | None) -> None:
    """Rank 0, holding the save lock ``token``: deletes other saves' temp dirs and old backups."""
    parent, name = _split(path)
    mine = f".{name}.tmp-{token}" if token else None
    for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*")):
        if os.path.basename(stale) != mine:
            shutil.rmtree(stale, ignore_errors=True)
    for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync directories; the data files are synced
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths atomically; False where the system or file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def commit(tmp: str, path: str) -> None:
    """Rank 0, after every rank has written ``tmp``: makes it the checkpoint at ``path``.

    Raises:
      OSError: a rename failed; ``path`` still holds the previous checkpoint (or, on a
        file system without atomic exchange, its backup ``.<name>.old-<id>``).
    """
    parent, _ = _split(path)
    _fsync_dir(tmp)  # the data files are fsynced by DCP; their directory entries too
    if not os.path.lexists(path):
        os.rename(tmp, path)
        _fsync_dir(parent)
        return
    if _exchange(tmp, path):
        _fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the previous checkpoint
        return
    backup = os.path.join(parent, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:12]}")
    os.rename(path, backup)
    os.rename(tmp, path)
    _fsync_dir(parent)
    shutil.rmtree(backup, ignore_errors=True)


def resolve(path: str) -> str:
    """The directory to read for ``path``: itself, or the backup a crashed commit left.

    Returns:
      ``path`` when it exists; else the newest complete ``.<name>.old-<id>`` next to it
      (with a warning); else ``path`` (the caller reports it missing).
    """
    if os.path.lexists(path):
        return path
    backups = _backups(path)
    if backups:
        warnings.warn(
            f"no checkpoint at '{path}', but a save was interrupted while replacing it; "
            f"reading the previous checkpoint from '{backups[0]}'. The next save restores the name.",
            stacklevel=3,
        )
        return backups[0]
    return path


def unfinished_saves(path: str) -> list[str]:
    """Temporary directories of saves to ``path`` that never finished (for messages)."""
    parent, name = _split(path)
    return sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*")))
