"""Per-layer costs by running a layer once: FLOPs, memory traffic, kernels, saved bytes.

:func:`trace_layer` runs ``fn(params, *inputs)`` forward, then backward twice (input
gradients only, then input and weight gradients), under a dispatch mode that sees
every aten op, and a ``saved_tensors_hooks`` pair that sees what autograd keeps for
backward. From that it returns per-phase :class:`Work` (F, I = backward-input,
W = backward-weight = full backward minus I) and the bytes saved per sample.

What is counted:

- FLOPs of matrix products and attention (``torch.utils.flop_counter``'s formulas, plus
  the CPU flash-attention kernels, which its registry lacks);
- bytes read and written by every other kernel (inputs + outputs: the traffic of a
  memory-bound op); views and metadata ops move nothing and are not kernels;
- the number of kernels (what costs a fixed launch / dispatch overhead each);
- bytes autograd saves, excluding the parameters themselves (FSDP frees gathered
  parameters and regathers them: they are memory of another kind).

Run it at batch 1 on a small real device (``"cpu"``: the kernels the machine runs, e.g.
flash attention on CPU, which a ``"meta"`` run decomposes into the math path) or on
``"meta"`` for shapes too large to run; every count but ``ops`` scales with the batch.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Sequence

import attrs
import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from fshard import tree as tree_util

__all__ = ["LayerTrace", "OptimizerWork", "Work", "trace_layer", "trace_optimizer"]

_aten = torch.ops.aten

# Ops that only create views or read metadata: no kernel, no traffic.
_FREE = {
    _aten.view,
    _aten._unsafe_view,
    _aten.t,
    _aten.transpose,
    _aten.permute,
    _aten.expand,
    _aten.slice,
    _aten.select,
    _aten.unsqueeze,
    _aten.squeeze,
    _aten.as_strided,
    _aten.alias,
    _aten.detach,
    _aten.split,
    _aten.split_with_sizes,
    _aten.unbind,
    _aten.chunk,
    _aten.reshape,
    _aten.lift_fresh,
    _aten._reshape_alias,
    _aten.unflatten,
    _aten.flatten,
    _aten.narrow,
    _aten.sym_size,
    _aten.sym_stride,
    _aten.sym_numel,
    _aten.is_same_size,
    _aten.empty,
    _aten.empty_strided,
    _aten.empty_like,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten.scalar_tensor,
}


def _sdpa_cpu_flops(q, k, v, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(q, k, v)


def _sdpa_cpu_backward_flops(grad_out, q, k, v, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # Every row of ``a`` meets one group's (K, N) matrix: (S, K) x (G, K, N), its backward's
    # (K, S) x (S, N) -> (G, K, N), and the batched 3-D x 3-D alike.
    return 2 * math.prod(a_shape) * b_shape[-1]


# torch's formulas take shapes (shape_wrapper turns the op's tensors into shapes); its
# registry lacks the CPU flash-attention kernels.
_FLOPS = dict(flop_counter.flop_registry)
_FLOPS[_aten._scaled_dot_product_flash_attention_for_cpu] = flop_counter.shape_wrapper(_sdpa_cpu_flops)
_FLOPS[_aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_counter.shape_wrapper(
    _sdpa_cpu_backward_flops
)
_FLOPS.setdefault(_aten._grouped_mm, flop_counter.shape_wrapper(_grouped_mm_flops))


@attrs.frozen
class Work:
    """The compute of one phase of one layer: what a machine turns into seconds.

    Attributes:
      flops: matrix-product and attention FLOPs per sample.
      bytes: bytes read + written by the other kernels per sample (memory-bound work).
      ops: kernels per call, whatever the batch (each costs a fixed overhead).
    """

    flops: float = 0.0
    bytes: float = 0.0
    ops: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.bytes + other.bytes, self.ops + other.ops)

    def __sub__(self, other: "Work") -> "Work":
        return Work(
            max(0.0, self.flops - other.flops), max(0.0, self.bytes - other.bytes), max(0.0, self.ops - other.ops)
        )

    def scale(self, k: float, ops: float = 1.0) -> "Work":
        """``flops`` and ``bytes`` times ``k``, ``ops`` times ``ops``."""
        return Work(self.flops * k, self.bytes * k, self.ops * ops)


@attrs.frozen
class LayerTrace:
    """What :func:`trace_layer` measured, per sample (``ops`` per call).

    Attributes:
      fwd, bwd_input, bwd_weight: :class:`Work` of forward, backward-input (I) and
        backward-weight (W); a full backward is I + W.
      saved_bytes: bytes autograd keeps from forward to backward, parameters excluded.
      output_bytes: bytes of the output (the activation handed to the next layer).
      wgrad_bytes: bytes of the gradients a split backward (``fs.sched.SplitBackward``)
        captures in I and holds until W, besides the saved activations (0 for a layer
        whose input takes no gradient: its whole backward is W).
    """

    fwd: Work
    bwd_input: Work
    bwd_weight: Work
    saved_bytes: float
    output_bytes: float
    wgrad_bytes: float = 0.0


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class _Counter(TorchDispatchMode):
    def __init__(self, track_memory: bool = False) -> None:
        super().__init__()
        self.flops = 0
        self.bytes = 0
        self.ops = 0
        self.foreach = 0
        self.track_memory = track_memory
        self.live = 0
        self.peak = 0

    def _track(self, args: Any, out: Any) -> None:
        """Counts new storages the op made until their tensor is freed (in-place results and
        views are not new)."""
        inputs = {a.untyped_storage().data_ptr() for a in tree_util.leaves(list(args)) if isinstance(a, torch.Tensor)}
        for t in tree_util.leaves(out if isinstance(out, (list, tuple)) else [out]):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue
            n = _nbytes(t)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if self.track_memory:  # before the free ops return: empty_like costs no time but holds memory
            self._track(args, out)
        if packet in _FREE:
            return out
        self.ops += 1
        if packet.__name__.startswith("_foreach_"):
            self.foreach += 1
        if packet in _FLOPS:
            self.flops += _FLOPS[packet](*args, **kwargs, out_val=out)
        else:
            ins = sum(_nbytes(a) for a in tree_util.leaves(list(args)) if isinstance(a, torch.Tensor))
            self.bytes += ins + _nbytes(out)
        return out


def _run(fn: Callable[[], Any]) -> tuple[Any, Work]:
    with _Counter() as c:
        out = fn()
    return out, Work(float(c.flops), float(c.bytes), float(c.ops))


def trace_layer(fn: Callable[..., torch.Tensor], params: Any, inputs: Sequence[Any], *, batch: int = 1) -> LayerTrace:
    """Runs one layer forward and backward once and counts its work.

    Args:
      fn: ``fn(params, *inputs) -> tensor`` (an activation, or a scalar loss for the last
        layer).
      params: the layer's parameter pytree (tensors on the tracing device; they are
        made leaves that require grad).
      inputs: the layer's inputs for ``batch`` samples; floating ones get gradients
        (the activation from the previous layer), integer ones (token ids) do not.
      batch: how many samples ``inputs`` hold; results are divided by it (optional,
        default 1).

    Returns:
      A :class:`LayerTrace`, per sample.

    Raises:
      ValueError: ``batch`` < 1, or ``fn`` returns no tensor that depends on ``params``.
    """
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"trace_layer: batch must be an int >= 1, got {batch!r}")
    leaves = [p.detach().requires_grad_(True) for p in tree_util.leaves(params)]
    params = tree_util.tree_unflatten(tree_util.structure(params), leaves)
    xs = [x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in inputs]
    grad_inputs = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    param_ids = {id(p) for p in leaves}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) not in param_ids and id(base) not in param_ids:
            saved[id(base)] = max(saved.get(id(base), 0), _nbytes(base))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, fwd = _run(lambda: fn(params, *xs))
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise ValueError("trace_layer: fn must return a tensor computed from params")
    seed = torch.ones_like(out)
    bwd_i = Work()
    if grad_inputs:
        _, bwd_i = _run(lambda: torch.autograd.grad(out, grad_inputs, seed, retain_graph=True))
    _, bwd_full = _run(lambda: torch.autograd.grad(out, grad_inputs + leaves, seed, allow_unused=True))
    wgrad = _held_for_w(fn, params, leaves, xs) if len(grad_inputs) == 1 else 0
    per = 1.0 / batch
    return LayerTrace(
        fwd=fwd.scale(per),
        bwd_input=bwd_i.scale(per),
        bwd_weight=(bwd_full - bwd_i).scale(per),
        saved_bytes=sum(saved.values()) * per,
        output_bytes=_nbytes(out) * per,
        wgrad_bytes=wgrad * per,
    )


def _held_for_w(fn: Callable[..., torch.Tensor], params: Any, leaves: list[torch.Tensor], xs: list[Any]) -> int:
    """Bytes (distinct storages) of the gradients ``fs.sched.SplitBackward``'s I captures for W
    on one forward of ``fn``: what the pipeline executor holds from a microbatch's I to its W."""
    from fshard.sched.split import SplitBackward

    x = next(t for t in xs if isinstance(t, torch.Tensor) and t.requires_grad)
    out = fn(params, *xs)
    split = SplitBackward(out, torch.ones_like(out), x, leaves)
    held = {
        g.untyped_storage().data_ptr() or id(g): g.untyped_storage().nbytes()  # meta: no addresses
        for g in split.captured_gradients()
    }
    split.weight_grads()  # frees the graph
    return sum(held.values())


