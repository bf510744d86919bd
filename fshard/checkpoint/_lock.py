"""The save lock: one save at a time per checkpoint path, across jobs, surviving process death.

Why: two jobs saving to one path each cleared the other's temporary directory as "stale"
and then committed a checkpoint with no data. So rank 0 of a save first creates
``<parent>/.<name>.lock`` with ``O_CREAT | O_EXCL`` (atomic on local file systems and on
NFSv3+), holding who owns it: host, pid, the process's start time, the boot id and a
random token. The lock is held from before the temporary directory exists until the
commit (or the failure's clean-up) is done, and only its owner removes it.

A second save to the path finds the file and is refused (:class:`CheckpointLockedError`,
naming the path and the holder), unless the holder is provably dead: same host and boot,
and no process with that pid and start time (the pid may have been reused). A stale lock
is taken over under ``flock`` on the stale file itself, so that two processes taking over
the same stale lock cannot both win: the loser finds, under the flock, that the path no
longer names the file it locked, and looks again. The new record replaces the old one by
``rename``, so the path never stands empty for a third process to grab. A holder on
another host cannot be checked from here; the message says to remove the file by hand
once that job is known to be gone.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from typing import Any

from fshard.checkpoint._common import CheckpointLockedError

__all__ = ["SaveLock", "acquire", "lock_path"]


def lock_path(path: str) -> str:
    """``<parent>/.<name>.lock`` for the checkpoint directory ``path`` (absolute)."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.lock")


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 (the state) on; None without /proc or the process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return stat.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _me(token: str) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "start": _start_time(pid),
        "boot": _boot_id(),
        "token": token,
        "since": time.time(),
    }


def _alive(owner: dict[str, Any]) -> bool | None:
    """Whether the lock's owner runs: True, False, or None when it cannot be told (another host)."""
    if owner.get("host") != socket.gethostname():
        return None
    boot = _boot_id()
    if boot is not None and owner.get("boot") not in (None, boot):
        return False  # the machine rebooted since
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = _stat(pid)
    if fields and fields[0] in ("Z", "X"):
        return False  # killed and not yet reaped by its parent: it will never release the lock
    start = owner.get("start")
    now = fields[19] if fields else None
    # A different start time: the pid was reused by a later process.
    return start is None or now is None or now == start


def _describe(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "an unknown process (the lock file is empty or unreadable)"
    since = owner.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"pid {owner.get('pid')} on host {owner.get('host')!r} since {when}"


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


class SaveLock:
    """A held save lock; :meth:`release` removes it (only if it is still this one).

    Attributes:
      path: the lock file.
      token: this save's random id; its temporary directory carries it in its name.
    """

    def __init__(self, path: str, token: str) -> None:
        self.path = path
        self.token = token

    def held(self) -> bool:
        """Whether the lock file still names this save (someone may have removed it by hand)."""
        owner = _read(self.path)
        return owner is not None and bool(owner) and owner.get("token") == self.token

    def release(self) -> None:
        """Removes the lock file if it is still this save's; never raises."""
        try:
            if self.held():
                os.unlink(self.path)
        except OSError:
            pass


def _create(path: str, record: dict[str, Any]) -> bool:
    """Creates the lock file atomically; False when it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    return True


def _take_over(path: str, record: dict[str, Any]) -> bool:
    """Replaces a lock whose owner is dead; False when the lock changed meanwhile (look again)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # serializes the processes taking over this same file
        except OSError as e:  # a file system without flock (some NFS mounts): no safe take-over
            raise CheckpointLockedError(
                f"the save lock '{path}' was left by a process that is gone, and this file system "
                f"cannot lock it for a safe take-over ({e}). Remove '{path}' by hand, once no other "
                f"job saves to this path."
            ) from e
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return False  # another process took it over first
        except FileNotFoundError:
            return False
        owner = _read(path)
        if not owner or _alive(owner) is not False:
            return False
        fresh = f"{path}.{record['token']}"
        with open(fresh, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(fresh, path)  # atomic: the path never stands empty
        return True
    finally:
        os.close(fd)


def acquire(path: str) -> SaveLock:
    """Takes the save lock of the checkpoint directory ``path`` (absolute), or refuses.

    Returns:
      The held :class:`SaveLock`.

    Raises:
      CheckpointLockedError: another live process holds it (or one on another host,
        which cannot be checked); the message names the path, the lock file and the holder.
      OSError: the parent directory cannot be written.
    """
    lock = lock_path(path)
    token = uuid.uuid4().hex[:12]
    record = _me(token)
    for _ in range(20):  # each round: the lock vanished or changed hands while we looked
        if _create(lock, record):
            return SaveLock(lock, token)
        owner = _read(lock)
        if owner is None:
            if not os.path.exists(lock):
                continue  # released meanwhile
            time.sleep(0.05)  # created this instant, its record not yet written
            owner = _read(lock)
            if owner is None:
                if not os.path.exists(lock):
                    continue
                raise _refusal(path, lock, None, None)
        alive = _alive(owner)
        if alive is False:
            if _take_over(lock, record):
                return SaveLock(lock, token)
            continue
        raise _refusal(path, lock, owner, alive)
    raise CheckpointLockedError(
        f"cannot save to '{path}': its lock '{lock}' kept changing hands; "
        f"several jobs are saving to this path. Give each job its own path."
    )


def _refusal(path: str, lock: str, owner: dict[str, Any] | None, alive: bool | None) -> CheckpointLockedError:
    if alive is None and owner is not None:
        fix = f"fshard cannot check a process on another host: if that job is gone, remove '{lock}' by hand."
    else:
        fix = f"If no such job runs, remove '{lock}' by hand."
    return CheckpointLockedError(
        f"cannot save to '{path}': another save to it is in progress, held by {_describe(owner)} "
        f"(lock file '{lock}'). Two jobs must not save to one path: give each job its own path, or "
        f"wait for the other save to finish. {fix}"
    )
