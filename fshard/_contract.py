"""Collective contracts: the ranks of a group agree on each collective before they run it.

Every collective fshard issues (``fshard.comm``: all of ``fs.lax`` and the layer loops of
``fs.parallel``) first calls :func:`enter`. It numbers the collective on its group (the
sequence number ``#k``) and folds a header into a rolling hash per group:

  kind (``psum``, ``pmean``, ``all_gather``, ...), mesh axes, local shape, dtype, reduce
  op, group-size argument and extras (a ppermute's pairs).

With ``FSHARD_CHECK_COLLECTIVES=1`` every collective first all-gathers its header (a few
int64s) over the same group and compares: a rank whose header differs makes **every**
rank raise :class:`CollectiveMismatchError`, naming each side's header and the caller's
``file:line`` (the first frame outside fshard and torch). The real collective is never
started, so different shapes are an error, not a SIGABRT or a heap corruption, and
``pmax`` against ``psum`` is an error, not a wrong value. The caller's line is reported,
not compared: rank-dependent code may issue the same collective from different lines.

Without the flag the rule is cheaper: the rolling hash and sequence number are compared
every ``FSHARD_CHECK_EVERY`` collectives of a group (default 64), so a divergence that
did not crash is reported within that many, with the first differing collective of the
last ``FSHARD_CHECK_EVERY`` (their headers are kept, without lines).

The flag must be the same on every rank (it decides whether a header collective runs);
``run_local`` and the test pools pass the parent's environment to their ranks. Under
tracing (``fs.jit``'s ``make_fx``, ``torch.compile``: fake or functional tensors, a proxy
mode) nothing is checked or counted: the collectives in a compiled graph run without
a header.

When a collective times out (:func:`explain_timeout`), each rank says where it is: the
rank whose collective times out publishes its collective to the job's store, and a
watchdog thread (started with the flag on) republishes, every second, the collective of a
rank that has been in one for ``FSHARD_REPORT_AFTER_S`` (default 2 s). The error then
reads, e.g., ``rank 1 is in all_gather #17 over 'fsdp' (scan.py:201); rank 0 is in
psum_scatter #18 over 'fsdp' (scan.py:230)``, and a rank with no fresh report is named as
not in any fshard collective (computing, stopped or dead).
"""

from __future__ import annotations

import collections
import contextvars
import json
import os
import sys
import threading
import time
import zlib
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["CollectiveMismatchError", "CollectiveTimeoutError", "enter", "done", "explain_timeout", "checking"]

ENV = "FSHARD_CHECK_COLLECTIVES"
EVERY_ENV = "FSHARD_CHECK_EVERY"

# The fs.lax name of the collective being issued (psum and pmean are both an all-reduce
# sum on the wire; their headers must still differ). Set by fshard.lax.
WHAT: contextvars.ContextVar[str | None] = contextvars.ContextVar("fshard_collective_what", default=None)


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group called different collectives (kind, axes, shape, dtype, op or
    order); raised on every rank of the group, before the collective runs."""


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out; the message says which collective each rank is in."""


def checking() -> bool:
    """Whether full header checks are on (``FSHARD_CHECK_COLLECTIVES=1``), read at call time."""
    return os.environ.get(ENV, "0") == "1"


def _every() -> int:
    return max(1, int(os.environ.get(EVERY_ENV, "64")))


# --- headers ---------------------------------------------------------------------------
def _package_dir(name: str) -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    return os.path.dirname(os.path.abspath(spec.origin)) + os.sep if spec and spec.origin else None


# Frames in these are not "the caller": fshard itself, torch (autograd, checkpointing),
# optree (fshard.tree maps over pytrees with it) and the standard library (contextlib).
_SKIP = tuple(
    d
    for d in (
        os.path.dirname(os.path.abspath(__file__)) + os.sep,
        _package_dir("torch"),
        _package_dir("optree"),
        os.path.dirname(os.path.abspath(os.__file__)) + os.sep,
    )
    if d
)
_CODES: dict[Any, int] = {}  # stable codes of strings and dtypes (Python's str hash is salted per process)


