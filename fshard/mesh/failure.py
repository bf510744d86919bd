"""When a torchrun job fails: every rank says whether it is the cause or a casualty.

A rank that raises leaves a one-line obituary in the job's rendezvous store. A rank whose
collective failed because a peer process went away (gloo's "Connection closed by peer")
is a casualty: it prints that its error is a consequence, names the rank that failed first
from its obituary or, when none comes (the rank was killed by a signal, ran out of memory,
crashed), says so, and stays up to ``FSHARD_PEER_LOSS_WAIT_S`` (10 s) before it exits. The
wait is for the launcher: torchrun takes the first process it sees exit as the root cause,
and its clock ticks in whole seconds, so casualties that exit at once can be reported
instead of the rank that failed. Waiting lets it see the real one first; it then stops the
others itself.

Only uncaught exceptions take this path (``sys.excepthook``); :func:`install` is called
by ``fs.init()`` for multi-process jobs. ``fs.run_local`` reports failures itself.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

__all__ = ["install", "PEER_LOST", "is_peer_lost"]

# What a rank's collective raises when a peer process is gone (gloo; nccl's comm errors
# are reported by its watchdog instead).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_KEY = "fshard/failed/{}"
WAIT_S = float(os.environ.get("FSHARD_PEER_LOSS_WAIT_S", "10"))


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it chains) says that a peer process is gone."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(s in str(exc) for s in PEER_LOST):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_JOB: dict[str, Any] = {}  # the job the hook reports on: the latest install()


def install(store: Any, rank: int, world_size: int, *, wait_s: float = WAIT_S) -> None:
    """Chains an excepthook that reports this rank as the cause or a casualty of a failure.

    Calling it again (a new process group) updates the job; the hook is chained once.

    Args:
      store: the job's key-value store (torchrun's rendezvous store); used for obituaries.
      rank, world_size: this process's place in the job.
      wait_s: how long a casualty waits for another rank's obituary before it exits.
    """
    first = not _JOB
    _JOB.update(store=store, rank=rank, world_size=world_size, wait_s=wait_s)
    if first:
        previous = sys.excepthook

        def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
            previous(exc_type, exc, tb)
            if is_peer_lost(exc):
                _report_casualty(_JOB["store"], _JOB["rank"], _JOB["world_size"], _JOB["wait_s"])
            else:
                _leave_obituary(_JOB["store"], _JOB["rank"], exc)

        sys.excepthook = hook


def _leave_obituary(store: Any, rank: int, exc: BaseException) -> None:
    line = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    text = (line[-1] if line else type(exc).__name__)[:500]
    try:
        store.set_timeout(timedelta(seconds=2))
        store.set(_KEY.format(rank), text)
    except Exception:  # the store may be gone with the rank that hosted it
        pass


def _report_casualty(store: Any, rank: int, world_size: int, wait_s: float) -> None:
    """Names the rank that failed first if it left an obituary; stays up to ``wait_s`` either way.

    Staying lets the launcher see the failed rank exit first (and then stop this one);
    without such a launcher, this rank exits when the time is up.
    """
    say = lambda msg: print(f"fshard: rank {rank} of {world_size}: {msg}", file=sys.stderr, flush=True)
    say("the error above is a consequence: another rank of the job stopped while this one was "
        "talking to it.")
    deadline = time.monotonic() + wait_s
    keys = {r: _KEY.format(r) for r in range(world_size) if r != rank}
    named = False
    try:
        store.set_timeout(timedelta(seconds=2))
        while not named and time.monotonic() < deadline:
            for r, key in keys.items():
                if store.check([key]):
                    say(f"rank {r} failed first: {store.get(key).decode(errors='replace')}")
                    named = True
                    break
            else:
                time.sleep(0.1)
    except Exception:  # the store went away with its host: nothing more to learn here
        pass
    if not named:
        say(f"no rank reported an exception within {wait_s:.0f} s: a rank was killed or crashed "
            f"(a signal, out of memory, a segfault). The launcher's report names it (torchrun: "
            f"'Root Cause').")
    time.sleep(max(0.0, deadline - time.monotonic()))
