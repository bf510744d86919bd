"""Pipeline schedule IR: actions, per-rank schedules, stage placement, CSV.

A schedule is data. Each rank owns an ordered list of :class:`Action` records; a
runtime walks its own rank's list front to back and never decides anything else.
Generators build compute-only lists (F/B/I/W); :func:`fshard.sched.lower` adds the
point-to-point SEND/RECV actions between ranks.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, NamedTuple, Union

import attrs

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "stage_to_rank"]


class ScheduleError(ValueError):
    """A schedule is malformed: wrong placement, missing work, bad order or deadlock."""


class Kind(str, enum.Enum):
    """What an :class:`Action` does.

    ``B`` is the full backward (``I`` then ``W`` fused); ``I`` computes only the
    input gradient and ``W`` only the weight gradient of the same (stage, mb).
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble paper's name for backward-input
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    OVERLAP_F_B = "OVERLAP_F_B"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP_F_B})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
STAGE_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD})
_SIMPLE_COMPUTE = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
# Which neighbour a comm action talks to, as an offset from its own stage.
_PEER_OFFSET = {Kind.SEND_F: 1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: 1}

_ACTION_RE = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP_RE = re.compile(r"\((.*)\)OVERLAP_F_B")


class _ActionFields(NamedTuple):
    kind: Kind
    stage: int
    microbatch: int | None = None
    sub: tuple[Action, ...] = ()


class Action(_ActionFields):
    """One step of one rank: ``Action(kind, stage, microbatch)``.

    ``str(action)`` is ``"{stage}{kind}{microbatch}"`` (``"2F0"``, ``"1SEND_F3"``,
    ``"0UNSHARD"``) and :meth:`parse` inverts it. ``stage`` is always the stage
    *this* rank runs; for comm actions the other end is :attr:`peer_stage`.
    An ``OVERLAP_F_B`` action (DualPipeV) has ``stage=-1``, no microbatch and two
    compute sub-actions in ``sub`` that a runtime runs in order; it prints as
    ``"(0F3;7B1)OVERLAP_F_B"``.

    Args:
        kind: a :class:`Kind` or its string value.
        stage: global stage index (>= 0; -1 only for OVERLAP_F_B).
        microbatch: microbatch index; required for compute and comm kinds, None
            for UNSHARD/RESHARD/REDUCE_GRAD/OVERLAP_F_B (optional, default None).
        sub: the sub-actions of an OVERLAP_F_B (optional, default ()).

    Raises:
        ValueError: unknown kind, negative indices, or a microbatch/sub that does
            not fit the kind.
    """

    __slots__ = ()

    def __new__(
        cls,
        kind: Kind | str,
        stage: int,
        microbatch: int | None = None,
        sub: Iterable[Action] = (),
    ) -> Action:
        if kind.__class__ is not Kind:
            kind = Kind(kind)
        sub = tuple(sub)
        _check_action(kind, stage, microbatch, sub)
        return super().__new__(cls, kind, stage, microbatch, sub)

    @classmethod
    def _trusted(cls, kind: Kind, stage: int, microbatch: int | None) -> Action:
        # For internally built actions whose fields are known good: skips the
        # checks, which dominate lowering and validation time on large grids.
        return tuple.__new__(cls, (kind, stage, microbatch, ()))

    def __str__(self) -> str:
        if self.kind is Kind.OVERLAP_F_B:
            return "(" + ";".join(str(a) for a in self.sub) + ")OVERLAP_F_B"
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __repr__(self) -> str:
        return f"Action.parse({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parses ``"2F0"``, ``"1SEND_F3"``, ``"0UNSHARD"`` or ``"(0F3;7B1)OVERLAP_F_B"``.

        Args:
            text: the action string (surrounding whitespace is ignored).

        Returns:
            The :class:`Action`.

        Raises:
            ValueError: the text is not an action string.
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"expected an Action or an action string, got {text!r}")
        text = text.strip()
        overlap = _OVERLAP_RE.fullmatch(text)
        if overlap:
            parts = tuple(cls.parse(t) for t in overlap.group(1).split(";"))
            return cls(Kind.OVERLAP_F_B, -1, None, parts)
        match = _ACTION_RE.fullmatch(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected '<stage><kind><microbatch>' "
                f"such as '2F0', '1SEND_F3' or '0UNSHARD'"
            )
        stage, kind, mb = match.groups()
        return cls(kind, int(stage), int(mb) if mb else None)

    @property
    def is_compute(self) -> bool:
        """True for F, B, I, W and OVERLAP_F_B."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for SEND_F, RECV_F, SEND_B and RECV_B."""
        return self.kind in COMM_KINDS

    @property
    def parts(self) -> tuple[Action, ...]:
        """The simple compute actions this action performs (itself, or its sub-actions)."""
        return self.sub or (self,)

    @property
    def peer_stage(self) -> int | None:
        """For SEND/RECV: the stage at the other end (SEND_F/RECV_B: stage+1,
        RECV_F/SEND_B: stage-1); None for other kinds."""
        offset = _PEER_OFFSET.get(self.kind)
        return None if offset is None else self.stage + offset