def _code(value: Any) -> int:
    code = _CODES.get(value)
    if code is None:
        code = _CODES[value] = zlib.crc32(repr(value).encode())
    return code


def _caller() -> str:
    """``file:line in function`` of the first frame outside fshard, torch, optree and the
    standard library (the user's code that issued the collective)."""
    f: Any = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_SKIP) or name.startswith("<")):
            return f"{os.path.basename(name)}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "?"


class _Header:
    """One collective as this rank issues it; ``key`` is what the ranks must agree on."""

    __slots__ = ("kind", "axes", "shape", "dtype", "op", "n", "extra", "seq", "line", "key")

    def __init__(self, kind, axes, shape, dtype, op, n, extra, seq, line) -> None:
        self.kind, self.axes, self.shape, self.dtype, self.op = kind, axes, shape, dtype, op
        self.n, self.extra, self.seq, self.line = n, extra, seq, line
        # Ints only, so Python's hash of the tuple is the same in every process.
        self.key = hash((_code(kind), _code(axes), shape, _code(dtype), _code(op), n, extra))

    def text(self) -> str:
        op = f", op {self.op}" if self.op else ""
        extra = f", {self.extra_text()}" if self.extra else ""
        where = f" ({self.line})" if self.line else ""
        axes = repr(self.axes[0]) if len(self.axes) == 1 else repr(self.axes)
        return (
            f"{self.kind} #{self.seq} over {axes}{where}: shape {tuple(self.shape)}, "
            f"{str(self.dtype).removeprefix('torch.')}{op}{extra}"
        )

    def extra_text(self) -> str:
        return f"pairs {list(self.extra)}" if self.kind == "ppermute" else f"{self.extra}"


class _Group:
    """Per-group state: the sequence number, the rolling hash, the recent headers."""

    __slots__ = ("seq", "rolling", "recent")

    def __init__(self) -> None:
        self.seq, self.rolling = 0, 0
        self.recent: collections.deque = collections.deque(maxlen=_every())


_GROUPS: dict[tuple[int, str], _Group] = {}


def forget_groups() -> None:
    """Drops every group's numbering (``fs.shutdown()`` destroys the groups)."""
    _GROUPS.clear()


def _tracing(x: torch.Tensor) -> bool:
    """Under make_fx / torch.compile: no real communication may be issued, nor counted."""
    if torch.compiler.is_compiling() or type(x) not in (torch.Tensor, torch.nn.Parameter):
        return True
    if not torch._C._len_torch_dispatch_stack():  # the common case: no mode at all
        return False
    key = torch._C._TorchDispatchModeKey
    return any(torch._C._get_dispatch_mode(k) is not None for k in (key.PROXY, key.FAKE, key.FUNCTIONAL))


def enter(
    group, kind: str, x: torch.Tensor, axes: Sequence[str], *, op: str | None = None, n: int = 0, extra: tuple = ()
) -> None:
    """Numbers and checks the collective about to run on ``group`` (see the module docstring).

    Args:
      kind: the wire kind (``psum`` for an all-reduce sum); fs.lax's name wins when set.
      x: this rank's input (its shape and dtype are the header's).
      op: the reduce op, if any; ``n``: the group-size argument; ``extra``: ints that
        must also agree (a ppermute's pairs).

    Raises:
      CollectiveMismatchError: (checked, or every N-th) a rank of the group differs.
    """
    if _tracing(x):
        return
    state = _GROUPS.get((id(group), group.group_name))
    if state is None:
        state = _GROUPS[(id(group), group.group_name)] = _Group()
    state.seq += 1
    full = checking()
    header = _Header(
        WHAT.get() or kind,
        tuple(axes),
        tuple(x.shape),
        x.dtype,
        op,
        n,
        tuple(extra),
        state.seq,
        _caller() if full else None,
    )
    before = state.rolling
    state.rolling = hash((state.rolling, header.key)) & 0x7FFFFFFFFFFFFFFF
    state.recent.append(header)
    _watch(group, header, full)
    if full or state.seq % (state.recent.maxlen or 1) == 0:
        try:
            _outside_modes(lambda: _agree(group, x, state, header, full))
        except CollectiveMismatchError:
            if full:  # it never ran, on any rank: the group stays in step for what follows
                state.seq, state.rolling = state.seq - 1, before
                state.recent.pop()
            raise


