"""``P``: the partition spec, one entry per tensor dim.

An entry is ``None`` (the dim is not split), a mesh axis name (split over that axis),
or a tuple of axis names (split over their product, major to minor). Mesh axes that
a spec does not name are replicated. ``P()`` is "replicated everywhere".
"""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["P", "PartitionSpec"]

Entry = "str | tuple[str, ...] | None"


def _normalize(entry: Any, index: int) -> str | tuple[str, ...] | None:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        axes = tuple(entry)
        bad = [a for a in axes if not isinstance(a, str)]
        if bad:
            raise TypeError(f"P entry {index} = {entry!r}: a tuple entry must hold mesh axis names (str), got {bad!r}.")
        if len(axes) == 0:
            return None
        if len(axes) == 1:
            return axes[0]
        return axes
    raise TypeError(
        f"P entry {index} = {entry!r} of type {type(entry).__name__}: each entry must be "
        f"None, a mesh axis name, or a tuple of axis names."
    )


class PartitionSpec:
    """How a tensor is laid out over a mesh: ``P('dp', None)``, ``P(('dp', 'tp'))``, ``P()``.

    Immutable and hashable; ``repr`` round-trips. A one-element tuple entry is stored as
    the bare axis name, and an empty tuple as ``None``, so equal layouts compare equal.

    Example:
      >>> P("fsdp", None)
      P('fsdp', None)
      >>> P(("dp", "tp")).axes()
      ('dp', 'tp')
    """

    __slots__ = ("_entries",)

    def __init__(self, *entries: Any) -> None:
        object.__setattr__(self, "_entries", tuple(_normalize(e, i) for i, e in enumerate(entries)))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        raise TypeError("PartitionSpec cannot be subclassed.")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PartitionSpec is immutable.")

    # Sequence protocol: P behaves like the tuple of its entries, but is a pytree leaf.
    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, i):
        return self._entries[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartitionSpec):
            return self._entries == other._entries
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("P", self._entries))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self._entries) + ")"

    def __reduce__(self):
        return (PartitionSpec, self._entries)

    @property
    def entries(self) -> tuple[Any, ...]:
        """The per-dim entries, normalized."""
        return self._entries

    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec names, in order of appearance."""
        out: list[str] = []
        for e in self._entries:
            if e is None:
                continue
            out.extend((e,) if isinstance(e, str) else e)
        return tuple(out)

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """The axes that split tensor dim ``dim`` (major to minor); ``()`` when none."""
        if dim >= len(self._entries):
            return ()
        e = self._entries[dim]
        if e is None:
            return ()
        return (e,) if isinstance(e, str) else e

    def padded(self, ndim: int) -> "PartitionSpec":
        """This spec extended with ``None`` up to ``ndim`` entries."""
        return PartitionSpec(*self._entries, *([None] * (ndim - len(self._entries))))


P = PartitionSpec


def is_spec(x: Any) -> bool:
    """True for a :class:`P` (the leaf type of spec trees)."""
    return isinstance(x, PartitionSpec)