def _check_action(kind: Kind, stage: int, mb: int | None, sub: tuple[Action, ...]) -> None:
    if kind is Kind.OVERLAP_F_B:
        if stage != -1 or mb is not None:
            raise ValueError(f"OVERLAP_F_B takes stage=-1 and no microbatch, got {stage=}, {mb=}")
        if len(sub) != 2 or any(not isinstance(a, Action) or a.kind not in _SIMPLE_COMPUTE for a in sub):
            raise ValueError(f"OVERLAP_F_B needs exactly two F/B/I/W sub-actions, got {[str(a) for a in sub]}")
        return
    if sub:
        raise ValueError(f"only OVERLAP_F_B has sub-actions, got kind {kind.value}")
    if stage.__class__ is not int or stage < 0:
        raise ValueError(f"stage must be an int >= 0, got {stage!r} for kind {kind.value}")
    if kind in STAGE_KINDS:
        if mb is not None:
            raise ValueError(f"{kind.value} acts on a whole stage, got microbatch={mb}")
    elif mb.__class__ is not int or mb < 0:
        raise ValueError(f"{kind.value} on stage {stage} needs a microbatch >= 0, got {mb!r}")


def stage_to_rank(n_ranks: int, n_stages: int, placement: str) -> tuple[int, ...]:
    """Maps each stage to the rank that holds it.

    ``"loop"`` puts stage s on rank ``s % n_ranks`` (interleaved schedules).
    ``"v"`` zig-zags: stages 0..p-1 go down ranks 0..p-1, stages p..2p-1 come back
    up p-1..0, and so on, so rank 0 holds both the first and the last stage.

    Args:
        n_ranks: number of pipeline ranks p (>= 1).
        n_stages: number of stages, a multiple of n_ranks.
        placement: ``"loop"`` or ``"v"``.

    Returns:
        A tuple whose entry s is the rank of stage s.

    Raises:
        ScheduleError: bad sizes or an unknown placement.
    """
    if n_ranks < 1 or n_stages < n_ranks or n_stages % n_ranks:
        raise ScheduleError(f"n_stages must be a positive multiple of n_ranks, got {n_stages=}, {n_ranks=}")
    if placement == "loop":
        return tuple(s % n_ranks for s in range(n_stages))
    if placement == "v":
        return tuple(s % n_ranks if (s // n_ranks) % 2 == 0 else n_ranks - 1 - s % n_ranks for s in range(n_stages))
    raise ScheduleError(f"placement must be 'loop' or 'v', got {placement!r}")


ActionLike = Union[Action, str]


def _to_actions(
    value: Sequence[Iterable[ActionLike]] | Mapping[int, Iterable[ActionLike]],
) -> tuple[tuple[Action, ...], ...]:
    if isinstance(value, Mapping):
        if sorted(value) != list(range(len(value))):
            raise ScheduleError(f"rank keys must be 0..n-1, got {sorted(value)}")
        value = [value[r] for r in range(len(value))]
    return tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row if a is not None) for row in value)


