"""A model as data: per layer kind, its parameters, work per phase and activation bytes.

A :class:`ModelDesc` is a sequence of :class:`LayerDesc` (embedding, ``count`` identical
blocks, head), each with:

- its parameter leaves (path and global shape) and the tensor-parallel plan that
  applies to them (path regex -> ``"colwise"`` / ``"rowwise"`` / ``"vocab"``, as
  :func:`fshard.parallel.tp_specs`): the planner derives every FSDP / DDP / TP byte
  count from these through fshard's own spec rules;
- :class:`~fshard.plan.trace.Work` for forward, backward-input and backward-weight, per
  sample at tp = 1, and the part of it that tensor parallelism divides;
- bytes saved for backward per sample (and the part TP divides), and the bytes of the
  activation it hands on (what a pipeline sends, and what remat keeps);
- its tensor-parallel collectives: region entries / exits (Megatron's f and g), the
  replicated parameters that sequence parallelism sums, and extra fixed collectives
  (the vocab-parallel loss's pmax / psum).

Two ways to get one: :func:`describe_transformer` traces fshard's own Transformer
(``fshard.models``) one layer at a time (exact for what ``examples/train_lm.py`` runs);
:func:`describe_llama` writes a Llama-family model down from its config (for planning
models too large to run here). :data:`PRESETS` names the published ones.

Every description is checked on construction; a bad value raises
:class:`DescriptionError` naming the field path (``layers[1].fwd.flops``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

import attrs
import torch

from fshard.plan.trace import Work, trace_layer

__all__ = [
    "DescriptionError",
    "Experts",
    "LayerDesc",
    "ModelDesc",
    "PRESETS",
    "describe_llama",
    "describe_transformer",
    "get_model",
    "model_from_dict",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8": 1}
TP_STYLES = ("colwise", "rowwise", "vocab")


class DescriptionError(ValueError):
    """A model or machine description with a missing or invalid field (named in the message)."""


def _num(where: str, value: Any, *, minimum: float = 0.0, integer: bool = False, strict: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if ok:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        kind = "an integer" if integer else "a finite number"
        rel = ">" if strict else ">="
        raise DescriptionError(f"{where} must be {kind} {rel} {minimum:g}, got {value!r}")


def _check_work(where: str, w: Any) -> None:
    if not isinstance(w, Work):
        raise DescriptionError(f"{where} must be a Work(flops, bytes, ops), got {type(w).__name__}")
    for f in ("flops", "bytes", "ops"):
        _num(f"{where}.{f}", getattr(w, f))


@attrs.frozen
class Experts:
    """A layer's dropless mixture of experts (``fs.parallel.moe_ffn(capacity_factor=None)``),
    per sample of ``seq_len`` tokens with every expert's rows counted once (the work of all
    ``seq_len * top_k`` routed rows, which does not depend on where they go).

    The layer's own work and saved bytes include these; the planner scales this part on
    the busiest ep rank by ``skew``.

    Attributes:
      n_experts: experts in the layer (its expert leaves' dim 0).
      top_k: experts per token.
      fwd, bwd_input, bwd_weight: work of the expert GEMMs (forward, backward-input,
        backward-weight).
      act_bytes: the expert GEMMs' saved-for-backward bytes.
      skew: the busiest ep rank's routed rows over the mean (1: balanced routing; the
        layout's ep ranks each hold ``n_experts / ep`` experts). It scales the rank's
        expert work and saved bytes, and the rows its exchanges move.
    """

    n_experts: int
    top_k: int
    fwd: Work = Work()
    bwd_input: Work = Work()
    bwd_weight: Work = Work()
    act_bytes: float = 0.0
    skew: float = 1.0

    def check(self, where: str) -> None:
        """Raises DescriptionError naming the first bad field under ``where``."""
        _num(f"{where}.n_experts", self.n_experts, minimum=1, integer=True)
        _num(f"{where}.top_k", self.top_k, minimum=1, integer=True)
        if self.top_k > self.n_experts:
            raise DescriptionError(f"{where}.top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})")
        for f in ("fwd", "bwd_input", "bwd_weight"):
            _check_work(f"{where}.{f}", getattr(self, f))
        _num(f"{where}.act_bytes", self.act_bytes)
        _num(f"{where}.skew", self.skew, minimum=1.0)


@attrs.frozen
class LayerDesc:
    """One kind of layer, per sample (one sequence) at tensor-parallel size 1.

    Attributes:
      name: e.g. ``"embed"``, ``"block"``, ``"head"``.
      count: how many identical layers of this kind follow each other.
      params: ``((path, global shape), ...)`` of one layer's leaves, paths as the
        model's pytree names them relative to the layer (``"attention.wq.weight"``).
      tp_plan: ``((path regex, style), ...)``; unmatched leaves are replicated over tp.
      fwd, bwd_input, bwd_weight: work of forward, backward-input (I) and
        backward-weight (W).
      fwd_split, bwd_input_split, bwd_weight_split: the part of each that tensor
        parallelism divides by tp (the rest is repeated on every tp rank, unless
        sequence parallelism divides it too).
      act_bytes: bytes saved for backward per sample (parameters excluded).
      act_split: the part of ``act_bytes`` that tensor parallelism divides.
      out_bytes: bytes of the activation the layer hands on, per sample.
      wgrad_bytes: bytes per sample of the gradients a split backward holds from the
        layer's I to its W besides ``act_bytes`` (``fs.sched.SplitBackward``'s captured
        gradients at the weights' frontier nodes; schedules with W actions only).
      wgrad_split: the part of ``wgrad_bytes`` that tensor parallelism divides.
      tp_enter: tensor-parallel region entries per call (Megatron's f: backward psum,
        or an all-gather forward with sequence parallelism).
      tp_exit: region exits per call (g: forward psum, or psum_scatter with SP).
      sp_param_numel: elements of replicated parameters used on sequence-split data
        (their gradients take one psum over tp per call with SP).
      tp_extra: ``((kind, phase, bytes per sample), ...)`` other collectives over tp
        per call, e.g. the vocab-parallel loss's ``("pmax", "fwd", 4 * T)``; bytes in
        float32 (a float64 run sends twice as many).
      loss: this layer computes the loss (its input activation gets no gradient from
        outside: the pipeline's last stage).
      experts: the layer's mixture of experts (:class:`Experts`; its leaves are the
        params under an ``experts.`` key, dim 0 the expert), or None.
    """

    name: str
    count: int
    params: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(
        converter=lambda ps: tuple((str(p), tuple(int(d) for d in s)) for p, s in ps)
    )
    tp_plan: tuple[tuple[str, str], ...] = attrs.field(converter=lambda ps: tuple((str(r), str(s)) for r, s in ps))
    fwd: Work
    bwd_input: Work
    bwd_weight: Work
    fwd_split: Work = Work()
    bwd_input_split: Work = Work()
    bwd_weight_split: Work = Work()
    act_bytes: float = 0.0
    act_split: float = 0.0
    out_bytes: float = 0.0
    wgrad_bytes: float = 0.0
    wgrad_split: float = 0.0
    tp_enter: int = 0
    tp_exit: int = 0
    sp_param_numel: int = 0
    tp_extra: tuple[tuple[str, str, float], ...] = attrs.field(
        default=(), converter=lambda xs: tuple((str(k), str(p), float(b)) for k, p, b in xs)
    )
    loss: bool = False
    experts: Experts | None = None

    @property
    def numel(self) -> int:
        """Parameters of one layer."""
        return sum(math.prod(s) for _, s in self.params)

    def check(self, where: str) -> None:
        """Raises DescriptionError naming the first bad field under ``where``."""
        if not isinstance(self.name, str) or not self.name:
            raise DescriptionError(f"{where}.name must be a non-empty string, got {self.name!r}")
        _num(f"{where}.count", self.count, minimum=1, integer=True)
        for i, (path, shape) in enumerate(self.params):
            if not path:
                raise DescriptionError(f"{where}.params[{i}].path must be a non-empty string")
            if any(d < 1 for d in shape):
                raise DescriptionError(f"{where}.params[{i}] ({path}).shape must have positive sizes, got {shape}")
        for i, (rx, style) in enumerate(self.tp_plan):
            if style not in TP_STYLES:
                raise DescriptionError(f"{where}.tp_plan[{i}] ({rx!r}).style must be one of {TP_STYLES}, got {style!r}")
            try:
                re.compile(rx)
            except re.error as e:
                raise DescriptionError(f"{where}.tp_plan[{i}].regex {rx!r} does not compile: {e}") from None
        for f in ("fwd", "bwd_input", "bwd_weight", "fwd_split", "bwd_input_split", "bwd_weight_split"):
            _check_work(f"{where}.{f}", getattr(self, f))
        for f in ("fwd", "bwd_input", "bwd_weight"):
            whole, part = getattr(self, f), getattr(self, f + "_split")
            if part.flops > whole.flops * (1 + 1e-9) or part.bytes > whole.bytes * (1 + 1e-9):
                raise DescriptionError(f"{where}.{f}_split ({part}) must not exceed {where}.{f} ({whole})")
        for f in ("act_bytes", "act_split", "out_bytes", "wgrad_bytes", "wgrad_split"):
            _num(f"{where}.{f}", getattr(self, f))
        for whole, part in (("act_bytes", "act_split"), ("wgrad_bytes", "wgrad_split")):
            if getattr(self, part) > getattr(self, whole) * (1 + 1e-9):
                raise DescriptionError(
                    f"{where}.{part} ({getattr(self, part):g}) must not exceed {whole} ({getattr(self, whole):g})"
                )
        for f in ("tp_enter", "tp_exit", "sp_param_numel"):
            _num(f"{where}.{f}", getattr(self, f), integer=True)
        for i, (kind, phase, nbytes) in enumerate(self.tp_extra):
            if kind not in ("psum", "pmax", "all_gather", "psum_scatter") or phase not in ("fwd", "bwd"):
                raise DescriptionError(
                    f"{where}.tp_extra[{i}] must be (psum|pmax|all_gather|psum_scatter, "
                    f"fwd|bwd, bytes), got {(kind, phase, nbytes)!r}"
                )
            _num(f"{where}.tp_extra[{i}].bytes", nbytes)
        if self.experts is not None:
            if not isinstance(self.experts, Experts):
                raise DescriptionError(f"{where}.experts must be an Experts, got {type(self.experts).__name__}")
            self.experts.check(f"{where}.experts")
            ex = self.experts
            for f in ("fwd", "bwd_input", "bwd_weight"):
                whole, part = getattr(self, f), getattr(ex, f)
                if part.flops > whole.flops * (1 + 1e-9):
                    raise DescriptionError(f"{where}.experts.{f} ({part}) must not exceed {where}.{f} ({whole})")
            if ex.act_bytes > self.act_bytes * (1 + 1e-9):
                raise DescriptionError(
                    f"{where}.experts.act_bytes ({ex.act_bytes:g}) must not exceed act_bytes ({self.act_bytes:g})"
                )


def _tuple(xs: Iterable[Any]) -> tuple[Any, ...]:
    """``tuple(xs)``, typed: mypy's attrs plugin cannot infer a generic ``converter=tuple``."""
    return tuple(xs)


@attrs.frozen
class ModelDesc:
    """A model for the planner: its layers in order, per sample of ``seq_len`` tokens.

    Attributes:
      name: for reports.
      seq_len: tokens per sample.
      hidden: the residual width (activations between layers are ``(b, seq_len, hidden)``).
      dtype: the compute dtype the work and activation bytes were described in.
      layers: the layer kinds in order; a pipeline cuts the ``count`` of the repeated
        kind (the blocks) into stages, the first stage also holding the layers before
        it and the last stage those after it.
      tp_divides: sizes that tensor parallelism must divide (heads, KV heads).
      n_experts: experts per MoE layer (0: dense; expert parallelism needs experts).
      published_params: parameter count the model's authors state (for reports), or 0.
    """

    name: str
    seq_len: int
    hidden: int
    dtype: str
    layers: tuple[LayerDesc, ...] = attrs.field(converter=_tuple)
    tp_divides: tuple[int, ...] = attrs.field(default=(), converter=_tuple)
    n_experts: int = 0
    published_params: int = 0

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DescriptionError(f"model.name must be a non-empty string, got {self.name!r}")
        _num(f"model {self.name!r}: seq_len", self.seq_len, minimum=1, integer=True)
        _num(f"model {self.name!r}: hidden", self.hidden, minimum=1, integer=True)
        if self.dtype not in DTYPE_BYTES:
            raise DescriptionError(
                f"model {self.name!r}: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}"
            )
        if not self.layers:
            raise DescriptionError(f"model {self.name!r}: layers must not be empty")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, LayerDesc):
                raise DescriptionError(
                    f"model {self.name!r}: layers[{i}] must be a LayerDesc, got {type(layer).__name__}"
                )
            layer.check(f"model {self.name!r}: layers[{i}] ({layer.name})")
        for i, d in enumerate(self.tp_divides):
            _num(f"model {self.name!r}: tp_divides[{i}]", d, minimum=1, integer=True)
        _num(f"model {self.name!r}: n_experts", self.n_experts, integer=True)
        for i, layer in enumerate(self.layers):
            if layer.experts is not None and layer.experts.n_experts != self.n_experts:
                raise DescriptionError(
                    f"model {self.name!r}: layers[{i}] ({layer.name}).experts.n_experts "
                    f"({layer.experts.n_experts}) must equal the model's n_experts ({self.n_experts})"
                )
        if sum(1 for layer in self.layers if layer.count > 1) > 1:
            raise DescriptionError(
                f"model {self.name!r}: layers: only one kind may repeat (count > 1): "
                f"{[(layer.name, layer.count) for layer in self.layers]}"
            )

    @property
    def repeated(self) -> int:
        """Index of the repeated layer kind (the blocks), or of the largest if none repeats."""
        counts = [layer.count for layer in self.layers]
        if max(counts) > 1:
            return counts.index(max(counts))
        return max(range(len(self.layers)), key=lambda i: self.layers[i].numel)

    @property
    def n_blocks(self) -> int:
        return self.layers[self.repeated].count

    @property
    def numel(self) -> int:
        """Total parameters."""
        return sum(layer.numel * layer.count for layer in self.layers)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def flops_per_sample(self) -> float:
        """Forward + backward FLOPs of one sample (no remat)."""
        return sum(
            (layer.fwd.flops + layer.bwd_input.flops + layer.bwd_weight.flops) * layer.count for layer in self.layers
        )


