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

A rank whose collective timed out (a peer never came: stopped with SIGSTOP, frozen, stuck
in native code) names the ranks that stopped responding. Every rank runs a heartbeat
thread that bumps a counter in the store every ``FSHARD_HEARTBEAT_S`` seconds (default:
a tenth of the group timeout, between 0.5 and 5 s). A rank blocked in a collective
releases the GIL, so its heartbeat goes on; a stopped or frozen process's does not. The
timed-out rank reads every counter twice, a few periods apart, and names the ranks whose
counters did not move and that did not exit through the interpreter. Counters, not clocks: the hosts'
clocks need not agree.

Only uncaught exceptions take this path (``sys.excepthook``); :func:`install` is called
by ``fs.init()`` for multi-process jobs. ``fs.run_local`` reports failures itself.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

__all__ = ["install", "PEER_LOST", "TIMED_OUT", "is_peer_lost", "is_timeout", "heartbeat_period", "unresponsive_ranks"]

# What a rank's collective raises when a peer process is gone (gloo; nccl's comm errors
# are reported by its watchdog instead).
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
# What a collective or store wait raises when its timeout ran out (gloo, the TCPStore,
# nccl's watchdog).
TIMED_OUT = ("Timed out waiting", "timed out", "Socket Timeout", "Watchdog caught collective operation timeout")
_KEY = "fshard/failed/{}"
_BEAT = "fshard/alive/{}"
_EXITED = "fshard/exited/{}"
WAIT_S = float(os.environ.get("FSHARD_PEER_LOSS_WAIT_S", "10"))


