"""Multi-rank test harness: run a test body on 1, 2 or 4 real gloo ranks (8 for tiny 3-D meshes).

One persistent :class:`~fshard.runtime.local.WorkerPool` per world size serves every
test (starting ranks costs seconds; a test costs milliseconds). The ranks are forked
from a ``forkserver`` that has imported torch and fshard once: spawning each rank
imports them again, seconds of CPU per rank (``bench/README.md``, "Host costs behind the
code"), and the forkserver holds no threads or process groups, so
forking it is as clean as a spawn. A body that fails on
any rank fails the test with that rank's traceback; a body that deadlocks is killed
after its timeout and the failure shows where each rank was stuck. A pool that had to
be killed is rebuilt for the next test.

Test bodies are module-level functions (they are sent to the ranks by reference)::

    def _body(n):
        mesh = fs.make_mesh({"fsdp": n})
        ...
        return something_small

    @pytest.mark.parametrize("n", [1, 2, 4])
    def test_thing(n):
        results = run_on_ranks(_body, n, world_size=n)
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing
import os
import re
from typing import Any, Callable, Iterator

import torch

from fshard._ports import free_port  # noqa: F401 - re-exported: tests and tools use it here
from fshard.runtime.local import WorkerPool
from fshard.runtime.simulation import run_simulated

__all__ = [
    "run_on_ranks",
    "run_simulated",
    "assert_bitwise_equal",
    "shutdown_pools",
    "release_pool_groups",
    "assert_close",
    "local_block_diff",
    "free_port",
    "MESH_SHAPES",
    "transformer_train_step",
    "collective_calls",
    "inductor_output_code",
]

# What the test pools' forkserver imports once for every rank it forks (see _pool).
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "fshard", "fshard.runtime.local")
_POOLS: dict[int, WorkerPool] = {}
DEFAULT_TIMEOUT_S = float(os.environ.get("FSHARD_TEST_TIMEOUT_S", "120"))

# Mesh shapes the suites parametrize over (world sizes 1, 2 and 4: 2 cores; 8 ranks only
# for tiny 2x2x2 tests).
MESH_SHAPES: list[dict[str, int]] = [{"x": 1}, {"x": 2}, {"x": 4}, {"x": 2, "y": 2}]


def _pool(world_size: int) -> WorkerPool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        # Takes effect when the forkserver starts (the first pool); later calls are no-ops.
        # torch._dynamo too: every rank's first DTensor.from_local imports it (most of a
        # second of CPU per rank, once in the forkserver instead), and Inductor's compile_fx,
        # which a rank's first fs.jit compile imports (as much, aot_eager included). Neither
        # starts a thread (transformers would: its model modules are imported per rank).
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
        pool = WorkerPool(world_size, start_method="forkserver", timeout_s=DEFAULT_TIMEOUT_S)
        _POOLS[world_size] = pool
    return pool


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    timeout_s: float | None = None,
    grace_s: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` ranks of a shared pool.

    ``grace_s``: after one rank fails, how long the others get to finish before they are
    taken as blocked and the pool is replaced (default: the pool's, 5 s). A test whose
    failure leaves the other ranks blocked by design can pass a shorter one.

    Returns:
      Each rank's result, by rank.

    Raises:
      Exception: the first failing rank's exception, with rank and traceback attached.
      RankTimeoutError: a deadlock; the message shows each stuck rank's stack.
    """
    pool = _pool(world_size)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s or DEFAULT_TIMEOUT_S, grace_s=grace_s, **kwargs)
    finally:
        if not pool.alive:
            _drop(world_size, pool)


def _drop(world_size: int, pool: WorkerPool) -> None:
    """A pool that is dead or failed: its children stopped, and the next call builds a new one."""
    pool.shutdown(kill=True)
    _POOLS.pop(world_size, None)


def shutdown_pools() -> None:
    """Stops every pool (registered at exit)."""
    for pool in list(_POOLS.values()):
        pool.shutdown(kill=not pool.alive)
    _POOLS.clear()


atexit.register(shutdown_pools)


def _release_groups() -> None:
    from fshard.runtime.teardown import release_groups

    release_groups()