# --- agreement ---------------------------------------------------------------------------
def _agree(group, x: torch.Tensor, state: _Group, header: _Header, full: bool) -> None:
    """All-gathers ``[seq, key, rolling]`` over ``group``; on a difference, every rank raises."""
    device = x.device if x.device.type != "cpu" and not _gloo(group, x.device.type) else torch.device("cpu")
    mine = torch.tensor([header.seq, header.key, state.rolling], dtype=torch.int64, device=device)
    size = group.size()
    every = torch.empty(size * 3, dtype=torch.int64, device=device)
    try:
        _all_gather(every, mine, group)
    except RuntimeError as e:
        explain_timeout(e, group)
        raise
    # Checked: this collective's number and header. Every N-th: the rolling hash too (the
    # history since the last check); a checked run does not compare it, so that a
    # difference already reported (or from an unchecked stretch) is not reported again.
    rows = [r if not full else r[:2] for r in every.view(size, 3).tolist()]
    if all(r == rows[0] for r in rows):
        return
    texts = [None] * size
    recent = [h.text() for h in state.recent] if not full else [header.text()]
    dist.all_gather_object(texts, (dist.get_rank(), recent), group=group)
    raise CollectiveMismatchError(_mismatch_message(texts, full))


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (renamed in torch 2.13)
    gather(out, mine, group=group)


def _not_known(group, device_type: str) -> bool:
    return False


# Whether a group runs on gloo for a device type: fshard.comm (which imports this module and
# issues every collective that reaches enter()) sets it to its cached backend lookup.
is_gloo: Callable[[Any, str], bool] = _not_known


def _gloo(group, device_type: str) -> bool:
    return is_gloo(group, device_type)


def _outside_modes(fn):
    """Runs ``fn`` with no dispatch mode active: comm_log must not count the header
    exchange, and a checkpoint policy must neither record its ops in the forward nor
    serve them from a cache on recomputation."""
    if not torch._C._len_torch_dispatch_stack():
        return fn()
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return fn()


def _mismatch_message(texts: list, full: bool) -> str:
    """Every rank's header, grouped by header (``ranks 0-2: ...``)."""
    if full:
        lines = _grouped({rank: recent[-1] for rank, recent in texts})
        return (
            "fshard: the ranks of one group called different collectives (" + ENV + "=1 caught it before "
            "it ran):\n" + lines + "\nEvery rank of a group must issue the same collectives in the same "
            "order, with the same shapes, dtypes and ops."
        )
    first = _first_difference([recent for _, recent in texts])
    where = {rank: recent[first] if first < len(recent) else "(none)" for rank, recent in texts}
    return (
        f"fshard: the ranks of one group issued different collectives (the every-{_every()} check of "
        f"{EVERY_ENV}; run with {ENV}=1 to stop at the first one with the callers' lines). The first that "
        f"differs:\n" + _grouped(where)
    )


def _first_difference(seqs: list[list[str]]) -> int:
    for i in range(max(len(s) for s in seqs)):
        if len({s[i] if i < len(s) else None for s in seqs}) > 1:
            return i
    return 0


def _grouped(by_rank: dict[int, str]) -> str:
    """``  rank 3: X`` / ``  ranks 0-2: Y``, one line per distinct text (lines differ per rank)."""
    texts: dict[str, list[int]] = {}
    for rank in sorted(by_rank):
        texts.setdefault(by_rank[rank], []).append(rank)
    return "\n".join(f"  {_ranks(ranks)}: {text}" for text, ranks in texts.items())


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2``, ``ranks 0, 2``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


# --- timeouts ------------------------------------------------------------------------------
_KEY = "fshard/collective/{}"
REPORT_AFTER_S = float(os.environ.get("FSHARD_REPORT_AFTER_S", "2"))
FRESH_S = 3.0  # a report older than this is not taken as "still there"


