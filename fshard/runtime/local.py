"""Run a function on N local ranks: ``fs.run_local`` and the persistent ``WorkerPool``.

Each rank is a child process on a loopback gloo group, one thread each. The parent
hosts the rendezvous store, so there is no port race. A failure on any rank is raised
in the caller as the original exception type, with the rank and the remote traceback
attached; ranks left blocked in a collective by that failure are killed after a short
grace period (``run_local`` stops a failed rank at once, so that the ranks blocked on it
fail with a lost peer rather than wait), and a group that makes no progress before the
timeout is killed with a stack dump of every stuck rank. No child outlives the call
(``run_local``) or the pool.

Why processes and not torch's threaded process group or ``LocalTensorMode``: the
threaded group shares one global RNG and one autograd engine between ranks, and
``LocalTensorMode`` simulates ranks on one tensor-subclass, so neither exercises the
real gloo path that ``torchrun`` runs; both would hide ordering bugs.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch
import torch.distributed as dist

from fshard.runtime import gloo_workers
from fshard.runtime.failure import PEER_LOST

__all__ = ["run_local", "WorkerPool", "RankTimeoutError", "RemoteTraceback", "RankExitError", "UnpicklableResultError"]

_INHERITED: dict[str, Any] = {}


class RemoteTraceback(Exception):
    """Carries a rank's traceback text; set as ``__cause__`` of the re-raised error."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


class RankTimeoutError(TimeoutError):
    """Some ranks made no progress before the timeout; the message shows where each was stuck."""


_GO = "go"  # the message that lets a started rank connect to the store