def release_pool_groups() -> None:
    """Destroys, on every live pool's ranks, the process groups of the meshes their tests
    made (``fshard.runtime.teardown.release_groups``), keeping each pool's default group.

    The suite calls it after each test module: a gloo group's transport thread wakes every
    10 ms for as long as it lives, and a pool that kept every mesh of the suite would burn
    a large share of a core while idle. A pool that fails here is replaced.
    """
    import warnings

    for world_size, pool in list(_POOLS.items()):
        if not pool.alive:
            continue
        try:
            pool.run(_release_groups, timeout_s=60)
        except Exception as e:  # noqa: BLE001 - the next test gets a fresh pool; the others are released
            warnings.warn(
                f"fshard.testing: releasing the process groups of the {world_size}-rank pool failed "
                f"({type(e).__name__}: {e}); the pool is replaced.",
                RuntimeWarning,
                stacklevel=2,
            )
            _drop(world_size, pool)
        else:
            if not pool.alive:
                _drop(world_size, pool)


def local_block_diff(dist: Any, ref: Any, specs: Any, mesh: Any, *, uneven: bool = False) -> float:
    """Worst difference between this rank's blocks of ``dist`` (DTensors laid out by ``specs``,
    a spec tree or a prefix of one) and the same blocks of the global ``ref``, without a
    collective: every rank checks its own blocks (replicas included), so together the ranks
    check every element of every leaf. ``uneven``: blocks cut like ``torch.chunk`` (FSDP's
    layout; see :func:`fshard.mesh.placement.local_block`). A leaf not laid out by its spec,
    or a block of the wrong shape, counts as infinite."""
    import fshard as fs
    from fshard.mesh.placement import local_block
    from fshard.mesh.spec import is_spec

    worst = 0.0
    flat_specs = fs.tree.broadcast_prefix(specs, ref, is_prefix_leaf=is_spec)
    for x, spec, r in zip(fs.tree.leaves(dist), flat_specs, fs.tree.leaves(ref), strict=True):
        local, want = x.to_local(), r[local_block(spec, r.shape, mesh, uneven=uneven)]
        if tuple(x.placements) != fs.NamedSharding(mesh, spec).placements or local.shape != want.shape:
            return float("inf")
        if local.numel():
            worst = max(worst, (local - want).abs().max().item())
    return worst


def assert_close(actual: Any, expected: Any, *, rtol: float = 1.3e-6, atol: float = 1e-5, what: str = "value") -> None:
    """``torch.testing.assert_close`` over pytrees, naming the first differing path."""
    for path, a, e in _paired_leaves(actual, expected, what):
        if isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, p=path: f"{what} at '{p}': {m}")
        elif isinstance(a, float) and isinstance(e, float):
            if not math.isclose(a, e, rel_tol=rtol, abs_tol=atol):
                raise AssertionError(f"{what} at '{path}': {a} != {e}")
        elif a != e:
            raise AssertionError(f"{what} at '{path}': {a!r} != {e!r}")


def _paired_leaves(actual: Any, expected: Any, what: str) -> list[tuple[str, Any, Any]]:
    """``(path, actual leaf, expected leaf)`` for two pytrees of one structure, else an
    AssertionError showing both structures."""
    from fshard import tree as tree_util

    a_paths, a_leaves, a_def = tree_util.zip_with_path(actual)
    _, e_leaves, e_def = tree_util.zip_with_path(expected)
    if a_def != e_def:
        raise AssertionError(f"{what}: structures differ:\n  actual   {a_def}\n  expected {e_def}")
    return list(zip(a_paths, a_leaves, e_leaves))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise_equal(actual: Any, expected: Any, *, what: str = "value") -> None:
    """Every leaf equal bit for bit (tensors: same dtype, shape and bits, NaNs equal; floats:
    equal or both NaN), naming the first differing path: a simulated run against a real one."""
    for path, a, e in _paired_leaves(actual, expected, what):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
            if not (a.dtype == e.dtype and a.shape == e.shape and torch.equal(_bits(a), _bits(e))):
                diff = (a.double() - e.double()).abs().max().item() if a.shape == e.shape and a.numel() else None
                raise AssertionError(
                    f"{what} at '{path}': not bitwise equal (dtype {a.dtype} vs {e.dtype}, shape "
                    f"{tuple(a.shape)} vs {tuple(e.shape)}, max |diff| {diff})"
                )
        elif isinstance(a, float) and isinstance(e, float):
            if not (a == e or (math.isnan(a) and math.isnan(e))):
                raise AssertionError(f"{what} at '{path}': {a!r} != {e!r}")
        elif type(a) is not type(e) or a != e:
            raise AssertionError(f"{what} at '{path}': {a!r} != {e!r}")


