"""``fs.jit``: capture a whole step (forward, gradient, optimizer, collectives) as one graph
and compile it with ``torch.compile(fullgraph=True)``.

The function is traced once per input signature by running its Python on fake tensors
(``make_fx``): shard_map's checks, checked mode's metadata, autograd and the optimizer's
kernels run at trace time and leave an aten graph with the collectives as
``_c10d_functional`` ops, which Dynamo and a backend then compile. How the capture, the
signatures, donation, the collective passes and the pipeline regions work, and what was
measured: ``docs/jit.md``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sysconfig
import time
import traceback
import warnings
from typing import Any, Callable, Iterable, Sequence

import attrs
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from fshard import comm
from fshard import tree as tree_util
from fshard.jit import donation as _jit_aliases
from fshard.jit import fx
from fshard.jit import p2p as _jit_p2p
from fshard.jit.recompile import JitRecompileLimitError, JitRecompileWarning, Recompiles, check_options

__all__ = ["jit", "Jitted", "JitCaptureError", "DonatedTensorError", "JitRecompileLimitError", "JitRecompileWarning"]

log = logging.getLogger("fshard.jit")


class JitCaptureError(RuntimeError):
    """The function could not be captured as one graph (the message says where and why)."""


@attrs.frozen
class _Entry:
    """One compiled signature."""

    run: Callable[..., Any]  # flat local tensors -> flat outputs
    out_tree: Any  # treedef of the results
    out_leaves: tuple  # per result leaf: ("tensor", None) | ("dtensor", meta) | ("const", value)
    timeline: tuple  # comm.Event s recorded while tracing
    graph: Any  # the captured torch.fx.GraphModule (before compilation)
    eager: bool = False  # capture failed and on_capture_error="eager"


def jit(
    f: Callable[..., Any] | None = None,
    *,
    backend: str | Callable | None = "inductor",
    on_capture_error: str = "raise",
    options: dict | None = None,
    donate_argnums: int | Sequence[int] | None = None,
    donate_argnames: str | Iterable[str] | None = None,
    recompile_limit: int | None = None,
    on_recompile_limit: str = "raise",
) -> Any:
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
        step) compiles all its regions under Inductor before its first transfer, and the
        ranks agree on the outcome: when one rank fails, every rank raises (naming the rank
        that failed and its error) or, with ``"eager"``, every rank warns and runs eagerly.
        Under another backend such a graph raises even with ``"eager"`` (its compile may
        fail after transfers were posted).
      options: Inductor config for this compilation (``torch.compile(options=...)``); with
        ``"inductor"`` it is applied over fshard's collective passes
        (``fshard.jit.passes.bucket.collective_passes()``: merging back-to-back collectives), whose
        entries it may replace.
      donate_argnums: the arguments (by position) whose tensors the call may overwrite with
        its results, JAX's buffer donation; the rules are JAX's
        (``tests/conformance/test_donation_jax.py`` checks them against ``jax.jit``):

        - Each result leaf takes the first unused donated leaf of the same layout (shape,
          stride, dtype, device; for a DTensor also mesh, placements and local shape), in
          the flattening order of ``(args, kwargs)``, and is computed into it (a ``copy_``
          at the end of the graph, which Inductor fuses into the kernel that computes the
          result: the step allocates no new params or optimizer state). The result is a
          new tensor object on that argument's memory.
        - A donated argument that a result took cannot be used after the call, as in JAX
          (which deletes it): any torch operation on it (DTensor methods too) raises
          :class:`DonatedTensorError` naming its path, instead of reading the result's
          values. Its replacement costs a few microseconds per tensor and call
          (``bench/README.md``, "Host costs behind the code"). (``fs.optim.donate()``, in
          eager, updates in place instead: there the argument is the result.)
        - A donated leaf that no result can take is left unchanged, with a warning naming
          it (JAX: "Some donated buffers were not usable"). Two differences, both towards
          caution: JAX also gives a donated buffer to a result of another shape with the
          same number of elements (fshard: same layout only), and JAX says nothing about a
          donated argument the function never reads (fshard warns).
        - A result that is an argument, or any alias of one (a view, ``detach()``, an
          ``as_strided`` or ``set_`` on its memory), is returned as it is, and that
          argument, donated or not, keeps its value and takes no other result (JAX may
          give such a result a donated buffer and copy the argument there: same values,
          other buffers; copying argument into argument at the end of the graph would
          make the order of the copies matter).
        - A donated tensor whose memory overlaps another argument's (the same tensor passed
          twice, a view of it, another tensor on the same memory) is refused at the call
          (JAX refuses a donated buffer passed twice). Disjoint views of one buffer (e.g.
          parameters in one flat buffer) may be donated; strided views are compared by the
          span of memory between their first and last element.
        - A donated tensor with a live alias at the call is not donated at that call: a
          view of it (``x[1:]``, ``x.view(...)``), a NumPy array from ``x.numpy()``,
          ``x.data``, ``x.detach()``, a DLPack capsule, any other user of its storage that
          the call does not pass (counted with the storage's use count). Its result goes
          to new memory (one copy of the argument, made before the graph runs), the
          argument keeps its value and stays usable, the aliases keep showing the
          argument's values, and a warning names the argument. Why not raise: it is JAX's
          behaviour (jax 0.10.2 on CPU, checked: after ``np.asarray(x)`` a donating call
          leaves ``x`` undeleted, its NumPy array unchanged, the output in new memory; JAX
          says nothing), the values are right either way, and only the memory donation
          would save is lost, which the warning says. The tensor a donated view was taken
          from (its ``_base``, e.g. a flat buffer holding the parameters) is the buffer's
          owner, not an alias: it receives the results, as it would from an in-place
          update of the view, and the results stay views of it. Aliases count per storage:
          a view of any part of a flat buffer keeps every donated view of that buffer from
          donation. Not seen: memory that torch does not own (a tensor from
          ``torch.from_numpy``, whose NumPy array is no user of the storage), and a
          DTensor's local tensor object itself, held since ``to_local()`` under
          ``no_grad`` (which returns it, not a view).
        - A graph with donation that fails to compile raises even with
          ``on_capture_error="eager"`` (its first run may have written into the arguments
          already).

        As in ``jax.jit``, when only one of ``donate_argnums`` / ``donate_argnames`` is
        given the other is inferred from ``f``'s signature, so an argument is donated
        whether it is passed by position or by keyword; when both are given, each applies
        as given (positions to positional arguments, names to keyword arguments).
      donate_argnames: the arguments (by name) to donate; see ``donate_argnums``.
      recompile_limit: the most signatures ``f`` traces and compiles (an int >= 1; default
        ``None``: the environment variable ``FSHARD_JIT_RECOMPILE_LIMIT``, else 8, as
        ``torch.compile``'s ``recompile_limit``). A non-tensor argument is part of the
        signature by value, so a Python float that changes every call (a learning rate
        passed as ``0.1``) compiles every call: pass it as a tensor. The first recompile
        (the second signature) warns once per function with :class:`JitRecompileWarning`,
        naming each argument that changed (its path and parameter name) and how.
      on_recompile_limit: what a call that needs one signature more than the limit does:
        ``"raise"`` (default) raises :class:`JitRecompileLimitError` naming the function, the
        limit and the argument that changed; ``"eager"`` runs ``f`` eagerly (uncompiled,
        not cached, and without donation: the arguments keep their values), warning once.
        Signatures traced before the limit keep running compiled either way.

    Returns:
      A :class:`Jitted` with ``f``'s signature and results (DTensors laid out as eager).

    Raises:
      ValueError: an unknown ``on_capture_error``; a ``donate_argnums`` entry that is not a
        non-negative int or is past ``f``'s positional parameters; a ``donate_argnames``
        entry that is not a str, names a positional-only parameter or one ``f`` does not
        take (unless ``f`` takes ``**kwargs``), or ``donate_argnames`` for an ``f`` without
        an inspectable signature. At the call: a donated tensor whose memory is also
        another argument's.
    """
    if on_capture_error not in ("raise", "eager"):
        raise ValueError(f"fs.jit: on_capture_error={on_capture_error!r}; use 'raise' or 'eager'.")
    check_options(recompile_limit, on_recompile_limit)
    nums = (
        None
        if donate_argnums is None
        else ((donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums))
    )
    if nums is not None and any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in nums):
        raise ValueError(
            f"fs.jit: donate_argnums={donate_argnums!r}; use non-negative ints, the positions of "
            f"the arguments whose tensors the call may overwrite."
        )
    names = (
        None
        if donate_argnames is None
        else (
            (donate_argnames,)
            if isinstance(donate_argnames, str)
            else tuple(donate_argnames)
            if isinstance(donate_argnames, Iterable)
            else (donate_argnames,)
        )
    )
    if names is not None and any(not isinstance(k, str) for k in names):
        raise ValueError(
            f"fs.jit: donate_argnames={donate_argnames!r}; use str, the names of the arguments "
            f"whose tensors the call may overwrite."
        )
    if f is None:
        return functools.partial(
            jit,
            backend=backend,
            on_capture_error=on_capture_error,
            options=options,
            donate_argnums=nums,
            donate_argnames=names,
            recompile_limit=recompile_limit,
            on_recompile_limit=on_recompile_limit,
        )
    return Jitted(f, backend, on_capture_error, options, nums, names, recompile_limit, on_recompile_limit)


