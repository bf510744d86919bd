"""Collective bucketing and compute/communication reordering for ``fs.jit``'s Inductor
compile: the one place that decides which of Inductor's distributed passes run
(:func:`collective_passes`, config patches that ``fs.jit(options=...)`` overrides).

Every rank must issue the same collectives in the same order (a mismatch deadlocks), so
every decision here depends on the graph alone: its collectives' order, kinds, process
groups, dtypes and byte sizes, never on timing. And the compiled graph must not depend on
the rank that compiled it: the ranks of one host share one compile (``fs.jit``'s
once-per-host lock, and Inductor's FX graph cache, whose key is taken before these passes
run and does not contain the rank).

What runs (Inductor's post-grad passes; sources in ``torch/_inductor/fx_passes``):

- :class:`BucketCollectives` (on), a ``post_grad_custom_post_pass``: merges collectives of
  one kind, process group and dtype that the graph already issues back to back and waits
  for back to back (:func:`_back_to_back_runs`) into one collective over a flat buffer,
  with the same bytes on the wire: all-gathers (``all_gather_into_tensor``), all-reduces,
  NCCL reduce-scatters (``reduce_scatter_tensor``) and all-to-alls with equal splits
  (``all_to_all_single``: fshard's gloo reduce-scatter, ``fs.lax.all_to_all``;
  ``ppermute``'s uneven ones are left alone); at most ``bucket_mb`` per bucket. It saves
  calls and changes nothing else: the compute between collectives stays where it was, so
  the overlap the graph had (``fs.parallel``'s prefetches and asynchronous reductions,
  Inductor's own sinking of waits to their first use) and its memory (reshard after
  forward) are kept. ``fs.parallel`` already gathers and reduces one flat buffer per
  layer, so its steps have nothing to merge; what this merges is per-leaf code
  (``fs.lax.all_gather`` of each parameter in a ``shard_map`` body, the per-leaf
  reduce-scatters of its backward).

  Torch's own FX bucketing (``bucket_all_gathers_fx``, ``bucket_reduce_scatters_fx``,
  ``bucket_all_reduces_fx``: ``bucketing.greedy_bucket_collective_by_mb``) is not used, for
  two reasons. It merges any independent collectives of a kind up to the cap: on an FSDP
  step that fits under the cap, every all-gather (forward gathers and backward regathers)
  into one, which gathers every parameter once at the start of the step and keeps it to
  the end (no reshard after forward, no prefetch overlap), and every reduce-scatter (NCCL's
  ``reduce_scatter_tensor``; gloo's all-to-alls it does not touch) into one, after the last
  gradient (``bench/README.md``, "Collective merging and reordering under Inductor"). And its
  merged all-gather (``all_gather_merge_fn_to_trace``, also the ``custom_ops`` mode and the
  overlap scheduler's bucketer) copies this rank's input to ``rank * numel`` of the output:
  a constant of the compiling rank in the compiled graph, which Inductor's cache (its key
  does not hold the rank) and fs.jit's once-per-host compile hand to the other ranks, so
  one rank would run a graph compiled for another. The merge here
  gathers a concatenation and takes each input's columns (rank-free).
- :class:`fshard.jit.passes.overlap.OverlapCollectives` (on), after bucketing, in the same
  ``post_grad_custom_post_pass`` list: fshard's own overlap scheduling of CPU (gloo)
  collectives. It keeps the compute's order and the collectives' order, one collective in
  flight per group, and moves each start as early and each wait as late as that allows,
  sharing the compute between consecutive collectives of a group by their bytes (see its
  module docstring): on the FSDP step, each layer's reduce-scatter runs behind the
  next layer's backward instead of before it. With it, Inductor's ``reorder_for_peak_memory``
  is off: it runs after the post-grad passes and would move every collective's start back
  next to its wait, undoing the overlap (the whole-step peak-memory tests,
  tests/jit/test_jit_memory.py, pass without it).
- Torch's overlap scheduling (off; ``collective_passes(reorder=True)`` turns it on):
  ``aten_distributed_optimizations.enable_overlap_scheduling`` moves collectives' starts
  earlier and their waits later, behind independent compute, and pins that order for
  Inductor's scheduler (``insert_overlap_deps``). It ranks candidates by runtime
  estimates: with ``reorder=True`` both estimators are ``"analytical"`` (roofline and
  bandwidth formulas of the shapes and the device's datasheet: the same on every rank of
  a cluster of one GPU type), because the default ``compute_estimator="benchmark"`` times
  kernels and then all-gathers the timings over the default group while compiling, which
  deadlocks when one rank per host compiles and the others wait for it. Its own bucketing
  (``collective_bucketing``, ``pre_bucketing_fsdp_collectives``) stays off: it uses the
  rank-baked merge above. Off by default because on a CPU-only torch (this project's CI)
  it fails to compile: its roofline estimate of every compute node asks Triton for the
  memory bandwidth (``torch._inductor.utils.get_gpu_dram_gbps``: ``ModuleNotFoundError: No
  module named 'triton'``), and it has not run on a GPU build here yet.
- Not used: ``reorder_for_compute_comm_overlap`` (Inductor's scheduler-level reordering:
  it may benchmark, and ``runtime_estimations_align_across_all_distributed_ranks`` runs a
  collective while compiling).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from fshard import _wire
from fshard._wire import CollectiveKind as K
from fshard._wire import c10d_kind
from fshard.jit import fx

__all__ = ["collective_passes", "without_collective_passes", "BucketCollectives", "BUCKET_MB"]

# Per-bucket cap (MB of the larger of a collective's input and output), fs.parallel's DDP
# bucket size: it bounds the flat buffer (and its copy) a merge adds.
BUCKET_MB = 25.0

_C10D = torch.ops._c10d_functional


def collective_passes(
    bucket_mb: float | None = BUCKET_MB, reorder: bool = False, overlap: bool = True
) -> dict[str, Any]:
    """Inductor config patches that bucket and reorder ``fs.jit``'s collectives.

    Args:
      bucket_mb: the cap per bucket in MB; ``None`` turns bucketing off.
      reorder: whether to run Inductor's overlap scheduling (analytical estimates only).
        Off by default: it needs Triton (a CUDA build of torch) even on CPU graphs, and it
        is not tested on one yet (see the module docstring).
      overlap: whether to run fshard's own overlap scheduling of CPU (gloo) collectives
        after bucketing (:class:`fshard.jit.passes.overlap.OverlapCollectives`).

    Returns:
      A dict for ``torch._inductor.config.patch`` (``fs.jit(options=...)``'s entries replace
      its entries: ``{"post_grad_custom_post_pass": None}`` turns bucketing and fshard's
      overlap scheduling off (:func:`without_collective_passes` keeps either),
      ``{"aten_distributed_optimizations.enable_overlap_scheduling": False}`` torch's).
    """
    patches: dict[str, Any] = {}
    post = _post_passes(bucket_mb, overlap)
    if post is not None:
        patches["post_grad_custom_post_pass"] = post
    if overlap:
        # Inductor's scheduler reorders its nodes for peak memory after the post-grad passes
        # (torch 2.13: on by default), and moved every collective's start down next to its
        # wait (an output buffer allocated later): the overlap pass's order was undone in the
        # compiled code (tests/jit/test_jit_overlap.py's Inductor test: no matrix product left
        # between any start and its wait).
        patches["reorder_for_peak_memory"] = False
    if reorder:
        opt = "aten_distributed_optimizations."
        patches.update(
            {
                opt + "enable_overlap_scheduling": True,
                opt + "compute_estimator": "analytical",
                opt + "collective_estimator": "analytical",
                opt + "collective_bucketing": False,
                opt + "pre_bucketing_fsdp_collectives": False,
            }
        )
    return patches


def _post_passes(bucket_mb: float | None, overlap: bool) -> Any:
    """The ``post_grad_custom_post_pass`` entry: bucketing, then overlap scheduling (of the
    merged collectives); ``None`` for neither."""
    from fshard.jit.passes.overlap import OverlapCollectives

    passes = ([BucketCollectives(bucket_mb)] if bucket_mb is not None else []) + (
        [OverlapCollectives()] if overlap else []
    )
    return None if not passes else passes[0] if len(passes) == 1 else passes


class BucketCollectives(CustomGraphPass):
    """Merges back-to-back collectives of one kind, group and dtype into buckets of at most
    ``bucket_mb`` (see the module docstring). Deterministic: graph order and sizes only."""

    def __init__(self, bucket_mb: float) -> None:
        if not bucket_mb > 0:
            raise ValueError(f"fs.jit: bucket_mb={bucket_mb!r}; use a positive number of MB.")
        self.bucket_mb = float(bucket_mb)

    def __repr__(self) -> str:  # part of fs.jit's compile key: stable across processes
        return f"BucketCollectives(bucket_mb={self.bucket_mb}, source={_SOURCE_HASH.hex()[:16]})"

    def uuid(self) -> Any:  # part of Inductor's cache key
        return ("fshard.BucketCollectives", _SOURCE_HASH, self.bucket_mb)

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.fx_passes import bucketing as b

        for kind, bucket, wait_point in _back_to_back_runs(graph, int(self.bucket_mb * 2**20)):
            if wait_point is _IN_FLIGHT:
                # Found now, on the graph as the earlier merges left it: a point found before
                # them could be a node one of them erased (a done bucket's wait, or the first
                # wait of a bucket merged earlier); if the waits are no longer adjacent, the
                # bucket stays as it is.
                wait_point = _adjacent_waits(graph, {next(iter(c.users)) for c in bucket})
                if wait_point is None:
                    continue
            if kind is K.ALL_GATHER:
                _merge(graph, bucket, _all_gather_merge, _all_gather_args, wait_point)
            elif kind is K.ALL_TO_ALL:
                _merge(graph, bucket, _all_to_all_merge, _all_to_all_args, wait_point)
            elif kind is K.PSUM_SCATTER:
                b.merge_reduce_scatter_bucket(graph, bucket, "default", wait_insertion_point=wait_point)
            else:
                b.merge_all_reduce_bucket(graph, bucket, wait_insertion_point=wait_point)


_SOURCE_HASH = get_hash_for_files((__file__, fx.__file__, _wire.__file__))
_IN_FLIGHT = object()  # an in-flight bucket's wait point: found when it is merged


def _kind(node: torch.fx.Node) -> tuple | None:
    """``(kind, group, dtype, ...)`` of a collective this pass can merge, else ``None``."""
    if (
        node.op != "call_function"
        or len(node.users) != 1
        or next(iter(node.users)).target is not _C10D.wait_tensor.default
    ):
        return None  # the merge rewrites a collective whose one user is its wait
    from torch._inductor.fx_passes.bucketing import _resolve_group_name

    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None  # no metadata to size it by
    dtype = (val.dtype, val.device)  # a group may carry CPU (gloo) and CUDA (NCCL) collectives
    kind = c10d_kind(node.target, tuple(node.args))
    if kind is K.ALL_GATHER:
        return (kind, _resolve_group_name(node.args[2]), dtype)
    if kind is K.ALL_TO_ALL and _even_splits(node):
        return (kind, _resolve_group_name(node.args[3]), dtype, len(node.args[2]))
    if kind is K.PSUM_SCATTER:
        return (kind, _resolve_group_name(node.args[3]), node.args[1], dtype)
    if kind is not None and node.target is _C10D.all_reduce.default:  # out of place only
        return (K.ALL_REDUCE, _resolve_group_name(node.args[2]), node.args[1], dtype)
    return None


_is_c10d = fx.is_c10d
_nbytes = fx.result_or_input_bytes
_is_view = fx.is_view


def _feeds(node: torch.fx.Node, key: tuple) -> bool:
    """Whether every use of ``node`` (through views) is a collective of kind ``key``."""
    return bool(node.users) and all(_kind(u) == key or (_is_view(u) and _feeds(u, key)) for u in node.users)


def _back_to_back_runs(graph: torch.fx.Graph, cap_bytes: int) -> list[tuple[str, list[torch.fx.Node], Any]]:
    """The buckets ``(kind, collectives, wait_point)``: collectives of one kind, group and
    dtype that the graph already issues back to back and waits for back to back.

    A run holds only collectives of one kind, their waits, views, the nodes that prepare
    a later collective's input (all their uses are such collectives) and the nodes computed
    from the run's results alone (a gloo reduce-scatter's local sum); the next other node
    ends it. The collectives waited for within their run are one bucket (``wait_point``
    ``None``: the merged wait follows the merged collective, as the separate ones did). Those
    still in flight when it ends (issued together, then overlapped with compute) are one
    bucket if their waits are back to back too (only views and results of theirs between
    them): the merged wait goes where the first of them was (``wait_point``, the node it
    goes before). So merging moves no other compute across a collective: no result is
    needed earlier, nothing overlapped is overlapped less, and no gathered tensor lives
    longer. A collective whose input depends on an earlier one's result, or that would
    take the run over ``cap_bytes``, starts a new run.
    """
    buckets: list[tuple[str, list[torch.fx.Node], Any]] = []
    in_flight: list[tuple[str, list[torch.fx.Node]]] = []
    run: list[torch.fx.Node] = []
    results: set[torch.fx.Node] = set()  # nodes of the run computed from its collectives' results
    key, size = None, 0

    def flush():
        nonlocal key, size
        done = [c for c in run if next(iter(c.users)) in results]
        if len(done) > 1:
            buckets.append((key[0], done, None))
        flying = [c for c in run if c not in done]
        if len(flying) > 1:
            in_flight.append((key[0], flying))
        run.clear()
        results.clear()
        key, size = None, 0

    for node in graph.nodes:
        k = _kind(node)
        if k is not None:
            n = _nbytes(node)
            if run and (k != key or size + n > cap_bytes or any(a in results for a in node.all_input_nodes)):
                flush()
            key = k
            run.append(node)
            size += n
            continue
        if not run:
            continue
        inputs = node.all_input_nodes
        if node.target is _C10D.wait_tensor.default and inputs[0] in run:
            results.add(node)
        elif inputs and all(a in results for a in inputs) and node.op == "call_function" and not _is_c10d(node):
            results.add(node)  # a view or epilogue of the run's results (never another collective)
        elif _is_view(node) or (node.op == "call_function" and _feeds(node, key)):
            if any(a in results for a in inputs):
                results.add(node)  # prepares a later collective's input from an earlier one's result
        else:
            flush()
    flush()
    for kind, flying in in_flight:
        if _adjacent_waits(graph, {next(iter(c.users)) for c in flying}) is not None:
            buckets.append((kind, flying, _IN_FLIGHT))
    return buckets


def _adjacent_waits(graph: torch.fx.Graph, waits: set) -> Any:
    """The node after the first of ``waits`` if nothing but views and results of theirs lies
    between the first and the last of them, else ``None``."""
    seen, results, first = 0, set(waits), None
    for node in graph.nodes:
        if node in waits:
            seen += 1
            first = first or node
            if seen == len(waits):
                point = first.next
                while point in waits:  # those are replaced: the merged wait goes before a node that stays
                    point = point.next
                return point
            continue
        if first is None:
            continue
        if node.op == "call_function" and node.all_input_nodes and all(a in results for a in node.all_input_nodes):
            results.add(node)
        elif not _is_view(node):
            return None
    return None


def _even_splits(node: torch.fx.Node) -> bool:
    _, out_splits, in_splits, _ = node.args
    return (
        isinstance(in_splits, (list, tuple))
        and list(out_splits) == list(in_splits)
        and len(set(in_splits)) == 1
        and all(isinstance(s, int) for s in in_splits)
    )


def _merge(graph, bucket, fn, args_fn, wait_point) -> None:
    from torch._inductor.fx_passes.bucketing import process_collective_bucket

    group_name = bucket[0].args[-1]
    process_collective_bucket(
        graph,
        bucket,
        fn,
        lambda ins: args_fn(bucket, ins),
        wait_insertion_point=wait_point,
        extra_graph_inps=[group_name] if isinstance(group_name, torch.fx.Node) else None,
    )


def _group_value(group_name):
    return group_name.meta["val"] if isinstance(group_name, torch.fx.Node) else group_name


def _all_gather_args(bucket, ins) -> tuple:
    _, n, group_name = bucket[0].args
    return ([i.meta["val"] for i in ins], _group_value(group_name), n, bucket[0].meta["val"].dtype)


def _all_gather_merge(ins: list[torch.Tensor], group_name, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    # Rank-free: gather the concatenation (rank j's inputs land in row j), then take each
    # input's columns. An input that was cast just before its gather (process_collective_bucket
    # hands over the uncast one) is cast here.
    sizes = [x.numel() for x in ins]
    flat = torch.cat([x.reshape(-1).to(dtype) for x in ins])
    out = _C10D.wait_tensor(_C10D.all_gather_into_tensor(flat, n, group_name)).view(n, -1)
    return [part.reshape((n * x.shape[0],) + tuple(x.shape[1:])) for part, x in zip(out.split(sizes, dim=1), ins)]


def _all_to_all_args(bucket, ins) -> tuple:
    _, _, in_splits, group_name = bucket[0].args
    return ([i.meta["val"] for i in ins], _group_value(group_name), len(in_splits))


def _all_to_all_merge(ins: list[torch.Tensor], group_name, n: int) -> list[torch.Tensor]:
    # Chunk j of every input goes to rank j: lay the inputs side by side as (n, sum of
    # chunk sizes), so that row j is everything for rank j; row j of the result is then
    # everything from rank j, and each input's columns are its (n, chunk) result.
    sizes = [x.numel() // n for x in ins]
    total = sum(sizes)
    flat = torch.cat([x.reshape(n, -1) for x in ins], dim=1).reshape(-1)
    out = _C10D.wait_tensor(_C10D.all_to_all_single(flat, [total] * n, [total] * n, group_name)).view(n, total)
    return [part.reshape(x.shape) for part, x in zip(out.split(sizes, dim=1), ins)]


def without_collective_passes(bucketing: bool = False, reorder: bool = False, overlap: bool = False) -> dict[str, Any]:
    """``fs.jit(options=...)`` that turns fshard's collective passes off (all of them by
    default; ``bucketing=True``, ``reorder=True`` or ``overlap=True`` keeps that one): for
    comparisons. Without the overlap pass, Inductor's ``reorder_for_peak_memory`` is back
    on, as with no fshard pass (``options={"post_grad_custom_post_pass": None}`` alone
    leaves it off)."""
    patches: dict[str, Any] = {"post_grad_custom_post_pass": _post_passes(BUCKET_MB if bucketing else None, overlap)}
    if not reorder:
        patches["aten_distributed_optimizations.enable_overlap_scheduling"] = False
    if not overlap:  # Inductor's own memory ordering, which collective_passes turns off for the pass
        patches["reorder_for_peak_memory"] = True
    return patches