class _Now:
    """What this process is in: the header, since when, done or not (read by the watchdog)."""

    header: _Header | None = None
    group: Any = None
    since = 0.0
    busy = False


def _watch(group, header: _Header, full: bool) -> None:
    _Now.header, _Now.group, _Now.since, _Now.busy = header, group.group_name, time.monotonic(), True
    if full:
        _start_watchdog()


def done() -> None:
    """The collective entered last has completed (``fshard.comm`` calls it on wait)."""
    _Now.busy = False


def _report(state: str) -> str:
    h = _Now.header
    return json.dumps(
        {"t": time.time(), "state": state, "group": _Now.group, "text": h.text() if h is not None else None}
    )


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


_WATCHDOG: dict[str, Any] = {}


def _start_watchdog() -> None:
    """A daemon thread that republishes, every second, the collective this rank has been
    in for ``REPORT_AFTER_S`` (a stuck peer's timeout may come much later than ours)."""
    if _WATCHDOG.get("pid") == os.getpid() or not dist.is_initialized():
        return
    _WATCHDOG["pid"] = os.getpid()
    threading.Thread(
        target=_watchdog, args=(_store(), dist.get_rank()), daemon=True, name="fshard-collective-watchdog"
    ).start()


def _watchdog(store, rank: int) -> None:
    published = False
    while True:
        time.sleep(1.0)
        stuck = _Now.busy and time.monotonic() - _Now.since > REPORT_AFTER_S
        if not stuck and not published:
            continue
        try:  # while stuck, every second; once more when it is over (an "in" must not outlive it)
            store.set(_KEY.format(rank), _report("in" if stuck else "out"))
        except Exception:  # the store went away (the job ends): nothing left to report to
            return
        published = stuck


def explain_timeout(exc: BaseException, group) -> None:
    """If ``exc`` is a timeout, raises :class:`CollectiveTimeoutError` from it, saying
    which collective each rank of the job is in (see the module docstring); else returns."""
    text = str(exc)
    if "imed out" not in text and "imeout" not in text:
        return
    if not dist.is_initialized() or _Now.header is None:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store()
    try:
        store.set(_KEY.format(rank), _report("in"))
        reports = _collect(store, rank, world)
    except Exception:  # noqa: BLE001 - the store is gone: say what this rank knows
        reports = {rank: json.loads(_report("in"))}
    said = f"\n(the backend said: {text[:300]})"
    raise CollectiveTimeoutError(_timeout_message(rank, world, reports) + said) from exc


def _collect(store, rank: int, world: int, wait_s: float | None = None) -> dict[int, dict]:
    """Fresh reports of every rank, waiting up to ``wait_s`` (``FSHARD_TIMEOUT_REPORT_S``,
    default 3 s) for the ranks that have not published one yet."""
    wait_s = float(os.environ.get("FSHARD_TIMEOUT_REPORT_S", "3")) if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    reports: dict[int, dict] = {}
    while True:
        for r in range(world):
            if r not in reports and store.check([_KEY.format(r)]):
                report = json.loads(store.get(_KEY.format(r)))
                if time.time() - report["t"] < FRESH_S + wait_s:
                    reports[r] = report
        if len(reports) == world or time.monotonic() > deadline:
            return reports
        time.sleep(0.1)


def _timeout_message(rank: int, world: int, reports: dict[int, dict]) -> str:
    """``rank 1 is in all_gather #17 over 'fsdp' (x.py:3): ...; ranks 0, 2-3 are in ...``."""
    where: dict[str, list[int]] = {}
    for r in sorted(reports):
        if reports[r].get("state") == "in" and reports[r].get("text"):
            where.setdefault(reports[r]["text"], []).append(r)
    parts = [f"{_ranks(rs)} {'is' if len(rs) == 1 else 'are'} in {text}" for text, rs in where.items()]
    missing = [r for r in range(world) if not any(r in rs for rs in where.values())]
    if missing:
        parts.append(
            f"{_ranks(missing)}: no report of an fshard collective (computing, stopped, dead, or in "
            f"a collective outside fshard)"
        )
    return f"fshard: rank {rank}: a collective timed out. Where each rank is:\n  " + ";\n  ".join(parts)