class Jitted:
    """A jitted function: ``__call__`` as ``f``; ``cache_size``, ``graph(*args)`` to inspect."""

    def __init__(
        self,
        f: Callable[..., Any],
        backend,
        on_capture_error: str,
        options: dict | None,
        donate_argnums: tuple[int, ...] | None = None,
        donate_argnames: tuple[str, ...] | None = None,
        recompile_limit: int | None = None,
        on_recompile_limit: str = "raise",
    ) -> None:
        functools.update_wrapper(self, f)
        self._f, self._backend, self._on_error, self._options = f, backend, on_capture_error, options
        self._donate_nums, self._donate_names = _resolve_donation(f, donate_argnums, donate_argnames)
        self._donate = bool(self._donate_nums or self._donate_names)
        self._donate_given = (donate_argnums, donate_argnames)  # as the user wrote them, for messages
        self._donated_at: dict[Any, frozenset[int]] = {}  # call structure -> donated leaf indices
        self._cache: dict[tuple, _Entry] = {}
        self._recompiles = Recompiles(self.__name__, f, recompile_limit, on_recompile_limit)

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
        kept = self._keep_aliased_donations(entry, leaves, locals_) if self._donate else {}
        # Dynamo compiles no frame while a dispatch mode (comm_log's) is active: the graph
        # runs without them, and its collectives are replayed into the logs instead.
        try:
            with _disable_current_modes():
                out = entry.run(*locals_)
        except JitCaptureError as e:  # the backend failed to compile the captured graph
            # With donation the first call may have written into the arguments before failing:
            # running them eagerly again could apply a step twice. With point-to-point
            # transfers, Inductor's regions all compile before any transfer and every rank
            # raises together (_first_p2p_call), so every rank falls back together; another
            # backend compiles and runs in one go, and its failure may come after transfers
            # were posted (an eager rerun would post them again, out of step with the peers).
            if self._on_error != "eager" or self._donate or (_has_p2p(entry.graph) and self._backend != "inductor"):
                raise
            warnings.warn(
                f"{e}\nfs.jit runs this signature eagerly (on_capture_error='eager').", RuntimeWarning, stacklevel=2
            )
            self._cache[key] = _Entry(None, None, (), (), entry.graph, eager=True)
            return self._f(*args, **kwargs)
        if entry.timeline:
            _replay(entry.timeline)
        flat, k = [], 0
        for kind, meta in entry.out_leaves:
            if kind == "const":
                flat.append(meta)
                continue
            if kind == "donated":  # computed into this argument's tensor: the result takes its memory
                j = meta[0]
                flat.append(
                    _consume(leaves[j], self.__name__, meta[1]) if j not in kept else _rewrap(leaves[j], kept[j])
                )  # into a copy: the argument keeps its value
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

    def _keep_aliased_donations(self, entry: _Entry, leaves: list, locals_: list) -> dict[int, torch.Tensor]:
        """JAX's rule for a donated buffer with a live alias (a view, a ``.numpy()`` array,
        ``.data``, a DLPack capsule: :mod:`fshard.jit.donation`): it is not donated at this
        call. Its position in ``locals_`` gets a copy of the same layout, which the graph
        computes the result into, and the argument keeps its value (and stays usable), as
        its aliases do. Returns leaf index -> that copy; warns naming each argument."""
        donated = [meta for kind, meta in entry.out_leaves if kind == "donated"]
        if not donated:
            return {}
        pos = None
        kept: dict[int, torch.Tensor] = {}
        given = list(locals_)  # the call's own tensors, before a copy replaces one of them
        for j, path in donated:
            x = leaves[j]
            local = x._local_tensor if isinstance(x, DTensor) else x
            n = _jit_aliases.foreign_users(local, given)
            if not n:
                continue
            if pos is None:
                pos = {i: k for k, i in enumerate(i for i, y in enumerate(leaves) if isinstance(y, torch.Tensor))}
            copy = torch.empty_strided(local.size(), local.stride(), dtype=local.dtype, device=local.device)
            copy.copy_(local)  # same strides: the compiled graph assumes its inputs' layout
            locals_[pos[j]] = kept[j] = copy
            warnings.warn(
                f"fs.jit({self.__name__}): donated {path} (shape {tuple(x.shape)}, {x.dtype}) is not donated at "
                f"this call: {n} other tensor(s) or NumPy array(s) share its memory (a view, .numpy(), .data or "
                f"a DLPack capsule taken before the call) and would show the result's values. Its result goes "
                f"to new memory and {path} keeps its value and stays usable, as jax.jit does for a buffer with "
                f"an external reference. Drop those aliases, or take copies (.clone(), .numpy().copy()), to "
                f"donate it.",
                UserWarning,
                stacklevel=3,
            )
        return kept

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
        also passed as another argument): the graph would overwrite what it still reads.
        Compares memory, not objects or storages: views, ``set_`` and ``as_strided`` aliases
        and tensors over one foreign buffer (``torch.from_numpy``) overlap; disjoint parts of
        one buffer do not."""
        donated = self._donated_indices(args, kwargs, treedef)
        if not donated:
            return
        spans = []  # runs on every call: the fewest tensor method calls per leaf
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                loc = x._local_tensor if isinstance(x, DTensor) else x
                n = loc.nbytes
                if n and not loc.is_meta:  # meta tensors have no memory (every data_ptr is 0)
                    start = loc.data_ptr()
                    spans.append((start, start + (n if loc.is_contiguous() else _nbytes_spanned(loc)), i))
        spans.sort()
        end = -1
        for start, stop, _ in spans:  # disjoint (the usual case) when each starts after the last ends
            if start < end:
                break
            end = stop
        else:
            return

        # Addresses compare within one device only (CPU and CUDA share one address space; other
        # backends may not): the devices are read only here, off the common path.
        def device(i: int) -> str:
            x = leaves[i]
            return str((x._local_tensor if isinstance(x, DTensor) else x).device)

        spans = sorted((device(i), start, stop, i) for start, stop, i in spans)
        bad, group, end, dev = [], [], -1, None
        for d, start, stop, i in spans + [(None, float("inf"), 0, -1)]:
            if d != dev or start >= end:  # a new group of overlapping spans begins: judge the last one
                if len(group) > 1 and any(j in donated for j in group):
                    bad.append(sorted(group))
                group, end, dev = [], stop, d
            group.append(i)
            end = max(end, stop)
        if bad:
            paths = _paths(args, kwargs)
            raise ValueError(
                f"fs.jit({self.__name__}): {self._donation_str()}: a donated tensor's memory is also passed as "
                f"another argument: "
                + "; ".join(" and ".join(paths[i] for i in idx) for idx in bad)
                + ". Pass a copy (x.clone()) where the same tensor (or memory) appears twice, or do not "
                "donate it."
            )

    def _donation_str(self) -> str:
        nums, names = self._donate_given
        parts = [f"donate_argnums={nums}"] if nums else []
        return ", ".join(parts + ([f"donate_argnames={names}"] if names else []))

    def _entry(self, key, call_args, leaves, treedef) -> _Entry:
        entry = self._cache.get(key)
        if entry is None:
            if not self._recompiles.admit(key, list(self._cache), lambda: _paths(*call_args)):
                return _PAST_LIMIT  # on_recompile_limit="eager": not cached, or the cache would grow per value
            if self._cache and os.environ.get("FSHARD_LOG_RECOMPILES"):
                log.warning(
                    "fs.jit(%s) recompiles: %s", self.__name__, _why(key, _paths(*call_args), list(self._cache))
                )
            entry = self._cache[key] = self._capture(leaves, treedef, self._donated_leaves(*call_args))
        return entry

    def _donated_leaves(self, args: tuple, kwargs: dict) -> dict[int, str]:
        """Leaf index (in the flattened ``(args, kwargs)``) -> path, of the donated tensors."""
        if not self._donate:
            return {}
        paths = _paths(args, kwargs)
        return {i: paths[i] for i in self._donated_indices(args, kwargs)}

    def _donated_indices(self, args: tuple, kwargs: dict, treedef: Any = None) -> frozenset[int]:
        """The leaf indices of the donated arguments: positional ones in ``donate_argnums``,
        keyword ones in ``donate_argnames`` (JAX's ``donation_vector``); cached by the call's
        structure ``treedef`` (of ``(args, kwargs)``) when given."""
        found = self._donated_at.get(treedef) if treedef is not None else None
        if found is not None:
            return found
        raw, _, _ = tree_util.tree_flatten_with_path((args, kwargs))
        found = frozenset(
            i
            for i, p in enumerate(raw)
            if (p[0] == 0 and p[1] in self._donate_nums) or (p[0] == 1 and p[1] in self._donate_names)
        )
        if treedef is not None:
            self._donated_at[treedef] = found
        return found

    # --- capture ---------------------------------------------------------------------------
    def _capture(self, leaves: list, treedef, donated: dict[int, str] | None = None) -> _Entry:
        from torch.fx.experimental.proxy_tensor import make_fx

        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        rebuild = [
            (x.device_mesh, x.placements, x.shape, x.stride()) if isinstance(x, DTensor) else None for x in tensors
        ]
        found: dict[str, Any] = {}
        # Donated tensor leaves, in order: (leaf index, layout) for matching results to them.
        donors = [(i, _tensor_sig(x)) for i, x in enumerate(leaves) if i in (donated or {}) and type(x) in _CONSUMABLE]
        # A tensor subclass cannot be made unusable after the call (its class cannot be
        # switched): left as it is, before the graph writes into anything.
        odd = [
            i
            for i, x in enumerate(leaves)
            if i in (donated or {}) and isinstance(x, torch.Tensor) and type(x) not in _CONSUMABLE
        ]
        if odd:
            warnings.warn(
                f"fs.jit({self.__name__}): donated tensors of a tensor subclass are not donated (only "
                f"torch.Tensor, nn.Parameter and DTensor can be): "
                f"{', '.join(f'{donated[i]} ({type(leaves[i]).__name__})' for i in odd)}. "
                f"They are left unchanged.",
                UserWarning,
                stacklevel=4,
            )

        def traced(*locals_):
            it = iter(zip(locals_, rebuild))
            flat = []
            for x in leaves:
                if not isinstance(x, torch.Tensor):
                    flat.append(x)
                    continue
                local, meta = next(it)
                flat.append(
                    local
                    if meta is None
                    else DTensor.from_local(local, meta[0], meta[1], run_check=False, shape=meta[2], stride=meta[3])
                )
            args, kwargs = tree_util.tree_unflatten(treedef, flat)
            with comm.comm_log() as tlog:
                out = self._f(*args, **kwargs)
            found["timeline"] = tuple(tlog.timeline)
            out_flat, found["tree"] = tree_util.tree_flatten(out)
            kinds, tensors_out = [], []
            by_leaf = dict(zip([i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)], locals_))
            free = []
            if donors:  # (without donation nothing here is needed: no memory is looked at)
                memory = _Memory(by_leaf)
                # A donated argument that is also returned (as it is, as a view or as any other
                # alias of its memory) keeps its value: the result shares its buffer already.
                returned = {j for o in out_flat if isinstance(o, torch.Tensor) for j in memory.aliased(o)}
                free = [(j, sig) for j, sig in donors if j not in returned]
            for o in out_flat:
                j = _take_donor(o, free, memory) if free else None
                if j is not None:
                    # The result is computed into the donated argument's tensor; Inductor fuses
                    # the copy into the kernel that computes it.
                    by_leaf[j].copy_(o.to_local() if isinstance(o, DTensor) else o)
                    kinds.append(("donated", (j, donated[j])))
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
            warnings.warn(
                f"fs.jit({self.__name__}): donated tensors no result could take (no result of the "
                f"same shape, stride, dtype and layout left): "
                f"{', '.join(donated[j] for j in found['unused'])}. They are left unchanged.",
                UserWarning,
                stacklevel=4,
            )
        log.info(
            "fs.jit(%s): traced %d graph nodes in %.1f s", self.__name__, len(gm.graph.nodes), time.perf_counter() - t0
        )
        if self._backend not in _ORDER_KEEPING_BACKENDS and _has_p2p(gm):
            return self._failed(f"compile (backend={self._backend!r})", JitCaptureError(_P2P_REORDERED))
        run = gm if self._backend in _UNCOMPILED_BACKENDS else _Compiled(gm, self)
        if isinstance(run, _Compiled):
            run._meshes = list({id(r[0]): r[0] for r in rebuild if r is not None}.values())
        return _Entry(run, found["tree"], found["kinds"], found["timeline"], gm)

    def _failed(self, stage: str, e: BaseException) -> _Entry:
        msg = _capture_message(self.__name__, stage, e)
        if self._on_error == "raise":
            raise JitCaptureError(msg) from e
        warnings.warn(
            msg + "\nfs.jit runs this signature eagerly (on_capture_error='eager').", RuntimeWarning, stacklevel=3
        )
        return _Entry(None, None, (), (), None, eager=True)


# A signature past the recompile limit under on_recompile_limit="eager": run f eagerly.
_PAST_LIMIT = _Entry(None, None, (), (), None, eager=True)


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


_POS_OR_KW = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _resolve_donation(
    f: Callable, nums: tuple[int, ...] | None, names: tuple[str, ...] | None
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``jax.jit``'s ``resolve_argnums`` for donation: completes and checks the donated
    positions and names against ``f``'s signature.

    Given one of the two, the other is inferred from the positional-or-keyword parameters
    (so an argument is donated however it is passed); given both, each is used as given.
    Returns ``(positions, names)``: positions apply to positional arguments, names to
    keyword ones."""
    if not nums and not names:
        return (), ()
    label = getattr(f, "__name__", type(f).__name__)
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        sig = None
    if sig is None:
        if names:
            raise ValueError(
                f"fs.jit({label}): donate_argnames={names} but the function's signature cannot be "
                f"inspected to check them; pass donate_argnums instead."
            )
        return tuple(sorted(set(nums or ()))), ()
    params = list(sig.parameters.values())
    if nums is None or names is None:
        if names is None:
            names = tuple(p.name for i, p in enumerate(params) if p.kind is _POS_OR_KW and i in nums)
        else:
            nums = tuple(i for i, p in enumerate(params) if p.kind is _POS_OR_KW and p.name in names)
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        n_pos = sum(p.kind in (p.POSITIONAL_ONLY, _POS_OR_KW) for p in params)
        if nums and max(nums) >= n_pos:
            raise ValueError(
                f"fs.jit({label}): donate_argnums={tuple(nums)} but the function takes {n_pos} "
                f"positional argument(s) {sig}."
            )
    positional_only = {p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)}
    if bad := sorted(positional_only & set(names)):
        raise ValueError(
            f"fs.jit({label}): donate_argnames={tuple(names)}: {bad} cannot be passed by keyword "
            f"{sig}; use donate_argnums for them."
        )
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        keyword = {p.name for p in params if p.kind in (_POS_OR_KW, p.KEYWORD_ONLY)}
        if bad := sorted(set(names) - keyword):
            raise ValueError(
                f"fs.jit({label}): donate_argnames={tuple(names)}: the function takes no argument "
                f"named {', '.join(bad)} {sig}."
            )
    return tuple(sorted(set(nums))), tuple(dict.fromkeys(names))