@attrs.frozen
class OptimizerWork:
    """What one optimizer step costs, from a traced run of the real update.

    Attributes:
      bytes_per_element: bytes read + written per parameter element (memory-bound).
      ops: kernels per step whatever the leaf count (foreach kernels).
      ops_per_leaf: kernels per parameter leaf.
      foreach_ops: of ``ops``, the foreach kernels (a CPU runs one kernel per leaf each).
      transient_per_element: peak bytes of temporaries per parameter element (the
        clipped gradients and the update's intermediates), on top of parameters,
        gradients and state.
    """

    bytes_per_element: float
    ops: float
    ops_per_leaf: float
    foreach_ops: float
    transient_per_element: float = 0.0


def trace_optimizer(dtype: torch.dtype = torch.float32) -> OptimizerWork:
    """Traces the update ``examples/train_lm.py`` takes: ``fs.optim.global_norm``, the
    clipping scale (``g * coef`` per leaf), ``fs.optim.adamw`` and ``apply_updates`` under
    ``donate()``, on small trees to separate the cost per element, per leaf and per step."""
    from fshard import optim

    def run(n_leaves: int, numel: int) -> tuple[Work, int, int]:
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(numel, generator=g, dtype=dtype) for _ in range(n_leaves)]
        grads = [torch.randn(numel, generator=g, dtype=dtype) for _ in range(n_leaves)]
        opt = optim.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
        state = opt.init(params)
        with optim.donate():  # first step builds lazily initialised buffers: trace the second
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
        with _Counter(track_memory=True) as c:
            norm = optim.global_norm(grads)
            clipped = [x * (1.0 / (float(norm) + 1e-6)) for x in grads]
            with optim.donate():
                updates, state = opt.update(clipped, state, params)
                params = optim.apply_updates(params, updates)
            del clipped, updates
        return Work(float(c.flops), float(c.bytes), float(c.ops)), c.foreach, c.peak

    (a, fa, peak), (b, _, _), (c2, _, _) = run(2, 4096), run(4, 4096), run(2, 8192)
    per_leaf = (b.ops - a.ops) / 2
    return OptimizerWork(
        bytes_per_element=(c2.bytes - a.bytes) / (2 * 4096),
        ops=a.ops - 2 * per_leaf,
        ops_per_leaf=per_leaf,
        foreach_ops=fa,
        transient_per_element=peak / (2 * 4096),
    )
