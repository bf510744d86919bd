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

Not yet capturable: ``fs.lax.ppermute`` and the pipeline executor (point-to-point
transfers are not functional collectives), and anything else that calls
``torch.distributed`` directly.
"""

from __future__ import annotations

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

from fshard import comm
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
        on_capture_error: str = "raise", options: dict | None = None) -> Any:
    """Compiles ``f`` (a function of pytrees of tensors / DTensors) into one graph per signature.

    Args:
      f: e.g. ``fs.shard_map(per_device_step, ...)`` or any function that calls shard_map'd
        functions, ``fs.value_and_grad`` and ``fs.optim`` updates. Usable as a decorator,
        with or without arguments.
      backend: the ``torch.compile`` backend: ``"inductor"`` (default), ``"aot_eager"``
        (debugging: no code generation), any other backend name or callable, or ``None``
        (run the captured graph without compiling it).
      on_capture_error: ``"raise"`` (default): a function that cannot be captured raises
        :class:`JitCaptureError`; ``"eager"``: warn (naming the cause) and run that
        signature eagerly from then on.
      options: passed to ``torch.compile(options=...)``.

    Returns:
      A :class:`Jitted` with ``f``'s signature and results (DTensors laid out as eager).

    Raises:
      ValueError: an unknown ``on_capture_error``.
    """
    if on_capture_error not in ("raise", "eager"):
        raise ValueError(f"fs.jit: on_capture_error={on_capture_error!r}; use 'raise' or 'eager'.")
    if f is None:
        return functools.partial(jit, backend=backend, on_capture_error=on_capture_error, options=options)
    return Jitted(f, backend, on_capture_error, options)


class Jitted:
    """A jitted function: ``__call__`` as ``f``; ``cache_size``, ``graph(*args)`` to inspect."""

    def __init__(self, f: Callable[..., Any], backend, on_capture_error: str, options: dict | None) -> None:
        functools.update_wrapper(self, f)
        self._f, self._backend, self._on_error, self._options = f, backend, on_capture_error, options
        self._cache: dict[tuple, _Entry] = {}

    @property
    def cache_size(self) -> int:
        """How many signatures have been traced."""
        return len(self._cache)

    def graph(self, *args: Any, **kwargs: Any):
        """The captured aten FX graph for these arguments (traces them if needed)."""
        return self._entry(*self._signature(args, kwargs)).graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, paths, leaves, treedef = self._signature(args, kwargs)
        entry = self._entry(key, paths, leaves, treedef)
        if entry.eager:
            return self._f(*args, **kwargs)
        locals_ = [_local(x) for x in leaves if isinstance(x, torch.Tensor)]
        # Dynamo compiles no frame while a dispatch mode (comm_log's) is active: the graph
        # runs without them, and its collectives are replayed into the logs instead.
        try:
            with _disable_current_modes():
                out = entry.run(*locals_)
        except JitCaptureError as e:  # the backend failed to compile the captured graph
            if self._on_error != "eager":
                raise
            warnings.warn(f"{e}\nfs.jit runs this signature eagerly (on_capture_error='eager').",
                          RuntimeWarning, stacklevel=2)
            self._cache[key] = _Entry(None, None, (), (), entry.graph, eager=True)
            return self._f(*args, **kwargs)
        _replay(entry.timeline)
        flat, k = [], 0
        for kind, meta in entry.out_leaves:
            if kind == "const":
                flat.append(meta)
                continue
            t = out[k]
            k += 1
            if kind == "dtensor":
                mesh, placements, shape, stride = meta
                t = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
            flat.append(t)
        return tree_util.tree_unflatten(entry.out_tree, flat)

    # --- signature and cache -----------------------------------------------------------
    def _signature(self, args: tuple, kwargs: dict):
        raw_paths, leaves, treedef = tree_util.tree_flatten_with_path((args, kwargs))
        paths = [_path(p) for p in raw_paths]
        sig = []
        for path, x in zip(paths, leaves):
            if isinstance(x, torch.Tensor):
                if x.requires_grad and torch.is_grad_enabled():
                    raise ValueError(
                        f"fs.jit({self.__name__}): argument {path} requires grad. A captured graph has no "
                        f"autograd of its own: differentiate inside the jitted function "
                        f"(fs.jit(fs.value_and_grad(f)) or a shard_map'd value_and_grad), or pass a "
                        f"detached tensor."
                    )
                sig.append(_tensor_sig(x))
            else:
                try:
                    hash(x)
                except TypeError:
                    raise TypeError(
                        f"fs.jit({self.__name__}): argument {path} is a {type(x).__name__}, neither a tensor "
                        f"nor hashable: non-tensor arguments are part of the compiled signature (static)."
                    ) from None
                sig.append(("static", type(x), x))
        key = (treedef, tuple(sig), torch.is_grad_enabled())
        return key, paths, leaves, treedef

    def _entry(self, key, paths, leaves, treedef) -> _Entry:
        entry = self._cache.get(key)
        if entry is None:
            if self._cache and os.environ.get("FSHARD_LOG_RECOMPILES"):
                log.warning("fs.jit(%s) recompiles: %s", self.__name__, _why(key, paths, list(self._cache)))
            entry = self._cache[key] = self._capture(leaves, treedef)
        return entry

    # --- capture ---------------------------------------------------------------------------
    def _capture(self, leaves: list, treedef) -> _Entry:
        from torch.fx.experimental.proxy_tensor import make_fx

        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        rebuild = [(x.device_mesh, x.placements, x.shape, x.stride()) if isinstance(x, DTensor) else None
                   for x in tensors]
        found: dict[str, Any] = {}

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
            for o in out_flat:
                if isinstance(o, DTensor):
                    kinds.append(("dtensor", (o.device_mesh, o.placements, o.shape, o.stride())))
                    tensors_out.append(o.to_local())
                elif isinstance(o, torch.Tensor):
                    kinds.append(("tensor", None))
                    tensors_out.append(o)
                else:
                    kinds.append(("const", o))
            found["kinds"] = tuple(kinds)
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
        log.info("fs.jit(%s): traced %d graph nodes in %.1f s", self.__name__, len(gm.graph.nodes),
                 time.perf_counter() - t0)
        if self._backend is None:
            run = gm
        else:
            compiled = torch.compile(gm, fullgraph=True, backend=self._backend, dynamic=False,
                                     options=self._options)
            run = _FirstCallChecked(compiled, self)
        return _Entry(run, found["tree"], found["kinds"], found["timeline"], gm)

    def _failed(self, stage: str, e: BaseException) -> _Entry:
        msg = _capture_message(self.__name__, stage, e)
        if self._on_error == "raise":
            raise JitCaptureError(msg) from e
        warnings.warn(msg + "\nfs.jit runs this signature eagerly (on_capture_error='eager').",
                      RuntimeWarning, stacklevel=3)
        return _Entry(None, None, (), (), None, eager=True)


class _FirstCallChecked:
    """Runs the compiled graph; a failure of the first call (Dynamo/backend compilation)
    is reported as a :class:`JitCaptureError` naming the backend."""

    def __init__(self, compiled, owner: Jitted) -> None:
        self._compiled, self._owner, self._ok = compiled, owner, False

    def __call__(self, *args):
        if self._ok:
            return self._compiled(*args)
        t0 = time.perf_counter()
        try:
            out = self._compiled(*args)
        except Exception as e:  # noqa: BLE001
            raise JitCaptureError(_capture_message(self._owner.__name__, f"compile (backend={self._owner._backend!r})",
                                                   e)) from e
        self._ok = True
        log.info("fs.jit(%s): compiled (backend %r) and ran the first call in %.1f s", self._owner.__name__,
                 self._owner._backend, time.perf_counter() - t0)
        return out


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


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _tensor_sig(x: torch.Tensor) -> tuple:
    if isinstance(x, DTensor):
        loc = x.to_local()
        return ("dtensor", tuple(x.shape), x.stride(), x.dtype, x.device_mesh, tuple(x.placements),
                tuple(loc.shape), loc.stride())
    return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)


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
    treedef, sig, grad = key
    same_tree = [k for k in old if k[0] == treedef]
    if not same_tree:
        return "the argument structure changed (new pytree: %s)" % (treedef,)
    best, best_diff = None, None
    for k in same_tree:
        diff = []
        if k[2] != grad:
            diff.append(f"grad mode {k[2]} -> {grad}")
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