class DonatedTensorError(RuntimeError):
    """A tensor donated to an ``fs.jit`` call was used after it (JAX: a deleted array)."""


# The argument types whose objects fs.jit can make unusable after a donating call.
_CONSUMABLE = (torch.Tensor, torch.nn.Parameter, DTensor)


def _deleted_message(self) -> str:
    d = object.__getattribute__(self, "_fshard_donated")
    return (
        f"fs.jit({d[0]}): this tensor was donated ({d[1]}, shape {d[2]}, {d[3]}) and its memory now "
        f"holds the call's result: use the result instead (JAX deletes a donated array too)."
    )


class _DonatedTensor(torch.Tensor):
    """The class of a plain tensor after it was donated: every torch operation raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        for a in tree_leaves((args, kwargs or {})):  # lists too: torch.cat, the _foreach_ ops
            if isinstance(a, (_DonatedTensor, _DonatedDTensor)):
                raise DonatedTensorError(_deleted_message(a))
        raise DonatedTensorError("fs.jit: a donated tensor was used after the call.")


class _DonatedDTensor(DTensor):
    """The class of a DTensor after it was donated: every torch operation, and DTensor's
    own methods, raise."""

    __torch_function__ = _DonatedTensor.__torch_function__

    def __getattribute__(self, name):
        if name in ("to_local", "full_tensor", "redistribute", "_local_tensor", "__repr__", "__str__"):
            raise DonatedTensorError(_deleted_message(self))
        return object.__getattribute__(self, name)


def _consume(arg: torch.Tensor, fn_name: str, leaf: str) -> torch.Tensor:
    """The result that was computed into donated ``arg``: a new tensor object on ``arg``'s
    memory; ``arg`` itself becomes unusable (a torch operation on it raises), as JAX deletes
    a donated array."""
    arg._fshard_donated = (fn_name, leaf, tuple(arg.shape), arg.dtype)
    if isinstance(arg, DTensor):
        # The local tensor moves to the result: the donated DTensor keeps none.
        local = arg._local_tensor
        out = DTensor(local, arg._spec, requires_grad=False)
        arg._local_tensor = local.new_empty(0)
        arg.__class__ = _DonatedDTensor
    else:
        if arg._base is not None:
            # A view of the same memory whose _base is arg's: the buffer's owner (a flat
            # parameter buffer) stays the result's base, so the next call, donating the
            # result, accounts for it (fshard/jit/donation.py) as it did for arg.
            with torch.no_grad():
                out = arg._base.as_strided(arg.size(), arg.stride(), arg.storage_offset())
        else:
            out = arg.detach()  # a new tensor on the same memory, no view of arg
        # No memory left either: torch's own C++ code (autograd accumulating into a donated
        # .grad) does not go through __torch_function__, and must not write into the result.
        try:
            with torch.no_grad():
                arg.set_()
        except RuntimeError:  # a tensor made by .detach() or .data may not change its storage
            pass
        arg.__class__ = _DonatedTensor
    return out


def _rewrap(arg: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The result computed into ``local``, a copy of donated ``arg``'s local tensor that
    was kept from donation (:meth:`Jitted._keep_aliased_donations`), typed as ``arg``."""
    return DTensor(local, arg._spec, requires_grad=False) if isinstance(arg, DTensor) else local