def transformer_train_step(
    mode: str,
    cfg: Any,
    mesh: Any,
    *,
    axis: str = "d",
    dtype: torch.dtype = torch.float32,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    bucket_bytes: int | None = None,
) -> tuple[Callable[..., Any], Any, Any]:
    """The data-parallel Transformer train step that fs.jit's tests and ``bench/jit_step.py``
    both run: ``fs.parallel``'s layer loop (``gather_params`` for the root parameters,
    ``scan_layers`` for the blocks) in ``value_and_grad(shard_map(...))``, then AdamW.

    Args:
      mode: ``"fsdp"`` (parameters sharded on ``axis``, gathered per layer, gradients
        reduce-scattered) or ``"replicate"`` (DDP: replicated, gradients all-reduced).
      cfg: a ``fshard.models.TransformerConfig``.
      mesh: a mesh with the axis ``axis`` (the batch is sharded on it).
      axis: the data-parallel mesh axis (optional, default ``"d"``).
      dtype: of the parameters (optional, default float32).
      lr, weight_decay: AdamW's (optional).
      bucket_bytes: replicate only: the gradient all-reduce's bucket size (optional,
        default ``scan_layers``'s).

    Returns:
      ``(step, params, opt_state)``: ``step(params, opt_state, tokens, targets) -> (loss,
      params, opt_state)`` on global values (tokens and targets ``(batch, seq)`` int64,
      batch divisible by the axis size), and the initial sharded params (seed 0) and
      optimizer state.

    Raises:
      ValueError: an unknown ``mode``.
    """
    import torch.nn.functional as F

    import fshard as fs
    from fshard import P
    from fshard.models import block, embed, head, transformer_init

    params = transformer_init(cfg, 0, dtype=dtype)
    if mode == "fsdp":
        specs, axes = fs.parallel.fsdp_specs(params, axis), dict(axis=axis)
    elif mode == "replicate":
        specs, axes = fs.parallel.replicate_specs(params), dict(axis=None, replicate_axis=axis)
    else:
        raise ValueError(f"transformer_train_step: mode={mode!r}; use 'fsdp' or 'replicate'.")
    opt = fs.optim.adamw(lr, weight_decay=weight_decay)

    loop = (
        dict(axes, config=fs.parallel.ScanConfig(bucket_bytes=bucket_bytes))
        if bucket_bytes is not None and mode == "replicate"
        else axes
    )

    def loss_fn(p, tok, tgt):
        root = fs.parallel.gather_params({k: v for k, v in p.items() if k != "layers"}, **axes)
        x = fs.parallel.scan_layers(lambda lp, h: block(lp, h, cfg), p["layers"], embed(root, tok, cfg), **loop)
        return fs.lax.pmean(F.cross_entropy(head(root, x, cfg).flatten(0, 1), tgt.flatten()), axis)

    grad_fn = fs.value_and_grad(
        fs.shard_map(loss_fn, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=P(), check=False)
    )

    def step(p, s, tok, tgt):
        loss, grads = grad_fn(p, tok, tgt)
        updates, s = opt.update(grads, s, p)
        return loss, fs.optim.apply_updates(p, updates), s

    sharded = fs.shard(params, specs, mesh, uneven=True)
    return step, sharded, opt.init(sharded)


