"""Train a character-level Transformer language model with fshard, on any mesh.

One process (CPU or one GPU), about half a minute on two CPU cores::

    python examples/train_lm.py

Several processes: one flag for the layout, axes pp (pipeline), dp (replicate),
fsdp (shard) and tp (tensor parallel), any product equal to the number of ranks::

    torchrun --nproc-per-node 4 examples/train_lm.py                      # fsdp=4
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh dp=2,fsdp=2   # HSDP
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh fsdp=2,tp=2   # FSDP x Megatron TP
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh pp=2,fsdp=2   # 1F1B pipeline x FSDP
    torchrun --nproc-per-node 4 examples/train_lm.py --mesh pp=2,tp=2 --schedule zbv --layers 4

``--jit`` compiles the train step with ``fs.jit`` (forward, backward, gradient clipping,
AdamW and the collectives as one graph; the first step traces and compiles it)::

    torchrun --nproc-per-node 2 examples/train_lm.py --mesh fsdp=2 --jit            # Inductor
    torchrun --nproc-per-node 2 examples/train_lm.py --mesh fsdp=2 --jit aot_eager  # no codegen
    torchrun --nproc-per-node 2 examples/train_lm.py --mesh pp=2 --jit              # a pipeline: the
        # compute between its point-to-point transfers compiled, the transfers run in order

The model is fshard's pure-function Transformer (``fshard.models``); the parameters are
a pytree of DTensors laid out by specs ``P(...)`` on a named mesh; the step is one
per-device function run by ``fs.shard_map`` (FSDP's gathers and reductions in
``fs.parallel.scan_layers``, TP's collectives in ``fs.parallel.tp``), or, with pp, by
``fs.sched.pipeline_step`` following a schedule. The global batch of step ``s`` depends
only on ``--seed`` and ``s``, and every mesh starts from the same initial values, so the
loss curve is the same on every mesh (to rounding: ``--dtype float64`` agrees to 1e-9),
and a checkpoint written on one mesh resumes exactly on any other.

The step itself is the library's (``fshard.recipes``: the layout's roles, the Transformer
as a ``LayeredModel``, the train, pipeline and ``fs.jit`` steps); this file is the command
line around it (the corpus, the progress bar and the gathering of a sharded model for
sampling are ``fshard.recipes``' too). Top to bottom: command line, optimizer, checkpoints,
sampling, the planner, and ``main``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import torch
import torch.distributed as dist

import fshard as fs
from fshard.models import TransformerConfig, transformer_apply, transformer_init
from fshard.parallel.layout import Layout, LayoutError
from fshard.recipes import Injection, LayeredModel, NonFiniteError, Pipeline, Roles, TrainStep
from fshard.recipes.data import CharCorpus, DataError, padded_vocab
from fshard.recipes.pipeline import gather_full
from fshard.recipes.progress import Progress, write_log
from fshard.recipes.roles import check_batch
from fshard.recipes.step import init_params, make_jit_train_step, make_pipeline_step, make_train_step, param_order
from fshard.sched.registry import resolve_name

DATA = Path(__file__).resolve().parent / "data" / "kjv_shakespeare.txt"

# Mesh axes, outermost first. The order is fixed whatever order --mesh names them in:
# the innermost axes get the closest ranks (same host, NVLink), where traffic is highest.
AXES = ("pp", "dp", "fsdp", "tp")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class ConfigError(LayoutError):
    """Flags that do not fit together (or this world size); reported without a traceback, as
    the recipes' own ``LayoutError`` is."""


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags; defaults train a small model in well under a minute on 2 CPU cores."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run = p.add_argument_group("layout")
    run.add_argument("--mesh", default=None,
                     help="axis=size,... over all ranks, axes pp, dp, fsdp, tp; e.g. fsdp=4, dp=2,fsdp=2, "
                          "fsdp=2,tp=2, pp=2,fsdp=2; 'auto': the planner (fs.plan) picks the layout "
                          "(default: every rank on fsdp)")
    run.add_argument("--machine", default=None,
                     help="machine for the planner's prediction: h100, a100 or a machine file (default: this "
                          "host's, from fs.plan.calibrate, measured on first use and saved)")
    run.add_argument("--schedule", default="1f1b",
                     help="pipeline schedule when the mesh has pp: gpipe, 1f1b, interleaved, bfs, "
                          "zb, zbh2, zbv, dualpipev (python -m fshard.sched --list)")
    run.add_argument("--virtual", type=int, default=None,
                     help="pipeline stages per rank (default: the schedule's own, 1 or 2)")
    run.add_argument("--microbatches", type=int, default=None,
                     help="microbatches per step: pipeline microbatches with pp (default 2 x pp), "
                          "else gradient accumulation (default 1)")
    run.add_argument("--remat", action="store_true", help="recompute each block in backward")
    run.add_argument("--sequence-parallel", action="store_true",
                     help="with tp: split the activations between TP regions over the sequence")
    run.add_argument("--jit", nargs="?", const="inductor", default=None, metavar="BACKEND",
                     help="compile the train step with fs.jit: one graph (forward, backward, clipping, AdamW, "
                          "collectives), traced and compiled at the first step; BACKEND is torch.compile's: "
                          "inductor (the default), aot_eager (no code generation, faster to compile) or none "
                          "(run the captured graph uncompiled: checks the capture). The "
                          "losses equal the eager step's. Not with pp (not capturable yet)")
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
    train.add_argument("--skip-nonfinite", action="store_true",
                       help="skip a step whose loss or gradients are NaN or infinite (no update; the optimizer's "
                            "step count stays), and say so; default: stop with the step and the first "
                            "non-finite gradient's parameter path")
    model = p.add_argument_group("model")
    model.add_argument("--dim", type=int, default=64)
    model.add_argument("--layers", type=int, default=2,
                       help="blocks; a pipeline needs one per stage at least: zbv, dualpipev and "
                            "interleaved on pp=2 need 4")
    model.add_argument("--heads", type=int, default=4)
    io = p.add_argument_group("input and output")
    io.add_argument("--data", default=str(DATA), help="a UTF-8 text file")
    io.add_argument("--checkpoint-dir", default=None, help="save params, optimizer state and step here")
    io.add_argument("--checkpoint-every", type=int, default=0, help="also save every N steps (0: at the end only)")
    io.add_argument("--async-checkpoint", action="store_true",
                    help="write the --checkpoint-every checkpoints in the background while training goes on "
                         "(the last one is complete before the script exits)")
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
    aid = p.add_argument_group("testing aids")
    aid.add_argument("--inject-nonfinite", default=None, metavar="STEP[:WHERE[:VALUE]]",
                     help="testing aid: at STEP, make the loss (WHERE=loss, the default) or the gradient of the "
                          "parameter WHERE (a path such as layers.1.feed_forward.w2.weight) NaN (VALUE=nan, "
                          "the default) or inf, to see what --skip-nonfinite and the default stop do")
    args = p.parse_args(argv)
    if args.checkpoint_every and not args.checkpoint_dir:
        p.error("--checkpoint-every needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    try:
        resolve_name(args.schedule)
    except ValueError as e:
        p.error(f"--schedule: {e}")
    try:
        args.inject_nonfinite = Injection.parse(args.inject_nonfinite)
    except ValueError as e:
        p.error(f"--inject-nonfinite: {e}")
    for flag in ("steps", "batch_size", "seq_len", "microbatches", "virtual", "dim", "layers", "heads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def parse_mesh(text: str | None, world_size: int) -> dict[str, int]:
    """``"dp=2,fsdp=2"`` -> ``{"dp": 2, "fsdp": 2}`` in :data:`AXES` order.

    Raises:
      ConfigError: bad syntax, an unknown or repeated axis, or sizes whose product is not
        the world size.
    """
    if not text:
        return {"fsdp": world_size}
    try:
        shape = fs.parallel.layout.parse_mesh(text, AXES)
    except LayoutError as e:
        raise ConfigError(f"--mesh {e}") from None
    if math.prod(shape.values()) != world_size:
        n = math.prod(shape.values())
        raise ConfigError(f"--mesh {text}: the sizes multiply to {n}, but {world_size} rank(s) run this; "
                          f"launch {n} with `torchrun --nproc-per-node {n} examples/train_lm.py --mesh {text}`")
    return shape


# ---------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------


def lr_schedule(args: argparse.Namespace) -> fs.optim.Schedule:
    """Linear warmup from a tenth of ``--lr`` to ``--lr``, then cosine decay back to a tenth."""
    return fs.optim.warmup_cosine_decay_schedule(
        init_value=args.lr / 10, peak_value=args.lr, warmup_steps=min(args.warmup, args.steps - 1),
        decay_steps=args.steps, end_value=args.lr / 10)


def make_optimizer(args: argparse.Namespace) -> fs.optim.GradientTransformation:
    """AdamW on the schedule above; its state is sharded exactly like the parameters."""
    return fs.optim.adamw(lr_schedule(args), b1=0.9, b2=0.95, weight_decay=args.weight_decay)


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------


def save_checkpoint(path: str, params: Any, opt_state: Any, step: int, cfg: TransformerConfig, *,
                    blocking: bool = True) -> None:
    """Every rank writes its own shards; a crash mid-save keeps the previous checkpoint.

    ``blocking=False`` returns once the values are copied to CPU memory and writes in the
    background; the next save (or load) waits for it.
    """
    fs.checkpoint.save(path, {"params": params, "opt": opt_state, "step": step,
                              "model": attrs.asdict(cfg)}, blocking=blocking)


def load_checkpoint(path: str, params: Any, opt_state: Any, cfg: TransformerConfig) -> tuple[Any, Any, int]:
    """Reads a checkpoint onto this run's mesh (it may have been written on another one).

    Raises:
      ConfigError: the checkpoint holds another model (checked first, from its small
        ``model`` entry): the message names each differing field with both values.
      fs.checkpoint.CheckpointError: the checkpoint is incomplete or corrupt; the message
        names the data file and the key.
    """
    want = attrs.asdict(cfg)
    saved_model = fs.checkpoint.load(path, like={"model": want})["model"]
    if saved_model != want:
        diff = ", ".join(f"{k} {saved_model.get(k)!r} (this run: {want.get(k)!r})"
                         for k in sorted(set(want) | set(saved_model)) if saved_model.get(k) != want.get(k))
        raise ConfigError(f"--resume: the checkpoint at {path} holds another model: {diff}. Give the flags "
                          f"it was trained with (--dim, --layers, --heads, --seq-len, --data), or another "
                          f"--checkpoint-dir. The checkpoint is left as it is.")
    like = {"params": params, "opt": opt_state, "step": 0}
    saved = fs.checkpoint.load(path, like=like)
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
             seed: int, n_real: int, temperature: float = 0.8) -> list[int]:
    """Samples ``n_new`` ids after ``prompt`` from full (gathered) parameters, on one rank.

    Only the first ``n_real`` ids are characters; the padding ids are never drawn.
    """
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt) or [0]
    for _ in range(n_new):
        context = torch.tensor([ids[-cfg.max_seq_len:]])                        # (1, t)
        logits = transformer_apply(params, context, cfg)[0, -1, :n_real].float()  # (n_real,)
        probs = torch.softmax(logits / temperature, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return ids


# ---------------------------------------------------------------------------
# The planner (fs.plan): --mesh auto, and its prediction next to the measurement
# ---------------------------------------------------------------------------


def plan_machine(args: argparse.Namespace, world: int, cfg: TransformerConfig | None = None) -> fs.plan.Machine:
    """``--machine``, else this host's machine file, else a quick calibration (saved) whose
    compute efficiency is fitted on ``cfg``'s block.

    Rank 0 decides and its machine goes to every rank, so all ranks plan alike.
    """
    machine = None
    if args.machine:
        machine = fs.plan.get_machine(args.machine)
    elif not dist.is_initialized() or dist.get_rank() == 0:
        path = fs.plan.default_machine_path()
        machine = fs.plan.load_machine(path) if path.exists() else None
    if world > 1:
        box = [machine]
        dist.broadcast_object_list(box, src=0)
        machine = box[0]
    if machine is None:  # collective: every rank measures at once
        machine = fs.plan.calibrate(fs.make_mesh({"ranks": world}), quick=True, block=cfg)
    return machine


def plan_layout(args: argparse.Namespace, shape: dict[str, int], microbatches: int) -> Layout:
    """The flags as an ``fs.parallel.Layout`` (the recipes', the planner's)."""
    return Layout(shape, batch=args.batch_size, microbatches=microbatches, schedule=args.schedule,
                  virtual=args.virtual, remat=args.remat, sequence_parallel=args.sequence_parallel, dtype=args.dtype)


def choose_layout(args: argparse.Namespace, world: int, corpus: CharCorpus) -> None:
    """``--mesh auto``: sets the layout flags to the planner's best layout for ``world`` ranks."""
    cfg = model_config(args, corpus)
    machine = plan_machine(args, world, cfg)
    model = fs.plan.describe_transformer(cfg, seq_len=args.seq_len, dtype=args.dtype)
    found = fs.plan.search(model, machine, world, args.batch_size, axes=AXES, dtype=args.dtype)
    if found.best is None:
        raise ConfigError(f"--mesh auto: no layout of {world} rank(s) fits --batch-size {args.batch_size} "
                          f"in {machine.memory_bytes / 2**30:.1f} GiB per rank")
    lay = found.best.layout
    args.mesh = ",".join(f"{a}={n}" for a, n in lay.shape.items() if a in AXES)
    args.microbatches, args.remat, args.sequence_parallel = lay.microbatches, lay.remat, lay.sequence_parallel
    args.schedule, args.virtual = lay.schedule, lay.virtual
    if not dist.is_initialized() or dist.get_rank() == 0:
        if not args.quiet:
            print(f"--mesh auto: {lay.label()} (best of {found.considered} layouts on {machine.name}): "
                  f"{found.best.explain()}")


def predicted_vs_measured(args: argparse.Namespace, cfg: TransformerConfig, shape: dict[str, int],
                          microbatches: int, probe: fs.plan.StepProbe,
                          records: list[dict[str, Any]]) -> dict[str, Any]:
    """``predicted_step_s``, ``measured_step_s`` (median after the warm-up), ``predicted_peak_mib``
    and ``measured_peak_mib`` (one profiled step), for the last log record."""
    machine = plan_machine(args, dist.get_world_size() if dist.is_initialized() else 1, cfg)
    try:
        est = fs.plan.estimate(fs.plan.describe_transformer(cfg, seq_len=args.seq_len, dtype=args.dtype),
                               machine, plan_layout(args, shape, microbatches))
    except fs.plan.LayoutError as e:  # a layout the planner does not model: measure only
        est = None
        logging.getLogger(__name__).warning("fs.plan: no prediction: %s", e)
    peak = probe.summary([r["step_time_s"] for r in records])
    if dist.is_initialized() and peak["measured_peak_mib"] is not None:  # the largest rank, as predicted
        t = torch.tensor([peak["measured_peak_mib"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak["measured_peak_mib"] = float(t)
    return {"predicted_step_s": est and est.step_s, "measured_step_s": peak["measured_step_s"],
            "predicted_peak_mib": est and est.peak_bytes / 2**20, "measured_peak_mib": peak["measured_peak_mib"],
            "predicted_breakdown_s": est and est.breakdown, "plan_layout": est and est.layout.label(),
            "plan_machine": machine.name}


def prediction_line(r: dict[str, Any]) -> str:
    def fmt(key: str, spec: str, unit: str) -> str:
        return "n/a" if r[key] is None else f"{r[key]:{spec}} {unit}"
    return (f"fs.plan: step predicted {fmt('predicted_step_s', '.4f', 's')}, measured "
            f"{fmt('measured_step_s', '.4f', 's')} (median after warm-up); peak memory per rank predicted "
            f"{fmt('predicted_peak_mib', '.1f', 'MiB')}, measured {fmt('measured_peak_mib', '.1f', 'MiB')}")


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def train_loop(args: argparse.Namespace, corpus: CharCorpus, step_fn: TrainStep, params: Any, opt_state: Any,
               steps: range, device: torch.device, progress: Progress,
               cfg: TransformerConfig, say: Callable[..., None] = print) -> tuple[Any, Any, list[dict[str, Any]]]:
    """Runs ``steps``; returns the final params and optimizer state, and one record per step.

    Raises:
      NonFiniteError: a step's loss or gradients were not finite, without --skip-nonfinite;
        the message names the step and the first non-finite gradient.
    """
    lr_at = lr_schedule(args)  # for the log; the optimizer counts its own steps
    tokens_per_step = args.batch_size * args.seq_len
    records: list[dict[str, Any]] = []
    for step in steps:
        tokens, targets = corpus.batch(step, args.batch_size, args.seq_len, args.seed)
        args.inject_nonfinite.current = step + 1
        t0 = time.perf_counter()
        params, opt_state, loss, grad_norm, bad = step_fn(params, opt_state, tokens.to(device), targets.to(device))
        loss_value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)  # waits for the step
        dt = time.perf_counter() - t0
        records.append({"step": step + 1, "loss": loss_value, "tokens_per_s": tokens_per_step / dt,
                        "lr": float(lr_at(step)), "grad_norm": grad_norm, "step_time_s": dt})
        if bad is not None:
            if not args.skip_nonfinite:
                raise NonFiniteError(f"step {step + 1}: {bad}; stopped before the update (--skip-nonfinite "
                                     f"skips such steps instead)")
            records[-1]["skipped"] = str(bad)
            say(f"step {step + 1}: skipped (--skip-nonfinite): {bad}; the parameters and the optimizer "
                f"state are left as they were")
        progress.update(records[-1])
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 < steps.stop:
            save_checkpoint(args.checkpoint_dir, params, opt_state, step + 1, cfg, blocking=not args.async_checkpoint)
    return params, opt_state, records


def model_config(args: argparse.Namespace, corpus: CharCorpus) -> TransformerConfig:
    return TransformerConfig(vocab_size=padded_vocab(corpus.vocab_size), dim=args.dim, n_layers=args.layers,
                             n_heads=args.heads, max_seq_len=args.seq_len)


def configure(args: argparse.Namespace, mesh: fs.Mesh,
              corpus: CharCorpus) -> tuple[TransformerConfig, Roles, LayeredModel, Pipeline | None, int]:
    """The model's shapes and this run's layout: ``(cfg, roles, model, pipeline or None, microbatches)``.

    Raises:
      LayoutError: flags that do not fit together or this mesh.
    """
    cfg = model_config(args, corpus)
    microbatches = args.microbatches or (2 * mesh.shape["pp"] if "pp" in mesh.shape else 1)
    layout = plan_layout(args, dict(mesh.shape), microbatches)
    layout.validate()
    roles = Roles.of(layout, mesh)  # the mesh keeps size-1 axes (--mesh fsdp=1,tp=2): their roles too
    model = fs.recipes.transformer(cfg)(roles)
    check_batch(args.batch_size, microbatches, mesh, roles)
    pipe = (Pipeline.build(args.schedule, mesh, cfg.n_layers, microbatches, args.virtual, model)
            if roles.pp_axis else None)
    return cfg, roles, model, pipe, microbatches


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Trains; returns the per-step records (the same on every rank).

    Callable from Python too, e.g. ``fs.run_local(main, ["--mesh", "fsdp=2"], world_size=2)``.
    """
    args = parse_args(argv)
    fs.init()  # torchrun's environment -> process group (nccl on GPUs, gloo on CPUs); no-op alone
    world = dist.get_world_size() if dist.is_initialized() else 1
    auto = args.mesh == "auto"
    if auto:  # the planner picks mesh, schedule, microbatches, remat and SP for this machine
        choose_layout(args, world, CharCorpus.load(args.data))
    mesh = fs.make_mesh(parse_mesh(args.mesh, world))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    say = print if rank0 and not args.quiet else (lambda *a, **k: None)

    corpus = CharCorpus.load(args.data)
    cfg, roles, model, pipe, microbatches = configure(args, mesh, corpus)

    params, specs = init_params(model, roles, args.seed, pipe)
    opt = make_optimizer(args)
    opt_state = opt.init(params)
    start = 0
    if args.resume and has_checkpoint(args.checkpoint_dir):
        params, opt_state, start = load_checkpoint(args.checkpoint_dir, params, opt_state, cfg)
        say(f"resumed from {args.checkpoint_dir} at step {start}")
    elif args.resume:
        say(f"no checkpoint in {args.checkpoint_dir} yet: starting from step 0")
    order = param_order(model)  # "the first" non-finite gradient: in this order
    paths = list(order)
    with torch.device("meta"):
        n_params = sum(x.numel() for x in fs.tree.leaves(transformer_init(cfg, 0)))
    inject = args.inject_nonfinite
    if inject.where != "loss" and inject.where not in order:
        raise ConfigError(f"--inject-nonfinite: no parameter {inject.where!r}; parameters are e.g. "
                          f"{', '.join(paths[:3])}")
    say(f"mesh {dict(mesh.shape)} on {world} rank(s), {args.dtype}; {n_params:,} parameters; "
        f"{len(corpus.ids):,} characters, vocabulary {corpus.vocab_size}")
    if args.jit:
        step_fn = make_jit_train_step(model, roles, specs, opt, microbatches, args.grad_clip, inject, order,
                                      args.jit, pipe)
        say(f"fs.jit (backend {args.jit}): the first step traces and compiles the train step")
    elif pipe is not None:
        say(f"pipeline: schedule {pipe.schedule.name!r}, {pipe.schedule.n_stages} stages, "
            f"{microbatches} microbatches; blocks per stage {[list(b) for b in pipe.layers]}")
        step_fn = make_pipeline_step(model, roles, pipe, opt, args.grad_clip, inject, order)
    else:
        step_fn = make_train_step(model, roles, specs, opt, microbatches, args.grad_clip, inject, order)
    probe = fs.plan.StepProbe(warmup=min(2, args.steps // 3)) if (args.log_json or auto) else None
    step_fn = probe.wrap(step_fn) if probe is not None else step_fn  # one step's peak memory, profiled
    end = min(args.steps, args.stop_at) if args.stop_at is not None else args.steps
    progress = Progress(start, args.steps, rank0 and not args.quiet, args.log_every)
    params, opt_state, records = train_loop(args, corpus, step_fn, params, opt_state, range(start, end),
                                            mesh.device, progress, cfg, say)
    progress.close()

    if args.checkpoint_dir and end > start:
        save_checkpoint(args.checkpoint_dir, params, opt_state, end, cfg)
        say(f"checkpoint: {args.checkpoint_dir} (step {end})")
    if probe is not None and records:  # the planner's prediction next to what this run measured
        records[-1].update(predicted_vs_measured(args, cfg, dict(mesh.shape), microbatches, probe, records))
        say(prediction_line(records[-1]))
    if args.log_json and rank0:
        write_log(args.log_json, records)
    if records:
        say(f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} over steps "
            f"{records[0]['step']}-{records[-1]['step']}")
    if args.sample_chars and not args.quiet:
        full = gather_full(params, pipe)  # collective: every rank takes part, rank 0 samples
        if rank0:
            ids = generate(full, cfg, corpus.encode(args.prompt), args.sample_chars, seed=args.seed,
                           n_real=corpus.vocab_size)
            say("-" * 60 + "\n" + corpus.decode(ids) + "\n" + "-" * 60)
    return records


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    try:
        main()
    except (LayoutError, DataError, NonFiniteError, fs.checkpoint.CheckpointError) as e:
        # Every rank raises these alike (the checkpoint's checks agree across ranks), so
        # one line from rank 0 says it all.
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"train_lm.py: error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, (LayoutError, DataError)) else 1)
    except Exception as e:
        # Under torchrun, the error file puts this traceback in its report (what @record
        # does). Not for a rank that only lost a peer: torchrun stops such ranks with
        # SIGTERM, and a file cut short by it crashes torchrun's report.
        if not fs.runtime.failure.is_peer_lost(e):
            get_error_handler().record_exception(e)
        raise
    # Only after a clean run: after an error, other ranks may be gone, and this rank must
    # exit (and fs.init's hook say why) without waiting on them. fs.shutdown(), not
    # dist.destroy_process_group(): the meshes hold the groups, whose gloo threads must be
    # joined before the interpreter finalizes (docs/reliability.md, "The abort at exit").
    fs.shutdown()