def _take_donor(o: Any, free: list, memory: "_Memory") -> int | None:
    """The leaf index of the first donated tensor in ``free`` with ``o``'s layout, removed
    from ``free``; ``None`` if there is none or ``o`` is not a fresh result. An argument
    returned as it is (or any alias of one) is not computed into another (``free`` holds no
    returned argument either): copying argument into argument at the end of the graph
    would make the order of the copies matter."""
    if not isinstance(o, torch.Tensor) or memory.aliased(o):
        return None
    sig = _tensor_sig(o)
    for k, (j, s) in enumerate(free):
        if s == sig:
            del free[k]
            return j
    return None


class _Memory:
    """Which traced inputs a traced tensor's memory overlaps. Fake tensors keep their real
    inputs' storage sharing and offsets, so this sees views, ``detach()``, ``set_`` and
    ``as_strided`` aliases alike (a ``_base`` check sees views only)."""

    def __init__(self, by_leaf: dict[int, torch.Tensor]) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._spans: dict[Any, list[tuple[int, int, int]]] = {}
        for j, t in by_leaf.items():
            if t.numel():
                self._spans.setdefault(StorageWeakRef(t.untyped_storage()), []).append((*_storage_span(t), j))

    def aliased(self, o: torch.Tensor) -> list[int]:
        """The leaf indices of the inputs whose memory ``o`` (a tensor or DTensor) overlaps."""
        loc = o._local_tensor if isinstance(o, DTensor) else o
        if not loc.numel():
            return []
        spans = self._spans.get(self._ref(loc.untyped_storage()))
        if not spans:
            return []
        start, stop = _storage_span(loc)
        return [j for a, b, j in spans if a < stop and start < b]


