"""The pipeline executor: one rank walks its own lowered action list, nothing else.

:class:`Executor` has no per-schedule code: which stage and microbatch run when, when
to send, and whether backward is split into I and W is all in the list that a
generator and :func:`fshard.sched.lower` built. Per action:

* ``F(s, mb)`` runs ``stage_fn`` under autograd on a fresh leaf input (so each stage's
  graph ends at its own input) and keeps input and output (the loss on the last stage).
* ``B`` differentiates the output w.r.t. input and parameters in one pass; ``I`` only
  w.r.t. the input; ``W`` later only w.r.t. the parameters, from gradients captured
  during ``I`` (:class:`fshard.sched.split.SplitBackward`): neither the forward nor the input-gradient
  chain runs twice. The stage's graph is dropped as soon as its B or W ran.
* Each run of consecutive SEND/RECV actions is posted as one ``batch_isend_irecv``
  (validated deadlock-free); receives are posted in list order, on gloo up to 2 ahead
  of their place so their data moves during compute; a receive is waited on only by
  the compute action that consumes it, sends at the end of the step (or earlier, once
  complete). Neighbour stages on the same rank (the tip of a V) hand over in memory.
* UNSHARD / RESHARD / REDUCE_GRAD call optional hooks.

Shapes: the first SEND_F across each stage boundary is preceded by an int64 header
(ndim, dtype, sizes) so the receiver can size its buffers; every later microbatch
must give the same shape and dtype (checked where it is produced). Gradient buffers
take the shape of the stage output this rank computed itself.

Under ``fs.jit`` (:func:`tracing`): each batch of transfers is one functional op
``torch.ops.fshard.p2p_batch`` (``batch_isend_irecv`` inside) and each wait a
``wait_tensor``, nodes of the captured graph; a received tensor is the ``wait_tensor``'s
result. The headers are not in the graph: they are exchanged once, for real, while the
ranks trace (as ``fs.lax.ppermute``'s split sizes, the shapes become Python ints baked
into each rank's graph). So every rank must trace the step together (a new batch shape
retraces them all), and a captured graph receives the shapes of its trace: a rank whose
stage output shape changes without its neighbours retracing (a new parameter shape on
one rank only) is not supported.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from fshard import comm
from fshard import tree as tree_util
from fshard.sched.ir import Action, Kind, Schedule, ScheduleError
from fshard.sched.split import SplitBackward, differentiable, grad, wants_grad

__all__ = ["Executor", "ExecutorConfig", "tracing"]

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741
_SENDS = (Kind.SEND_F, Kind.SEND_B)
_MAX_DIMS = 8  # header: [ndim, dtype code, size_0, ..., size_7]
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_C10D = torch.ops._c10d_functional


def tracing() -> bool:
    """True while a graph is being captured: ``fs.jit``'s ``make_fx`` trace on fake tensors
    (or Dynamo). A direct ``torch.distributed`` call would then run once, at trace time,
    and be missing from the graph, so transfers go through functional ops instead.

    Detected from the active fake mode rather than a flag that ``fs.jit`` sets: it holds for
    any trace (a user's own ``make_fx`` too), and ``fs.optim`` and ``clip_by_global_norm``
    decide the same way.
    """
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None


class _Once:
    """A transfer in flight, waited at most once (a second wait on gloo p2p blocks).

    Holds its tensor until done. ``batch_isend_irecv`` gives one work per op on gloo,
    one for the whole batch where the backend coalesces (NCCL): then ops share it.
    """

    __slots__ = ("work", "tensor")

    def __init__(self, work: Any, tensor: Any) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = self.tensor = None

    def finished(self) -> bool:
        """True (and the tensor released) if the transfer is known to be complete."""
        if self.work is not None and getattr(self.work, "is_completed", lambda: False)():
            self.wait()
        return self.work is None

    @staticmethod
    def post(ops: list[dist.P2POp]) -> list[_Once]:
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):
            return [_Once(w, op.tensor) for w, op in zip(works, ops)]
        shared = _Once(SimpleNamespace(wait=lambda: [w.wait() for w in works]), [op.tensor for op in ops])
        return [shared] * len(ops)


class _Traced:
    """A transfer captured in the graph (:func:`tracing`): waiting is a ``wait_tensor``
    node, and for a receive its result, not the buffer, is what the consumer reads."""

    __slots__ = ("tensor", "done")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.done = tensor, False

    def wait(self) -> None:
        if not self.done:
            self.tensor, self.done = _C10D.wait_tensor(self.tensor), True

    def finished(self) -> bool:
        return False  # a graph cannot ask; sends are waited at the end of the step

    @staticmethod
    def post(ops: list[dist.P2POp]) -> list[_Traced]:
        outs = torch.ops.fshard.p2p_batch(
            [op.op is dist.isend for op in ops],
            [op.group_peer for op in ops],
            [op.tensor for op in ops],
            ops[0].group.group_name,
        )
        return [_Traced(t) for t in outs]


# The graph's transfers. Not torch's functional ``batch_p2p_ops``: it registers a send's work
# under both its input and the empty tensor it returns, and a gloo send waited twice blocks,
# so one of the two entries (and, through the work, the sent tensor) would stay in c10d's
# work registry after every step. Here each output has its own registration, which
# ``wait_tensor`` pops once.
@torch.library.custom_op("fshard::p2p_batch", mutates_args=())
def _p2p_batch(sends: list[bool], peers: list[int], tensors: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """Posts sends of ``tensors[i]`` (``sends[i]``) and receives shaped like ``tensors[i]``
    (the others) with group rank ``peers[i]``, as one ``batch_isend_irecv``;
    returns per op an empty token (send) or the buffer being received, each to be waited
    with ``wait_tensor``."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    outs = _p2p_outputs(sends, tensors)
    ops = [
        dist.P2POp(dist.isend, t, group=group, group_peer=peer)
        if send
        else dist.P2POp(dist.irecv, out, group=group, group_peer=peer)
        for send, t, out, peer in zip(sends, tensors, outs, peers)
    ]
    works = dist.batch_isend_irecv(ops)
    for i, out in enumerate(outs):
        # One work per op (gloo), or one for the batch (a coalescing backend: waited per output).
        torch._C._distributed_c10d._register_work(out, works[i] if len(works) == len(ops) else works[0])
    return outs


@_p2p_batch.register_fake
def _(sends, peers, tensors, group_name):
    return _p2p_outputs(sends, tensors)


def _p2p_outputs(sends: list[bool], tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [
        t.new_empty(0) if send else torch.empty_like(t, memory_format=torch.contiguous_format)
        for send, t in zip(sends, tensors)
    ]


torch.fx.node.has_side_effect(torch.ops.fshard.p2p_batch.default)


class _Saved:
    """What the backward of one (stage, microbatch) needs; dropped once it ran."""

    __slots__ = ("x", "root", "wrt", "split")

    def __init__(self, x: Any, root: torch.Tensor, wrt: list[Any]) -> None:
        # wrt[i]: what to differentiate for parameter i (its leaf, or the GradientEdge of
        # the gathered tensor the stage used, which keeps no gathered storage alive), or None.
        self.x, self.root, self.wrt, self.split = x, root, wrt, None


_HOOK_KINDS = (Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD)


def _hooks(value: Mapping[Kind, Callable[[int, Any], None]] | None) -> dict[Kind, Callable[[int, Any], None]]:
    hooks = dict(value or {})
    for kind, fn in hooks.items():
        if kind not in _HOOK_KINDS or not callable(fn):
            raise TypeError(
                f"ExecutorConfig.hooks[{kind!r}]={fn!r}: hooks map Kind.UNSHARD, Kind.RESHARD or "
                f"Kind.REDUCE_GRAD to fn(stage, executor); the schedule's other actions run without hooks."
            )
    return hooks


def _non_negative_int(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ExecutorConfig.{attribute.name}={value!r}: must be an int >= 0.")


@attrs.frozen(kw_only=True)
class ExecutorConfig:
    """Where one rank runs its part of a schedule (rank, group, axis, device), and how.

    Attributes:
        rank: this rank's index on the pipeline axis.
        group: the pipeline axis' process group.
        axis: the pipeline axis name (for comm_log).
        device: where stage inputs and received tensors live (transfers go through host
            memory where the group's backend cannot move ``device`` tensors itself:
            gloo with CUDA tensors).
        hooks: ``{Kind.UNSHARD | RESHARD | REDUCE_GRAD: fn(stage, executor)}`` (default none).
        prefetch: receives kept posted ahead of their place in the list (gloo only;
            default 2).
        stages: optional per-stage parameter view (FSDP at stage level,
            :class:`fshard.sched.stage_fsdp.StageShards`): ``stages.forward(s, leaves)``
            gives the leaves ``stage_fn`` sees and a context to run it in;
            ``stages.backward_done(s)`` is called after each B/I/W of stage ``s``.
        transport: optional replacement for ``batch_isend_irecv`` (``transport.post(ops)``
            returns one work per op, each with ``wait()`` and ``finished()``): under
            ``fs.simulate``, :class:`fshard.sched.simulated.Transport` (default None: the
            process group's own transfers).

    Raises:
        ValueError: ``rank`` or ``prefetch`` not an int >= 0.
        TypeError: a hook for another kind of action, or one that is not callable.
    """

    rank: int = attrs.field(validator=_non_negative_int)
    group: Any
    axis: str
    device: torch.device
    hooks: dict[Kind, Callable[[int, Any], None]] = attrs.field(factory=dict, converter=_hooks)
    prefetch: int = attrs.field(default=2, validator=_non_negative_int)
    stages: Any = None
    transport: Any = None


# The old form of Executor took these as its own arguments (transport came with the config).
_CONFIG_FIELDS = frozenset(attrs.fields_dict(ExecutorConfig)) - {"transport"}


def _args(
    stage_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    params: Mapping[int, tuple[list[Any], Any]],
    inputs: Sequence[Any],
    targets: Sequence[Any],
    seed: float,
) -> tuple[Any, ...]:
    return stage_fn, loss_fn, params, inputs, targets, seed


def _old_args(
    rank: int,
    group: Any,
    axis: str,
    stage_fn: Callable[..., Any],
    loss_fn: Callable[..., Any],
    params: Mapping[int, tuple[list[Any], Any]],
    inputs: Sequence[Any],
    targets: Sequence[Any],
    seed: float,
    device: torch.device,
    hooks: Mapping[Kind, Callable[[int, Any], None]] | None = None,
    prefetch: int = 2,
    stages: Any = None,
) -> tuple[tuple[Any, ...], ExecutorConfig]:
    config = ExecutorConfig(
        rank=rank, group=group, axis=axis, device=device, hooks=hooks, prefetch=prefetch, stages=stages
    )
    return (stage_fn, loss_fn, params, inputs, targets, seed), config


def _bind(args: tuple[Any, ...], kwargs: dict[str, Any], config: ExecutorConfig | None) -> tuple[Any, ...]:
    """``(stage_fn, loss_fn, params, inputs, targets, seed, config)`` from either form of
    ``Executor``'s arguments; the old one (placement and options beside the data) warns."""
    if config is not None:
        old = sorted(_CONFIG_FIELDS & set(kwargs))
        if old:
            given = ", ".join(f"{k}=..." for k in old)
            raise TypeError(
                f"Executor: both config= and the old keyword(s) {given} were given; put them in the "
                f"config: config=attrs.evolve(config, {given})."
            )
        try:
            return (*_args(*args, **kwargs), config)
        except TypeError as e:
            raise TypeError(f"{e}".replace("_args()", "Executor()")) from None
    try:
        data, config = _old_args(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"{e}".replace("_old_args()", "Executor()") + "; Executor takes (schedule, stage_fn, loss_fn, params, "
            "inputs, targets, seed, config=ExecutorConfig(rank=..., group=..., axis=..., device=...))."
        ) from None
    options = [k for k in ("hooks", "prefetch", "stages") if k in kwargs]
    given = ", ".join(f"{k}=..." for k in ("rank", "group", "axis", "device", *options))
    warnings.warn(
        f"Executor: rank, group, axis, device{''.join(', ' + k for k in options)} as arguments of Executor are "
        f"deprecated and will be removed in the next release; pass Executor(schedule, stage_fn, loss_fn, "
        f"params, inputs, targets, seed, config=ExecutorConfig({given})).",
        DeprecationWarning,
        stacklevel=3,  # the caller of Executor(...)
    )
    return (*data, config)


class Executor:
    """Runs ``schedule.actions[config.rank]`` for one step.

    Args:
        schedule: a lowered, validated schedule.
        stage_fn: ``stage_fn(params, x, stage) -> y``.
        loss_fn: ``loss_fn(y_last, target) -> scalar``.
        params: per held stage, ``(leaves, treedef)``; leaves that require grad get one.
        inputs: per microbatch, the stage-0 input pytree.
        targets: per microbatch, the loss target pytree.
        seed: the gradient seeded at every microbatch loss: the one place losses are
            scaled (1 / (n_microbatches * data-parallel size)).
        config: an :class:`ExecutorConfig`: this rank, the pipeline group, axis and
            device, and the hooks, receive prefetch and stage view. The old form,
            ``Executor(schedule, rank, group, axis, stage_fn, loss_fn, params, inputs,
            targets, seed, device, hooks=, prefetch=, stages=)``, still works for this
            release, with a ``DeprecationWarning``.

    Attributes (after :meth:`run`):
        grads: per held stage, one gradient (or None) per leaf, summed over microbatches.
        losses: per microbatch, the detached loss (on the rank of the last stage).
        peak_activations: the most (stage, microbatch) pairs whose F had started and
            whose B or W had not ended; acquired at the start and released at the end
            of an action, so an OVERLAP_F_B holds both, as in :func:`fshard.sched.simulate`.
        busy_s, wait_s: seconds computing / blocked on transfers.
        spans: ``(action, start_s, end_s)`` per compute action (its input waits
            excluded), in seconds from the start of :meth:`run`.
        n_sends, n_recvs, bytes_sent, bytes_received: payload transfers (no headers).

    Raises:
        TypeError: ``config`` together with an old keyword (both named), or arguments
            that fit neither form.
    """

    def __init__(
        self,
        schedule: Schedule,
        *args: Any,
        config: ExecutorConfig | None = None,
        **kwargs: Any,
    ) -> None:
        stage_fn, loss_fn, params, inputs, targets, seed, config = _bind(args, kwargs, config)
        rank, group, axis, device = config.rank, config.group, config.axis, config.device
        self.config = config
        self.schedule, self.rank, self.group, self.axis = schedule, rank, group, axis
        self.stage_fn, self.loss_fn, self.params = stage_fn, loss_fn, params
        self.inputs, self.targets, self.seed, self.device = inputs, targets, seed, device
        # Where transfers live: the device, or host memory where the backend's
        # point-to-point cannot read the device (gloo with CUDA tensors).
        self.wire = torch.device("cpu") if comm.via_host(group, device) else device
        self.hooks = dict(config.hooks)
        self.stages = config.stages
        self.last = schedule.n_stages - 1
        self.grads: dict[int, list[torch.Tensor | None]] = {
            s: [None] * len(leaves) for s, (leaves, _) in params.items()
        }
        self.losses: list[torch.Tensor | None] = [None] * schedule.n_microbatches
        self.peak_activations = self._live = 0
        self.busy_s = self.wait_s = self._t0 = 0.0
        self.spans: list[tuple[Action, float, float]] = []
        self.n_sends = self.n_recvs = self.bytes_sent = self.bytes_received = 0
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._local: dict[tuple[Kind, int, int], torch.Tensor] = {}  # same-rank hand-over
        self._outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self._recvs: dict[tuple[Kind, int, int], tuple[_Once, torch.Tensor]] = {}
        self._sent: list[_Once] = []
        self._out_meta: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}
        self._in_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._headed: set[int] = set()
        self._owned: set[tuple[int, int]] = set()  # accumulators this executor allocated
        self._unposted = deque(a for a in schedule.actions[rank] if a.kind in (Kind.RECV_F, Kind.RECV_B))
        self._posted: set[Action] = set()
        self.prefetch = config.prefetch if dist.get_backend(group) == "gloo" else 0
        self.traced = tracing()
        self._post_eager = _Once.post if config.transport is None else config.transport.post
        self._post_batch = _Traced.post if self.traced else self._post_eager
        self._header_sends: list[Any] = []  # while tracing: the real header sends in flight

    def run(self) -> Executor:
        """Executes every action of this rank in order; returns self."""
        row = self.schedule.actions[self.rank]
        self._t0 = time.perf_counter()
        i = 0
        while i < len(row):
            if row[i].is_comm:
                j = i
                while j < len(row) and row[j].is_comm:
                    j += 1
                self._post(row[i:j])
                i = j
                continue
            try:
                if row[i].is_compute:
                    self._compute(row[i])
                elif row[i].kind in self.hooks:
                    self.hooks[row[i].kind](row[i].stage, self)
            except ValueError as e:
                if isinstance(e, ScheduleError):
                    raise
                raise ValueError(
                    f"{e} (schedule {self.schedule.name!r}, rank {self.rank}, action #{i} {row[i]})"
                ) from e
            i += 1
        self._wait(self._sent)
        self._sent.clear()
        for work in self._header_sends:
            work.wait()
        self._header_sends.clear()
        return self

    def _wait(self, works: Sequence[_Once]) -> None:
        t0 = time.perf_counter()
        for w in works:
            w.wait()
        self.wait_s += time.perf_counter() - t0

    def _compute(self, action: Action) -> None:
        t0, wait0 = time.perf_counter(), self.wait_s
        self._live += sum(1 for p in action.parts if p.kind is F)
        self.peak_activations = max(self.peak_activations, self._live)
        for p in action.parts:
            {F: self._forward, B: self._backward, I: self._backward_input, W: self._backward_weight}[p.kind](
                p.stage, p.microbatch
            )
            if p.kind is not F and self.stages is not None:
                self.stages.backward_done(p.stage)
        self._live -= sum(1 for p in action.parts if p.kind in (B, W))
        t1, waited = time.perf_counter(), self.wait_s - wait0
        self.busy_s += t1 - t0 - waited
        # Inputs are waited for before compute starts, so the compute begins after the wait.
        self.spans.append((action, t0 + waited - self._t0, t1 - self._t0))
        self._prefetch()

    # --- compute ------------------------------------------------------------------------
    def _forward(self, s: int, mb: int) -> None:
        if s == 0:
            x = self.inputs[mb]
        else:
            x = self._local.pop((F, s, mb), None)
            x = self._take(Kind.RECV_F, s, mb, F) if x is None else x
        leaves, treedef = self.params[s]
        used, context = leaves, contextlib.nullcontext()
        with torch.enable_grad():
            if self.stages is not None:
                used, context = self.stages.forward(s, leaves)
            with context:
                y = self.stage_fn(tree_util.tree_unflatten(treedef, used), x, s)
            root = self._loss(y, mb) if s == self.last else self._check_output(s, mb, y)
        wrt = [
            None if not wants_grad(p) else p if u is p else torch.autograd.graph.get_gradient_edge(u)
            for p, u in zip(leaves, used)
        ]
        self._saved[(s, mb)] = _Saved(x, root, wrt)
        if s == self.last:
            return
        if self.schedule.rank_of(s + 1) == self.rank:
            # A new leaf, so the next stage's graph (and its I/W split) stops here.
            self._local[(F, s + 1, mb)] = y.detach().requires_grad_(differentiable(y))
        else:
            self._outbox[(Kind.SEND_F, s, mb)] = y.detach()

    def _loss(self, y: Any, mb: int) -> torch.Tensor:
        loss = self.loss_fn(y, self.targets[mb])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_fn must return a scalar tensor (the mean over the microbatch); got {got} for microbatch {mb}"
            )
        self.losses[mb] = loss.detach().reshape(())
        return loss

    def _check_output(self, s: int, mb: int, y: Any) -> torch.Tensor:
        if not isinstance(y, torch.Tensor):
            raise ValueError(
                f"stage_fn of stage {s} (not the last) must return one tensor, the "
                f"activation for stage {s + 1}; got {type(y).__name__}"
            )
        shape = tuple(y.shape)
        first = self._out_meta.setdefault(s, (shape, y.dtype, mb))
        if first[:2] != (shape, y.dtype):
            raise ValueError(
                f"stage {s} output changed between microbatches: microbatch {first[2]} gave "
                f"shape {first[0]} {first[1]}, microbatch {mb} gives shape {shape} {y.dtype}; "
                f"transfer buffers are sized once per step, so every microbatch of a stage "
                f"must give the same shape and dtype"
            )
        if y.dim() > _MAX_DIMS or y.dtype not in _DTYPES:
            raise ValueError(
                f"stage {s} output {shape} {y.dtype} cannot be sent: at most {_MAX_DIMS} dims and a dtype in {_DTYPES}"
            )
        return y

    def _grad_output(self, s: int, mb: int, saved: _Saved) -> torch.Tensor:
        if s == self.last:
            return torch.full_like(saved.root, self.seed)
        g = self._local.pop((B, s, mb), None)
        return self._take(Kind.RECV_B, s, mb, B) if g is None else g

    def _saved_of(self, s: int, mb: int, kind: Kind, drop: bool) -> _Saved:
        saved = self._saved.pop((s, mb), None) if drop else self._saved.get((s, mb))
        if saved is None or (kind is W and saved.split is None):
            raise ScheduleError(
                f"rank {self.rank}: {Action(kind, s, mb)} finds no state "
                f"from its F (or I); the action list is out of order"
            )
        return saved

    def _backward(self, s: int, mb: int) -> None:
        saved = self._saved_of(s, mb, B, drop=True)
        g = self._grad_output(s, mb, saved)
        wrt = [i for i, p in enumerate(saved.wrt) if p is not None]
        xs = [saved.x] if wants_grad(saved.x) else []
        grads = grad(saved.root, xs + [saved.wrt[i] for i in wrt], g)
        self._accumulate(s, wrt, grads[len(xs) :])
        self._emit_input_grad(s, mb, saved.x, grads[0] if xs else None)

    def _backward_input(self, s: int, mb: int) -> None:
        saved = self._saved_of(s, mb, I, drop=False)
        g = self._grad_output(s, mb, saved)
        saved.split = SplitBackward(saved.root, g, saved.x if wants_grad(saved.x) else None, saved.wrt)
        saved.root = None  # the split holds what W needs; the rest of the graph may go
        self._emit_input_grad(s, mb, saved.x, saved.split.input_grad)

    def _backward_weight(self, s: int, mb: int) -> None:
        saved = self._saved_of(s, mb, W, drop=True)
        self._accumulate(s, *saved.split.weight_grads())

    def _accumulate(self, s: int, wrt: list[int], grads: Sequence[torch.Tensor | None]) -> None:
        acc = self.grads[s]
        if self.stages is not None:  # gathered parameters' grads go to their unreduced sums
            wrt, grads = self.stages.take_grads(s, wrt, grads)
        for i, g in zip(wrt, grads):
            if g is None:
                continue
            if acc[i] is None:
                acc[i] = g  # may alias another gradient (x + b), so never written in place
            elif (s, i) in self._owned:
                acc[i].add_(g)
            else:
                acc[i] = acc[i] + g
                self._owned.add((s, i))

    def _emit_input_grad(self, s: int, mb: int, x: Any, dx: torch.Tensor | None) -> None:
        if s == 0:
            return
        dx = torch.zeros_like(x) if dx is None else dx  # input unused or not differentiable
        if self.schedule.rank_of(s - 1) == self.rank:
            self._local[(B, s - 1, mb)] = dx
        else:
            self._outbox[(Kind.SEND_B, s, mb)] = dx

    # --- point-to-point -----------------------------------------------------------------
    def _op(self, fn: Callable[..., Any], t: torch.Tensor, a: Action) -> dist.P2POp:
        peer = dist.get_global_rank(self.group, self.schedule.peer_rank(a))
        return dist.P2POp(fn, t, peer, self.group)

    def _post(self, batch: Sequence[Action]) -> None:
        """Posts one run of SEND/RECV actions: sends first, then receives."""
        # Completed sends let go of their buffers now rather than at the end of the step.
        self._sent = [w for w in self._sent if not w.finished()]
        ops: list[dist.P2POp] = []
        for a in (a for a in batch if a.kind in _SENDS):
            t = self._outbox.pop((a.kind, a.stage, a.microbatch), None)
            if t is None:
                raise ScheduleError(
                    f"rank {self.rank}: {a} has nothing to send; the compute action producing it has not run"
                )
            t = t.contiguous() if t.device == self.wire else t.to(self.wire).contiguous()
            if a.kind is Kind.SEND_F and a.stage not in self._headed:
                self._headed.add(a.stage)
                if self.traced:
                    self._send_header_now(t, a)
                else:
                    ops.append(self._op(dist.isend, _header(t.shape, t.dtype, t.device), a))
            ops.append(self._op(dist.isend, t, a))
            self.n_sends += 1
            self.bytes_sent += t.numel() * t.element_size()
            comm.record("send", (self.axis,), t.numel() * t.element_size())
        self._post_ops(ops, [a for a in batch if a.kind not in _SENDS and a not in self._posted])
        self._prefetch()

    def _post_ops(self, ops: list[dist.P2POp], recvs: Sequence[Action]) -> None:
        """Posts sends ``ops`` and then ``recvs``, the next receives in list order.

        Receives from one peer must be posted in the order of its sends, so a payload
        whose size comes in a header waits for the header in place: the sends and the
        receives before it are posted first, then the header's receive, then the rest.
        """
        n_send, keyed = len(ops), []
        for a in recvs:
            if self._unposted.popleft() != a:
                raise ScheduleError(f"rank {self.rank}: {a} posted out of list order")
            self._posted.add(a)
            if a.kind is Kind.RECV_F and a.stage not in self._in_meta and self.traced:
                self._in_meta[a.stage] = self._recv_header_now(a)
            elif a.kind is Kind.RECV_F and a.stage not in self._in_meta:
                h = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.wire)
                works = self._post_eager(ops + [self._op(dist.irecv, h, a)])
                self._register(works[:-1], n_send, keyed)
                self._wait(works[-1:])
                self._in_meta[a.stage] = (tuple(h[2 : 2 + int(h[0])].tolist()), _DTYPES[int(h[1])])
                ops, n_send, keyed = [], 0, []
            buf = self._recv_buffer(a)
            ops.append(self._op(dist.irecv, buf, a))
            keyed.append((a, buf))
        if ops:
            self._register(self._post_batch(ops), n_send, keyed)

    def _send_header_now(self, t: torch.Tensor, a: Action) -> None:
        """While tracing: sends ``a``'s header for real, outside the graph (the receiver's
        trace sizes its buffer from it)."""
        with _disable_current_modes():
            h = _header(t.shape, t.dtype, self.wire)
            self._header_sends.append(dist.isend(h, group=self.group, group_dst=self.schedule.peer_rank(a)))

    def _recv_header_now(self, a: Action) -> tuple[tuple[int, ...], torch.dtype]:
        """While tracing: receives ``a``'s header for real, outside the graph."""
        with _disable_current_modes():
            h = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.wire)
            dist.recv(h, group=self.group, group_src=self.schedule.peer_rank(a))
            return tuple(h[2 : 2 + int(h[0])].tolist()), _DTYPES[int(h[1])]

    def _register(self, works: list[_Once], n_send: int, keyed: list[tuple[Action, torch.Tensor]]) -> None:
        self._sent += works[:n_send]
        for (a, buf), work in zip(keyed, works[n_send:]):
            self._recvs[(a.kind, a.stage, a.microbatch)] = (work, buf)
            self.n_recvs += 1
            self.bytes_received += buf.numel() * buf.element_size()
            comm.record("recv", (self.axis,), buf.numel() * buf.element_size())

    def _prefetch(self) -> None:
        """Posts upcoming receives early, in list order, so their data moves during compute.

        Only where point-to-point ops progress independently (gloo): on a backend that
        serializes them on one stream (NCCL) an early receive would hold up this rank's
        own later sends. A receive whose buffer size is not known yet stops the walk.
        """
        while self._unposted and len(self._recvs) < self.prefetch:
            a = self._unposted[0]
            known = self._in_meta if a.kind is Kind.RECV_F else self._out_meta
            if a.stage not in known:
                return
            self._post_ops([], [a])

    def _recv_buffer(self, a: Action) -> torch.Tensor:
        if a.kind is Kind.RECV_F:
            shape, dtype = self._in_meta[a.stage]
        elif a.stage in self._out_meta:
            shape, dtype, _ = self._out_meta[a.stage]
        else:
            raise ScheduleError(
                f"rank {self.rank}: {a} is posted before any F of stage {a.stage}, so the gradient's shape is unknown"
            )
        return torch.empty(shape, dtype=dtype, device=self.wire)

    def _take(self, kind: Kind, s: int, mb: int, consumer: Kind) -> torch.Tensor:
        entry = self._recvs.pop((kind, s, mb), None)
        if entry is None:
            raise ScheduleError(
                f"rank {self.rank}: {Action(consumer, s, mb)} needs "
                f"{Action(kind, s, mb)}, which was not posted before it"
            )
        self._wait([entry[0]])
        buf = entry[0].tensor if isinstance(entry[0], _Traced) else entry[1]
        buf = buf if buf.device == self.device else buf.to(self.device)
        return buf.requires_grad_(differentiable(buf)) if kind is Kind.RECV_F else buf


def _header(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    h = [len(shape), _DTYPES.index(dtype), *shape]
    return torch.tensor(h + [0] * (2 + _MAX_DIMS - len(h)), dtype=torch.int64, device=device)
