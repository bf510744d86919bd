"""``tp_apply``: Megatron tensor parallelism for a functionalized ``nn.Module``, from a plan.

A plan is data: module path patterns (``*`` matches within one name, as in Hugging Face's
``base_model_tp_plan`` and torchtitan) mapped to a style::

    apply, params, _ = fs.nn.functionalize(model)
    apply = fs.parallel.tp_apply(apply, fs.parallel.HF_LLAMA_TP_PLAN, axis="tp")
    specs = fs.parallel.tp_specs(params, fs.parallel.HF_LLAMA_TP_PLAN)

==============  =================================================  ====================================
style           parameters (``Linear`` weight ``[out, in]``)       collectives (forward hooks)
==============  =================================================  ====================================
``colwise``     weight rows and bias split                         ``pvary`` on the input (Megatron "f")
``rowwise``     weight columns split, bias whole                   ``psum`` of the output ("g"), then
                                                                   the bias, once
``vocab``       ``Embedding [V, D]``: rows split                   masked local lookup, ``psum``
``vocab``       ``Linear [V, D]`` (the head): rows split           ``pvary`` on the input; the logits
                                                                   are all-gathered over the vocabulary
                                                                   (backward: this rank's slice) unless
                                                                   ``loss_parallel=True``
``replicate``   whole                                              none
==============  =================================================  ====================================

Modules no pattern matches are replicated. Inputs that several colwise modules share
(Llama's q/k/v projections read one hidden state) go through one ``pvary``, so backward
sums their gradient over ``tp`` once.

Transposed weights: transformers' ``Conv1D`` (GPT-2) stores its weight ``[in, out]``. The
style names what is split (output or input features), so for a ``Conv1D`` colwise splits
weight dim 1 (and the bias) and rowwise splits dim 0; :func:`module_tp_specs` reads the
orientation from the module's type (or, without the module, from the bias length) and
``tp_apply`` sets the module's ``nf`` (output width) to the local width for the call.

GPT-2's attention projection ``c_attn`` packs q, k and v along one dim: a contiguous split
would hand rank 0 all of q and no v, and the split that keeps heads whole (a slice of each
of the three parts) is not a contiguous block, which a spec cannot express. So
:data:`HF_GPT2_TP_PLAN` leaves attention replicated and splits the MLP and the vocabulary.

During a call, ``tp_apply`` registers forward hooks and sets the few module attributes
that hold a split size (``Conv1D.nf``; ``Embedding.padding_idx``, made local) and undoes
all of it when the call returns or raises: between calls the module is as the user left it.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import attrs
import torch
from torch import nn

from fshard import lax
from fshard import nn as fnn
from fshard import tree as tree_util
from fshard.mesh.spec import P, PartitionSpec
from fshard.parallel import _modules as mods
from fshard.runtime import simulation

__all__ = ["HF_LLAMA_TP_PLAN", "HF_GPT2_TP_PLAN", "STYLES", "tp_apply", "TPApply", "module_tp_specs", "is_module_plan"]

STYLES = ("colwise", "rowwise", "vocab", "replicate")

HF_LLAMA_TP_PLAN: dict[str, str] = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",  # whole heads per rank: n_heads % tp == 0
    "model.layers.*.self_attn.k_proj": "colwise",  # n_kv_heads % tp == 0
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab",
}
"""Llama (and Mistral/Qwen2-style) causal LMs: Hugging Face's ``base_model_tp_plan`` under
``model.``, plus the vocabulary-parallel embedding and head."""

HF_GPT2_TP_PLAN: dict[str, str] = {
    "transformer.wte": "vocab",  # tied with lm_head: one [V / tp, D] shard serves both
    "transformer.h.*.mlp.c_fc": "colwise",  # Conv1D [D, 4D]: splits dim 1 and the bias
    "transformer.h.*.mlp.c_proj": "rowwise",  # Conv1D [4D, D]: splits dim 0; bias added after the psum
    "lm_head": "vocab",
}
"""GPT-2: MLP and vocabulary split, attention replicated (its ``c_attn`` packs q|k|v)."""


def is_module_plan(plan: Mapping[str, str]) -> bool:
    """A plan of module path patterns (``*`` wildcards, no regex syntax) rather than the
    parameter-path regexes of :data:`fshard.parallel.TRANSFORMER_TP_PLAN`."""
    return all(not re.search(r"[\\()\[\]+?^$|{}]", k) and not k.endswith((".weight", ".bias")) for k in plan)


def _check_plan(plan: Mapping[str, str], what: str) -> list[tuple[str, re.Pattern, str]]:
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"{what}: plan must be a non-empty dict of module path pattern -> style, got {plan!r}.")
    out = []
    for pat, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"{what}: plan entry {pat!r} has style {style!r}; use one of {list(STYLES)}.")
        out.append((pat, mods.compile_pattern(pat), style))
    return out


def _is_conv1d(m: nn.Module) -> bool:
    # transformers' Conv1D without importing transformers: weight [nx, nf], attribute nf.
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "weight")


def _out_dim(m: nn.Module, path: str, style: str, what: str) -> int:
    """The weight dim holding output features (``vocab`` on an Embedding: the rows)."""
    if isinstance(m, nn.Embedding):
        if style != "vocab" and style != "replicate":
            raise ValueError(
                f"{what}: module {path!r} is an Embedding; give it style 'vocab' or 'replicate', not {style!r}."
            )
        return 0
    if isinstance(m, nn.Linear):
        return 0
    if _is_conv1d(m):
        return 1
    if style == "replicate":
        return 0
    raise ValueError(
        f"{what}: module {path!r} is a {type(m).__name__}; style {style!r} applies to nn.Linear, "
        f"transformers' Conv1D and (vocab) nn.Embedding. Plan the Linear layers inside it instead."
    )


@attrs.frozen
class _Entry:
    path: str  # module path
    style: str
    pattern: str
    out_dim: int  # weight dim of the output features
    conv1d: bool
    embedding: bool

    def split_dim(self, leaf: str, ndim: int) -> int | None:
        """The dim of parameter ``leaf`` (``weight``/``bias``) split over tp, or None."""
        if self.style == "replicate":
            return None
        if leaf == "bias":
            return 0 if self.style in ("colwise", "vocab") else None
        if leaf == "weight":
            if self.embedding or self.style in ("colwise", "vocab"):
                return self.out_dim
            return 1 - self.out_dim  # rowwise: the input features
        return None


def _resolve(module: nn.Module, plan: Mapping[str, str], what: str) -> dict[str, _Entry]:
    """Module path -> its plan entry (the first matching pattern wins)."""
    compiled = _check_plan(plan, what)
    named = dict(module.named_modules(remove_duplicate=False))
    entries: dict[str, _Entry] = {}
    hits: dict[str, int] = {pat: 0 for pat, _, _ in compiled}
    for path, m in named.items():
        for pat, rx, style in compiled:
            if path and rx.fullmatch(path):
                hits[pat] += 1
                entries[path] = _Entry(
                    path, style, pat, _out_dim(m, path, style, what), _is_conv1d(m), isinstance(m, nn.Embedding)
                )
                break
    unmatched = [p for p, n in hits.items() if n == 0]
    if unmatched:
        sample = ", ".join(repr(p) for p in list(named)[1:7])
        raise ValueError(
            f"{what}: plan pattern {unmatched[0]!r} matches no module of {type(module).__name__} "
            f"(module paths look like {sample}; '*' matches within one name)."
        )
    return entries


def _param_entries(module: nn.Module, entries: dict[str, _Entry], what: str) -> dict[str, tuple[_Entry, str]]:
    """Canonical parameter name -> (entry of its module, leaf name), tied names checked to agree."""
    out: dict[str, tuple[_Entry, str]] = {}
    canonical = {id(p): n for n, p in module.named_parameters()}
    for name, p in module.named_parameters(remove_duplicate=False):
        mpath, _, leaf = name.rpartition(".")
        e = entries.get(mpath)
        first = canonical[id(p)]
        split = e.split_dim(leaf, p.dim()) if e is not None else None
        if first in out or first != name:
            prev = out.get(first)
            prev_split = prev[0].split_dim(prev[1], p.dim()) if prev and prev[0] is not None else None
            if prev is not None and prev_split != split:
                raise ValueError(
                    f"{what}: {name!r} is tied to {first!r}, but the plan splits them differently "
                    f"({_style_of(e)} vs {_style_of(prev[0])}); a tied tensor has one layout: give both "
                    f"modules the same kind of split (e.g. 'vocab' for a tied embedding and head)."
                )
            if prev is None:
                out[first] = (e, leaf)
            continue
        out[first] = (e, leaf)
    return out


def _style_of(e: _Entry | None) -> str:
    return "unplanned (replicated)" if e is None else f"{e.style} via {e.pattern!r}"


def _spec(split: int | None, ndim: int, axis: str, fsdp_axis: str | None) -> PartitionSpec:
    if ndim == 0:
        return P()
    entries: list[Any] = [None] * ndim
    if fsdp_axis:
        entries[0] = fsdp_axis
    if split is not None:
        entries[split] = (axis, fsdp_axis) if fsdp_axis and split == 0 else axis  # tp major, fsdp minor
    return P(*entries)


def module_tp_specs(
    params: Any, plan: Mapping[str, str], axis: str = "tp", *, fsdp_axis: str | None = None, module: Any = None
) -> Any:
    """The specs of a module plan (what :func:`fshard.parallel.tp_specs` gives for one).

    Args:
      params: the tree from ``fs.nn.functionalize`` (global tensors).
      plan: module path pattern -> style (e.g. :data:`HF_LLAMA_TP_PLAN`).
      axis: the tensor-parallel mesh axis.
      fsdp_axis: also shard dim 0 of every parameter over this axis (minor to ``axis`` on
        a dim both split), for ``fsdp_apply(tp_apply(...))``.
      module: the ``nn.Module`` (or an ``apply`` of it): its layer types give each weight's
        orientation. Without it, a weight with a bias whose length matches exactly one
        dim is oriented by that (a ``Conv1D`` ``[in, out]`` with bias ``[out]``); any other
        weight is taken as ``nn.Linear``'s ``[out, in]``.

    Returns:
      A pytree of ``P`` like ``params``.

    Raises:
      ValueError: an unknown style; with ``module``: a pattern that matches no module, a
        planned module of another type, tied tensors split two ways; without it: a
        square weight with a bias (orientation unknown: pass ``module``).
    """
    if module is not None:
        m = module if isinstance(module, nn.Module) else mods.module_of(module, "tp_specs")
        pe = _param_entries(m, _resolve(m, plan, "tp_specs"), "tp_specs")

        def one(path: str, x: Any) -> PartitionSpec:
            e, leaf = pe.get(path, (None, None))
            split = e.split_dim(leaf, x.dim()) if e is not None else None
            return _spec(split, x.dim(), axis, fsdp_axis)

        return tree_util.tree_map_with_path(one, params)
    compiled = _check_plan(plan, "tp_specs")
    flat = fnn.to_state_dict(params)

    def entry_of(path: str) -> _Entry | None:
        mpath = path.rpartition(".")[0]
        for pat, rx, style in compiled:
            if rx.fullmatch(mpath):
                bias = flat.get(mpath + ".bias")
                w = flat.get(mpath + ".weight")
                out_dim = 0
                if w is not None and w.dim() == 2 and bias is not None and style != "replicate":
                    fits = [d for d in (0, 1) if w.shape[d] == bias.shape[0]]
                    if len(fits) != 1:
                        raise ValueError(
                            f"tp_specs: {mpath + '.weight'!r} is {tuple(w.shape)} with a bias of "
                            f"{bias.shape[0]}: which dim holds the output features depends on the layer type "
                            f"(nn.Linear [out, in], Conv1D [in, out]). Pass module= (the model or its apply)."
                        )
                    out_dim = fits[0]
                return _Entry(mpath, style, pat, out_dim, out_dim == 1, False)
        return None

    def one(path: str, x: Any) -> PartitionSpec:
        e = entry_of(path)
        split = e.split_dim(path.rpartition(".")[2], x.dim()) if e is not None else None
        return _spec(split, x.dim(), axis, fsdp_axis)

    return tree_util.tree_map_with_path(one, params)


def tp_apply(apply: Any, plan: Mapping[str, str], axis: str = "tp", loss_parallel: bool = False) -> "TPApply":
    """Wraps ``apply`` (from ``fs.nn.functionalize``) to run tensor parallel by ``plan``.

    Call the result inside a shard_map body with the tp-local shards (specs from
    :func:`fshard.parallel.tp_specs`), exactly as ``apply``. The module's output is what
    it returns on one process: full logits (all-gathered over the vocabulary, whose
    backward keeps this rank's slice), unless ``loss_parallel``.

    Args:
      apply: from ``fs.nn.functionalize(module)``.
      plan: module path pattern -> ``"colwise"``, ``"rowwise"``, ``"vocab"`` or
        ``"replicate"``; e.g. :data:`HF_LLAMA_TP_PLAN`, :data:`HF_GPT2_TP_PLAN`.
      axis: the tensor-parallel mesh axis.
      loss_parallel: leave the logits of a ``vocab`` head split over the vocabulary
        (``(..., V / tp)``) for :func:`fshard.parallel.vocab_parallel_cross_entropy`.

    Returns:
      A :class:`TPApply` with ``apply``'s signature.

    Raises:
      TypeError: ``apply`` is not from ``functionalize``, or the plan is not a dict.
      ValueError: a pattern that matches no module (named), an unknown style, a style on
        a module type it does not fit, tied tensors planned two ways; at call time, a
        split dim not divisible by the tp size or a local shard of the wrong shape (each
        naming the module path, the parameter, the dim and the sizes).
    """
    module = mods.module_of(apply, "tp_apply")
    entries = _resolve(module, plan, "tp_apply")
    _param_entries(module, entries, "tp_apply")
    return TPApply(apply, module, dict(plan), entries, axis, bool(loss_parallel))


class TPApply:
    """The function :func:`tp_apply` returns: ``tp(params, *args, **kwargs)``.

    Attributes:
      module: the wrapped ``nn.Module``; inner: the wrapped ``apply``; plan: the plan;
      axis: the tp axis; loss_parallel: whether vocab-split logits stay split.
    """

    def __init__(
        self,
        inner: Any,
        module: nn.Module,
        plan: dict[str, str],
        entries: dict[str, _Entry],
        axis: str,
        loss_parallel: bool,
    ) -> None:
        self.inner, self.module, self.plan, self.axis, self.loss_parallel = inner, module, plan, axis, loss_parallel
        self._entries = {p: e for p, e in entries.items() if e.style != "replicate"}
        # Global shapes, read once from the module's own parameters (the call binds shards).
        self._shapes = {
            p: {n: tuple(t.shape) for n, t in module.get_submodule(p).named_parameters(recurse=False)}
            for p in self._entries
        }

    def __repr__(self) -> str:
        return f"TPApply({type(self.module).__name__}, {len(self._entries)} split modules, axis={self.axis!r})"

    def specs(self, params: Any, *, fsdp_axis: str | None = None) -> Any:
        """``tp_specs(params, self.plan, self.axis, fsdp_axis=..., module=self.module)``."""
        return module_tp_specs(params, self.plan, self.axis, fsdp_axis=fsdp_axis, module=self.module)

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        body = lax.BODY.get()
        if body is None:
            raise RuntimeError("fs.parallel.tp_apply: call the wrapped function inside a shard_map body.")
        body.mesh.check_axes(self.axis, what="axis")
        n = body.mesh.axis_size(self.axis)
        self._check_divisible(n)
        hooks = mods.CallHooks()
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # one pvary per input tensor
        for path, e in self._entries.items():
            m = self.module.get_submodule(path)
            hooks.add(m, *_hooks(e, self, n, hooks, shared))
        try:
            return self.inner(params, *args, **kwargs)
        finally:
            hooks.close()

    def _check_divisible(self, n: int) -> None:
        for path, e in self._entries.items():
            for leaf, shape in self._shapes[path].items():
                d = e.split_dim(leaf, len(shape))
                if d is not None and shape[d] % n:
                    raise ValueError(
                        f"tp_apply: {path}.{leaf} has shape {shape}; the {e.style} split puts dim {d} "
                        f"(size {shape[d]}) over axis {self.axis!r} of size {n}, which does not divide it."
                    )

    def check_local(self, e: _Entry, m: nn.Module, n: int) -> None:
        for leaf, shape in self._shapes[e.path].items():
            d = e.split_dim(leaf, len(shape))
            want = tuple(s // n if k == d else s for k, s in enumerate(shape))
            got = tuple(getattr(m, leaf).shape)
            if got != want:
                raise ValueError(
                    f"tp_apply: {e.path}.{leaf} is {got} on this rank, but the {e.style} split of its "
                    f"{shape} over axis {self.axis!r} (size {n}) is {want}. Shard the parameters with "
                    f"fs.parallel.tp_specs(params, plan, module=model) (Conv1D weights are [in, out])."
                )


def _pvary_shared(x: torch.Tensor, axis: str, shared: dict) -> torch.Tensor:
    hit = shared.get(id(x))
    if hit is not None and hit[0] is x:
        return hit[1]
    y = lax.pvary(x, axis)
    shared[id(x)] = (x, y)  # holds x: its id stays its own for the call
    return y


def _override(m: nn.Module, attr: str, value: Any, hooks: mods.CallHooks, undo: list) -> None:
    old = getattr(m, attr)
    setattr(m, attr, value)

    def restore():
        setattr(m, attr, old)

    undo.append(restore)
    hooks.push_cleanup(restore)


def _hooks(e: _Entry, tp: TPApply, n: int, hooks: mods.CallHooks, shared: dict):
    axis = tp.axis
    pending: list[Any] = []  # per-call state between this module's pre and post hook

    def finish(undo: list) -> None:
        for fn in reversed(undo):
            hooks.pop_cleanup(fn)

    def first_arg(args, kwargs):
        if args:
            return args[0], lambda v: ((v, *args[1:]), kwargs)
        if kwargs:
            k = next(iter(kwargs))
            return kwargs[k], lambda v: (args, {**kwargs, k: v})
        raise ValueError(f"tp_apply: module {e.path!r} was called without an input.")

    if e.embedding:  # vocab-parallel lookup

        def pre(m, args, kwargs):
            tp.check_local(e, m, n)
            ids, put = first_arg(args, kwargs)
            rows = m.weight.shape[0]
            start = lax.axis_index(axis) * rows
            mine = (ids >= start) & (ids < start + rows)  # (B, T)
            local = torch.where(mine, ids - start, torch.zeros_like(ids))
            undo: list = []
            if m.padding_idx is not None:
                p = m.padding_idx % (rows * n)
                first = int(start)  # a host int: padding_idx is one
                _override(m, "padding_idx", p - first if first <= p < first + rows else None, hooks, undo)
            pending.append((mine, undo))
            return put(local)

        def post(m, args, kwargs, out):
            mine, undo = pending.pop()
            finish(undo)
            return lax.psum(out * mine.unsqueeze(-1).to(out.dtype), axis)  # (B, T, D)

        return pre, post

    if e.style in ("colwise", "vocab"):

        def pre(m, args, kwargs):
            tp.check_local(e, m, n)
            x, put = first_arg(args, kwargs)
            undo: list = []
            if e.conv1d:
                _override(m, "nf", m.weight.shape[1], hooks, undo)
            pending.append(undo)
            return put(_pvary_shared(x, axis, shared))

        def post(m, args, kwargs, out):
            finish(pending.pop())
            if e.style == "vocab" and not tp.loss_parallel:
                return _gather_invariant(out, axis, n)
            return out

        return pre, post

    # rowwise
    def pre(m, args, kwargs):
        tp.check_local(e, m, n)
        x, _ = first_arg(args, kwargs)
        in_dim = m.weight.shape[1 - e.out_dim]
        if x.shape[-1] != in_dim:
            raise ValueError(
                f"tp_apply: rowwise module {e.path!r} got an input with last dim {x.shape[-1]}, but its weight "
                f"holds {in_dim} input features on this rank: a rowwise module takes the split output of a "
                f"colwise one."
            )
        bias = getattr(m, "bias", None)
        undo: list = []
        if bias is not None:
            # The partial sums are reduced first; the bias is added once, after the psum.
            before = mods.swap(m, {"bias": torch.zeros_like(bias)})

            def restore():
                mods.swap(m, before)

            undo.append(restore)
            hooks.push_cleanup(restore)
        pending.append((bias, undo))

    def post(m, args, kwargs, out):
        bias, undo = pending.pop()
        finish(undo)
        out = lax.psum(out, axis)
        return out if bias is None else out + bias

    return pre, post


class _GatherInvariant(torch.autograd.Function):
    """All-gather of vocab-split logits whose result is used alike on every tp rank:
    backward keeps this rank's slice (Megatron's gather-from-TP-region)."""

    @staticmethod
    def forward(x: torch.Tensor, axis: str, n: int, r: int):
        with torch.no_grad():
            return lax.all_gather(x, axis, axis=-1, tiled=True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.n, ctx.r = inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, g):
        # per rank: under fs.simulate ``r`` is each simulated rank's own index
        return simulation.per_rank(_own_chunk)(g, ctx.n, ctx.r), None, None, None


def _own_chunk(g: torch.Tensor, n: int, r: int) -> torch.Tensor:
    return g.chunk(n, -1)[r]


def _gather_invariant(out: Any, axis: str, n: int) -> Any:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"tp_apply: a 'vocab' head returned {type(out).__name__}; expected the logits tensor.")
    if n == 1:
        return out
    token = lax._IN_LAX.set(True)
    try:
        # backward's chunk index, from the mesh: a host int (per rank under fs.simulate)
        full = _GatherInvariant.apply(out, axis, n, lax.BODY.get().mesh.axis_index(axis))
    finally:
        lax._IN_LAX.reset(token)
    body = lax.BODY.get()
    if body is not None and body.check:
        lax.set_vma(full, lax.vma(out) - {axis})
    return full
