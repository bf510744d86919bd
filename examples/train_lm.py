"""Train a character-level Transformer language model with fshard, on any mesh.

One process (CPU or one GPU), about half a minute on two CPU cores::

    python examples/train_lm.py

Several processes: one flag for the layout, axes pp (pipeline), dp (replicate), fsdp
(shard), cp (context: sequences split), ep (experts, with --moe) and tp (tensor), any product
equal to the ranks::

    torchrun --nproc-per-node 4 examples/train_lm.py                      # fsdp=4
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=2,fsdp=2   # HSDP
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh fsdp=2,tp=2   # FSDP x Megatron TP
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh pp=2,fsdp=2   # 1F1B pipeline x FSDP
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh pp=2,tp=2 --schedule zbv --layers 4
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh ep=2,fsdp=2 --moe 4  # dropless experts
    python examples/train_lm.py --simulate 4 --mesh dp=2,fsdp=2        # 4 ranks in one process

``--jit`` compiles the whole step (forward, backward, clipping, AdamW, collectives) with
``fs.jit``: ``--mesh fsdp=2 --jit`` (Inductor), ``--jit aot_eager`` (no code generation).
``--data`` reads a text file, uint16 token shards (nanoGPT's train.bin/val.bin) or a saved
``datasets`` dataset, ``--tokenizer`` a local Hugging Face tokenizer (docs/data.md).

The parameters are a pytree of DTensors laid out by specs ``P(...)`` on a named mesh. The
step and the loop are the library's (``fs.recipes.train`` over ``fs.recipes.transformer``;
``fs.recipes.planning`` for ``--mesh auto``); this file is the command line. The batch of
step ``s`` depends only on ``--seed`` and ``s`` and every mesh starts from the same values,
so the loss curve is the same on every mesh (``--dtype float64``: to 1e-9), and a
checkpoint written on one mesh resumes exactly on any other.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch
import torch.distributed as dist

import fshard as fs
from fshard.models import TransformerConfig, generate
from fshard.parallel.layout import Layout
from fshard.recipes import Injection, planning
from fshard.recipes.data import CharCorpus, Corpus, padded_vocab  # noqa: F401 (CharCorpus: callers use train_lm.CharCorpus)
from fshard.recipes.metrics import mfu_for
from fshard.recipes.pipeline import gather_full
from fshard.recipes.sinks import Logs
from fshard.recipes.trainer import ConfigError, TrainConfig, train  # noqa: F401 (callers: train_lm.ConfigError)
from fshard.sched.registry import resolve_name

DATA = Path(__file__).resolve().parent / "data" / "kjv_shakespeare.txt"

# Mesh axes, outermost first. The order is fixed whatever order --mesh names them in:
# the innermost axes get the closest ranks (same host, NVLink), where traffic is highest.
AXES = ("pp", "dp", "fsdp", "cp", "ep", "tp")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags; defaults train a small model in well under a minute on 2 CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=fs.recipes.cli.HelpFormatter)
    run = p.add_argument_group("layout")
    run.add_argument("--mesh", default=None, help="axis=size,... over all ranks, axes pp, dp, fsdp, cp, ep, tp; e.g. "
                     "dp=2,fsdp=2; 'auto': the planner (fs.plan) picks the layout (default: every rank on fsdp)")
    run.add_argument("--simulate", type=int, default=None, metavar="N", help="run N ranks in this one process "
                     "(fs.simulate): the same loss curve as `torchrun --nproc-per-node N`")
    run.add_argument("--machine", default=None, help="machine for the planner: h100, a100 or a machine file "
                     "(default: this host's, from fs.plan.calibrate, measured on first use and saved)")
    run.add_argument("--schedule", default="1f1b", help="pipeline schedule with pp: gpipe, 1f1b, interleaved, bfs, "
                     "zb, zbh2, zbv, dualpipev (python -m fshard.sched --list)")
    run.add_argument("--virtual", type=int, default=None, help="stages per rank (default: the schedule's, 1 or 2)")
    run.add_argument("--microbatches", type=int, default=None, help="per step: pipeline microbatches with pp "
                     "(default 2 x pp), else gradient accumulation steps (default 1)")
    run.add_argument("--remat", action="store_true", help="recompute each block in backward")
    run.add_argument("--sequence-parallel", action="store_true",
                     help="with tp: each tp rank keeps 1/tp of a microbatch's rows between TP regions")
    run.add_argument("--jit", nargs="?", const="inductor", default=None, metavar="BACKEND",
                     help="compile the train step with fs.jit (one graph, compiled at the first step); BACKEND is "
                          "torch.compile's: inductor (the default), aot_eager or none (the captured graph "
                          "uncompiled); the losses equal the eager step's")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                     help="bfloat16 = bf16 compute and gathers over fp32 master weights")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=500, help="total optimizer steps")
    train.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    train.add_argument("--seq-len", type=int, default=64, help="tokens (characters by default) per sequence")
    train.add_argument("--lr", type=float, default=1e-2, help="peak learning rate")
    train.add_argument("--warmup", type=int, default=20, help="linear warmup steps")
    train.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    train.add_argument("--fused-optimizer", action="store_true", help="AdamW on torch's fused kernel (eager only)")
    train.add_argument("--grad-clip", type=float, default=1.0, help="max global norm (0: off)")
    train.add_argument("--seed", type=int, default=0, help="seeds the init, the data order and the sample")
    train.add_argument("--skip-nonfinite", action="store_true", help="skip (do not apply) a step whose loss or "
                       "gradients are not finite, and say so; default: stop, naming the step and the parameter")
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=64, help="model width (a multiple of --heads)")
    model.add_argument("--layers", type=int, default=2, help="blocks; a pipeline needs one per stage at least: "
                       "zbv, dualpipev and interleaved on pp=2 need 4")
    model.add_argument("--heads", type=int, default=4, help="attention heads (with tp: a multiple of tp)")
    model.add_argument("--moe", type=int, default=None, metavar="N", help="each block's MLP as N dropless "
                       "experts, top-2 (fs.recipes.MoE), split over an ep axis if the mesh has one")
    fs.recipes.data.add_flags(p, DATA)  # --data, --tokenizer, --val-fraction, --vocab-size
    io = p.add_argument_group("input and output")
    io.add_argument("--sample-chars", type=int, default=300, help="characters to generate at the end (0: none)")
    io.add_argument("--prompt", default="And God said", help="start of the generated sample")
    p.add_argument_group("testing aids").add_argument(
        "--inject-nonfinite", default=None, metavar="STEP[:WHERE[:VALUE]]", help="at STEP, make the loss (WHERE="
        "loss) or the gradient of parameter WHERE (e.g. layers.1.feed_forward.w2.weight) nan or inf (VALUE)")
    fs.recipes.cli.add_common_flags(p)
    args = fs.recipes.cli.parse(p, argv)  # --config, --threads, the checkpoint flags' checks
    if args.simulate is not None and (args.simulate < 1 or args.mesh == "auto" or args.jit):
        p.error("--simulate N needs N >= 1, and neither --mesh auto (it measures real links) nor --jit")
    if args.fused_optimizer and (args.jit or args.simulate is not None):  # both run fs.optim's chain instead
        p.error("--fused-optimizer steps eagerly on torch's fused AdamW; --jit and --simulate run the chain: drop one")
    if args.moe and args.jit:  # the split sizes are read on the host
        p.error("--moe runs eagerly: --jit cannot hold the dropless dispatch's host sync")
    try:
        resolve_name(args.schedule)
    except ValueError as e:
        p.error(f"--schedule: {e}")
    try:
        args.inject_nonfinite = Injection.parse(args.inject_nonfinite)
    except ValueError as e:
        p.error(f"--inject-nonfinite: {e}")
    for flag in ("steps", "batch_size", "seq_len", "microbatches", "virtual", "dim", "layers", "heads", "moe"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def parse_mesh(text: str | None, world_size: int) -> dict[str, int]:
    """``"dp=2,fsdp=2"`` -> ``{"dp": 2, "fsdp": 2}`` in :data:`AXES` order (``fs.recipes.cli.mesh_flag``)."""
    return fs.recipes.cli.mesh_flag(text, world_size, AXES, "examples/train_lm.py")


def lr_schedule(args: argparse.Namespace) -> fs.optim.Schedule:
    """Linear warmup from a tenth of ``--lr`` to ``--lr``, then cosine decay back to a tenth."""
    return fs.optim.warmup_cosine_decay_schedule(
        init_value=args.lr / 10, peak_value=args.lr, warmup_steps=min(args.warmup, args.steps - 1),
        decay_steps=args.steps, end_value=args.lr / 10)


def make_optimizer(args: argparse.Namespace) -> fs.optim.GradientTransformation:
    """AdamW on the schedule above (``--fused-optimizer``: torch's kernel), sharded like the params."""
    return fs.optim.adamw(lr_schedule(args), b1=0.9, b2=0.95, weight_decay=args.weight_decay, fused=args.fused_optimizer)


def model_config(args: argparse.Namespace, corpus: Corpus) -> TransformerConfig:
    return TransformerConfig(vocab_size=padded_vocab(corpus.vocab_size), dim=args.dim, n_layers=args.layers,
                             n_heads=args.heads, max_seq_len=args.seq_len)


def plan_layout(args: argparse.Namespace, shape: dict[str, int], microbatches: int) -> Layout:
    """The flags as an ``fs.parallel.Layout`` (the recipes', the planner's)."""
    return Layout(shape, batch=args.batch_size, microbatches=microbatches, schedule=args.schedule,
                  virtual=args.virtual, remat=args.remat, sequence_parallel=args.sequence_parallel, dtype=args.dtype)


def choose_layout(args: argparse.Namespace, world: int, corpus: Corpus, say: Any) -> None:
    """``--mesh auto``: sets the layout flags to the planner's best layout for ``world`` ranks."""
    cfg, moe = model_config(args, corpus), fs.recipes.MoE(args.moe) if args.moe else None
    lay, why = planning.auto_layout(cfg, plan_layout(args, {"fsdp": world}, 1), world, planning.machine(
        args.machine, world, cfg), axes=AXES, seq_len=args.seq_len, moe=moe)
    args.mesh = ",".join(f"{a}={n}" for a, n in lay.shape.items() if a in AXES)
    args.microbatches, args.remat, args.sequence_parallel = lay.microbatches, lay.remat, lay.sequence_parallel
    args.schedule, args.virtual = lay.schedule, lay.virtual
    say(f"--mesh auto: {why}")


def train_config(args: argparse.Namespace) -> TrainConfig:
    hint = "the flags it was trained with (--dim, --layers, --heads, --seq-len, --data), or another --checkpoint-dir"
    ck = fs.recipes.cli.checkpoint_config(args, hint)
    return TrainConfig(args.steps, seed=args.seed, max_norm=args.grad_clip, jit_backend=args.jit,
                       skip_nonfinite=args.skip_nonfinite, stop_at=args.stop_at, checkpoint=ck,
                       log_every=args.log_every, progress=not args.quiet, val_every=args.val_every,
                       val_batches=args.val_batches, profile=bool(args.log_json or args.mesh == "auto"))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Trains; returns the per-step records (the same on every rank).

    Callable from Python too, e.g. ``fs.run_local(main, ["--mesh", "fsdp=2"], world_size=2)``.
    """
    args = parse_args(argv)
    with fs.runtime.started(args.simulate):  # torchrun's group (nccl/gloo), none, or --simulate's N ranks
        return run(args)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank0 = fs.runtime.is_rank0()
    say = fs.recipes.cli.printer(args)  # rank 0, every rank with --all-ranks, or nowhere with --quiet
    config = train_config(args)  # before --mesh auto rewrites args.mesh: it decides the profiling
    corpus = fs.recipes.data.from_args(args)  # a text, token shards or a saved dataset; train and val splits
    if args.mesh == "auto":  # the planner picks mesh, schedule, microbatches, remat and SP for this machine
        choose_layout(args, world, corpus, say)
    mesh = fs.make_mesh(parse_mesh(args.mesh, world))
    cfg = model_config(args, corpus)
    microbatches = args.microbatches or (2 * mesh.shape["pp"] if "pp" in mesh.shape else 1)
    layout = plan_layout(args, dict(mesh.shape), microbatches)
    moe = fs.recipes.MoE(args.moe) if args.moe else None
    n_params = fs.recipes.model.count_params(cfg, moe)
    say(f"mesh {dict(mesh.shape)} on {world} rank(s), {args.dtype}; {n_params:,} parameters; "
        f"{corpus.describe()}")
    logs = Logs.from_flags(args, enabled=rank0)  # --log-json, --tensorboard, --plot: rank 0 writes
    mfu, mfu_line = mfu_for(cfg, args.seq_len, args.dtype, args.machine, world, moe)
    say(mfu_line)  # against the machine file's peak, or how to get one (no calibration here)
    val_at = (lambda i: corpus.batch(i, args.batch_size, args.seq_len, args.seed, split="val")) \
        if args.val_every else None
    result = train(fs.recipes.transformer(cfg, moe), layout, make_optimizer(args),
                   fs.recipes.data.batches_from_args(corpus, args, layout, mesh), config, mesh=mesh,
                   meta=attrs.asdict(cfg), lr_at=lr_schedule(args), inject=args.inject_nonfinite, say=say,
                   val_batch_at=val_at, logs=logs, mfu=mfu)
    records = result.records
    if result.probe is not None and records and not args.simulate:  # the prediction next to the measurement
        machine = planning.machine(args.machine, world, cfg)
        pred = planning.predicted_vs_measured(cfg, layout, machine, result.probe, records, seq_len=args.seq_len,
                                              moe=moe)
        records[-1].update(pred)
        result.summary.update(pred)  # the log's last line: the summary record
        say(planning.prediction_line(records[-1]))
    logs.close(result.summary)  # the summary record (with the prediction), the plot
    if records:
        say(f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} over steps "
            f"{records[0]['step']}-{records[-1]['step']}")
    if args.sample_chars and not args.quiet and corpus.tokenizer is not None and not moe:  # generate(): dense
        full = gather_full(result.params, result.composed.pipe)  # collective: every rank takes part, rank 0 samples
        if rank0:
            ids = generate(full, cfg, corpus.encode(args.prompt), args.sample_chars, seed=args.seed,
                           n_real=corpus.vocab_size)
            say("-" * 60 + "\n" + corpus.decode(ids) + "\n" + "-" * 60)
    return records


if __name__ == "__main__":
    fs.recipes.run_script(main, "train_lm.py")