# A call of a functional collective in a captured graph's code or in Inductor's output code.
_COLLECTIVE_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\(")


def collective_calls(code: str) -> list[str]:
    """The functional collectives (``all_gather_into_tensor``, ``all_reduce``, ...) that
    ``code`` (a captured graph's ``gm.code`` or Inductor's output code) calls, in order,
    their ``wait_tensor`` calls left out."""
    return [m.group(1) for m in _COLLECTIVE_CALL.finditer(code) if m.group(1) != "wait_tensor"]


@contextlib.contextmanager
def inductor_output_code() -> Iterator[list[str]]:
    """Collects, while the block runs, the Python code of every graph Inductor compiles or
    loads from its cache (through its ``GraphLowering.save_output_code`` hook; the hook's
    previous value is restored after).

    Yields:
      The list the codes are appended to, one string per compiled graph.
    """
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    old = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append
    try:
        yield codes
    finally:
        GraphLowering.save_output_code = old


@contextlib.contextmanager
def graph_peak_bytes() -> Iterator[dict[str, list[int]]]:
    """Peak tensor memory of each run of a captured graph's code on this thread while the
    block runs, counted from the code's own variables (deterministic: no allocator, no
    timing, no other thread's buffers such as gloo's).

    Two kinds of code are traced (``sys.settrace``, line by line):

    - ``"fx"``: a ``torch.fx.GraphModule``'s generated ``forward``, i.e. a captured graph
      run in program order (``fs.jit(..., backend=None)``; FX frees each value after its
      last use, as eager autograd and the optimizer free theirs);
    - ``"inductor"``: Inductor's output code, its wrapper's ``call`` (``fs.jit``'s default
      compile; its ``del bufN`` lines free buffers, ``reinterpret_tensor`` views share them).

    At each line the bytes of the distinct tensor storages held by the frame's local
    variables (and by lists and tuples among them) before or after it are summed (a line
    that computes a value and drops its inputs held both), plus those of the tensors the
    frame was called with, for the whole call (the caller holds them even where the code
    drops its own reference), plus, in FX code, the inputs of each functional collective
    until its wait (the collective's work holds them; Inductor's code keeps them in
    variables). Temporaries inside one operator are not seen.

    Yields:
      ``{"fx": [...], "inductor": [...]}``: the peak bytes of each traced run, in call order.
    """
    import sys

    peaks: dict[str, list[int]] = {"fx": [], "inductor": []}

    def held(frame) -> dict[str, dict[int, int]]:
        """Variable name -> {storage data pointer: bytes} of the tensors it holds."""
        found: dict[str, dict[int, int]] = {}
        for name, v in list(frame.f_locals.items()):
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    st = t.untyped_storage()
                    if st.nbytes():
                        found.setdefault(name, {})[st.data_ptr()] = st.nbytes()
        return found

    def kind(frame) -> str | None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.startswith("<eval_with_key>"):
            return "fx"
        g = frame.f_globals  # names every Inductor output module defines
        if code.co_name == "call" and "reinterpret_tensor" in g and "empty_strided_cpu" in g:
            return "inductor"
        return None

    def collectives(frame) -> tuple[dict[str, list[str]], dict[str, str]]:
        """FX code: collective -> its input variables, and wait -> its collective."""
        gm, inputs, waits = frame.f_locals.get("self"), {}, {}
        if not isinstance(gm, torch.fx.GraphModule):
            return inputs, waits
        wait = torch.ops._c10d_functional.wait_tensor.default
        for n in gm.graph.nodes:
            if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "_c10d_functional":
                if n.target is wait:
                    waits[n.name] = n.args[0].name
                else:
                    inputs[n.name] = [a.name for a in n.all_input_nodes]
        return inputs, waits

    def start(frame, event, arg):
        which = kind(frame) if event == "call" else None
        if which is None:
            return None
        args = {p: b for d in held(frame).values() for p, b in d.items()}
        inputs, waits = collectives(frame) if which == "fx" else ({}, {})
        peaks[which].append(sum(args.values()))
        slot, state = len(peaks[which]) - 1, {"before": {}, "pinned": {}}

        def line(frame, event, arg):
            if event in ("line", "return"):
                before, pinned, now = state["before"], state["pinned"], held(frame)
                for name in now.keys() - before.keys():
                    if name in inputs:  # a collective just issued: its inputs stay until its wait
                        pinned[name] = {p: b for a in inputs[name] for p, b in before.get(a, {}).items()}
                    elif name in waits:
                        pinned.pop(waits[name], None)
                live = dict(args)
                for d in (*before.values(), *now.values(), *pinned.values()):
                    live.update(d)
                peaks[which][slot] = max(peaks[which][slot], sum(live.values()))
                state["before"] = now
            return line

        return line

    previous = sys.gettrace()
    sys.settrace(start)
    try:
        yield peaks
    finally:
        sys.settrace(previous)
