"""``fs.simulate(n)``: a whole mesh of ``n`` ranks in one process.

Built on torch's ``LocalTensorMode`` (every tensor holds one block per simulated rank, and
DTensor ops and collectives run on all of them) and the ``fake`` process-group backend
(groups exist, nothing crosses a wire). fshard adds no collective implementation of its
own; where torch's simulation would differ from real ranks, a small shim below fixes it on
fshard's side, each listed in ``docs/simulate.md``:

- ``ring_sum``: a sum over ranks adds in gloo's ring order, so a ``psum`` over 4 ranks is
  bit-identical to gloo's (torch's simulation folds in rank order).
- ``refuse_rank_branch``: comparing a per-rank int (a mesh coordinate, an uneven block's
  size) in Python in a way whose answer differs per rank raises, naming the user's line
  (torch's simulation answers ``False`` for ``==``, raises a bare AssertionError for ``<``);
  the comparisons torch's C++ makes (a LocalTensor's sizes, autograd's shape checks) keep
  torch's answer.
- ``partial_ranks``: an op on a value only some ranks hold (a pipeline stage's gradient)
  runs on those ranks (torch's simulation looks up every rank's block and fails).
- ``broadcast_root``: a broadcast over a group whose ranks are not 0..k-1 takes its root's
  block (torch's simulation reads the group rank of the root as a world rank).
- ``local_contiguous``: ``contiguous()`` of a non-contiguous value is ``aten.clone`` run
  per rank, as on a real rank (torch's ``LocalTensor.contiguous`` builds the result outside
  dispatch, so checked mode lost its varying axes: a Hugging Face attention's
  ``.transpose(1, 2).contiguous()`` on data split over ``dp`` gave wrong gradients).
- ``one_thread``: ops run on one intra-op thread, as on ``fs.run_local``'s ranks (a CPU
  reduction such as layer_norm's weight gradient adds in an order that follows the thread
  count: the last bit differed on 2 threads).

Per-rank Python is the one thing a simulation cannot run: ``if dist.get_rank() == 0`` or
``if int(fs.lax.axis_index("dp")) == 0`` would take one branch for all ranks. Such a
branch raises :class:`RankBranchError` naming the line, never a silently wrong result.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import operator
import os
import sys
import traceback
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from fshard.runtime import teardown

__all__ = ["simulate", "Simulation", "RankBranchError", "active", "world_size", "per_rank", "rank_tensor", "host_int"]

_T = TypeVar("_T")
_ACTIVE: list["Simulation"] = []


class RankBranchError(RuntimeError):
    """Per-rank Python under ``fs.simulate``: a value that differs per rank was used where one
    host value is needed (a branch, ``int(...)``, a shape), at the line named in the message."""


_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


# fshard's dispatch layers: the line of an op passing through them is the caller's, not theirs.
_DISPATCH_FILES = ("simulation.py", os.path.join("transforms", "vma.py"))


def _user_line() -> str:
    """``file:line: code`` of the innermost frame outside fshard, torch and installed
    packages, then (when the value came from inside fshard) fshard's innermost line."""
    stack = traceback.extract_stack()[:-1]
    inner = next(
        (
            f
            for f in reversed(stack)
            if f.filename.startswith(_LIBRARY_DIRS[0]) and not f.filename.endswith(_DISPATCH_FILES)
        ),
        None,
    )
    for frame in reversed(stack):
        f = frame.filename
        if f.startswith(_LIBRARY_DIRS) or "site-packages" in f or f.startswith(sys.prefix) or "<frozen" in f:
            continue
        code = (frame.line or linecache.getline(f, frame.lineno or 0)).strip()
        where = f"{f}:{frame.lineno}: {code}"
        if inner is not None:
            where += f" (inside fshard: {os.path.relpath(inner.filename, _LIBRARY_DIRS[0])}:{inner.lineno})"
        return where
    return "<unknown>"


def _branch_error(what: str, values: dict[int, Any]) -> RankBranchError:
    shown = ", ".join(f"rank {r}: {v}" for r, v in sorted(values.items()))
    return RankBranchError(
        f"fs.simulate: {what} differs per rank ({shown}) at {_user_line()}. A simulation runs "
        f"one Python program for every rank, so per-rank Python (a branch on the rank, "
        f"int(fs.lax.axis_index(...)), dist.get_rank()) cannot be simulated. Write it as "
        f"tensor code (torch.where(fs.lax.axis_index(axis) == 0, a, b)), or run on real ranks "
        f"(fs.run_local / torchrun)."
    )