@attrs.frozen(kw_only=True)
class Schedule:
    """Per-rank ordered action lists plus the sizes and stage placement.

    Args:
        actions: one sequence of actions per rank (Actions or their strings; a
            mapping rank -> sequence works too; None entries are dropped).
        n_stages: number of pipeline stages (n_ranks * n_virtual).
        n_microbatches: number of microbatches m (>= 1).
        placement: ``"loop"`` or ``"v"`` (optional, default "loop"); see
            :func:`stage_to_rank`.
        name: a label used in printouts and plots (optional, default "custom").

    Raises:
        ScheduleError: bad sizes, or an action whose stage or microbatch is out of
            range or whose stage is not held by the rank it is listed on.
    """

    actions: tuple[tuple[Action, ...], ...] = attrs.field(converter=_to_actions)
    n_stages: int
    n_microbatches: int
    placement: str = "loop"
    name: str = "custom"
    _ranks: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.actions:
            raise ScheduleError("a schedule needs at least one rank")
        if self.n_microbatches < 1:
            raise ScheduleError(f"n_microbatches must be >= 1, got {self.n_microbatches}")
        ranks = stage_to_rank(len(self.actions), self.n_stages, self.placement)
        object.__setattr__(self, "_ranks", ranks)
        n_stages, n_mb = self.n_stages, self.n_microbatches
        for rank, row in enumerate(self.actions):
            for index, action in enumerate(row):
                for part in action.sub or (action,):
                    stage, mb = part.stage, part.microbatch
                    if (
                        stage >= n_stages
                        or ranks[stage] != rank
                        or (mb is not None and mb >= n_mb)
                        or (part.kind in COMM_KINDS and not 0 <= part.peer_stage < n_stages)
                    ):
                        raise ScheduleError(self._misplaced(rank, index, action, part))

    def _misplaced(self, rank: int, index: int, action: Action, part: Action) -> str:
        where = f"rank {rank} action #{index} {action}"
        if part.stage >= self.n_stages:
            return f"{where}: stage {part.stage} >= n_stages={self.n_stages}"
        if part.microbatch is not None and part.microbatch >= self.n_microbatches:
            return f"{where}: microbatch {part.microbatch} >= n_microbatches={self.n_microbatches}"
        if self._ranks[part.stage] != rank:
            return (
                f"{where}: stage {part.stage} lives on rank {self._ranks[part.stage]} "
                f"under {self.placement!r} placement with n_ranks={self.n_ranks}, "
                f"n_stages={self.n_stages}"
            )
        return f"{where}: peer stage {part.peer_stage} does not exist"

    @property
    def n_ranks(self) -> int:
        """Number of pipeline ranks p."""
        return len(self.actions)

    @property
    def n_virtual(self) -> int:
        """Stages per rank v (n_stages // n_ranks)."""
        return self.n_stages // self.n_ranks

    @property
    def last_rank(self) -> int:
        """The rank holding the last stage, where the loss is computed (0 for "v")."""
        return self._ranks[-1]

    @property
    def is_lowered(self) -> bool:
        """True when cross-rank transfers are explicit SEND/RECV actions (or none are needed)."""
        return self.n_ranks == 1 or any(a.is_comm for row in self.actions for a in row)

    def rank_of(self, stage: int) -> int:
        """Returns the rank holding ``stage``.

        Raises:
            ScheduleError: stage out of range.
        """
        if not 0 <= stage < self.n_stages:
            raise ScheduleError(f"stage {stage} out of range for n_stages={self.n_stages}")
        return self._ranks[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Returns the stages held by ``rank``, ascending.

        Raises:
            ScheduleError: rank out of range.
        """
        if not 0 <= rank < self.n_ranks:
            raise ScheduleError(f"rank {rank} out of range for n_ranks={self.n_ranks}")
        return tuple(s for s, r in enumerate(self._ranks) if r == rank)

    def peer_rank(self, action: Action) -> int:
        """Returns the rank at the other end of a SEND/RECV action.

        Raises:
            ScheduleError: the action is not a SEND/RECV.
        """
        peer = action.peer_stage
        if peer is None:
            raise ScheduleError(f"{action} is not a SEND/RECV action and has no peer")
        return self.rank_of(peer)

    def compute_only(self) -> Schedule:
        """Returns a copy without SEND/RECV actions (undoes :func:`lower`)."""
        rows = [[a for a in row if not a.is_comm] for row in self.actions]
        return attrs.evolve(self, actions=rows)

    def __str__(self) -> str:
        """A grid with one column per rank and one row per list position."""
        from fshard.sched._text import format_grid

        return format_grid(self)

    def to_csv(self, path: str | os.PathLike[str] | IO[str] | None = None, *, header: bool = True) -> str:
        """Writes one CSV row per rank, one action string per cell.

        Args:
            path: a file path or text stream to write to; None only returns the
                text (optional, default None).
            header: start with a ``# fshard.sched {json}`` line carrying name,
                sizes and placement; without it the rows are exactly
                torch.distributed.pipelining's CSV format (optional, default True).

        Returns:
            The CSV text.
        """
        from fshard.sched._text import write_csv

        return write_csv(self, path, header=header)

    @classmethod
    def from_csv(cls, path: str | os.PathLike[str] | IO[str], **overrides: object) -> Schedule:
        """Reads a schedule written by :meth:`to_csv` (or by torch's ``_dump_csv``).

        Sizes missing from the file are inferred: n_stages and n_microbatches from
        the largest indices, placement as "loop" if it fits, else "v".

        Args:
            path: a file path or text stream.
            **overrides: name, n_stages, n_microbatches or placement to use instead
                of the header's or inferred values.

        Returns:
            The :class:`Schedule`.

        Raises:
            ScheduleError: the file holds no actions, or no placement fits.
            ValueError: a cell is not an action string.
        """
        from fshard.sched._text import read_csv

        return read_csv(path, overrides)
