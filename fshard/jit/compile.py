"""fs.jit's compile side: a captured graph compiled at its first call (Inductor directly,
once per host; other backends through ``torch.compile``), the input views hoisted out of
the compiled region, and the collectives made functional."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable

import torch

from fshard.jit import fx
from fshard.jit import p2p as _jit_p2p
from fshard.jit.capture import JitCaptureError, _capture_message

log = logging.getLogger("fshard.jit")


class _Compiled:
    """Compiles the captured graph at the first call and runs it; a failure to compile is
    reported as a :class:`JitCaptureError` naming the backend.

    Inductor (``backend="inductor"``) compiles the aten graph directly
    (``torch._inductor.standalone_compile``): the graph is already what Dynamo would
    produce, and compiling without running lets the ranks of one host share the work
    (:func:`_once_per_host`). Other backends go through ``torch.compile(fullgraph=True)``.
    """

    def __init__(self, gm, owner: Any) -> None:  # owner: the fshard.jit.api.Jitted
        self._gm, self._owner = gm, owner
        self._fn: Callable[..., Any] | None = None
        self._meshes: list = []  # the input DTensors' device meshes (set by Jitted._capture)

    def __call__(self, *args):
        if self._fn is not None:
            return self._fn(*args)
        owner = self._owner
        if owner._backend == "inductor" and _has_p2p(self._gm):
            self._fn, out = self._first_p2p_call(args)
            return out
        t0 = time.perf_counter()
        try:
            if owner._backend == "inductor":
                prologue, main = _hoist_input_views(self._gm)
                inputs = prologue(*args) if prologue is not None else args
                compiled = _inductor_compile(main, inputs, owner._options)
                fn = compiled if prologue is None else (lambda *a: compiled(*prologue(*a)))
                log.info("fs.jit(%s): compiled (Inductor) in %.1f s", owner.__name__, time.perf_counter() - t0)
                out = compiled(*inputs)
            else:  # Dynamo compiles at the first call
                fn = torch.compile(
                    self._gm, fullgraph=True, backend=owner._backend, dynamic=False, options=owner._options
                )
                out = fn(*args)
                log.info(
                    "fs.jit(%s): compiled (backend %r) and ran the first call in %.1f s",
                    owner.__name__,
                    owner._backend,
                    time.perf_counter() - t0,
                )
        except Exception as e:  # noqa: BLE001
            raise JitCaptureError(_capture_message(owner.__name__, f"compile (backend={owner._backend!r})", e)) from e
        self._fn = fn
        return out

    def _first_p2p_call(self, args: tuple):
        """Compiles a graph with point-to-point transfers region by region
        (``fshard/jit/p2p.py``), has the ranks agree that every one compiled, then runs it.
        Only the compile is reported as a compile failure: an error of the run (a peer that
        died, a transfer's timeout) propagates as it is."""
        owner = self._owner
        stage = f"compile (backend={owner._backend!r})"
        t0 = time.perf_counter()
        error = None
        try:
            prologue, main = _hoist_input_views(self._gm)
            inputs = prologue(*args) if prologue is not None else args
            # No merging of collectives in the regions: ranks on different stages compile
            # different regions but share the pp group (the loss broadcast, a pp-wide norm),
            # and merging is only the same on every rank for the same graph.
            compiled = _jit_p2p.Segmented(
                main,
                lambda g, a: _inductor_compile(g, a, owner._options, bucketing=False),
                key=lambda g, a: _graph_key(g, a, {}),
            )
            compiled.compile_ahead()
        except Exception as e:  # noqa: BLE001
            error = e
        # Before the first transfer: a rank that failed would leave its peers waiting at their
        # receives for the process group's timeout, then reporting that instead of the cause.
        # Only where every rank of the default group runs this step (a step on a mesh that is
        # not the world would leave the other ranks out of the gather): otherwise a failure
        # raises on its rank alone, as before the agreement.
        if _jit_p2p.spans_world(self._gm.graph, self._meshes):
            failed = _jit_p2p.agree(error)
        elif error is not None:
            raise JitCaptureError(_capture_message(owner.__name__, stage, error)) from error
        else:
            failed = {}
        if failed:
            others = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
            if error is not None:
                raise JitCaptureError(
                    f"{_capture_message(owner.__name__, stage, error)}\n"
                    f"Every rank stops before its first transfer (ranks that failed: "
                    f"{others})."
                ) from error
            raise JitCaptureError(
                f"fs.jit({owner.__name__}) could not {stage} the function on another rank of "
                f"the pipeline ({others}). This rank compiled its regions and stops too, "
                f"before its first transfer."
            )
        fn = compiled if prologue is None else (lambda *a: compiled(*prologue(*a)))
        # Set before the first run: a rank whose first run raised must not agree again at its
        # next call, where its peers go straight to their transfers.
        self._fn = fn
        t1 = time.perf_counter()
        out = compiled(*inputs)
        log.info(
            "fs.jit(%s): point-to-point transfers: %d transfer nodes and %d others run eagerly "
            "between %d compiled regions (%d distinct, compiled in %.1f s); compiled and agreed in %.1f s, "
            "first run %.1f s",
            owner.__name__,
            compiled.n_transfer_nodes,
            compiled.n_eager,
            compiled.n_regions,
            compiled.n_compiled,
            compiled.compile_s,
            t1 - t0,
            time.perf_counter() - t1,
        )
        return fn, out


def _inductor_compile(gm, args: tuple, options: dict | None, bucketing: bool = True):
    """Inductor's compiled callable for ``gm`` on inputs like ``args`` (static shapes),
    with fshard's collective bucketing (unless ``bucketing`` is False) and reordering
    (:func:`fshard.jit.passes.bucket.collective_passes`) unless ``options`` replaces them."""
    from torch._inductor import standalone_compile

    from fshard.jit.passes.bucket import collective_passes
    from fshard.jit.passes.memory import memory_passes

    # Inductor config, for this compilation only; the caller's options win.
    passes = collective_passes() if bucketing else collective_passes(bucket_mb=None)
    patches = {**memory_passes(), **passes, **(options or {})}
    with _once_per_host(_graph_key(gm, args, patches)):
        return standalone_compile(
            gm, list(args), dynamic_shapes="from_example_inputs", options={"config_patches": patches}
        )


def _graph_key(gm, args: tuple, patches: dict) -> str:
    """A digest of what Inductor compiles: the graph's code, the inputs' layouts, the settings."""
    import hashlib

    text = "\n".join(
        [torch.__version__, gm.code, repr(sorted(patches.items()))]
        + [
            repr((tuple(a.shape), a.stride(), a.dtype, a.device)) if isinstance(a, torch.Tensor) else repr(a)
            for a in args
        ]
    )
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

    Two empty files per graph stay in ``<cache dir>/fshard_jit`` (next to Inductor's own
    entries, which also stay): ``<key>.done``, which lets a later process skip the lock, and
    ``<key>.lock``, which cannot be removed safely (a process waiting on the removed file
    and one creating it anew would both hold "the" lock). Removing the directory with
    Inductor's cache, while no process compiles, is safe.
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
        log.info(
            "fs.jit: graph %s was compiled on this host by another process (waited %.1f s): compiling from the cache",
            key[:12],
            time.perf_counter() - t0,
        )
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
        if (
            n.op == "call_function"
            and (n.target is _GETITEM or n.target in _SLICES)
            and n.all_input_nodes
            and all(a in outside and a not in blocked for a in n.all_input_nodes)
        ):
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
_SLICES = frozenset(
    {
        _ATEN.slice.Tensor,
        _ATEN.select.int,
        _ATEN.narrow.default,
        _ATEN.split.Tensor,
        _ATEN.split_with_sizes.default,
        _ATEN.unbind.int,
        _ATEN.chunk.default,
    }
)


_is_view = fx.is_view


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
                raise JitCaptureError(
                    f"fs.jit: an in-place all-reduce is used by {user.format_node()} before "
                    f"its wait; only a waited result can be captured."
                )
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
# and "inductor" compiles the compute between them (fshard/jit/p2p.py); any other is refused.
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
    "program order), 'aot_eager' or None."
)

_P2P_OPS = _jit_p2p.P2P_OPS


def _has_p2p(gm) -> bool:
    return any(n.op == "call_function" and str(n.target) in _P2P_OPS for n in gm.graph.nodes)