# --- shims over torch's simulation ---------------------------------------------------------
def _ring_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum gloo's ring all-reduce computes (torch 2.13's gloo, measured): the flat
    buffer is cut into n chunks of ``ceil(numel / n)`` elements rounded up to even; chunk c
    adds the ranks' values starting at rank c-1 and going down the ring (c-1, c-2, ..., c)."""
    n = len(tensors)
    if n <= 2 or not tensors[0].is_floating_point():
        return functools.reduce(operator.add, tensors)  # exact, or the same in any order
    flat = [t.reshape(-1) for t in tensors]
    numel = flat[0].numel()
    chunk = -(-numel // n)
    chunk += chunk % 2
    out = torch.empty_like(flat[0])
    for c in range(n):
        lo, hi = min(c * chunk, numel), min((c + 1) * chunk, numel)
        if lo == hi:
            continue
        acc = flat[(c - 1) % n][lo:hi].clone()
        for k in range(2, n + 1):
            acc = acc + flat[(c - k) % n][lo:hi]
        out[lo:hi] = acc
    return out.view(tensors[0].shape)


def _install_shims() -> Callable[[], None]:
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor
    from torch.distributed._local_tensor import _c10d as local_c10d

    saved_reduce = local_c10d._local_reduce
    compared = {"eq": ("==", operator.eq), "ne": ("!=", operator.ne), "lt": ("<", operator.lt)}
    compared |= {"le": ("<=", operator.le), "gt": (">", operator.gt), "ge": (">=", operator.ge)}
    saved: dict[str, Any] = {name: getattr(LocalIntNode, name) for name in compared}

    def reduce(reduce_op, tensors):
        if reduce_op in ("sum", dist.ReduceOp.SUM):
            return _ring_sum(list(tensors))
        if reduce_op in ("avg", dist.ReduceOp.AVG):
            return _ring_sum(list(tensors)) / len(tensors)
        return saved_reduce(reduce_op, tensors)

    def compare(method_name: str, name: str, op: Callable[[int, int], bool]):
        torch_answer = saved[method_name]

        def method(self, other):
            from torch.distributed._local_tensor import _int_on_rank

            if not sys._getframe(1).f_code.co_filename.endswith(_SYM_NODE_FILE):
                # Asked by torch's C++ (a LocalTensor's sizes, autograd's shape checks), not
                # by Python: torch's answer, which its simulation is built around.
                return torch_answer(self, other)
            answers = {r: op(v, _int_on_rank(other, r)) for r, v in self._local_ints.items()}
            if len(set(answers.values())) > 1:
                raise _branch_error(f"the comparison {self} {name} {other}", answers)
            return torch._C._get_constant_bool_symnode(next(iter(answers.values())))

        return method

    import torch.distributed._local_tensor as local_tensor

    saved_set_rng = local_tensor._set_rng_state

    def set_rng_state(*states):
        saved_set_rng(*states)
        for g, state in _OP_GENERATORS:  # before each rank's run of the op: same_generator
            g.set_state(state)

    def refuse(what: str):
        def method(self, *args):
            raise _branch_error(what.format(self=self), dict(self._local_ints))

        return method

    saved_get_rank = dist.get_rank

    def get_rank(group=None):  # refuse_rank_branch: dist.get_rank() is the per-rank int it is
        if group is None or group is dist.GroupMember.WORLD:
            mode = local_tensor.enabled_local_tensor_mode()
            if mode is not None:
                return torch.SymInt(LocalIntNode({r: r for r in mode.ranks}))
        return saved_get_rank(group)

    # reuse_mode: an op on a LocalTensor that reaches the tensor's own dispatch (the mode is
    # off the stack while it handles an op: the storage aliasing of every view op lands here)
    # runs in a fresh LocalTensorMode, whose entry copies every rank's RNG state and patches
    # DeviceMesh and torch's random functions, then undoes it: half of a simulated step's time.
    # The active simulation's mode, pushed once more, runs it the same way.
    saved_dispatch = LocalTensor.__dict__["__torch_dispatch__"]

    def dispatch(cls, func, types, args=(), kwargs=None):
        meta = _metadata(func, args)
        if meta is not _NOT_METADATA:
            return meta
        sim = _ACTIVE[-1] if _ACTIVE else None
        if sim is None or sim.mode is None:
            return saved_dispatch.__get__(None, cls)(func, types, args, kwargs)
        # The innermost simulation mode: a pipeline coordinate's own (fshard.sched.simulated).
        modes = local_tensor.get_local_tensor_mode_list()
        mode = modes[-1] if modes and hasattr(modes[-1], "reentered") else sim.mode
        with mode.reentered():
            return func(*args, **(kwargs or {}))

    saved_broadcast = local_c10d._local_broadcast_

    def broadcast(tensors, process_group_so, root_rank, *rest):
        # broadcast_root: c10d passes the root as its rank in the group, torch's simulation
        # reads it as a world rank (the pp group [0, 2] of pp=2,dp=2 took rank 1's block).
        group = process_group_so
        if isinstance(group, torch._C.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        return saved_broadcast(tensors, process_group_so, dist.get_process_group_ranks(group)[root_rank], *rest)

    # one_thread: fs.run_local's ranks compute on one intra-op thread each, and a CPU
    # reduction's order follows the thread count (layer_norm's weight grad, last bit).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    local_c10d._local_reduce = reduce
    local_c10d._local_broadcast_ = broadcast
    saved_contiguous = LocalTensor.contiguous
    LocalTensor.contiguous = _contiguous  # type: ignore[method-assign]
    setattr(LocalTensor, "__torch_dispatch__", classmethod(torch._disable_dynamo(dispatch)))  # noqa: B010
    for name, what in (("int_", "int({self})"), ("guard_int", "the int {self}"), ("expect_size", "the size {self}")):
        saved.setdefault(name, getattr(LocalIntNode, name, None))
        setattr(LocalIntNode, name, refuse(what))
    dist.get_rank = get_rank
    local_tensor._set_rng_state = set_rng_state
    for name, (symbol, op) in compared.items():
        setattr(LocalIntNode, name, compare(name, symbol, op))

    def undo() -> None:
        torch.set_num_threads(threads)
        local_c10d._local_reduce = saved_reduce
        local_c10d._local_broadcast_ = saved_broadcast
        LocalTensor.contiguous = saved_contiguous  # type: ignore[method-assign]
        setattr(LocalTensor, "__torch_dispatch__", saved_dispatch)  # noqa: B010
        local_tensor._set_rng_state = saved_set_rng
        dist.get_rank = saved_get_rank
        for name, fn in saved.items():
            if fn is None:
                delattr(LocalIntNode, name)
            else:
                setattr(LocalIntNode, name, fn)

    return undo


# Python's comparison of a SymInt reaches LocalIntNode through this file's magic methods.
_SYM_NODE_FILE = os.path.join("fx", "experimental", "sym_node.py")

_NOT_METADATA = object()


def _is_group_object(a: Any) -> bool:
    from torch._C import ScriptObject

    return isinstance(a, ScriptObject) and a._type().qualified_name().endswith("ProcessGroup")


def _contiguous(self: Any, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """``local_contiguous``: what ``Tensor.contiguous`` does on a real rank (itself, or a clone)."""
    if self.is_contiguous(memory_format=memory_format):
        return self
    return torch.ops.aten.clone.default(self, memory_format=memory_format)


def _same_blocks(func: Any, args: Any) -> None:
    """``mismatched_collective``: a collective whose blocks differ in shape or dtype between
    the ranks of one of its groups raises, naming the line; gloo ranks would fail or wait
    forever, while torch's simulation concatenates or adds whatever it is given."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed._local_tensor import _c10d as local_c10d

    # The group is the last string (a group name: a reduce op is a string too, before it) or group object.
    group = next((a for a in reversed(args) if isinstance(a, (str, dist.ProcessGroup)) or _is_group_object(a)), None)
    if group is None:
        return
    ranks, offsets, _ = local_c10d._prepare_collective_groups(local_c10d._resolve_pg_or_name(group))
    for t in args:
        if not isinstance(t, LocalTensor):
            continue
        for offset in offsets:
            kinds = {
                r: (tuple(t._local_tensors[r].shape), t._local_tensors[r].dtype)
                for r in (offset + k for k in ranks)
                if r in t._local_tensors
            }
            if len(set(kinds.values())) > 1:
                raise RuntimeError(
                    f"fs.simulate: {func} with blocks that differ between the ranks of one group ("
                    + ", ".join(f"rank {r}: {tuple(s)} {d}" for r, (s, d) in sorted(kinds.items()))
                    + f") at {_user_line()}. Every rank of a collective passes the same shape and dtype "
                    f"(real ranks would fail or wait forever); pad the blocks to one shape first."
                )


def _one_host_value(t: Any) -> None:
    """Raises :class:`RankBranchError` when the blocks of the 1-element LocalTensor ``t`` differ:
    Python is about to read it as one host value (a branch, ``int()``, ``.item()``)."""
    values = {r: b.item() for r, b in t._local_tensors.items()}
    if len({repr(v) for v in values.values()}) > 1:
        raise _branch_error("a tensor read as a host value (bool(), int(), float(), .item())", values)


def _metadata(func, args) -> Any:
    """``metadata_fast_path``: a LocalTensor's strides, storage offset or numel, read from its
    blocks. torch's simulation runs these queries like any op (once per rank, saving and
    restoring every rank's RNG state, pytree walks), and the storage aliasing of every view
    op asks for all three: a third of a simulated step. Same answer, without the op loop."""
    from torch.distributed._local_tensor import LocalTensor, _combine_rank_results

    read = _METADATA_READS.get(func)
    if read is None or len(args) != 1 or type(args[0]) is not LocalTensor:
        return _NOT_METADATA
    return _combine_rank_results({r: read(t) for r, t in args[0]._local_tensors.items()}, None)


_METADATA_READS: dict[Any, Callable[[torch.Tensor], Any]] = {
    torch.ops.aten.sym_stride.default: lambda t: t.stride(),
    torch.ops.aten.sym_storage_offset.default: lambda t: t.storage_offset(),
    torch.ops.aten.sym_numel.default: lambda t: t.numel(),
}

# The generators of the op being run per rank, and their state before it (see _mode_class).
_OP_GENERATORS: list[tuple[torch.Generator, torch.Tensor]] = []
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor")
# Collectives whose blocks may differ per rank: their split sizes say how.
_RAGGED_COLLECTIVES = frozenset(
    getattr(ns, name).default
    for ns, name in (
        (torch.ops._c10d_functional, "all_to_all_single"),
        (torch.ops.c10d, "alltoall_base_"),
        (torch.ops.c10d, "alltoall_"),
        (torch.ops.c10d, "send"),
        (torch.ops.c10d, "recv_"),
        (torch.ops.c10d, "gather_"),
        (torch.ops.c10d, "scatter_"),
    )
    if hasattr(ns, name)
)


def _mode_class() -> type:
    """torch's ``LocalTensorMode`` with two shims in its dispatch.

    - ``same_generator``: an op given ``generator=g`` runs once per rank; each run must start
      from ``g``'s state before the op, as each real rank's own ``g`` does (torch's
      simulation hands the ranks one generator in turn, so rank 1 drew rank 0's next values).
    - ``plain_collective``: a collective on plain tensors only (made before the simulation,
      or from plain tensors only) would reach the fake backend, which returns its input:
      a functional collective gets the tensor as every rank's block (a plain tensor is the
      same on every rank); an in-place one raises.
    """
    import torch.utils._pytree as pytree
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    class _Mode(LocalTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            meta = _metadata(func, args) if not kwargs else _NOT_METADATA
            if meta is not _NOT_METADATA:
                return meta
            if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], LocalTensor):
                _one_host_value(args[0])  # refuse_rank_branch: bool(t), t.item(), int(t) of a per-rank tensor
            if self._disable:
                return super().__torch_dispatch__(func, types, args, kwargs)
            flat, spec = pytree.tree_flatten((args, kwargs))
            held = [a._ranks for a in flat if isinstance(a, LocalTensor)]
            if held and min(map(len, held)) < len(self.ranks) and func.namespace not in _COLLECTIVE_NAMESPACES:
                return self._on_ranks(frozenset.intersection(*held), func, types, flat, spec)
            if func.namespace in _COLLECTIVE_NAMESPACES:
                tensors = [a for a in flat if isinstance(a, torch.Tensor)]
                if tensors and not any(isinstance(a, LocalTensor) for a in tensors):
                    if func._schema.is_mutable:
                        raise RuntimeError(
                            f"fs.simulate: {func} on a tensor that holds no per-rank blocks (made "
                            f"outside the simulation) at {_user_line()}; make it inside fs.simulate."
                        )
                    flat = [self._every_rank(a) if isinstance(a, torch.Tensor) else a for a in flat]
                    args, kwargs = pytree.tree_unflatten(flat, spec)
                elif func not in _RAGGED_COLLECTIVES:
                    _same_blocks(func, [a for a in flat if not isinstance(a, list)])
            generators = [a for a in flat if isinstance(a, torch.Generator)]
            if not generators:
                return super().__torch_dispatch__(func, types, args, kwargs)
            _OP_GENERATORS[:] = [(g, g.get_state()) for g in generators]
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                _OP_GENERATORS.clear()

        def _on_ranks(self, ranks: frozenset[int], func: Any, types: Any, flat: list[Any], spec: Any) -> Any:
            """``partial_ranks``: an op on a value only some ranks hold (a pipeline stage's
            gradient, on the ranks of its pipeline coordinate) runs on those ranks; its other
            operands give their blocks there (torch's simulation looks up every rank's block)."""
            from torch.distributed._local_tensor import _is_inplace_op

            if _is_inplace_op(func) and isinstance(flat[0], LocalTensor) and flat[0]._ranks != ranks:
                raise RuntimeError(
                    f"fs.simulate: {func} writes into a tensor of ranks {sorted(flat[0]._ranks)} with a "
                    f"value only ranks {sorted(ranks)} hold (a pipeline stage's, say) at {_user_line()}; "
                    f"compute it out of place (x = x - y), which holds blocks on those ranks only."
                )
            with self.disable():
                flat = [
                    LocalTensor({r: a._local_tensors[r] for r in sorted(ranks)})
                    if isinstance(a, LocalTensor) and a._ranks != ranks
                    else a
                    for a in flat
                ]
            args, kwargs = pytree.tree_unflatten(flat, spec)
            every, self.ranks = self.ranks, ranks
            try:
                return self.__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.ranks = every

        def _every_rank(self, t: torch.Tensor) -> torch.Tensor:
            with self.disable():
                return LocalTensor({r: t.clone() for r in self.ranks})

        @contextlib.contextmanager
        def reentered(self) -> Iterator[None]:
            """This mode pushed once more, for an op on a LocalTensor while it is off the
            dispatch stack (inside its own handler): see ``reuse_mode``."""
            from torch.distributed._local_tensor import get_local_tensor_mode_list
            from torch.utils._python_dispatch import TorchDispatchMode

            modes, was_off = get_local_tensor_mode_list(), self._disable
            modes.append(self)
            self.enable_()
            TorchDispatchMode.__enter__(self)
            try:
                yield
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
                modes.pop()
                if was_off:
                    self.disable_()

    return _Mode


# --- the context ------------------------------------------------------------------------------
class Simulation:
    """``n`` ranks in this process; see :func:`simulate`."""

    def __init__(self, world_size: int) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"fs.simulate(world_size={world_size!r}): world_size must be an int >= 1.")
        self.world_size = world_size
        self.mode: Any = None
        self._undo: Callable[[], None] | None = None

    def __repr__(self) -> str:
        state = "active" if self.mode is not None else "inactive"
        return f"fs.simulate({self.world_size}; {state})"

    def __enter__(self) -> "Simulation":
        from torch.distributed._local_tensor import local_tensor_mode
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if _ACTIVE or local_tensor_mode() is not None:
            raise RuntimeError(
                f"fs.simulate({self.world_size}): a simulation is already active "
                f"({_ACTIVE[-1] if _ACTIVE else 'a LocalTensorMode'}); simulations do not nest. "
                f"Leave it first (fs.simulate(...).__exit__() in a notebook)."
            )
        if dist.is_initialized() and dist.get_world_size() == 1 and teardown.owns_default_group():
            teardown.shutdown()  # the one-rank group fshard made for a plain process: made again on demand
        if dist.is_initialized():
            raise RuntimeError(
                f"fs.simulate({self.world_size}) inside a real process group "
                f"({dist.get_backend()}, rank {dist.get_rank()} of {dist.get_world_size()}): "
                f"a simulation needs this process to itself. Call it outside fs.run_local / "
                f"torchrun, or call fs.shutdown() first."
            )
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        entered = False
        try:
            self.mode = _mode_class()(self.world_size)
            self.mode.__enter__()
            entered = True
            self._undo = _install_shims()
        except BaseException:
            if entered:  # a half-made simulation must not stay active: the next one would refuse
                self.mode.__exit__(None, None, None)
            self.mode = None
            dist.destroy_process_group()
            raise
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mode is None:
            return
        _ACTIVE.remove(self)
        try:
            if self._undo is not None:
                self._undo()
            self.mode.__exit__(*exc) if exc else self.mode.__exit__(None, None, None)
        finally:
            self.mode = None
            teardown.shutdown()


def simulate(world_size: int) -> Simulation:
    """``n`` ranks in this one process: meshes, sharded values, ``shard_map`` and training
    steps run as on ``world_size`` real ranks, and every rank's block stays in memory.

    Use it as a context manager, or enter it for the rest of a notebook::

        with fs.simulate(4):
            mesh = fs.make_mesh({"fsdp": 4})
            ...

        fs.simulate(8).__enter__()   # top of a notebook

    Values and gradients are the same as on real gloo ranks, bit for bit (float32/64):
    ``tests/runtime/test_simulate.py`` runs each feature both ways. Tensors made inside the
    simulation hold one block per rank; ``fs.inspect(x)`` shows them.

    Args:
      world_size: the number of simulated ranks.

    Returns:
      A :class:`Simulation`; entering it starts a ``fake`` process group and torch's
      ``LocalTensorMode``, leaving it destroys both (meshes made inside cannot be used after).

    Raises:
      RuntimeError: a real process group exists (inside ``fs.run_local``/torchrun), or a
        simulation is already active.
    """
    return Simulation(world_size)


def active() -> Simulation | None:
    """The active simulation, or ``None`` on real ranks."""
    return _ACTIVE[-1] if _ACTIVE else None


def world_size() -> int | None:
    """The simulated world size, or ``None`` on real ranks."""
    return _ACTIVE[-1].world_size if _ACTIVE else None


def per_rank(fn: Callable[..., _T]) -> Callable[..., _T]:
    """``fn`` run once per simulated rank, its arguments' per-rank values (blocks, mesh
    coordinates) given to each run, and the results combined (a tensor per rank, an int that
    differs per rank as a per-rank int). On real ranks, ``fn`` itself. ``fn`` must not issue
    collectives."""
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(fn)


def rank_tensor(fn: Callable[[int], torch.Tensor], rank: int | None = None) -> torch.Tensor:
    """A tensor whose block on each rank r is ``fn(r)``; on real ranks ``fn(rank)``."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is not None:
        return mode.rank_map(fn)
    return fn(dist.get_rank() if rank is None else rank)


def host_int(value: Any, what: str) -> int:
    """``value`` as one host int: a per-rank int whose ranks agree, else :class:`RankBranchError`."""
    if isinstance(value, torch.SymInt):
        node = value.node
        local = getattr(node, "_local_ints", None)
        if local is not None:
            if len(set(local.values())) > 1:
                raise _branch_error(what, dict(local))
            return next(iter(local.values()))
        return int(node.maybe_as_int() if hasattr(node, "maybe_as_int") else value)
    return int(value)


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """Runs the block with torch's simulation off (plain tensors, real coordinates of rank 0)."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        yield


def run_simulated(fn: Callable[..., Any], *args: Any, world_size: int, **kwargs: Any) -> list[Any]:
    """``fn(*args, **kwargs)`` under ``fs.simulate(world_size)``, its result split per rank:
    the same list :func:`fshard.run_local` returns for the same program on real ranks.

    A tensor of the result gives each rank its own block (None on a rank it has no block on);
    a per-rank int, each rank its int.

    Raises:
      TypeError: the result holds a DTensor (its mesh ends with the simulation); return
        ``fs.gather(x)`` or ``x.to_local()``, as a program for ``run_local`` does.
    """
    from torch.distributed._local_tensor import LocalIntNode, LocalTensor
    from torch.distributed.tensor import DTensor

    with simulate(world_size):
        out = fn(*args, **kwargs)

        def block(x: Any, r: int) -> Any:
            if isinstance(x, DTensor):
                raise TypeError(
                    "fs.runtime.simulation.run_simulated: the result holds a DTensor, whose mesh ends "
                    "with the simulation; return fs.gather(x) or x.to_local()."
                )
            if isinstance(x, LocalTensor):  # no block on r: a value only some ranks hold (a pipeline stage's)
                return x._local_tensors[r].clone() if r in x._local_tensors else None
            if isinstance(x, torch.SymInt) and isinstance(x.node, LocalIntNode):
                return x.node._local_ints[r]
            return x

        import optree

        per_rank = [optree.tree_map(lambda x, r=r: block(x, r), out, none_is_leaf=True) for r in range(world_size)]
    return per_rank