def _nbytes_spanned(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last (``numel() > 0``)."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s byte range within its storage."""
    start = t.storage_offset() * t.element_size()
    return start, start + _nbytes_spanned(t)


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _tensor_sig(x: torch.Tensor) -> tuple:
    if isinstance(x, DTensor):
        spec, loc = x._spec, x._local_tensor
        meta = spec.tensor_meta
        if meta is None:  # a spec without its tensor's metadata: ask the DTensor
            return (
                "dtensor",
                tuple(x.shape),
                x.stride(),
                x.dtype,
                spec.mesh,
                spec.placements,
                tuple(loc.shape),
                loc.stride(),
            )
        return (
            "dtensor",
            tuple(meta.shape),
            meta.stride,
            meta.dtype,
            spec.mesh,
            spec.placements,
            tuple(loc.shape),
            loc.stride(),
        )
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


_FIELDS = {
    "tensor": ("shape", "stride", "dtype", "device"),
    "dtensor": ("shape", "stride", "dtype", "mesh", "placements", "local shape", "local stride"),
    "static": ("type", "value"),
}


def _why(key: tuple, paths: list[str], old: list[tuple]) -> str:
    """What differs between ``key`` and the closest cached signature, leaf by leaf."""
    treedef, sig, grad, aliases = key
    same_tree = [k for k in old if k[0] == treedef]
    if not same_tree:
        return "the argument structure changed (new pytree: %s)" % (treedef,)
    best_diff = None
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
            best_diff = diff
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


_JIT_DIR = os.path.dirname(os.path.abspath(__file__))  # fshard/jit
_OUR_DIR = os.path.dirname(_JIT_DIR)  # fshard
# Frames in these are not "the user's line": torch, installed packages, the standard library.
_LIB_DIRS = tuple(
    {os.path.dirname(os.path.abspath(torch.__file__))}
    | {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")}
)


def _capture_message(name: str, stage: str, e: BaseException) -> str:
    """Names the cause and the innermost line of user code (else of fshard) it came from."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [fr for fr in frames if not fr.filename.startswith(_LIB_DIRS + (_OUR_DIR,)) and "<" not in fr.filename]
    ours = [fr for fr in frames if fr.filename.startswith(_OUR_DIR) and not fr.filename.startswith(_JIT_DIR)]
    where = user[-1] if user else (ours[-1] if ours else None)
    line = f"{where.filename}:{where.lineno}: {where.line}" if where else "(no Python line found)"
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()][:3]
    cause = f"{type(e).__name__}: " + " / ".join(lines)[:600]
    hint = ""
    text = str(e)
    if (
        any(
            s in text
            for s in (
                "data-dependent",
                "Data dependent",
                "DataDependent",
                "item()",
                "data pointer",
                "GuardOnDataDependent",
                "unbacked",
            )
        )
        or "DataDependent" in type(e).__name__
    ):
        hint = (
            "\nThe function reads a tensor's value in Python (.item(), bool(t), if/while on a tensor, "
            "printing it): fs.jit traces without values. Compute it with tensor ops (torch.where), "
            "move it out of the jitted function, or pass on_capture_error='eager'."
        )
    elif stage == "trace" and ("convert all Tensors to FakeTensors" in text or "non-Fake Tensor" in text):
        hint = (
            "\nThe function uses a tensor it does not take as an argument (a tensor it closes over, or a "
            "module's parameter or buffer, e.g. one fs.nn.functionalize left on the module): fs.jit traces "
            "its arguments only and bakes in no tensor as a constant, since a torch tensor can change in "
            "place between calls. Pass that tensor as an argument (in the params or buffers pytree)."
        )
    return f"fs.jit({name}) could not {stage} the function: {cause}\n  at {line}{hint}"
