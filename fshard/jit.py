"""``fs.jit``: capture a whole step (forward, gradient, optimizer, collectives) as one graph
and compile it with ``torch.compile(fullgraph=True)``.

How, as JAX's ``jit`` does it: the function is *traced* once per input signature by running
its Python on fake tensors (``make_fx(tracing_mode="fake")``). Everything that is Python
(``shard_map``'s spec checks, the body context and the collectives' ContextVars, checked
mode's metadata, autograd through ``fs.value_and_grad``, ``fs.optim`` kernels) runs at
trace time and leaves only its tensor operations in an aten FX graph, the collectives as
``torch.ops._c10d_functional`` ops. That graph is then compiled by Dynamo + a backend
(``"inductor"`` by default, ``"aot_eager"`` to debug, or ``None`` to run the captured
graph as it is). Nothing of Dynamo ever sees a ContextVar.

Compile time (``bench/jit_compile.py``; ``bench/README.md``, "fs.jit"): Inductor compiles
the aten graph directly (``torch._inductor.standalone_compile``), without Dynamo tracing
it again, and the ranks of one host compile a graph once: the views that slice a rank's
rows out of a global input (the only rank-dependent part of a data-parallel step) run
before the compiled graph, so every rank has the same graph; the first process to reach
it compiles it while the others wait on a file lock in the Inductor cache directory, then
load it from the cache. The compiled graph is cached there (``TORCHINDUCTOR_CACHE_DIR``)
across processes. The log (logger ``fshard.jit``, INFO) says how long each part took.

Collectives under Inductor (``fshard/_jit_comm.py``; :func:`fshard._jit_comm.collective_passes`
is the one place that chooses): collectives of one kind, process group and dtype that the
graph issues back to back and waits for back to back are merged into one over a flat
buffer (up to 25 MB; all-gathers, all-reduces, reduce-scatters, and the even all-to-alls
that carry fshard's gloo reduce-scatter): per-leaf gathers and reductions become one call,
and nothing else moves, so overlap and memory stay as they were (``fs.parallel``'s steps
already use one flat buffer per layer: nothing to merge there). Torch's compute/
communication reordering (its overlap scheduling) is off: it needs Triton even for CPU
graphs. Every decision depends on the graph only (order, kinds, groups, sizes; no
timing, no collective while compiling) and no rank is baked into the compiled graph, so
every rank issues the same collectives in the same order and one compile serves the
ranks of a host. The bytes on the wire are eager's, and ``fs.comm_log`` still reports
eager's collectives (the logical ones, before merging). ``options`` replaces these
entries: ``{"post_grad_custom_post_pass": None}`` turns merging off
(``fshard._jit_comm.without_collective_passes()``).

Memory: Inductor's reordering for locality is off (``_MEMORY``; ``options`` may turn it
on): over a whole step it moved kernels across forward, backward and the optimizer and kept
buffers alive longer (``bench/jit_memory.py``). ``donate_argnums`` computes results into the
donated arguments' buffers, JAX's buffer donation (see :func:`jit`).

Consequences (JAX's rules):

- Python side effects and values read from tensors happen once, at trace time. Reading a
  tensor value (``.item()``, ``bool(t)``, data-dependent control flow) cannot be traced:
  it raises :class:`JitCaptureError` naming the line, or, with
  ``on_capture_error="eager"``, warns and runs that signature eagerly.
- Non-tensor results are trace-time constants.
- Each call with a new signature traces and compiles again. The signature is the pytree
  structure of the arguments, and for each tensor leaf its shape, stride, dtype, device,
  DTensor mesh, placements and local shape; non-tensor leaves by value (they must be
  hashable). ``FSHARD_LOG_RECOMPILES=1`` logs (logger ``fshard.jit``) why a call
  compiles again: the leaves whose signature changed.
- ``fs.comm_log`` counts the collectives of a compiled call exactly as in eager: they
  are recorded while tracing and replayed into the active logs on every call.

Differentiate *inside* the jitted function (``fs.jit(fs.value_and_grad(...))`` or a
shard_map'd ``value_and_grad``): a captured graph has no autograd of its own, so an
argument that requires grad is refused.

Captured and tested against eager: DP, FSDP (2 and 4 ranks), HSDP (2x2), Megatron TP,
``fs.parallel``'s layer loop (FSDP and replicate), ``fs.optim`` with learning-rate
schedules (tensor ops of the step count: one graph for every step) and
``clip_by_global_norm`` (its norm's all-reduces become functional collectives), and
gradient accumulation with ``fs.parallel.GradAccumulator`` (the microbatch loop unrolled:
``examples/train_lm.py --jit --microbatches 2``).

``fs.lax.ppermute`` (and its backward, the inverse perm) is captured as one
``all_to_all_single`` whose split sizes send this rank's whole tensor to its destination
and nothing to the other ranks: Python ints of the tracing rank, baked into its graph, so
the ranks' graphs differ in them (their collectives still match one to one). Tested
against eager: rings, partial perms (ranks that receive zeros or send nothing), a perm
over one axis of a 2-D mesh, in both orders of ``shard_map`` and ``value_and_grad``.

The pipeline step (``fs.sched.pipeline_step``, every schedule: GPipe, 1F1B, interleaved,
zero-bubble, ...) is captured too: each run of SEND/RECV actions is one
``torch.ops.fshard.p2p_batch`` node (a ``batch_isend_irecv``) and each wait a
``wait_tensor``; the activation-shape headers and the loss dtype are exchanged for real
while the ranks trace, so the shapes are Python ints of each rank's graph (every rank
traces together; a rank whose stage output shape changes while its peer keeps its graph is
not supported). Tested against eager with the optimizer update in the graph: losses,
gradients and updated parameters (1e-12, float64), comm_log counts and bytes, on pp=2 and
on dp=2 x pp=2 (data-parallel sum, stage-level FSDP). The transfers must run in program
order: their pairing across ranks shows in no data dependency of one rank's graph, and
Inductor, compiling such a graph whole, fused and reordered kernels across them (seen: a
1F1B deadlock). So with ``"inductor"`` (``fshard/_jit_p2p.py``) the graph is cut at the
transfers: each ``p2p_batch``, its results' getitems and their waits run eagerly at their
place, and each run of compute between them is one region compiled by Inductor as the
rest of fs.jit compiles (``_inductor_compile``: fshard's collective passes, the cache, the
once-per-host compile), regions of equal code and input layouts compiled once (a 1F1B
step: the microbatches' forwards, the later backwards). Tested against eager under
Inductor (float64, 1e-12): 1F1B m=4 and ZB-H1 on pp=2, 1F1B on dp=2 x pp=2 (opt-in:
``FSHARD_TEST_INDUCTOR_STEP=1``). Compile time
of a 1F1B m=4 pp=2 step with AdamW (the tests' MLP): 9 and 7 regions (ranks 0, 1), 5 distinct
on each, those without in-place ops compiled before the first transfer (the others when the
call reaches them); first call 48 s cold (load 5; 52 s when every region compiled as the
call reached it, a rank waiting at its receives for its peer's compiles), 2.6 s warm. The
bench Transformer's: see ``bench/README.md``, "Pipeline".
``aot_eager`` and ``None`` run the whole graph in order; any other backend (which would
compile the graph whole) is refused (a :class:`JitCaptureError`, or eager with
``on_capture_error="eager"``). ``return_stats=True`` is refused (its timings are
wall-clock ones of an eager run).

Not yet capturable: anything that calls ``torch.distributed`` directly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sysconfig
import time
import traceback
import warnings
from typing import Any, Callable

import attrs
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from fshard import _jit_p2p, comm
from fshard import tree as tree_util

__all__ = ["jit", "Jitted", "JitCaptureError"]

log = logging.getLogger("fshard.jit")


class JitCaptureError(RuntimeError):
    """The function could not be captured as one graph (the message says where and why)."""


@attrs.frozen
class _Entry:
    """One compiled signature."""

    run: Callable[..., Any]          # flat local tensors -> flat outputs
    out_tree: Any                    # treedef of the results
    out_leaves: tuple                # per result leaf: ("tensor", None) | ("dtensor", meta) | ("const", value)
    timeline: tuple                  # comm.Event s recorded while tracing
    graph: Any                       # the captured torch.fx.GraphModule (before compilation)
    eager: bool = False              # capture failed and on_capture_error="eager"


def jit(f: Callable[..., Any] | None = None, *, backend: str | Callable | None = "inductor",
        on_capture_error: str = "raise", options: dict | None = None,
        donate_argnums: int | tuple[int, ...] = ()) -> Any:
    """Compiles ``f`` (a function of pytrees of tensors / DTensors) into one graph per signature.

    Args:
      f: e.g. ``fs.shard_map(per_device_step, ...)`` or any function that calls shard_map'd
        functions, ``fs.value_and_grad`` and ``fs.optim`` updates. Usable as a decorator,
        with or without arguments.
      backend: the ``torch.compile`` backend: ``"inductor"`` (default), ``"aot_eager"``
        (debugging: no code generation), any other backend name or callable, or ``None``
        (run the captured graph without compiling it). ``"eager"`` is ``None``: Dynamo's
        eager backend runs what Dynamo captured as it is, and the graph here is captured
        already (a second capture by Dynamo, seconds for a training step, would change
        nothing).
      on_capture_error: ``"raise"`` (default): a function that cannot be captured raises
        :class:`JitCaptureError`; ``"eager"``: warn (naming the cause) and run that
        signature eagerly from then on. A graph with point-to-point transfers (a pipeline
        step) that fails to compile under Inductor raises even so: its regions compile as
        the first call reaches them, after earlier transfers were posted.
      options: Inductor config for this compilation (``torch.compile(options=...)``); with
        ``"inductor"`` it is applied over fshard's collective passes
        (``fshard._jit_comm.collective_passes()``: merging back-to-back collectives), whose
        entries it may replace.
      donate_argnums: positional arguments whose tensors the call may overwrite with its
        results, JAX's buffer donation: each result leaf takes the first unused donated
        leaf of the same layout (shape, stride, dtype, device; for a DTensor also mesh,
        placements and local shape), in flattening order, and is computed into it (a
        ``copy_`` at the end of the graph, which Inductor fuses into the kernel that
        computes the result: the step allocates no new params or optimizer state). The
        result *is* that argument's tensor (the same object), so the donated arguments
        must not be used after the call, as in JAX (where they are deleted) and
        ``fs.optim.donate()``. A donated leaf that no result can take is left unchanged,
        with a warning naming it (JAX: "Some donated buffers were not usable"). A donated
        tensor may not also be passed as another argument (JAX's rule too), and a graph
        with donation that fails to compile raises even with ``on_capture_error="eager"``
        (its first run may have written into the arguments already).

    Returns:
      A :class:`Jitted` with ``f``'s signature and results (DTensors laid out as eager).

    Raises:
      ValueError: an unknown ``on_capture_error``; a ``donate_argnums`` entry that is not a
        non-negative int (at the call: one past the positional arguments, or a donated
        tensor whose memory is also another argument's).
    """
    if on_capture_error not in ("raise", "eager"):
        raise ValueError(f"fs.jit: on_capture_error={on_capture_error!r}; use 'raise' or 'eager'.")
    donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in donate):
        raise ValueError(f"fs.jit: donate_argnums={donate_argnums!r}; use non-negative ints, the positions of "
                         f"the arguments whose tensors the call may overwrite.")
    if f is None:
        return functools.partial(jit, backend=backend, on_capture_error=on_capture_error, options=options,
                                 donate_argnums=donate)
    return Jitted(f, backend, on_capture_error, options, donate)


class Jitted:
    """A jitted function: ``__call__`` as ``f``; ``cache_size``, ``graph(*args)`` to inspect."""

    def __init__(self, f: Callable[..., Any], backend, on_capture_error: str, options: dict | None,
                 donate_argnums: tuple[int, ...] = ()) -> None:
        functools.update_wrapper(self, f)
        self._f, self._backend, self._on_error, self._options = f, backend, on_capture_error, options
        self._donate = tuple(sorted(set(donate_argnums)))
        self._donated_at: dict[Any, frozenset[int]] = {}  # call structure -> donated leaf indices
        self._cache: dict[tuple, _Entry] = {}

    @property
    def cache_size(self) -> int:
        """How many signatures have been traced."""
        return len(self._cache)

    def graph(self, *args: Any, **kwargs: Any):
        """The captured aten FX graph for these arguments (traces them if needed)."""
        return self._entry(*self._signature(args, kwargs)).graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, call_args, leaves, treedef = self._signature(args, kwargs)
        entry = self._entry(key, call_args, leaves, treedef)
        if entry.eager:
            return self._f(*args, **kwargs)
        # The local tensors themselves, not ``to_local()``'s views: no argument requires
        # grad (refused above), so the autograd node per leaf would only cost host time.
        locals_ = [x._local_tensor if isinstance(x, DTensor) else x for x in leaves if isinstance(x, torch.Tensor)]
        # Dynamo compiles no frame while a dispatch mode (comm_log's) is active: the graph
        # runs without them, and its collectives are replayed into the logs instead.
        try:
            with _disable_current_modes():
                out = entry.run(*locals_)
        except JitCaptureError as e:  # the backend failed to compile the captured graph
            # With donation the first call may have written into the arguments before failing:
            # running them eagerly again could apply a step twice. With point-to-point
            # transfers, the regions compile one by one as the call reaches them: the transfers
            # before a failing region were posted already, and an eager rerun would post them
            # again, out of step with the peers.
            if self._on_error != "eager" or self._donate or _has_p2p(entry.graph):
                raise
            warnings.warn(f"{e}\nfs.jit runs this signature eagerly (on_capture_error='eager').",
                          RuntimeWarning, stacklevel=2)
            self._cache[key] = _Entry(None, None, (), (), entry.graph, eager=True)
            return self._f(*args, **kwargs)
        if entry.timeline:
            _replay(entry.timeline)
        flat, k = [], 0
        for kind, meta in entry.out_leaves:
            if kind == "const":
                flat.append(meta)
                continue
            if kind == "donated":  # computed into this argument's tensor: the result is that tensor
                flat.append(leaves[meta])
                continue
            t = out[k]
            k += 1
            if kind == "dtensor":
                # The traced output's spec (mesh, placements, global shape, stride, dtype),
                # shared by every call: DTensor.from_local's autograd node and spec
                # construction per leaf and call were most of fs.jit's host time per call.
                t = DTensor(t, meta, requires_grad=t.requires_grad)
            flat.append(t)
        return tree_util.tree_unflatten(entry.out_tree, flat)

    # --- signature and cache -----------------------------------------------------------
    def _signature(self, args: tuple, kwargs: dict):
        """The cache key of a call. Runs on every call, so it reads each leaf's DTensor spec
        and local tensor directly, and leaf paths are built only for a message."""
        leaves, treedef = tree_util.tree_flatten((args, kwargs))
        grad = torch.is_grad_enabled()
        sig = []
        seen: dict[int, int] = {}
        aliases = []  # (leaf, earlier leaf) for a tensor passed twice: tracing makes them one input
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                j = seen.setdefault(id(x), i)
                if j != i:
                    aliases.append((i, j))
                if grad and x.requires_grad:
                    raise ValueError(
                        f"fs.jit({self.__name__}): argument {_paths(args, kwargs)[i]} requires grad. A captured "
                        f"graph has no autograd of its own: differentiate inside the jitted function "
                        f"(fs.jit(fs.value_and_grad(f)) or a shard_map'd value_and_grad), or pass a "
                        f"detached tensor."
                    )
                sig.append(_tensor_sig(x))
            else:
                try:
                    hash(x)
                except TypeError:
                    raise TypeError(
                        f"fs.jit({self.__name__}): argument {_paths(args, kwargs)[i]} is a {type(x).__name__}, "
                        f"neither a tensor nor hashable: non-tensor arguments are part of the compiled "
                        f"signature (static)."
                    ) from None
                sig.append(("static", type(x), x))
        if self._donate:
            self._refuse_aliased_donation(args, kwargs, leaves, treedef)
        key = (treedef, tuple(sig), grad, tuple(aliases))
        return key, (args, kwargs), leaves, treedef

    def _refuse_aliased_donation(self, args: tuple, kwargs: dict, leaves: list, treedef: Any) -> None:
        """JAX's rule: a donated buffer may not be passed twice (donated twice, or donated and
        also passed as another argument): the graph would overwrite what it still reads."""
        donated = self._donated_indices(args, treedef)
        ptrs: dict[int, list[int]] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                loc = x._local_tensor if isinstance(x, DTensor) else x
                if loc.numel():
                    ptrs.setdefault(loc.untyped_storage().data_ptr(), []).append(i)
        bad = [idx for idx in ptrs.values() if len(idx) > 1 and any(i in donated for i in idx)]
        if bad:
            paths = _paths(args, kwargs)
            raise ValueError(
                f"fs.jit({self.__name__}): donate_argnums={self._donate}: a donated tensor's memory is also "
                f"passed as another argument: " + "; ".join(" and ".join(paths[i] for i in idx) for idx in bad)
                + ". Pass a copy (x.clone()) where the same tensor appears twice, or do not donate it.")

    def _entry(self, key, call_args, leaves, treedef) -> _Entry:
        entry = self._cache.get(key)
        if entry is None:
            if self._cache and os.environ.get("FSHARD_LOG_RECOMPILES"):
                log.warning("fs.jit(%s) recompiles: %s", self.__name__,
                            _why(key, _paths(*call_args), list(self._cache)))
            entry = self._cache[key] = self._capture(leaves, treedef, self._donated_leaves(*call_args))
        return entry

    def _donated_leaves(self, args: tuple, kwargs: dict) -> dict[int, str]:
        """Leaf index (in the flattened ``(args, kwargs)``) -> path, of the donated tensors."""
        if not self._donate:
            return {}
        paths = _paths(args, kwargs)
        return {i: paths[i] for i in self._donated_indices(args)}

    def _donated_indices(self, args: tuple, treedef: Any = None) -> frozenset[int]:
        """The leaf indices of the donated positional arguments; cached by the call's
        structure ``treedef`` (of ``(args, kwargs)``) when given."""
        found = self._donated_at.get(treedef) if treedef is not None else None
        if found is not None:
            return found
        if self._donate[-1] >= len(args):
            raise ValueError(f"fs.jit({self.__name__}): donate_argnums={self._donate} but the call has "
                             f"{len(args)} positional argument(s); donation names positional arguments.")
        first, idx = 0, []
        for i, a in enumerate(args[: self._donate[-1] + 1]):
            n = len(tree_util.leaves(a))
            if i in self._donate:
                idx.extend(range(first, first + n))
            first += n
        found = frozenset(idx)
        if treedef is not None:
            self._donated_at[treedef] = found
        return found

    # --- capture ---------------------------------------------------------------------------
    def _capture(self, leaves: list, treedef, donated: dict[int, str] | None = None) -> _Entry:
        from torch.fx.experimental.proxy_tensor import make_fx

        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        rebuild = [(x.device_mesh, x.placements, x.shape, x.stride()) if isinstance(x, DTensor) else None
                   for x in tensors]
        found: dict[str, Any] = {}
        # Donated tensor leaves, in order: (leaf index, layout) for matching results to them.
        donors = [(i, _tensor_sig(x)) for i, x in enumerate(leaves)
                  if i in (donated or {}) and isinstance(x, torch.Tensor)]

        def traced(*locals_):
            it = iter(zip(locals_, rebuild))
            flat = []
            for x in leaves:
                if not isinstance(x, torch.Tensor):
                    flat.append(x)
                    continue
                local, meta = next(it)
                flat.append(local if meta is None else
                            DTensor.from_local(local, meta[0], meta[1], run_check=False, shape=meta[2],
                                               stride=meta[3]))
            args, kwargs = tree_util.tree_unflatten(treedef, flat)
            with comm.comm_log() as tlog:
                out = self._f(*args, **kwargs)
            found["timeline"] = tuple(tlog.timeline)
            out_flat, found["tree"] = tree_util.tree_flatten(out)
            kinds, tensors_out = [], []
            by_leaf = dict(zip([i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)], locals_))
            inputs = {id(t) for t in locals_}
            # A donated argument that is also returned (as it is or as a view) keeps its value:
            # the result shares its buffer already.
            returned = {id(b) for o in out_flat if isinstance(o, torch.Tensor)
                        for b in [_base_input(o, inputs)] if b is not None}
            free = [(j, sig) for j, sig in donors if id(by_leaf[j]) not in returned]
            for o in out_flat:
                j = _take_donor(o, free, inputs) if free else None
                if j is not None:
                    # The result is computed into the donated argument's tensor; Inductor fuses
                    # the copy into the kernel that computes it.
                    by_leaf[j].copy_(o.to_local() if isinstance(o, DTensor) else o)
                    kinds.append(("donated", j))
                    continue
                if isinstance(o, DTensor):
                    kinds.append(("dtensor", o._spec))
                    tensors_out.append(o.to_local())
                elif isinstance(o, torch.Tensor):
                    kinds.append(("tensor", None))
                    tensors_out.append(o)
                else:
                    kinds.append(("const", o))
            found["kinds"] = tuple(kinds)
            found["unused"] = [j for j, _ in free]
            return tensors_out

        # The trace's collectives are not this call's (they are replayed per call), and no
        # mode of the caller's (comm_log's, which would count them twice) sees the trace.
        outer = comm._LOGS.set(())
        t0 = time.perf_counter()
        try:
            with _disable_current_modes():
                gm = make_fx(traced, tracing_mode="fake")(*[_local(x) for x in tensors])
        except Exception as e:  # noqa: BLE001 - any failure to trace is reported as one, with its cause
            return self._failed("trace", e)
        finally:
            comm._LOGS.reset(outer)
        _functional_collectives(gm)
        if found.get("unused"):
            warnings.warn(f"fs.jit({self.__name__}): donated tensors no result could take (no result of the "
                          f"same shape, stride, dtype and layout left): "
                          f"{', '.join(donated[j] for j in found['unused'])}. They are left unchanged.",
                          UserWarning, stacklevel=4)
        log.info("fs.jit(%s): traced %d graph nodes in %.1f s", self.__name__, len(gm.graph.nodes),
                 time.perf_counter() - t0)
        if self._backend not in _ORDER_KEEPING_BACKENDS and _has_p2p(gm):
            return self._failed(f"compile (backend={self._backend!r})", JitCaptureError(_P2P_REORDERED))
        run = gm if self._backend in _UNCOMPILED_BACKENDS else _Compiled(gm, self)
        return _Entry(run, found["tree"], found["kinds"], found["timeline"], gm)

    def _failed(self, stage: str, e: BaseException) -> _Entry:
        msg = _capture_message(self.__name__, stage, e)
        if self._on_error == "raise":
            raise JitCaptureError(msg) from e
        warnings.warn(msg + "\nfs.jit runs this signature eagerly (on_capture_error='eager').",
                      RuntimeWarning, stacklevel=3)
        return _Entry(None, None, (), (), None, eager=True)


class _Compiled:
    """Compiles the captured graph at the first call and runs it; a failure to compile is
    reported as a :class:`JitCaptureError` naming the backend.

    Inductor (``backend="inductor"``) compiles the aten graph directly
    (``torch._inductor.standalone_compile``): the graph is already what Dynamo would
    produce, and compiling without running lets the ranks of one host share the work
    (:func:`_once_per_host`). Other backends go through ``torch.compile(fullgraph=True)``.
    """

    def __init__(self, gm, owner: Jitted) -> None:
        self._gm, self._owner, self._fn = gm, owner, None

    def __call__(self, *args):
        if self._fn is not None:
            return self._fn(*args)
        owner = self._owner
        t0 = time.perf_counter()
        try:
            if owner._backend == "inductor" and _has_p2p(self._gm):
                prologue, main = _hoist_input_views(self._gm)
                inputs = prologue(*args) if prologue is not None else args
                compiled = _jit_p2p.Segmented(main, lambda g, a: _inductor_compile(g, a, owner._options),
                                              key=lambda g, a: _graph_key(g, a, {}))
                fn = compiled if prologue is None else (lambda *a: compiled(*prologue(*a)))
                compiled.compile_ahead()
                out = compiled(*inputs)  # compiles the other regions at their first run
                log.info("fs.jit(%s): point-to-point transfers: %d transfer nodes and %d others run eagerly "
                         "between %d compiled regions (%d distinct, compiled in %.1f s); first call %.1f s",
                         owner.__name__, compiled.n_transfer_nodes, compiled.n_eager, compiled.n_regions,
                         compiled.n_compiled, compiled.compile_s, time.perf_counter() - t0)
            elif owner._backend == "inductor":
                prologue, main = _hoist_input_views(self._gm)
                inputs = prologue(*args) if prologue is not None else args
                compiled = _inductor_compile(main, inputs, owner._options)
                fn = compiled if prologue is None else (lambda *a: compiled(*prologue(*a)))
                log.info("fs.jit(%s): compiled (Inductor) in %.1f s", owner.__name__, time.perf_counter() - t0)
                out = compiled(*inputs)
            else:  # Dynamo compiles at the first call
                fn = torch.compile(self._gm, fullgraph=True, backend=owner._backend, dynamic=False,
                                   options=owner._options)
                out = fn(*args)
                log.info("fs.jit(%s): compiled (backend %r) and ran the first call in %.1f s", owner.__name__,
                         owner._backend, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            raise JitCaptureError(_capture_message(owner.__name__, f"compile (backend={owner._backend!r})",
                                                   e)) from e
        self._fn = fn
        return out


def _inductor_compile(gm, args: tuple, options: dict | None):
    """Inductor's compiled callable for ``gm`` on inputs like ``args`` (static shapes),
    with fshard's collective bucketing and reordering (:func:`fshard._jit_comm.collective_passes`)
    unless ``options`` replaces them."""
    from torch._inductor import standalone_compile

    from fshard._jit_comm import collective_passes

    # Inductor config, for this compilation only; the caller's options win.
    patches = {**_MEMORY, **collective_passes(), **(options or {})}
    with _once_per_host(_graph_key(gm, args, patches)):
        return standalone_compile(gm, list(args), dynamic_shapes="from_example_inputs",
                                  options={"config_patches": patches})


# A whole training step is one graph: Inductor's reordering for locality moves kernels next
# to their consumers across forward, backward and the optimizer, and that kept buffers alive
# longer (bench/jit_memory.py, 2 ranks: peak live memory of the FSDP step 124-137 -> 110 MiB,
# replicate 129 -> 119, eager fshard 104-106 and 112) for about 1 % more CPU time per step.
_MEMORY = {"reorder_for_locality": False}


def _graph_key(gm, args: tuple, patches: dict) -> str:
    """A digest of what Inductor compiles: the graph's code, the inputs' layouts, the settings."""
    import hashlib

    text = "\n".join([torch.__version__, gm.code, repr(sorted(patches.items()))] +
                      [repr((tuple(a.shape), a.stride(), a.dtype, a.device)) if isinstance(a, torch.Tensor) else repr(a)
                       for a in args])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@contextlib.contextmanager
def _once_per_host(key: str):
    """The first process of this host (of this Inductor cache directory) to compile graph
    ``key`` compiles it alone; the others wait and then compile from the cache it filled.

    Every rank compiles the same graph; compiling them at once on one host does the same
    work once per rank, on cores they share. Waiting costs the others a warm compile
    (loading the cached result) after the first one's cold compile. Compiling runs no
    collective, so a waiting rank blocks no one. The lock is an OS file lock: a process
    that dies holding it releases it.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.utils._filelock import FileLock

    where = os.path.join(cache_dir(), "fshard_jit")
    os.makedirs(where, exist_ok=True)
    done = os.path.join(where, key + ".done")
    if os.path.exists(done):
        log.info("fs.jit: graph %s was compiled on this host before: compiling from the cache", key[:12])
        yield
        return
    t0 = time.perf_counter()
    lock = FileLock(os.path.join(where, key + ".lock"))
    lock.acquire()
    if os.path.exists(done):  # another process compiled it while this one waited
        lock.release()
        log.info("fs.jit: graph %s was compiled on this host by another process (waited %.1f s): compiling "
                 "from the cache", key[:12], time.perf_counter() - t0)
        yield
        return
    log.info("fs.jit: graph %s: compiling it first on this host", key[:12])
    try:
        yield
        with open(done, "w"):
            pass
    finally:
        lock.release()


def _hoist_input_views(gm):
    """Splits ``gm`` into ``(prologue, main)``: the prologue computes the views of the
    graph's inputs that the graph takes first (``shard_map`` slicing this rank's rows out
    of a global batch), the main graph everything else, from the prologue's results.

    Those views are the only rank-dependent part of a data-parallel step (their offsets
    are the rank's): without them every rank of a host compiles the same graph, which one
    compile can serve (:func:`_once_per_host`; Inductor's cache keys ignore a storage
    offset). Views of an input that the graph mutates stay in the graph (the compiled
    graph must see the aliasing). ``prologue`` is ``None`` when there is nothing to hoist.
    The prologue runs at every call: a handful of view ops.
    """
    graph = gm.graph
    outside = {n for n in graph.nodes if n.op == "placeholder"}
    mutated = set()
    for n in graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            mutated.update(a for a in n.all_input_nodes)
    # An input the graph mutates, directly or through a view, keeps all its views inside.
    blocked = {n for n in outside if _reaches(n, mutated)}
    for n in graph.nodes:
        if (n.op == "call_function" and (n.target is _GETITEM or n.target in _SLICES) and n.all_input_nodes
                and all(a in outside and a not in blocked for a in n.all_input_nodes)):
            outside.add(n)
    if all(n.op == "placeholder" for n in outside):
        return None, gm
    needed = [n for n in graph.nodes if n in outside and any(u not in outside for u in n.users)]
    pro, env = torch.fx.Graph(), {}
    for n in graph.nodes:
        if n in outside:
            env[n] = pro.node_copy(n, lambda a: env[a])
    pro.output([env[n] for n in needed])
    main, env = torch.fx.Graph(), {}
    for n in needed:
        env[n] = main.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in graph.nodes:
        if n not in outside:
            env[n] = main.node_copy(n, lambda a: env[a])
    return torch.fx.GraphModule(gm, pro), torch.fx.GraphModule(gm, main)


_GETITEM = __import__("operator").getitem  # of a split's results
_ATEN = torch.ops.aten
# Views that take a part of a tensor (whose offsets may be the rank's); whole-tensor views
# (reshapes) stay in the graph: hoisting them would only add host work to every call.
_SLICES = frozenset({_ATEN.slice.Tensor, _ATEN.select.int, _ATEN.narrow.default, _ATEN.split.Tensor,
                     _ATEN.split_with_sizes.default, _ATEN.unbind.int, _ATEN.chunk.default})


def _is_view(node) -> bool:
    if node.target is _GETITEM:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _reaches(node, targets: set) -> bool:
    """Whether ``node`` or a view of it (transitively) is in ``targets``."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n in targets:
            return True
        todo.extend(u for u in n.users if _is_view(u))
    return False


# --- helpers -------------------------------------------------------------------------------
def _functional_collectives(gm) -> None:
    """Rewrites in-place all-reduces (``fs.parallel``'s DDP buckets reduce in place) as
    out-of-place ones whose waited result is copied back: AOTAutograd cannot functionalize
    a custom op that mutates its input, and Inductor reorders the copy as it likes."""
    graph, changed = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _C10D.all_reduce_.default:
            continue
        buf = node.args[0]
        with graph.inserting_before(node):
            fresh = graph.call_function(_C10D.all_reduce.default, node.args, node.kwargs)
        fresh.meta = dict(node.meta)  # same shape and dtype: what later passes size it by
        for user in list(node.users):
            if user.target is not _C10D.wait_tensor.default:
                raise JitCaptureError(f"fs.jit: an in-place all-reduce is used by {user.format_node()} before "
                                      f"its wait; only a waited result can be captured.")
            user.args = (fresh,)
            with graph.inserting_after(user):
                back = graph.call_function(torch.ops.aten.copy_.default, (buf, user))
            user.replace_all_uses_with(back, delete_user_cb=lambda n, back=back: n is not back)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()


_C10D = torch.ops._c10d_functional

# Point-to-point transfers (fs.sched's pipeline) pair up across ranks in program order, which no
# data dependency of one rank's graph shows: backends that run the graph in its order keep them,
# and "inductor" compiles the compute between them (fshard/_jit_p2p.py); any other is refused.
_ORDER_KEEPING_BACKENDS = (None, "aot_eager", "eager", "inductor")
# Backends that run the captured graph as it is (see jit()'s ``backend``).
_UNCOMPILED_BACKENDS = (None, "eager")
_P2P_REORDERED = (
    "the graph holds point-to-point transfers (fs.sched's pipeline: fshard.p2p_batch), which must run in "
    "program order: a rank's wait for a receive depends on a peer's send that no data dependency of its "
    "own graph shows, and a backend that compiles the whole graph may fuse and reorder kernels across "
    "them (seen with Inductor on the whole graph: a 1F1B rank waited for a gradient before sending the "
    "activation its peer needed, and the ranks deadlocked). fs.jit runs such graphs with "
    "backend='inductor' (the compute between the transfers compiled, the transfers run eagerly in "
    "program order), 'aot_eager' or None.")

_P2P_OPS = _jit_p2p.P2P_OPS


def _has_p2p(gm) -> bool:
    return any(n.op == "call_function" and str(n.target) in _P2P_OPS for n in gm.graph.nodes)


def _take_donor(o: Any, free: list, inputs: set[int]) -> int | None:
    """The leaf index of the first donated tensor in ``free`` with ``o``'s layout, removed
    from ``free``; ``None`` if there is none or ``o`` is not a fresh result. An argument
    returned as it is (or a view of one) is not computed into another (``free`` holds no
    returned argument either): copying argument into argument at the end of the graph
    would make the order of the copies matter."""
    if not isinstance(o, torch.Tensor) or _base_input(o, inputs) is not None:
        return None
    sig = _tensor_sig(o)
    for k, (j, s) in enumerate(free):
        if s == sig:
            del free[k]
            return j
    return None


def _base_input(o: torch.Tensor, inputs: set[int]) -> torch.Tensor | None:
    """The graph input that ``o`` (a traced result) is, or is a view of; else ``None``."""
    loc = o._local_tensor if isinstance(o, DTensor) else o
    for t in (loc, loc._base):
        if t is not None and id(t) in inputs:
            return t
    return None


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _tensor_sig(x: torch.Tensor) -> tuple:
    if isinstance(x, DTensor):
        spec, loc = x._spec, x._local_tensor
        meta = spec.tensor_meta
        if meta is None:  # a spec without its tensor's metadata: ask the DTensor
            return ("dtensor", tuple(x.shape), x.stride(), x.dtype, spec.mesh, spec.placements,
                    tuple(loc.shape), loc.stride())
        return ("dtensor", tuple(meta.shape), meta.stride, meta.dtype, spec.mesh, spec.placements,
                tuple(loc.shape), loc.stride())
    return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)


def _paths(args: tuple, kwargs: dict) -> list[str]:
    """Each leaf's path in the call, as a message names it (``args[0].w``, ``kwargs.lr``)."""
    raw, _, _ = tree_util.tree_flatten_with_path((args, kwargs))
    return [_path(p) for p in raw]


def _path(p) -> str:
    s = tree_util.keystr(p)
    # (args, kwargs): "0.1.w" -> "args[1].w"; "1.lr" -> "kwargs.lr"
    head, _, rest = s.partition(".")
    if head == "0":
        i, _, rest = rest.partition(".")
        return f"args[{i}]" + (f".{rest}" if rest else "")
    return f"kwargs.{rest}" if rest else "kwargs"


_FIELDS = {"tensor": ("shape", "stride", "dtype", "device"),
           "dtensor": ("shape", "stride", "dtype", "mesh", "placements", "local shape", "local stride"),
           "static": ("type", "value")}


def _why(key: tuple, paths: list[str], old: list[tuple]) -> str:
    """What differs between ``key`` and the closest cached signature, leaf by leaf."""
    treedef, sig, grad, aliases = key
    same_tree = [k for k in old if k[0] == treedef]
    if not same_tree:
        return "the argument structure changed (new pytree: %s)" % (treedef,)
    best, best_diff = None, None
    for k in same_tree:
        diff = []
        if k[2] != grad:
            diff.append(f"grad mode {k[2]} -> {grad}")
        if k[3] != aliases:
            diff.append(f"tensors passed more than once (leaf, same as leaf) {k[3]} -> {aliases}")
        for path, a, b in zip(paths, k[1], sig):
            if a == b:
                continue
            if a[0] != b[0]:
                diff.append(f"{path}: {a[0]} -> {b[0]}")
                continue
            for name, u, v in zip(_FIELDS[a[0]], a[1:], b[1:]):
                if u != v:
                    diff.append(f"{path}: {name} {u} -> {v}")
        if best_diff is None or len(diff) < len(best_diff):
            best, best_diff = k, diff
    return "; ".join(best_diff) or "no difference found (equal signature, unhashable equality?)"


def _replay(timeline: tuple) -> None:
    """Replays a traced call's collectives into the active comm logs (as eager logs them)."""
    if not comm._LOGS.get():
        return
    for ev in timeline:
        if ev.what == "issue":
            comm.record(ev.kind, ev.axes, ev.nbytes, wire=ev.wire)
        else:
            comm._append(ev)


_OUR_DIR = os.path.dirname(os.path.abspath(__file__))
# Frames in these are not "the user's line": torch, installed packages, the standard library.
_LIB_DIRS = tuple({os.path.dirname(os.path.abspath(torch.__file__))} |
                  {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")})


def _capture_message(name: str, stage: str, e: BaseException) -> str:
    """Names the cause and the innermost line of user code (else of fshard) it came from."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [fr for fr in frames if not fr.filename.startswith(_LIB_DIRS + (_OUR_DIR,)) and "<" not in fr.filename]
    ours = [fr for fr in frames if fr.filename.startswith(_OUR_DIR) and not fr.filename.endswith("jit.py")]
    where = user[-1] if user else (ours[-1] if ours else None)
    line = f"{where.filename}:{where.lineno}: {where.line}" if where else "(no Python line found)"
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()][:3]
    cause = f"{type(e).__name__}: " + " / ".join(lines)[:600]
    hint = ""
    text = str(e)
    if any(s in text for s in ("data-dependent", "Data dependent", "DataDependent", "item()", "data pointer",
                                "GuardOnDataDependent", "unbacked")) or "DataDependent" in type(e).__name__:
        hint = ("\nThe function reads a tensor's value in Python (.item(), bool(t), if/while on a tensor, "
                "printing it): fs.jit traces without values. Compute it with tensor ops (torch.where), "
                "move it out of the jitted function, or pass on_capture_error='eager'.")
    return f"fs.jit({name}) could not {stage} the function: {cause}\n  at {line}{hint}"