# ---------------------------------------------------------------------------
# fshard's Transformer, traced
# ---------------------------------------------------------------------------


def _tp_local(shape: tuple[int, ...], style: str | None, tp: int) -> tuple[int, ...]:
    if style is None or tp == 1:
        return shape
    dim = 1 if style == "rowwise" else 0
    out = list(shape)
    out[dim] = -(-out[dim] // tp)
    return tuple(out)


def _style(path: str, plan: Sequence[tuple[str, str]]) -> str | None:
    for rx, style in plan:
        if re.fullmatch(rx, path):
            return style
    return None


def describe_transformer(
    cfg: Any,
    *,
    seq_len: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    name: str | None = None,
    moe: Any = None,
    skew: float = 1.0,
) -> ModelDesc:
    """Describes :mod:`fshard.models`' Transformer by running each layer kind once.

    Each of the embedding, one block and the head (+ cross-entropy) runs forward and
    backward on one sample with real kernels (``device="cpu"``: a few milliseconds for
    the sizes ``examples/train_lm.py`` trains), once with whole parameters and once
    with the tp = 2 shards the Megatron plan gives each rank; the difference is the work
    tensor parallelism divides.

    Args:
      cfg: a :class:`fshard.models.TransformerConfig`.
      seq_len: tokens per sample (optional, default ``cfg.max_seq_len``).
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"`` (optional).
      device: where to run the layers: ``"cpu"`` (real kernels) or ``"meta"`` (shapes only;
        attention then runs the math path) (optional, default ``"cpu"``).
      name: for reports (optional).
      moe: an ``fs.recipes.MoE`` (optional): each block's MLP as its dropless experts,
        traced on ``device="cpu"`` in one process; the block's :class:`Experts` is the
        expert GEMMs traced alone on ``seq_len * top_k`` rows spread evenly.
      skew: with ``moe``, :attr:`Experts.skew` (optional, default 1: balanced routing).

    Returns:
      A :class:`ModelDesc` with layers ``embed``, ``block`` (``cfg.n_layers``), ``head``.

    Raises:
      DescriptionError: an unknown dtype, or ``moe`` on the meta device.
    """
    import torch.nn.functional as F

    from fshard.models.transformer import block, embed, head, transformer_init
    from fshard.parallel.tp import TRANSFORMER_TP_PLAN

    if dtype not in ("float32", "bfloat16", "float64"):
        raise DescriptionError(f"describe_transformer: dtype must be float32, bfloat16 or float64, got {dtype!r}")
    if moe is not None and device == "meta":
        raise DescriptionError("describe_transformer: moe routes on real values; trace it on device='cpu'")
    T = seq_len or cfg.max_seq_len
    tdt = getattr(torch, dtype)
    with torch.device("meta"):
        full = transformer_init(cfg, 0, dtype=tdt)
        if moe is not None:
            full = moe.init_layers(full, cfg, 0, tdt)
    from fshard import tree as tree_util

    ffn = None
    if moe is not None:
        from fshard.parallel.ep import moe_ffn

        def ffn(lp: Any, h: torch.Tensor) -> torch.Tensor:
            return moe_ffn(lp["moe"], h, top_k=moe.top_k, capacity_factor=None)

    def shapes(tree: Any, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [
            (p[len(prefix) :] if p.startswith(prefix) else p, tuple(x.shape))
            for p, x in zip(*tree_util.zip_with_path(tree)[:2])
        ]

    def plan_for(prefix: str) -> list[tuple[str, str]]:
        # The model-level regexes, relative to the layer (layers\.\d+\. stripped).
        out = []
        for rx, style in TRANSFORMER_TP_PLAN.items():
            if prefix and rx.startswith(r"layers\.\d+\."):
                out.append((rx[len(r"layers\.\d+\.") :], style))
            elif not prefix and not rx.startswith("layers"):
                out.append((rx, style))
        return out

    root = {k: v for k, v in full.items() if k != "layers"}
    layer0 = full["layers"][0]
    root_plan, block_plan = plan_for(""), plan_for("layers.0.")
    embed_keys = ("tok_embeddings", "pos_embeddings")
    head_keys = tuple(k for k in root if k not in embed_keys)

    def materialize(tree: Any, plan: list[tuple[str, str]], tp: int) -> Any:
        paths, leaves, treedef = tree_util.zip_with_path(tree)
        g = torch.Generator().manual_seed(0)
        out = []
        for p, x in zip(paths, leaves):
            shape = _tp_local(tuple(x.shape), _style(p, plan), tp)
            t = torch.empty(shape, dtype=tdt, device=device)
            if device != "meta":
                t.copy_(torch.randn(shape, generator=g, dtype=torch.float32).mul_(0.02).to(tdt))
            out.append(t)
        return tree_util.tree_unflatten(treedef, out)

    def run(tp: int):
        local_v = -(-cfg.vocab_size // tp)
        toks = torch.randint(0, local_v, (1, T), generator=torch.Generator().manual_seed(1)).to(device)
        x = (
            torch.randn(1, T, cfg.dim, dtype=tdt, device=device)
            if device != "meta"
            else torch.empty(1, T, cfg.dim, dtype=tdt, device=device)
        )
        e = trace_layer(
            lambda p, t: embed(p, t, cfg), materialize({k: root[k] for k in embed_keys}, root_plan, tp), [toks]
        )
        b = trace_layer(lambda p, h: block(p, h, cfg, ffn=ffn), materialize(layer0, block_plan, tp), [x])

        def head_loss(p: Any, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            logits = head(p, h, cfg)
            return F.cross_entropy(logits.float().flatten(0, 1), t.flatten())

        head_params = {k: root[k] for k in head_keys}
        if cfg.tie_weights:
            head_params["tok_embeddings"] = root["tok_embeddings"]
        h = trace_layer(head_loss, materialize(head_params, root_plan, tp), [x, toks])
        return e, b, h

    one, two = run(1), run(2)

    def split(a: Work, b: Work) -> Work:
        # cost(tp) = rep + split / tp: two traces give split = 2 * (cost(1) - cost(2)).
        return Work(max(0.0, 2 * (a.flops - b.flops)), max(0.0, 2 * (a.bytes - b.bytes)), 0.0)

    experts = None if moe is None else _experts(moe, layer0["moe"]["experts"], T, cfg.dim, tdt, skew, materialize)
    act = cfg.dim * T * DTYPE_BYTES[dtype]  # bytes of one (1, T, D) activation
    n_norm = 2 * cfg.dim  # a LayerNorm's weight + bias

    def desc(i: int, name_: str, count: int, tree: Any, plan, **kw) -> LayerDesc:
        a, b = one[i], two[i]
        return LayerDesc(
            name=name_,
            count=count,
            params=shapes(tree, ""),
            tp_plan=plan,
            fwd=a.fwd,
            bwd_input=a.bwd_input,
            bwd_weight=a.bwd_weight,
            fwd_split=split(a.fwd, b.fwd),
            bwd_input_split=split(a.bwd_input, b.bwd_input),
            bwd_weight_split=split(a.bwd_weight, b.bwd_weight),
            act_bytes=a.saved_bytes,
            act_split=min(a.saved_bytes, max(0.0, 2 * (a.saved_bytes - b.saved_bytes))),
            wgrad_bytes=a.wgrad_bytes,
            wgrad_split=min(a.wgrad_bytes, max(0.0, 2 * (a.wgrad_bytes - b.wgrad_bytes))),
            out_bytes=act,
            **kw,
        )

    layers = [
        desc(0, "embed", 1, {k: root[k] for k in embed_keys}, root_plan, tp_exit=1, sp_param_numel=T * cfg.dim),
        desc(
            1,
            "block",
            cfg.n_layers,
            layer0,
            block_plan,
            tp_enter=2,
            tp_exit=2,
            sp_param_numel=2 * n_norm + cfg.dim,
            experts=experts,
        ),
        desc(
            2,
            "head",
            1,
            {k: root[k] for k in head_keys},
            root_plan,
            tp_enter=1,
            sp_param_numel=n_norm,
            tp_extra=(("pmax", "fwd", 4 * T), ("psum", "fwd", 8 * T)),
            loss=True,
        ),
    ]
    return ModelDesc(
        name=name or f"transformer-d{cfg.dim}-l{cfg.n_layers}" + (f"-e{moe.n_experts}" if moe else ""),
        seq_len=T,
        hidden=cfg.dim,
        dtype=dtype,
        layers=layers,
        tp_divides=(cfg.n_heads,),
        n_experts=moe.n_experts if moe else 0,
    )


def _experts(moe: Any, meta: Any, T: int, dim: int, tdt: torch.dtype, skew: float, materialize: Any) -> Experts:
    """The expert GEMMs of one sample (``T * top_k`` rows, as evenly spread as they divide),
    traced alone: what routing moves between ranks."""
    import torch.nn.functional as F

    from fshard.parallel._dropless import expert_gemms

    rows, n = T * moe.top_k, moe.n_experts
    sizes = torch.tensor([rows // n + (j < rows % n) for j in range(n)])
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(2), dtype=torch.float32).to(tdt)
    t = trace_layer(lambda w, h: expert_gemms(w, h, sizes, F.gelu), materialize(meta, [], 1), [x])
    return Experts(n, moe.top_k, t.fwd, t.bwd_input, t.bwd_weight, act_bytes=t.saved_bytes, skew=skew)


# ---------------------------------------------------------------------------
# Llama family, from the config
# ---------------------------------------------------------------------------


def describe_llama(
    *,
    name: str,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    seq_len: int,
    dtype: str = "bfloat16",
    published_params: int = 0,
) -> ModelDesc:
    """A Llama-style decoder (RMSNorm, GQA attention with RoPE, SwiGLU MLP, untied head).

    Work per token, forward (backward-input and backward-weight each cost the forward's
    matrix FLOPs; flash attention's backward 2.5x its forward, all in I); causal flash
    attention computes half of the ``4 T D`` products per token (the published MFU
    figures count all of them: see :func:`fshard.plan.estimate.model_flops`)::

      projections  2 * (D * (D + 2 * kv) + D * D + 3 * D * F)    (q, k, v, o, w1, w3, w2)
      attention    2 * T * D
      head         2 * D * V

    Activations saved per token and block (in ``dtype``): the inputs of both norms and
    of every projection, q / k / v, the attention output and its logsumexp (fp32 per
    head), and the SwiGLU's w1 / w3 outputs, silu output and product: the layout that
    torch autograd keeps for this model with flash attention.

    Memory-bound work (norms, RoPE, SwiGLU, residual adds) is counted as bytes: each
    such kernel reads and writes its tensors once.

    Returns:
      A :class:`ModelDesc` (``embed``, ``block`` x ``n_layers``, ``head``).

    Raises:
      DescriptionError: sizes that do not fit together (heads, kv heads, dim).
    """
    for field_, value in (
        ("dim", dim),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("n_kv_heads", n_kv_heads),
        ("ffn_dim", ffn_dim),
        ("vocab_size", vocab_size),
        ("seq_len", seq_len),
    ):
        _num(f"describe_llama({name}).{field_}", value, minimum=1, integer=True)
    if dim % n_heads or n_heads % n_kv_heads:
        raise DescriptionError(
            f"describe_llama({name}): dim={dim} must be a multiple of n_heads={n_heads}, "
            f"and n_heads a multiple of n_kv_heads={n_kv_heads}"
        )
    if dtype not in DTYPE_BYTES:
        raise DescriptionError(f"describe_llama({name}).dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    D, F, V, T, s = dim, ffn_dim, vocab_size, seq_len, DTYPE_BYTES[dtype]
    kv = D // n_heads * n_kv_heads
    proj = 2 * (D * (D + 2 * kv) + D * D + 3 * D * F) * T
    attn = 2 * T * D * T  # causal flash attention computes half of the 4 T^2 D products
    # Elementwise kernels per token: 2 RMSNorms (read x, write y), RoPE on q and k, 2
    # residual adds, SwiGLU (silu + mul); backward about twice the traffic.
    ew_fwd = s * T * (2 * 2 * D + 2 * (D + kv) + 2 * 3 * D + 3 * F + 3 * F)
    ew_split_fwd = s * T * (2 * (D + kv) + 6 * F)
    block = LayerDesc(
        name="block",
        count=n_layers,
        params=[
            ("attention_norm.weight", (D,)),
            ("attention.wq.weight", (D, D)),
            ("attention.wk.weight", (kv, D)),
            ("attention.wv.weight", (kv, D)),
            ("attention.wo.weight", (D, D)),
            ("ffn_norm.weight", (D,)),
            ("feed_forward.w1.weight", (F, D)),
            ("feed_forward.w3.weight", (F, D)),
            ("feed_forward.w2.weight", (D, F)),
        ],
        tp_plan=[
            (r"attention\.w[qkv]\.weight", "colwise"),
            (r"attention\.wo\.weight", "rowwise"),
            (r"feed_forward\.w[13]\.weight", "colwise"),
            (r"feed_forward\.w2\.weight", "rowwise"),
        ],
        fwd=Work(proj + attn, ew_fwd, 24),
        bwd_input=Work(proj + 2.5 * attn, 2 * ew_fwd, 30),
        bwd_weight=Work(proj, 0.0, 7),
        fwd_split=Work(proj + attn, ew_split_fwd, 0),
        bwd_input_split=Work(proj + 2.5 * attn, 2 * ew_split_fwd, 0),
        bwd_weight_split=Work(proj, 0.0, 0),
        act_bytes=s * T * (2 * D + 2 * D + (D + 2 * kv) + D + 4 * F) + 4 * T * n_heads,
        act_split=s * T * ((D + 2 * kv) + D + 4 * F) + 4 * T * n_heads,
        out_bytes=s * T * D,
        tp_enter=2,
        tp_exit=2,
        sp_param_numel=2 * D,
        # Held from I to W: the gradients of every projection's output (q, k, v, w1, w3 split
        # over tp; wo, w2 whole) and of both norms' outputs.
        wgrad_bytes=s * T * (D + 2 * kv + 2 * F + 4 * D),
        wgrad_split=s * T * (D + 2 * kv + 2 * F),
    )
    embed = LayerDesc(
        name="embed",
        count=1,
        params=[("tok_embeddings.weight", (V, D))],
        tp_plan=[(r"tok_embeddings\.weight", "vocab")],
        fwd=Work(0.0, 2 * s * T * D, 2),
        bwd_input=Work(),
        bwd_weight=Work(0.0, 2 * s * T * D, 2),
        fwd_split=Work(0.0, s * T * D, 0),
        bwd_weight_split=Work(0.0, s * T * D, 0),
        act_bytes=8 * T,
        out_bytes=s * T * D,
        tp_exit=1,
    )
    head = LayerDesc(
        name="head",
        count=1,
        params=[("norm.weight", (D,)), ("output.weight", (V, D))],
        tp_plan=[(r"output\.weight", "vocab")],
        fwd=Work(2 * D * V * T, s * T * 2 * D + 4 * 3 * T * V, 8),
        bwd_input=Work(2 * D * V * T, s * T * 2 * D + 4 * 2 * T * V, 8),
        bwd_weight=Work(2 * D * V * T, 0.0, 2),
        fwd_split=Work(2 * D * V * T, 4 * 3 * T * V, 0),
        bwd_input_split=Work(2 * D * V * T, 4 * 2 * T * V, 0),
        bwd_weight_split=Work(2 * D * V * T, 0.0, 0),
        # the norm's input and output, and the fp32 logits for the loss's backward
        act_bytes=2 * s * T * D + 4 * T * V,
        act_split=4 * T * V,
        out_bytes=4.0,
        wgrad_bytes=s * T * (D + V),
        wgrad_split=s * T * V,
        tp_enter=1,
        sp_param_numel=D,
        tp_extra=(("pmax", "fwd", 4 * T), ("psum", "fwd", 8 * T)),
        loss=True,
    )
    return ModelDesc(
        name=name,
        seq_len=T,
        hidden=D,
        dtype=dtype,
        layers=(embed, block, head),
        tp_divides=(n_heads, n_kv_heads),
        published_params=published_params,
    )


# Published configs (Meta's model cards / params.json; GPT-3 from Brown et al. 2020 Table 2.1).
_LLAMA: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        published_params=8_030_000_000,
    ),
    "llama3-70b": dict(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=128256,
        published_params=70_600_000_000,
    ),
    "llama3-405b": dict(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
        published_params=405_000_000_000,
    ),
    "llama2-7b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
        vocab_size=32000,
        published_params=6_740_000_000,
    ),
    "llama2-70b": dict(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=32000,
        published_params=68_980_000_000,
    ),
}
PRESETS: tuple[str, ...] = tuple(_LLAMA)


def get_model(name: str, *, seq_len: int = 8192, dtype: str = "bfloat16") -> ModelDesc:
    """A preset by name (:data:`PRESETS`), at ``seq_len`` tokens per sample.

    Raises:
      DescriptionError: an unknown name (the presets are listed).
    """
    key = name.lower().replace("_", "-")
    if key not in _LLAMA:
        raise DescriptionError(
            f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
            f"(or build one with describe_llama / describe_transformer)"
        )
    return describe_llama(name=key, seq_len=seq_len, dtype=dtype, **_LLAMA[key])


def model_from_dict(data: Mapping[str, Any]) -> ModelDesc:
    """A :class:`ModelDesc` from plain data (e.g. JSON), naming the first bad field.

    ``{"name", "seq_len", "hidden", "dtype", "layers": [{"name", "count", "params":
    [[path, [sizes]], ...], "tp_plan": [[regex, style], ...], "fwd": {"flops", "bytes",
    "ops"}, ...}], "tp_divides": [...]}``; fields of :class:`LayerDesc` may be left out
    where they have defaults.

    Raises:
      DescriptionError: a missing or unknown field, or a bad value.
    """
    if not isinstance(data, Mapping):
        raise DescriptionError(f"model description must be a mapping, got {type(data).__name__}")
    top = {f.name for f in attrs.fields(ModelDesc)}
    name = data.get("name", "?")
    for key in data:
        if key not in top:
            raise DescriptionError(f"model {name!r}: unknown field {key!r}; fields are {sorted(top)}")
    for key in ("name", "seq_len", "hidden", "dtype", "layers"):
        if key not in data:
            raise DescriptionError(f"model {name!r}: missing field {key!r}")
    if not isinstance(data["layers"], Sequence) or isinstance(data["layers"], (str, bytes)):
        raise DescriptionError(f"model {name!r}: layers must be a list of layer descriptions")
    layer_fields = {f.name: f for f in attrs.fields(LayerDesc)}
    layers = []
    for i, ld in enumerate(data["layers"]):
        where = f"model {name!r}: layers[{i}]"
        if not isinstance(ld, Mapping):
            raise DescriptionError(f"{where} must be a mapping, got {type(ld).__name__}")
        kw = {}
        for key, value in ld.items():
            if key not in layer_fields:
                raise DescriptionError(f"{where}: unknown field {key!r}; fields are {sorted(layer_fields)}")
            if key in ("fwd", "bwd_input", "bwd_weight", "fwd_split", "bwd_input_split", "bwd_weight_split"):
                value = _work_from_dict(f"{where}.{key}", value)
            if key == "experts" and value is not None:
                value = _experts_from_dict(f"{where}.experts", value)
            kw[key] = value
        for key in ("name", "count", "params", "fwd", "bwd_input", "bwd_weight"):
            if key not in kw:
                raise DescriptionError(f"{where}: missing field {key!r}")
        try:
            for j, entry in enumerate(kw["params"]):  # noqa: B007 - j names the entry in the error
                path, shape = entry
                [int(d) for d in shape]
        except (TypeError, ValueError):
            raise DescriptionError(f"{where}.params[{j}] must be [path, [sizes...]], got {entry!r}") from None
        kw.setdefault("tp_plan", ())
        layers.append(LayerDesc(**kw))
    return ModelDesc(**{**data, "layers": layers})


def _experts_from_dict(where: str, value: Any) -> Experts:
    fields = {f.name for f in attrs.fields(Experts)}
    if not isinstance(value, Mapping) or set(value) - fields or not {"n_experts", "top_k"} <= set(value):
        raise DescriptionError(f"{where} must be a mapping with n_experts, top_k and fields of {sorted(fields)}")
    kw = dict(value)
    for f in ("fwd", "bwd_input", "bwd_weight"):
        if f in kw:
            kw[f] = _work_from_dict(f"{where}.{f}", kw[f])
    return Experts(**kw)


def _work_from_dict(where: str, value: Any) -> Work:
    """A :class:`~fshard.plan.trace.Work` from its JSON mapping (``flops``, ``bytes``, ``ops``),
    or a DescriptionError naming ``where``."""
    if not isinstance(value, Mapping) or set(value) - {"flops", "bytes", "ops"}:
        raise DescriptionError(f"{where} must be a mapping with flops, bytes, ops; got {value!r}")
    return Work(**value)
