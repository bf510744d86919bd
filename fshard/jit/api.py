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

import functools
import logging
import os
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import attrs
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _disable_current_modes

from fshard import comm
from fshard import tree as tree_util
from fshard.jit import donation as _jit_aliases
from fshard.jit.capture import JitCaptureError, _capture_message, _local, _paths, _replay, _tensor_sig, _why
from fshard.jit.compile import (
    _ORDER_KEEPING_BACKENDS,
    _P2P_REORDERED,
    _UNCOMPILED_BACKENDS,
    _Compiled,
    _functional_collectives,
    _has_p2p,
)
from fshard.jit.donation import (
    _CONSUMABLE,
    DonatedTensorError,
    _consume,
    _Memory,
    _nbytes_spanned,
    _resolve_donation,
    _rewrap,
    _take_donor,
)
from fshard.jit.recompile import JitRecompileLimitError, JitRecompileWarning, Recompiles, check_options
from fshard.runtime import simulation

__all__ = ["jit", "Jitted", "JitCaptureError", "DonatedTensorError", "JitRecompileLimitError", "JitRecompileWarning"]

log = logging.getLogger("fshard.jit")


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
        if simulation.active() is not None:
            raise RuntimeError(
                f"fs.jit({self.__name__}) under {simulation.active()}: a compiled step cannot run on simulated "
                f"ranks (torch.compile does not trace LocalTensor programs). Call the eager step there, "
                f"and fs.jit on real ranks (fs.run_local / torchrun)."
            )
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
