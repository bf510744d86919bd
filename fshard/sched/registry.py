"""The schedule registry: every pipeline schedule by name, and the names people type.

``python -m fshard.sched``, ``examples/train_lm.py --schedule`` and ``fs.plan`` take the same
names through :func:`build_schedule` and :func:`resolve_name`. A new generator is one entry
in :data:`GENERATORS` (and its aliases in :data:`ALIASES`).
"""

from __future__ import annotations

from typing import Callable

from fshard.sched.generators import (
    dualpipev,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    zbv,
    zero_bubble,
)
from fshard.sched.greedy import zb_h2
from fshard.sched.ir import Schedule

__all__ = ["ALIASES", "GENERATORS", "build_schedule", "choices", "resolve_name"]

# Canonical name -> generator ``(n_ranks, n_microbatches, *, n_virtual) -> Schedule``.
GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "one_f_one_b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zero_bubble": zero_bubble,
    "zb_h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipev,
}

# Short names people type (and the names the generators print in their grids).
ALIASES: dict[str, str] = {
    "1f1b": "one_f_one_b",
    "pipedream": "one_f_one_b",
    "interleaved": "interleaved_1f1b",
    "i1f1b": "interleaved_1f1b",
    "bfs": "looped_bfs",
    "zb": "zero_bubble",
    "zbh1": "zero_bubble",
    "zb_h1": "zero_bubble",
    "interleaved_zb": "zero_bubble",
    "zbh2": "zb_h2",
    "dualpipe": "dualpipev",
}

# An alias that names a variant also fixes its default stages per rank.
_ALIAS_VIRTUAL: dict[str, int] = {"interleaved_zb": 2}


def resolve_name(name: str) -> str:
    """Returns the canonical generator name for ``name`` (case, ``-`` and ``_`` ignored).

    Raises:
      ValueError: an unknown name; the message lists every accepted name.
    """
    return ALIASES.get(_known(name), _known(name))


def _known(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    for known in [*GENERATORS, *ALIASES]:
        if key == known or key.replace("_", "") == known.replace("_", ""):
            return known
    raise ValueError(f"unknown schedule {name!r}; choose one of {choices()}")


def choices() -> str:
    """Every accepted name, canonical names then aliases, comma-separated (for messages)."""
    return ", ".join(sorted(GENERATORS) + sorted(ALIASES))


def build_schedule(name: str, n_ranks: int, n_microbatches: int, *, n_virtual: int | None = None) -> Schedule:
    """Builds schedule ``name`` (any name or alias of :data:`GENERATORS`).

    Args:
      name: e.g. ``"1f1b"``, ``"interleaved"``, ``"zbv"``.
      n_ranks: pipeline ranks.
      n_microbatches: microbatches per step.
      n_virtual: stages per rank; ``None`` keeps the generator's default (1 for gpipe,
        1f1b and zero_bubble, 2 for the interleaved and V schedules).

    Returns:
      The compute-only :class:`~fshard.sched.Schedule`.

    Raises:
      ValueError: unknown name, or sizes the generator rejects (its message says why).
    """
    gen = GENERATORS[resolve_name(name)]
    n_virtual = n_virtual if n_virtual is not None else _ALIAS_VIRTUAL.get(_known(name))
    kwargs = {} if n_virtual is None else {"n_virtual": n_virtual}
    return gen(n_ranks, n_microbatches, **kwargs)