def is_peer_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it chains) says that a peer process is gone."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(s in str(exc) for s in PEER_LOST):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_timeout(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it chains) says that a wait ran out of time."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, TimeoutError) or any(s in str(exc) for s in TIMED_OUT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def heartbeat_period(timeout: timedelta) -> float:
    """Seconds between heartbeats: ``FSHARD_HEARTBEAT_S`` (0 turns them off), else a tenth
    of ``timeout`` between 0.5 and 5 s, so a timed-out rank can tell a stopped peer from a
    waiting one well within the time the launcher gives it."""
    raw = os.environ.get("FSHARD_HEARTBEAT_S")
    if raw is not None:
        return max(0.0, float(raw))
    return min(5.0, max(0.5, timeout.total_seconds() / 10))


_JOB: dict[str, Any] = {}  # the job the hook reports on: the latest install()


def install(store: Any, rank: int, world_size: int, *, wait_s: float = WAIT_S, heartbeat_s: float = 0.0) -> None:
    """Chains an excepthook that reports this rank as the cause or a casualty of a failure.

    Calling it again (a new process group) updates the job; the hook is chained once.

    Args:
      store: the job's key-value store (torchrun's rendezvous store); used for obituaries
        and heartbeats.
      rank, world_size: this process's place in the job.
      wait_s: how long a casualty waits for another rank's obituary before it exits.
      heartbeat_s: seconds between this rank's heartbeats (:func:`heartbeat_period`); 0:
        none, and a timed-out rank cannot name the ranks that stopped responding.
    """
    first = not _JOB
    _JOB.update(store=store, rank=rank, world_size=world_size, wait_s=wait_s, heartbeat_s=heartbeat_s)
    if heartbeat_s > 0:
        _start_heartbeat(store, rank, heartbeat_s)
    if first:
        previous = sys.excepthook

        def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
            previous(exc_type, exc, tb)
            job = _JOB
            if is_peer_lost(exc):
                _report_casualty(job["store"], job["rank"], job["world_size"], job["wait_s"])
            elif is_timeout(exc) and job["heartbeat_s"] > 0:
                _report_timeout(job["store"], job["rank"], job["world_size"], job["heartbeat_s"], exc)
            else:
                _leave_obituary(job["store"], job["rank"], exc)

        sys.excepthook = hook


_HEARTBEAT: dict[str, Any] = {}  # the running heartbeat: its thread and stop event


def _start_heartbeat(store: Any, rank: int, period: float) -> None:
    """Starts (or restarts, for a new job) this rank's heartbeat thread; marks a clean exit."""
    _stop_heartbeat()
    stop = threading.Event()
    thread = threading.Thread(
        target=_beat, args=(store, _BEAT.format(rank), period, stop), name="fshard-heartbeat", daemon=True
    )
    _HEARTBEAT.update(thread=thread, stop=stop, store=store, rank=rank)
    thread.start()
    if not _HEARTBEAT.get("atexit"):
        atexit.register(_mark_exited)  # a rank that ended normally is not "unresponsive"
        _HEARTBEAT["atexit"] = True


def _beat(store: Any, key: str, period: float, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            store.add(key, 1)
        except Exception:  # the store went away (its host exited): nobody is left to ask
            return
        stop.wait(period)


def _stop_heartbeat() -> None:
    stop, thread = _HEARTBEAT.get("stop"), _HEARTBEAT.get("thread")
    if stop is not None:
        stop.set()
    # Joined, not left to die with the interpreter: a daemon thread that comes back from
    # the store call into a finalizing interpreter is ended inside C++ code, and the process
    # aborts (fshard.runtime.teardown explains the same hazard for gloo's threads).
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5)


def _mark_exited() -> None:
    _stop_heartbeat()
    store, rank = _HEARTBEAT.get("store"), _HEARTBEAT.get("rank")
    if store is None:
        return
    try:
        store.set(_EXITED.format(rank), "1")
    except Exception:
        pass


def unresponsive_ranks(store: Any, rank: int, world_size: int, period: float) -> list[int]:
    """The other ranks whose heartbeat did not advance over 2.5 periods and that did not
    exit through the interpreter (which marks them, done or failed): stopped (SIGSTOP),
    frozen, killed, or holding the GIL in native code."""
    others = [r for r in range(world_size) if r != rank]
    before = {r: store.add(_BEAT.format(r), 0) for r in others}
    time.sleep(2.5 * period)
    after = {r: store.add(_BEAT.format(r), 0) for r in others}
    return [r for r in others if after[r] == before[r] and not store.check([_EXITED.format(r)])]


def _report_timeout(store: Any, rank: int, world_size: int, period: float, exc: BaseException) -> None:
    """Names the ranks that stopped responding (the likely cause of the timeout), and leaves
    an obituary that says so for the ranks that lose their connection to this one."""
    say = lambda msg: print(f"fshard: rank {rank} of {world_size}: {msg}", file=sys.stderr, flush=True)
    try:
        store.set_timeout(timedelta(seconds=max(2.0, 2 * period)))
        silent = unresponsive_ranks(store, rank, world_size, period)
    except Exception as e:  # the store went away with its host: nothing more to learn here
        say(
            f"the error above is a timeout; the job's store did not answer ({type(e).__name__}), so "
            f"the ranks that stopped responding cannot be named."
        )
        _leave_obituary(store, rank, exc)
        return
    if silent:
        names = _rank_list(silent)
        say(
            f"the error above is a timeout: {names} stopped responding (no heartbeat for "
            f"{2.5 * period:.1f} s: stopped with SIGSTOP, frozen, killed, or stuck holding the GIL). "
            f"{'They are' if len(silent) > 1 else 'It is'} the likely cause; this rank was waiting "
            f"for {'them' if len(silent) > 1 else 'it'}."
        )
        _leave_obituary(store, rank, exc, suffix=f" ({names} stopped responding)")
    else:
        say(
            "the error above is a timeout, and every rank is still alive: a deadlock (ranks calling "
            "different collectives, or a collective some ranks skip) or a rank busy for longer than "
            "the timeout (raise FSHARD_TIMEOUT_S or fs.init(timeout=...))."
        )
        _leave_obituary(store, rank, exc)


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _leave_obituary(store: Any, rank: int, exc: BaseException, suffix: str = "") -> None:
    line = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()
    text = (line[-1] if line else type(exc).__name__)[:500] + suffix
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
    say("the error above is a consequence: another rank of the job stopped while this one was talking to it.")
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
        say(
            f"no rank reported an exception within {wait_s:.0f} s: a rank was killed or crashed "
            f"(a signal, out of memory, a segfault). The launcher's report names it (torchrun: "
            f"'Root Cause')."
        )
    time.sleep(max(0.0, deadline - time.monotonic()))