def _worker_main(
    rank: int, world: int, port: int, conn, stack_path: str, timeout_s: float, finalizes: bool = False
) -> None:
    _IN_RANK.update(rank=rank, world=world)  # a rank cannot start ranks: _refuse_nested
    torch.set_num_threads(1)
    # What the rank inherited (torch, fshard and the test harness's preloads: some 380k
    # objects) is never garbage: out of the collector's reach, a full collection (the
    # explicit gc.collect() of tests and teardown, and the automatic ones) costs
    # milliseconds, not a large part of a second (bench/README.md, "Host costs behind the code").
    gc.freeze()
    # The test suite sets this: a task that returns with a collective still in flight
    # fails (the backend would keep writing its buffers after the test moved on).
    check_leaks = os.environ.get("FSHARD_CHECK_LEAKS") == "1"
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a crashing rank leaves its stack
    # ...and its native stacks, every thread's, on stderr. glibc reports heap corruption
    # ("malloc(): unaligned tcache chunk detected") in whichever thread allocates next, so
    # the Python stack alone does not show what the gloo threads were doing.
    if hasattr(torch._C, "_set_print_stack_traces_on_fatal_signal"):
        torch._C._set_print_stack_traces_on_fatal_signal(True)
    if dist.is_initialized():
        _forget_inherited_groups()
    from fshard.runtime import teardown

    # The parent's meshes (and checkpoint group, collectives in flight) hold its process
    # groups (perhaps destroyed there, so no longer in the world forgotten above): dropping
    # the last reference here would run a group's destructor, which joins gloo threads that
    # did not survive the fork, and hang.
    _LEAKED.extend(owner.after_fork() for owner in teardown.group_owners())
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        # Wait until the parent has started every rank. A forked rank inherits the
        # parent's locks as they were at the fork: had an earlier rank already connected,
        # the parent's store thread could be inside getnameinfo() (formatting that
        # connection's address) holding glibc's resolver lock, and this rank would block
        # forever in its own getnameinfo() (seen: bench/plan_validate.py hung in a
        # 4-rank run_local start-up, the last rank in resolv_conf.c's lock).
        if conn.recv() != _GO:
            raise RuntimeError("fshard: a rank was not released by the pool that started it")
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=timeout_s))
        with gloo_workers.one_worker():  # torch's two gloo workers race (fshard.runtime.gloo_workers)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
            )
    except BaseException as e:  # report start-up failures like any other
        conn.send(("err", _pack_exc(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn = None
        try:
            if msg == "inherited":
                fn, args, kwargs = _INHERITED["task"]
                # run_local's ranks check every collective's header unless the caller said
                # FSHARD_CHECK_COLLECTIVES=0: a notebook's mismatch is an error, not a SIGABRT.
                # Every rank inherits the same environment, so the flag agrees across them.
                os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "1")
            else:
                fn, args, kwargs = msg
            before = _in_flight()
            result = fn(*args, **kwargs)
            if check_leaks and _in_flight() > before:
                raise RuntimeError(
                    f"{getattr(fn, '__qualname__', fn)} returned with {_in_flight() - before} "
                    f"functional collective(s) started and never waited (a dropped fs.comm "
                    f"Handle): their buffers stay in use by the backend"
                )
            _send_result(conn, result, rank, world, fn)
        except BaseException as e:
            # run_local kills a rank as soon as its error arrives: what it printed must be
            # out of its buffers first.
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            conn.send(("err", _pack_exc(_rank_error(e, rank, world, fn))))
    try:
        if finalizes:
            # A spawned rank exits through the interpreter's finalization, where a gloo
            # worker still alive could abort it (fshard.runtime.teardown); a forked one
            # leaves with os._exit and never finalizes.
            from fshard.runtime import teardown

            teardown.shutdown()
        else:
            dist.destroy_process_group()
    finally:
        conn.close()


_LEAKED: list[Any] = []
_IN_RANK: dict[str, int] = {}  # set in a rank process: {"rank": r, "world": n}


class RankExitError(RuntimeError):
    """A rank called ``sys.exit()`` (or raised ``SystemExit``) instead of returning."""


class UnpicklableResultError(TypeError):
    """A rank's result cannot be pickled, so it cannot be sent back to the caller."""


def _task_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _rank_error(e: BaseException, rank: int, world: int, fn: Any) -> BaseException:
    """The error to send for a task that ended with ``e``: ``SystemExit`` becomes a
    :class:`RankExitError`. Sent as it was, the caller would re-raise ``SystemExit`` and its
    process would exit with the rank's code and no word of why (``sys.exit(0)``: exit 0,
    as if all went well)."""
    if not isinstance(e, SystemExit):
        return e
    err = RankExitError(
        f"rank {rank} of {world} called sys.exit({e.code!r}) in {_task_name(fn)} instead of returning "
        f"(exit code {e.code!r}): a rank has no process of its own to exit, and the caller gets no result "
        f"from it. Return a value, or raise an exception to fail the call."
    )
    err.__cause__ = None
    return err


def _send_result(conn: Any, result: Any, rank: int, world: int, fn: Any) -> None:
    """Sends ``("ok", result)``; an unpicklable result raises an error naming this rank, the
    first part of the result that cannot be pickled (its path and type), and the fix."""
    try:  # what Connection.send does, in two steps: the pickling error is ours to explain
        payload = ForkingPickler.dumps(("ok", result))
    except Exception as e:
        path, bad = _unpicklable_part(result)
        raise UnpicklableResultError(
            f"rank {rank} of {world}: the result of {_task_name(fn)} cannot be sent back to the caller: "
            f"{path} is a {type(bad).__module__}.{type(bad).__qualname__}, which cannot be pickled "
            f"({type(e).__name__}: {e}). Return only picklable values (tensors, numbers, strings, and "
            f"lists/tuples/dicts of them): leave {path} out, or convert it (e.g. .tolist(), str())."
        ) from None
    conn.send_bytes(payload)


def _unpicklable_part(value: Any, path: str = "result") -> tuple[str, Any]:
    """The path (``result['a'][1]``) and value of the first leaf of ``value`` that cannot be
    pickled; ``value`` itself when no part of it is to blame on its own."""
    if isinstance(value, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = [(f"{path}.{k}", v) for k, v in vars(value).items()]
    else:
        items = []
    for sub_path, sub in items:
        try:
            ForkingPickler.dumps(sub)
        except Exception:
            return _unpicklable_part(sub, sub_path)
    return path, value


def _refuse_nested(entry: str) -> None:
    """Raises a clear error when a rank of a run_local/WorkerPool tries to start ranks."""
    if not _IN_RANK:
        return
    raise RuntimeError(
        f"{entry} was called inside a rank (rank {_IN_RANK['rank']} of {_IN_RANK['world']}) of another "
        f"fs.run_local or WorkerPool: a rank cannot start ranks of its own. Inside a rank the process "
        f"group already exists: call the inner function directly (fs.make_mesh works there), or call "
        f"{entry} from the top-level process."
    )


def _in_flight() -> int:
    """Functional collectives started and not yet waited, on this process."""
    size = getattr(torch._C._distributed_c10d, "_get_work_registry_size", None)
    return size() if size is not None else 0


def _forget_inherited_groups() -> None:
    """Drops the process groups a forked child inherited from its parent.

    Their gloo threads did not survive the fork, so destroying them could block on
    threads that do not exist; the child forgets them instead (kept referenced, never
    destroyed) and starts its own world.
    """
    from torch.distributed import distributed_c10d as c10d

    _LEAKED.append(c10d._world)
    c10d._world = c10d._World()
    c10d._unregister_all_process_groups()


def _pack_exc(e: BaseException) -> tuple[Any, str]:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        import pickle

        pickle.loads(pickle.dumps(e))
        return e, tb
    except Exception:
        return None, tb


class WorkerPool:
    """``world_size`` long-lived ranks on a loopback gloo group; run many functions on them.

    Args:
      world_size: number of ranks.
      start_method: ``"spawn"`` (default; functions are sent by reference, so they
        must be importable module-level functions) or ``"fork"`` (inherits the parent's
        state; needed for functions defined in a notebook).
      timeout_s: default per-call limit.
      grace_s: after one rank fails, how long the others get to finish before they are
        taken as blocked by the failure and killed.
    """

    def __init__(
        self,
        world_size: int,
        *,
        start_method: str = "spawn",
        timeout_s: float = 120.0,
        grace_s: float = 5.0,
        name: str = "fshard-rank",
    ) -> None:
        _refuse_nested("WorkerPool")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
        self.world_size, self.timeout_s, self.grace_s = world_size, timeout_s, grace_s
        ctx = mp.get_context(start_method)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self._tmp = tempfile.mkdtemp(prefix="fshard-pool-")
        self._stack_paths = [os.path.join(self._tmp, f"rank{r}.stack") for r in range(world_size)]
        self._conns, self._procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                daemon=True,
                name=f"{name}{r}",
                args=(r, world_size, self._store.port, child, self._stack_paths[r], timeout_s, start_method == "spawn"),
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        for c in self._conns:  # every rank forked: now they may connect (see _worker_main)
            try:
                c.send(_GO)
            except OSError:  # that rank already died: the start-up report below says how
                pass
        self._collect(["ready"] * world_size, timeout_s=max(60.0, timeout_s), what="start-up")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout_s: float | None = None,
        grace_s: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank; returns the results by rank.

        ``timeout_s`` and ``grace_s`` override the pool's for this call (a caller that
        knows the other ranks stay blocked after a failure need not wait for them).

        Raises:
          Exception: the first failing rank's exception (its own type), with the rank
            and remote traceback attached; the pool is shut down if other ranks hang.
          RankTimeoutError: no result before the timeout; names stuck ranks and stacks.
        """
        for c in self._conns:
            c.send((fn, args, kwargs))
        return self._collect(
            None, timeout_s=timeout_s or self.timeout_s, what=getattr(fn, "__name__", "fn"), grace_s=grace_s
        )

    def _collect(
        self, expect, *, timeout_s: float, what: str, grace_s: float | None = None, stop_failed: bool = False
    ) -> list[Any]:
        """Each rank's reply to ``what``, by rank; raises the first failure (see :meth:`run`).

        ``grace_s``: how long the other ranks get after one fails (default: the pool's).
        ``stop_failed`` (one-shot ranks, :func:`run_local`): a rank that reported an error is
        killed at once. Its connections close, so a rank blocked in a collective with it
        fails with a lost peer now (and is stopped in turn) instead of waiting out the
        grace period; only ranks blocked on each other still wait for it.
        """
        grace_s = self.grace_s if grace_s is None else grace_s
        results: dict[int, Any] = {}
        errors: dict[int, tuple[Any, str]] = {}
        alive_at_kill: set[int] | None = None  # the ranks alive when this call first killed a failed one
        late_deaths: set[int] = set()  # of those, the ones that died after it
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, self._first_error_time + grace_s)
            if now >= deadline:
                break
            ready = mpc.wait([self._conns[r] for r in pending], timeout=min(0.5, deadline - now))
            for c in ready:
                r = self._conns.index(c)
                try:
                    kind, payload = c.recv()
                except (EOFError, OSError):
                    kind, payload = "err", (None, _death(r, self._procs[r], what))
                except Exception as e:  # e.g. an exception class this process cannot import
                    kind, payload = (
                        "err",
                        (None, f"rank {r}'s reply to {what} cannot be unpickled here: {type(e).__name__}: {e}"),
                    )
                pending.discard(r)
                if kind == "err":
                    if not errors:
                        self._first_error_time = time.monotonic()
                    errors[r] = payload
                    if alive_at_kill is not None and r in alive_at_kill and payload[0] is None:
                        late_deaths.add(r)
                    if stop_failed:
                        if alive_at_kill is None:
                            alive_at_kill = {q for q in pending if self._procs[q].is_alive()}
                        self._procs[r].kill()
                else:
                    results[r] = payload
            for r in list(pending):  # a child that died without a word
                if not self._procs[r].is_alive() and not self._conns[r].poll():
                    pending.discard(r)
                    if not errors:
                        self._first_error_time = time.monotonic()
                    errors[r] = (None, _death(r, self._procs[r], what))
                    if alive_at_kill is not None and r in alive_at_kill:
                        late_deaths.add(r)
        stuck = sorted(pending)
        stopped = _stopped_note([r for r in stuck if _is_stopped(self._procs[r].pid)])
        stacks = self._dump_stacks(stuck) if stuck else ""
        if stuck:
            self.shutdown(kill=True)
        if errors:
            r = _cause(errors, late_deaths)
            exc, tb = errors[r]
            verb = "died" if exc is None and " died (" in tb else "raised"
            note = f"{verb} on rank {r} of {self.world_size} during {what}"
            others = {k: v for k, v in errors.items() if k != r}
            for k, (_, other_tb) in others.items():
                last = other_tb.strip().splitlines()[-1] if other_tb.strip() else "?"
                note += f"\nrank {k} also failed: {last}"
                if "died" in last:
                    crash = self._read_stack(k)
                    if crash:
                        note += f"\n--- rank {k} stack at exit ---\n{crash}"
            if stuck:
                note += f"\nranks {stuck} were still blocked and were killed{stopped}:\n{stacks}"
            if exc is None:
                crash = self._read_stack(r) if "died" in tb else ""
                exc = RuntimeError(f"{note}\n{tb}" + (f"\n--- rank {r} stack at exit ---\n{crash}" if crash else ""))
            elif hasattr(exc, "add_note"):
                exc.add_note(note)
            raise exc from RemoteTraceback(tb)
        if stuck:
            raise RankTimeoutError(
                f"{what}: ranks {stuck} of {self.world_size} made no progress in {timeout_s:.0f} s"
                + (
                    ": " + stopped.lstrip("; ") + ". "
                    if stopped
                    else " (a deadlock: mismatched collectives, or a collective some ranks skip). "
                )
                + f"Where each was stuck:\n{stacks}"
            )
        return [results[r] for r in range(self.world_size)]

    def _read_stack(self, r: int) -> str:
        try:
            with open(self._stack_paths[r]) as f:
                return _trim_stack(f.read().strip())
        except OSError:
            return ""

    def _dump_stacks(self, ranks: list[int]) -> str:
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        out = []
        for r in ranks:
            try:
                with open(self._stack_paths[r]) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            if not text and _is_stopped(self._procs[r].pid):
                text = (
                    f"(no stack: rank {r} is stopped (SIGSTOP/SIGTSTP, or a debugger) and cannot run; "
                    f"the ranks in a collective with it wait for it)"
                )
            out.append(f"--- rank {r} ---\n{_trim_stack(text) or '(no stack)'}")
        return "\n".join(out)

    def shutdown(self, *, kill: bool = False) -> None:
        """Stops every rank (politely unless ``kill``); idempotent."""
        for c in self._conns:
            if not kill:
                try:
                    c.send(None)
                except (OSError, BrokenPipeError):
                    pass
        for p in self._procs:
            if kill:
                p.kill()
            p.join(timeout=5 if not kill else 2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _cause(errors: dict[int, tuple[Any, str]], late_deaths: set[int] | frozenset[int] = frozenset()) -> int:
    """The rank to blame among the failed ones.

    A rank that died beats one that raised, and a rank that raised on its own beats one
    whose collective failed because a peer went away: when one rank is killed the others
    often report the broken connection before the parent notices the death. A rank that
    died after the parent killed a failed rank (``late_deaths``, ``stop_failed``) ranks
    below the ones that raised on their own: a peer blocked in a native collective may
    abort when the killed rank's connections close, and the parent caused that death.
    Ties go to the first to arrive (dicts keep arrival order).
    """

    def rank_of_blame(r: int) -> int:
        exc, tb = errors[r]
        if exc is None and " died (" in tb:
            return 2 if r in late_deaths else 0
        return 3 if any(s in tb for s in PEER_LOST) else 1

    return min(errors, key=rank_of_blame)


def _death(r: int, proc: Any, what: str) -> str:
    proc.join(timeout=2)  # its pipe closed first; the exit code comes when it is reaped
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"rank {r} died (killed by {signal.Signals(-code).name}, exit code {code}) during {what}"
        except ValueError:
            pass
    return f"rank {r} died (exit code {code}) during {what}"


def _stopped_note(ranks: list[int]) -> str:
    if not ranks:
        return ""
    who = f"rank {ranks[0]} was" if len(ranks) == 1 else f"ranks {ranks} were"
    return (
        f"; {who} stopped (SIGSTOP/SIGTSTP, or a debugger), the likely cause: "
        f"the other ranks waited for {'it' if len(ranks) == 1 else 'them'}"
    )


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (Linux ``/proc``: state T or t); False elsewhere.

    A stopped rank cannot answer the SIGUSR1 that asks for its stack, so without this its
    entry would read "(no stack)" and hide the likely cause of the hang.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _trim_stack(text: str, current_lines: int = 40, other_lines: int = 60) -> str:
    """faulthandler's dump of every thread, cut to what a reader needs.

    Each thread's stack is printed innermost frame first, newest thread first, so the
    thread that crashed (``Current thread``, often the oldest: the main thread) can come
    after a long list of idle ones (thread pools, tqdm's monitor). It goes first, with up to
    ``current_lines`` lines; the other threads follow with ``other_lines`` lines in all.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    head: list[str] = []
    blocks: list[list[str]] = []
    for ln in lines:
        if ln.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([ln])
        elif blocks:
            blocks[-1].append(ln)
        else:
            head.append(ln)
    if not blocks:
        return "\n".join(lines[:current_lines])
    current = [b for b in blocks if b[0].startswith("Current thread")]
    out = head + [ln for b in current for ln in b[:current_lines]]
    budget, left = other_lines, 0
    for b in (b for b in blocks if not b[0].startswith("Current thread")):
        if budget <= 0:
            left += 1
            continue
        out += b[:budget]
        budget -= len(b[:budget])
    if left:
        out.append(f"(and {left} more thread(s))")
    return "\n".join(out)


def run_local(
    fn: Callable[..., Any], *args: Any, world_size: int, timeout_s: float = 300.0, grace_s: float = 5.0, **kwargs: Any
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` ranks and returns each rank's result.

    Works from a plain script or a notebook: the ranks are forked child processes, so
    ``fn`` may be defined in the notebook itself. Each rank has a loopback gloo group
    (``fs.make_mesh`` works inside ``fn``), one thread, and the torchrun variables set.

    Args:
      fn: the per-rank function; its result must be picklable.
      *args, **kwargs: passed to ``fn`` on every rank.
      world_size: number of ranks (2 cores here: keep it at 4 or fewer).
      timeout_s: limit for the whole call (default 300 s).
      grace_s: after one rank fails, how long the others get to finish before they are
        taken as blocked by the failure and killed (default 5 s).

    Returns:
      ``[result_of_rank_0, result_of_rank_1, ...]``.

    Raises:
      Exception: the exception of the first failing rank, with its rank and remote
        traceback attached; every child is gone when it propagates. A rank that fails is
        stopped at once: the ranks in a collective with it fail too (a lost peer, listed
        in the notes) instead of waiting out the grace period.
      RankTimeoutError: no result in time; the message shows each stuck rank's stack.
      RankExitError: a rank called ``sys.exit()`` instead of returning; names the rank and
        the exit code.
      UnpicklableResultError: a rank's result cannot be pickled; names the rank and the
        part of the result (path and type) to blame.
      RuntimeError: called inside a rank of another ``run_local`` (ranks cannot nest).

    The ranks check every collective's header across the group (``FSHARD_CHECK_COLLECTIVES=1``,
    see ``fshard._contract``) unless the environment sets ``FSHARD_CHECK_COLLECTIVES=0``: ranks
    that issue different collectives raise ``CollectiveMismatchError`` naming both sides.
    It costs about a millisecond per collective on gloo (bench/README.md).
    """
    _refuse_nested("fs.run_local")
    _INHERITED["task"] = (fn, args, kwargs)
    # Children must never collect the parent's objects: a store or process group from an
    # earlier call (kept alive by a traceback cycle) would run a destructor that waits on
    # a thread that did not survive the fork. gc.freeze() puts them out of the collector's reach.
    gc.collect()
    gc.freeze()
    try:
        pool = WorkerPool(
            world_size, start_method="fork", timeout_s=timeout_s, grace_s=grace_s, name="fshard-local-rank"
        )
        try:
            for c in pool._conns:
                c.send("inherited")
            return pool._collect(None, timeout_s=timeout_s, what=getattr(fn, "__name__", "fn"), stop_failed=True)
        finally:
            pool.shutdown(kill=not pool.alive)
            pool._store = None  # release the rendezvous server now, not at some later collection
    finally:
        gc.unfreeze()
        _INHERITED.clear()
