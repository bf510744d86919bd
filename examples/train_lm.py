"""Train a character-level Transformer language model with fshard, on any mesh.

One process (CPU or one GPU)::

    python examples/train_lm.py

Several processes, one flag for the layout (axes: dp = replicate, fsdp = shard)::

    torchrun --nproc-per-node 4 examples/train_lm.py                     # fsdp=4
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=2,fsdp=2  # HSDP
    torchrun --nproc-per-node 2 examples/train_lm.py --mesh dp=2         # DDP

The model is fshard's pure-function Transformer (``fshard.models``); the parameters are
a pytree of DTensors laid out by specs ``P(...)`` on a named mesh; the step is one
per-device function run by ``fs.shard_map``, with FSDP's gathers and reductions in
``fs.parallel.scan_layers``. The global batch of step ``s`` depends only on ``--seed``
and ``s``, and every mesh starts from the same initial values, so the loss curve is
the same on every mesh (to rounding: ``--dtype float64`` agrees to 1e-9).

Everything a reader needs is in this file, top to bottom: command line, data, layout
(the "plan"), per-device loss, train step, checkpoints, sampling, and ``main``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs
from fshard import P
from fshard.models import TransformerConfig, block, embed, head, transformer_apply, transformer_init

DATA = Path(__file__).resolve().parent / "data" / "kjv_shakespeare.txt"

# Mesh axes, outermost first. The order is fixed whatever order --mesh names them in:
# the innermost axes get the closest ranks (same host, NVLink), where traffic is highest.
AXES = ("pp", "dp", "fsdp", "tp")
AVAILABLE = ("dp", "fsdp")  # tp and pp arrive with fshard.parallel.tp and fs.sched.pipeline_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags; defaults train a small model in well under a minute on 2 CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run = p.add_argument_group("layout")
    run.add_argument("--mesh", default=None,
                     help="axis=size,... over all ranks, e.g. fsdp=4, dp=2,fsdp=2, dp=2 "
                          "(default: every rank on fsdp)")
    run.add_argument("--schedule", default="1f1b", help="pipeline schedule when the mesh has pp")
    run.add_argument("--microbatches", type=int, default=1,
                     help="microbatches per step (pipeline microbatches with pp, else "
                          "gradient accumulation)")
    run.add_argument("--remat", action="store_true", help="recompute each block in backward")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                     help="bfloat16 = bf16 compute and gathers over fp32 master weights")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=500, help="total optimizer steps")
    train.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    train.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    train.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    train.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--grad-clip", type=float, default=1.0, help="max global norm (0: off)")
    train.add_argument("--seed", type=int, default=0, help="seeds the init, the data order and the sample")
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=64)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    io = p.add_argument_group("input and output")
    io.add_argument("--data", default=str(DATA), help="a UTF-8 text file")
    io.add_argument("--checkpoint-dir", default=None, help="save params, optimizer state and step here")
    io.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: at the end only)")
    io.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir if it holds a checkpoint")
    io.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                    help="end this run after STEP (saving a checkpoint), as a preempted job would; "
                         "--resume goes on to --steps with the same schedule")
    io.add_argument("--log-json", default=None, metavar="PATH",
                    help="write the per-step records (step, loss, tokens_per_s, lr, ...) as a JSON list")
    io.add_argument("--log-every", type=int, default=25, help="print a line every N steps without tqdm")
    io.add_argument("--sample-chars", type=int, default=300, help="characters to generate at the end (0: none)")
    io.add_argument("--prompt", default="And God said", help="start of the generated sample")
    io.add_argument("--quiet", action="store_true", help="no progress output and no sample")
    args = p.parse_args(argv)
    if args.checkpoint_every and not args.checkpoint_dir:
        p.error("--checkpoint-every needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    for flag in ("steps", "batch_size", "seq_len", "microbatches", "dim", "layers", "heads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def parse_mesh(text: str | None, world_size: int) -> dict[str, int]:
    """``"dp=2,fsdp=2"`` -> ``{"dp": 2, "fsdp": 2}`` in :data:`AXES` order.

    Raises:
      ValueError: bad syntax, an unknown or repeated axis, sizes whose product is not
        the world size, or an axis whose support has not landed yet.
    """
    if not text:
        return {"fsdp": world_size}
    shape: dict[str, int] = {}
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: expected axis=size items like 'dp=2,fsdp=2', got {item!r}")
        if name not in AXES:
            raise ValueError(f"--mesh {text!r}: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if name in shape:
            raise ValueError(f"--mesh {text!r}: axis {name!r} given twice")
        shape[name] = int(size)
    if math.prod(shape.values()) != world_size:
        raise ValueError(f"--mesh {text!r}: the sizes multiply to {math.prod(shape.values())}, but "
                         f"there are {world_size} ranks (torchrun --nproc-per-node {world_size})")
    missing = [a for a in shape if a not in AVAILABLE]
    if missing:
        raise NotImplementedError(
            f"--mesh {text!r}: {' and '.join(missing)} is not available yet in this example "
            f"(tensor parallelism waits for fshard.parallel.tp, pipelines for "
            f"fs.sched.pipeline_step); use the axes {', '.join(AVAILABLE)}")
    return {a: shape[a] for a in AXES if a in shape}


# ---------------------------------------------------------------------------
# Data: characters of one text file, batches that do not depend on the mesh
# ---------------------------------------------------------------------------


@attrs.frozen
class CharCorpus:
    """A text as a 1-d tensor of character ids; the vocabulary is its sorted characters."""

    ids: torch.Tensor
    chars: str

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharCorpus":
        text = Path(path).read_text(encoding="utf-8")
        chars = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(chars)}
        return cls(torch.tensor([lookup[c] for c in text], dtype=torch.int64), chars)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        # Characters the corpus lacks are dropped rather than mapped to a fake id.
        return [self.chars.index(c) for c in text if c in self.chars]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``batch_size`` random windows and their next characters.

        The windows come from a generator seeded with ``(seed, step)`` alone, so every rank
        draws the same global batch on every mesh, and a resumed run continues exactly
        where the interrupted one would have gone. shard_map then gives each data-parallel
        rank its rows.
        """
        if len(self.ids) <= seq_len:
            raise ValueError(f"the corpus has {len(self.ids)} characters; --seq-len {seq_len} needs more")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.ids) - seq_len, (batch_size,), generator=g)
        windows = torch.stack([self.ids[s:s + seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------
# Layout: which mesh axis does what
# ---------------------------------------------------------------------------


@attrs.frozen
class Plan:
    """How the parameters and the batch are laid out on the mesh.

    Attributes:
      mesh: the named mesh.
      shard_axis: the axis parameters are sharded over (FSDP), or None.
      replicate_axis: the axis parameters are replicated over with gradients all-reduced
        (DDP; with ``shard_axis`` that is HSDP), or None.
      data_axes: the axes the batch's rows are split over.
      policy: mixed precision for the gathers and the compute (None: the masters' dtype).
      remat: recompute blocks in backward instead of keeping their activations.
    """

    mesh: fs.Mesh
    shard_axis: str | None
    replicate_axis: str | None
    data_axes: tuple[str, ...]
    policy: fs.Policy | None
    remat: bool

    @classmethod
    def for_mesh(cls, mesh: fs.Mesh, compute_dtype: torch.dtype, master_dtype: torch.dtype,
                 remat: bool) -> "Plan":
        axes = mesh.axis_names
        # With only dp the parameters are replicated (DDP); fsdp alone or with dp shards them.
        shard = "fsdp" if "fsdp" in axes else None
        replicate = "dp" if "dp" in axes else None
        data = tuple(a for a in ("dp", "fsdp") if a in axes)
        policy = None
        if compute_dtype != master_dtype:
            # Gather and compute in bf16, reduce gradients in the masters' precision.
            policy = fs.Policy(param_dtype=compute_dtype, reduce_dtype=master_dtype)
        return cls(mesh, shard, replicate, data, policy, remat)

    @property
    def group_axes(self) -> dict[str, Any]:
        """The keyword arguments of ``gather_params`` and ``scan_layers``."""
        return dict(axis=self.shard_axis, replicate_axis=self.replicate_axis, policy=self.policy)

    def param_specs(self, params: Any) -> Any:
        """One ``P`` per parameter: FSDP shards dim 0 (uneven sizes are padded), DDP replicates."""
        if self.shard_axis is None:
            return fs.parallel.replicate_specs(params)
        return fs.parallel.fsdp_specs(params, self.shard_axis)

    @property
    def batch_spec(self) -> fs.PartitionSpec:
        """Rows of the batch split over every data axis."""
        return P(self.data_axes)


def init_params(cfg: TransformerConfig, plan: Plan, seed: int, dtype: torch.dtype) -> tuple[Any, Any]:
    """The parameters of ``transformer_init(cfg, seed)``, built directly as shards.

    Returns:
      ``(params, specs)``: a pytree of DTensors equal, on every mesh, to the one-process
      init; and their specs.
    """
    def init_fn(s: int) -> Any:
        return transformer_init(cfg, s, dtype=dtype)

    with torch.device("meta"):  # shapes only, for the spec rules: no memory, no RNG
        shapes = init_fn(seed)
    specs = plan.param_specs(shapes)
    return fs.init_sharded(init_fn, specs, plan.mesh, seed, uneven=True), specs


# ---------------------------------------------------------------------------
# The per-device loss and the train step
# ---------------------------------------------------------------------------


def per_device_loss(params: Any, tokens: torch.Tensor, targets: torch.Tensor, *,
                    cfg: TransformerConfig, plan: Plan) -> torch.Tensor:
    """Mean next-character loss of the global batch, computed from this rank's rows.

    Runs inside ``shard_map``: ``params`` are local shards and ``tokens``/``targets``
    this rank's rows. The embeddings and head (the "root" group) are gathered once and
    kept; each block is gathered just before use with the next one prefetched, and
    its gradients are reduce-scattered as soon as backward produces them.
    """
    root = fs.parallel.gather_params({k: v for k, v in params.items() if k != "layers"}, **plan.group_axes)
    x = embed(root, tokens, cfg)                                                      # (b, T, D)
    x = fs.parallel.scan_layers(lambda layer, h: block(layer, h, cfg), params["layers"], x,
                                remat=plan.remat, **plan.group_axes)                  # (b, T, D)
    logits = head(root, x, cfg)                                                       # (b, T, V)
    # The softmax in at least fp32, whatever the compute dtype.
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return fs.lax.pmean(loss, plan.data_axes)  # every data rank holds the same number of rows


def lr_schedule(args: argparse.Namespace) -> fs.optim.Schedule:
    """Linear warmup from a tenth of ``--lr`` to ``--lr``, then cosine decay back to a tenth."""
    return fs.optim.warmup_cosine_decay_schedule(
        init_value=args.lr / 10, peak_value=args.lr, warmup_steps=min(args.warmup, args.steps - 1),
        decay_steps=args.steps, end_value=args.lr / 10)


def make_optimizer(args: argparse.Namespace) -> fs.optim.GradientTransformation:
    """AdamW on the schedule above, after clipping the global gradient norm."""
    adamw = fs.optim.adamw(lr_schedule(args), b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    if args.grad_clip > 0:
        return fs.optim.chain(fs.optim.clip_by_global_norm(args.grad_clip), adamw)
    return adamw


TrainStep = Callable[[Any, Any, torch.Tensor, torch.Tensor], tuple[Any, Any, torch.Tensor]]


def make_train_step(cfg: TransformerConfig, plan: Plan, specs: Any,
                    opt: fs.optim.GradientTransformation, microbatches: int) -> TrainStep:
    """``step(params, opt_state, tokens, targets) -> (params, opt_state, loss)`` on global values.

    With ``microbatches > 1`` the global batch is cut into that many slices (the same
    slices on every mesh), their gradients summed and averaged: gradient accumulation.
    """
    def loss_fn(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return per_device_loss(params, tokens, targets, cfg=cfg, plan=plan)

    sharded_loss = fs.shard_map(loss_fn, mesh=plan.mesh, out_specs=P(),
                                in_specs=(specs, plan.batch_spec, plan.batch_spec))
    grad_fn = fs.value_and_grad(sharded_loss)

    def step(params: Any, opt_state: Any, tokens: torch.Tensor, targets: torch.Tensor):
        loss, grads = accumulate(grad_fn, params, tokens.chunk(microbatches), targets.chunk(microbatches))
        with fs.optim.donate():  # the old params and state are not used again: update in place
            updates, opt_state = opt.update(grads, opt_state, params)
            params = fs.optim.apply_updates(params, updates)
        return params, opt_state, loss

    return step


def accumulate(grad_fn: Callable, params: Any, tokens: Sequence[torch.Tensor],
               targets: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any]:
    """Mean loss and mean gradients over microbatches (one backward each)."""
    total_loss, total_grads = None, None
    for tok, tgt in zip(tokens, targets):
        loss, grads = grad_fn(params, tok, tgt)
        if total_grads is None:
            total_loss, total_grads = loss, grads
        else:
            total_loss = total_loss + loss
            total_grads = fs.tree.tree_map(torch.add, total_grads, grads)
    n = len(tokens)
    if n == 1:
        return total_loss, total_grads
    return total_loss / n, fs.tree.tree_map(lambda g: g / n, total_grads)


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------


def save_checkpoint(path: str, params: Any, opt_state: Any, step: int, cfg: TransformerConfig) -> None:
    """Every rank writes its own shards; a crash mid-save keeps the previous checkpoint."""
    fs.checkpoint.save(path, {"params": params, "opt": opt_state, "step": step,
                              "model": attrs.asdict(cfg)})


def load_checkpoint(path: str, params: Any, opt_state: Any, cfg: TransformerConfig) -> tuple[Any, Any, int]:
    """Reads a checkpoint onto this run's mesh (it may have been written on another one).

    Raises:
      ValueError: the checkpoint holds another model shape.
    """
    like = {"params": params, "opt": opt_state, "step": 0, "model": attrs.asdict(cfg)}
    saved = fs.checkpoint.load(path, like=like)
    if saved["model"] != attrs.asdict(cfg):
        raise ValueError(f"--resume: the checkpoint at {path} is of model {saved['model']}, "
                         f"this run builds {attrs.asdict(cfg)}")
    return saved["params"], saved["opt"], int(saved["step"])


def has_checkpoint(path: str) -> bool:
    try:
        fs.checkpoint.read_metadata(path)
        return True
    except fs.checkpoint.CheckpointNotFoundError:
        return False


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


@torch.no_grad()
def generate(params: Any, cfg: TransformerConfig, prompt: list[int], n_new: int, *,
             seed: int, temperature: float = 0.8) -> list[int]:
    """Samples ``n_new`` ids after ``prompt`` from full (gathered) parameters, on one rank."""
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt) or [0]
    for _ in range(n_new):
        context = torch.tensor([ids[-cfg.max_seq_len:]])                        # (1, t)
        logits = transformer_apply(params, context, cfg)[0, -1].float()         # (V,)
        probs = torch.softmax(logits / temperature, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return ids


# ---------------------------------------------------------------------------
# Output on rank 0
# ---------------------------------------------------------------------------


class Progress:
    """A tqdm bar with loss and throughput if tqdm is installed, else a line every few steps."""

    def __init__(self, start: int, total: int, enabled: bool, every: int) -> None:
        self.enabled, self.every, self.total = enabled, max(1, every), total
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            self.bar.update(1)
        elif record["step"] % self.every == 0 or record["step"] == self.total:
            print(f"step {record['step']:>5}/{self.total}  loss {record['loss']:.4f}  "
                  f"{record['tokens_per_s']:,.0f} tokens/s  lr {record['lr']:.2e}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_log(path: str, records: list[dict[str, Any]]) -> None:
    """Writes the records as one JSON list, atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Trains; returns the per-step records (the same on every rank).

    Callable from Python too, e.g. ``fs.run_local(main, ["--mesh", "fsdp=2"], world_size=2)``.
    """
    args = parse_args(argv)
    fs.init()  # torchrun's environment -> process group (nccl on GPUs, gloo on CPUs); no-op alone
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = fs.make_mesh(parse_mesh(args.mesh, world))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    say = print if rank0 and not args.quiet else (lambda *a, **k: None)

    corpus = CharCorpus.load(args.data)
    cfg = TransformerConfig(vocab_size=corpus.vocab_size, dim=args.dim, n_layers=args.layers,
                            n_heads=args.heads, max_seq_len=args.seq_len)
    compute_dtype = DTYPES[args.dtype]
    master_dtype = torch.float32 if compute_dtype == torch.bfloat16 else compute_dtype
    plan = Plan.for_mesh(mesh, compute_dtype, master_dtype, args.remat)
    check_batch(args, mesh, plan)

    params, specs = init_params(cfg, plan, args.seed, master_dtype)
    opt = make_optimizer(args)
    opt_state = opt.init(params)
    lr_at = lr_schedule(args)  # for the log; the optimizer counts its own steps
    start = 0
    if args.resume and has_checkpoint(args.checkpoint_dir):
        params, opt_state, start = load_checkpoint(args.checkpoint_dir, params, opt_state, cfg)
        say(f"resumed from {args.checkpoint_dir} at step {start}")
    elif args.resume:
        say(f"no checkpoint in {args.checkpoint_dir} yet: starting from step 0")
    n_params = sum(math.prod(x.shape) for x in fs.tree.leaves(params))
    say(f"mesh {dict(mesh.shape)} on {world} rank(s), {args.dtype}; {n_params:,} parameters; "
        f"{len(corpus.ids):,} characters, vocabulary {corpus.vocab_size}")

    step_fn = make_train_step(cfg, plan, specs, opt, args.microbatches)
    tokens_per_step = args.batch_size * args.seq_len
    records: list[dict[str, Any]] = []
    progress = Progress(start, args.steps, rank0 and not args.quiet, args.log_every)
    end = min(args.steps, args.stop_at) if args.stop_at is not None else args.steps
    for step in range(start, end):
        tokens, targets = corpus.batch(step, args.batch_size, args.seq_len, args.seed)
        t0 = time.perf_counter()
        params, opt_state, loss = step_fn(params, opt_state, tokens.to(mesh.device), targets.to(mesh.device))
        loss_value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)  # waits for the step
        dt = time.perf_counter() - t0
        records.append({"step": step + 1, "loss": loss_value, "tokens_per_s": tokens_per_step / dt,
                        "lr": float(lr_at(step)), "step_time_s": dt})
        progress.update(records[-1])
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < end:
            save_checkpoint(args.checkpoint_dir, params, opt_state, step + 1, cfg)
    progress.close()

    if args.checkpoint_dir and end > start:
        save_checkpoint(args.checkpoint_dir, params, opt_state, end, cfg)
        say(f"checkpoint: {args.checkpoint_dir} (step {end})")
    if args.log_json and rank0:
        write_log(args.log_json, records)
    if records:
        say(f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} over steps "
            f"{records[0]['step']}-{records[-1]['step']}")
    if args.sample_chars and not args.quiet:
        full = fs.gather(params)  # collective: every rank takes part, rank 0 samples
        if rank0:
            ids = generate(full, cfg, corpus.encode(args.prompt), args.sample_chars, seed=args.seed)
            say("-" * 60 + "\n" + corpus.decode(ids) + "\n" + "-" * 60)
    return records


def check_batch(args: argparse.Namespace, mesh: fs.Mesh, plan: Plan) -> None:
    """Every microbatch must split evenly over the data-parallel ranks.

    Raises:
      ValueError: naming the batch, the microbatches and the data ranks.
    """
    n_data = mesh.axis_size(plan.data_axes) if plan.data_axes else 1
    if args.batch_size % (args.microbatches * n_data):
        raise ValueError(
            f"--batch-size {args.batch_size} must be a multiple of --microbatches {args.microbatches} "
            f"x {n_data} data-parallel ranks ({' x '.join(plan.data_axes) or 'none'})")


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
