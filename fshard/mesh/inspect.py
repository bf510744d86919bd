"""``fs.inspect``: every rank's block of a value in one table, inside or outside a body.

One row per rank: the rank's block (its values when small, else a summary), its shape and
dtype, the mesh axes the value varies over, its spec and its global shape. The same call
works in a notebook under ``fs.simulate`` (every rank's block is in this process) and in a
script on real ranks (each rank renders its own row, and the rows are gathered to rank 0,
which prints the table), so a program does not change between the two.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from fshard import meta
from fshard import tree as tree_util
from fshard.mesh.mesh import Mesh
from fshard.mesh.sharding import _mesh_of, spec_of
from fshard.runtime import simulation

__all__ = ["inspect", "Inspection"]

_COLUMNS = ("leaf", "rank", "coord", "shape", "dtype", "vma", "spec", "global", "block")
_ALL = "all"


class Inspection(str):
    """The table :func:`inspect` printed, as plain text (a ``str``).

    Its ``repr`` is the table itself, so a log line or a notebook cell shows the table and
    not a quoted string; a notebook cell ending in ``fs.inspect(x)`` shows it once (the
    call printed it already).
    """

    shown: bool = False

    def __repr__(self) -> str:
        return str(self)

    def _ipython_display_(self) -> None:
        if not self.shown:
            print(str(self))


def inspect(x: Any, *, name: str | None = None, max_values: int = 16, show: bool = True) -> Inspection | None:
    """Prints (and returns) one table with every rank's block of ``x``.

    A row per rank (per leaf, for a pytree) gives the rank, its mesh coordinate, the
    block's shape and dtype, ``vma`` (the mesh axes the value varies over: inside a
    ``shard_map`` body the checked mode's type, ``?`` in unchecked mode; outside, the axes
    a DTensor's spec splits or sums over), the spec and the global shape (``-`` where the
    value has none: a body value that is not an input), and the block: its values when it
    has at most ``max_values`` elements, else ``min``/``max``/``mean``, a CRC32 of its bytes
    and its first elements. A value known to be the same on every rank (a tensor closed
    over by a body, or made outside the simulation) is one row, ``rank all``; a non-tensor
    leaf is shown by its ``repr``.

    Under ``fs.simulate`` every rank's block is in this process. On real ranks it is a
    collective over the default group (with its timeout): every rank calls it, rank 0
    prints the table and returns it, the other ranks return ``None``. Outside a process
    group it shows this process's value. A body prints each time it runs: under
    ``fs.remat`` also when backward recomputes it.

    Args:
      x: a tensor (DTensor, a body's local tensor, a plain tensor) or a pytree of them;
        usable inside a ``shard_map`` body or outside.
      name: a label for the title (default: none).
      max_values: blocks with at most this many elements are shown in full.
      show: print the table (on rank 0).

    Returns:
      The table as :class:`Inspection` (a ``str``), on rank 0 or under a simulation;
      ``None`` on the other real ranks.

    Raises:
      ValueError: ``max_values`` is not an int >= 0.
      RuntimeError: called inside ``fs.jit`` / ``torch.compile`` (a traced program cannot
        print per-rank values; call it outside the compiled step), or on real ranks when a
        rank does not call it (the default group's timeout, naming the collective).
    """
    if not isinstance(max_values, int) or isinstance(max_values, bool) or max_values < 0:
        raise ValueError(f"fs.inspect(max_values={max_values!r}): max_values must be an int >= 0.")
    paths, leaves, _ = tree_util.zip_with_path(x)
    if _tracing(leaves):
        raise RuntimeError(
            "fs.inspect inside fs.jit / torch.compile: a compiled step cannot print per-rank "
            "values. Call fs.inspect on the step's inputs or outputs, outside the compiled step."
        )
    body = meta.BODY.get()
    sim = simulation.active()
    bare = isinstance(x, torch.Tensor) or len(leaves) == 1 and paths[0] in ("", "<root>")
    rows: list[tuple[str, ...]] = []
    meshes: list[Mesh] = []
    with _quiet():
        rank: int | None = None  # None: every simulated rank is here
        if sim is not None:
            world = sim.world_size
        elif dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        for path, leaf in zip(paths, leaves):
            leaf_rows, mesh = _leaf_rows("" if bare else _path_text(path), leaf, body, rank, max_values)
            rows += leaf_rows
            if mesh is not None and mesh not in meshes:
                meshes.append(mesh)
        if rank is not None and world > 1:
            gathered = _gather_rows(rows, rank, world)
            if gathered is None:
                return None
            rows = gathered
    text = Inspection(_render(_title(name, body, sim, world, meshes), _collapse(rows), bare))
    if show:
        print(text, flush=True)
        text.shown = True
    return text


def _tracing(leaves: list[Any]) -> bool:
    """Inside ``torch.compile`` or ``fs.jit``'s capture (``make_fx``: a proxy mode, fake tensors)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if torch.compiler.is_compiling() or get_proxy_mode() is not None:
        return True
    return any(isinstance(t, torch.Tensor) and is_fake(t) for t in leaves)


# --- one leaf ------------------------------------------------------------------------------
def _leaf_rows(
    path: str, leaf: Any, body: meta.Body | None, rank: int | None, max_values: int
) -> tuple[list[tuple[str, ...]], Mesh | None]:
    """Rows ``(leaf, rank, coord, shape, dtype, vma, spec, global, block, hash, invariant)``
    of one leaf: every rank's under a simulation (``rank`` None), else this rank's."""
    if isinstance(leaf, torch.SymInt) and hasattr(leaf.node, "_local_ints"):
        ints = leaf.node._local_ints
        rows: list[tuple[str, ...]] = [
            (path, str(r), "", "", "int", "", "", "", str(v), str(v), "") for r, v in sorted(ints.items())
        ]
        return rows, None
    if not isinstance(leaf, torch.Tensor):
        text = repr(leaf)
        text = text if len(text) <= 80 else text[:77] + "..."
        here = _ALL if rank is None else str(rank)
        return [(path, here, "", "", type(leaf).__name__, "", "", "", text, text, "value")], None
    mesh: Mesh | None = None
    invariant = False
    if isinstance(leaf, DTensor):
        mesh = _mesh_of(leaf)
        vma_text = _braces(a for a, p in zip(mesh.axis_names, leaf.placements) if not p.is_replicate())
        spec_text = _placements_text(leaf, mesh)
        global_text = str(tuple(leaf.shape))
        local = leaf.to_local()
    elif body is not None:
        mesh = body.mesh
        m = meta.meta_of(leaf)
        vma_text = _braces(a for a in mesh.axis_names if a in m.vma) if body.check else "?"
        invariant = body.check and not m.vma
        spec_text = str(m.spec) if m.spec is not None else "-"
        global_text = str(tuple(m.global_shape)) if m.global_shape is not None else "-"
        local = leaf
    else:
        vma_text = spec_text = global_text = "-"
        local = leaf
    local = _unwrapped(local)
    blocks = getattr(local, "_local_tensors", None)
    if rank is None and blocks is None:  # the same tensor on every simulated rank
        per_rank: dict[str, torch.Tensor] = {_ALL: local}
        invariant = True
    elif blocks is not None:
        per_rank = {str(r): blocks[r] for r in sorted(blocks)}
    else:
        per_rank = {str(rank): local}
    coords = _coordinates(mesh) if mesh is not None else {}
    out: list[tuple[str, ...]] = []
    for r, t in per_rank.items():
        block, digest = _block_text(t, max_values)
        coord = coords.get(int(r), "") if r != _ALL else ""
        dtype = str(t.dtype).removeprefix("torch.")
        row = (path, r, coord, str(tuple(t.shape)), dtype, vma_text, spec_text, global_text, block, digest)
        out.append(row + ("1" if invariant else "",))
    return out, mesh


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The value under ``torch.func`` wrappers (``fs.grad``'s levels), detached."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t.detach()


def _block_text(t: torch.Tensor, max_values: int) -> tuple[str, str]:
    """The block's text and a CRC32 of its bytes (hex)."""
    t = t.detach().cpu().contiguous()
    digest = f"{zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes()):08x}" if t.numel() else "empty"
    if t.numel() <= max_values:
        return _values(t.tolist()), digest
    flat = t.reshape(-1)
    first = ", ".join(_number(v) for v in flat[:4].tolist())
    if t.is_complex() or t.dtype == torch.bool:
        return f"crc32 {digest}, first [{first}, ...]", digest
    f = flat.to(torch.float64)
    stats = f"min {_number(f.min().item())} max {_number(f.max().item())} mean {_number(f.mean().item())}"
    return f"{stats}, crc32 {digest}, first [{first}, ...]", digest


def _values(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_values(e) for e in v) + "]"
    return _number(v)


def _number(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _braces(axes: Any) -> str:
    return "{" + ", ".join(axes) + "}"


def _placements_text(x: DTensor, mesh: Mesh) -> str:
    if any(isinstance(p, Partial) for p in x.placements):
        parts = []
        for a, p in zip(mesh.axis_names, x.placements):
            if isinstance(p, Partial):
                parts.append(f"{a}: partial {p.reduce_op}")
            elif isinstance(p, (Shard, _StridedShard)):
                parts.append(f"{a}: shard dim {p.dim}")
        return "(" + ", ".join(parts) + ")"
    return str(spec_of(x, mesh))


def _coordinates(mesh: Mesh) -> dict[int, str]:
    """``{global rank: "dp=0,tp=1"}`` for the mesh's ranks."""
    from fshard.mesh.visualize import rank_grid

    grid = rank_grid(mesh)
    out = {}
    for idx in _indices(tuple(grid.shape)):
        out[int(grid[idx])] = ",".join(f"{a}={i}" for a, i in zip(mesh.axis_names, idx))
    return out


def _indices(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    import itertools

    return itertools.product(*(range(s) for s in shape))


def _path_text(path: Any) -> str:
    text = str(path)
    return text or "<root>"


# --- ranks -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Runs inspect's own tensor ops and its gather outside every mode: not as the
    simulation's per-rank ops, not as checked mode's typed ops (a block converted to Python
    is not the body's value escaping), not in ``fs.comm_log``, and without autograd."""
    from torch.utils._python_dispatch import _disable_current_modes

    with simulation.outside(), _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        yield


def _gather_rows(rows: list[tuple[str, ...]], rank: int, world: int) -> list[tuple[str, ...]] | None:
    """Every rank's rows on rank 0 (``None`` on the others): one ``gather_object``."""
    out: list[Any] | None = [None] * world if rank == 0 else None
    try:
        dist.gather_object(rows, out, dst=0)
    except RuntimeError as e:
        raise RuntimeError(
            f"fs.inspect on rank {rank} of {world}: gathering every rank's block to rank 0 failed "
            f"({str(e)[:300]}). fs.inspect is a collective on real ranks: every rank must call "
            f"it, with the same pytree, at the same point of the program."
        ) from e
    if out is None:
        return None
    return [row for part in out for row in part]


def _collapse(rows: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """A leaf that is invariant by type (or a Python value) and the same on every rank: one
    row (``rank all``); invariant by type but differing blocks: every row, flagged."""
    out: list[tuple[str, ...]] = []
    by_leaf: dict[str, list[tuple[str, ...]]] = {}
    for row in rows:
        by_leaf.setdefault(row[0], []).append(row)
    for leaf_rows in by_leaf.values():
        kinds = {r[10] for r in leaf_rows}
        invariant = kinds == {"1"}
        same = len({r[9] for r in leaf_rows}) == 1 and len({r[3] for r in leaf_rows}) == 1
        if kinds <= {"1", "value"} and len(leaf_rows) > 1 and same:
            out.append(leaf_rows[0][:1] + (_ALL, "") + leaf_rows[0][3:9])
        elif invariant and len(leaf_rows) > 1:
            out += [r[:5] + (r[5] + " (typed invariant, blocks differ)",) + r[6:9] for r in leaf_rows]
        else:
            out += [r[:9] for r in leaf_rows]
    return out


# --- text ------------------------------------------------------------------------------------
def _title(name: str | None, body: meta.Body | None, sim: Any, world: int, meshes: list[Mesh]) -> str:
    what = f"fs.inspect({name})" if name else "fs.inspect"
    if body is not None:
        mode = "checked" if body.check else "unchecked (vma not tracked)"
        where = f"inside a shard_map body on {body.mesh!r}, {mode}"
    else:
        where = "outside a body" + (f", on {', '.join(map(repr, meshes))}" if meshes else "")
    ranks = f"{world} simulated ranks" if sim is not None else f"{world} rank{'s' if world > 1 else ''}"
    return f"{what}: {where}; {ranks}"


def _render(title: str, rows: list[tuple[str, ...]], bare: bool) -> str:
    if not rows:
        return f"{title}\n(no leaves)"
    keep = [i for i, c in enumerate(_COLUMNS) if not (bare and c == "leaf") and any(r[i] for r in rows)]
    keep = keep or [_COLUMNS.index("block")]
    head = [_COLUMNS[i] for i in keep]
    body = [[r[i] for i in keep] for r in rows]
    widths = [max([len(h), *(len(r[j]) for r in body)]) for j, h in enumerate(head)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join(lines)
