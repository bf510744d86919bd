"""The training loop around a composed step: resume, steps, non-finite steps, checkpoints,
validation, metrics and logs.

:func:`train` is what a training script calls once its model, layout, optimizer and data
are known: it composes the step (:func:`~fshard.recipes.step.compose_train_step`), builds
or resumes the state, runs the steps with a progress display, skips or stops at a step that
is not finite, and saves checkpoints. ``examples/train_lm.py`` is a command line over it;
``examples/train_custom.py`` calls it for a model of its own.

Checkpoints hold ``{"params", "opt", "step", "model"}``: ``model`` is the caller's ``meta``
(a small dict describing the model, e.g. ``attrs.asdict(cfg)``), compared before anything
else is read, so that resuming another model's checkpoint is refused with the differing
fields named and the checkpoint left untouched.

Each step makes one record (:class:`TrainResult`'s ``records``): its loss, a windowed token
rate, MFU, peak memory, elapsed time, ETA and, every ``val_every`` steps, the validation
loss (:mod:`fshard.recipes.metrics`, :mod:`fshard.recipes.validate`). Rank 0 shows them
(:mod:`fshard.recipes.progress`) and hands them to the caller's sinks as they are made
(:mod:`fshard.recipes.sinks`: JSON lines, TensorBoard, a plot); the run ends with a summary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import attrs
import torch

from fshard import checkpoint as ckpt
from fshard.mesh.mesh import Mesh
from fshard.optim.base import GradientTransformation
from fshard.parallel.layout import Layout
from fshard.recipes.errors import ConfigError
from fshard.recipes.faults import Injection, NonFiniteError
from fshard.recipes.metrics import MFU, Meter, peak_memory, summarize, summary_table
from fshard.recipes.model import ModelLike
from fshard.recipes.progress import Progress
from fshard.recipes.step import ComposedStep, compose_train_step
from fshard.runtime.process import is_rank0

if TYPE_CHECKING:  # sinks and validate import this module's ConfigError
    from fshard.recipes.sinks import Logs

__all__ = ["CheckpointConfig", "ConfigError", "TrainConfig", "TrainResult", "train"]

# step -> (inputs, targets): the global batch of that step (the same on every rank).
BatchAt = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def _resume_mode(_: Any, attribute: Any, value: Any) -> None:
    if value not in (False, True, "auto"):
        raise ConfigError(f"CheckpointConfig(resume={value!r}): must be True, False or 'auto'")


@attrs.frozen
class CheckpointConfig:
    """Where and when :func:`train` saves, and whether it resumes.

    Attributes:
      directory: the checkpoint's directory (None: no checkpoints).
      every: also save every this many steps (0: at the end only).
      background: write the periodic saves in the background while training goes on (the
        last save is complete before :func:`train` returns).
      resume: ``True``: continue from the checkpoint in ``directory`` (an error if there is
        none); ``"auto"``: continue if there is one, else start from step 0; ``False``: start
        from step 0, and an existing checkpoint in ``directory`` is an error unless
        ``overwrite``.
      hint: what the user should give when the checkpoint holds another model (the end of
        that error's message), e.g. the command line's flags.
      overwrite: start from step 0 and replace an existing checkpoint.
    """

    directory: str | None = None
    every: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    background: bool = False
    resume: bool | str = attrs.field(default=False, validator=_resume_mode)
    hint: str = "the settings it was trained with, or another checkpoint directory"
    overwrite: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.every or self.resume or self.overwrite) and not self.directory:
            raise ConfigError(
                f"CheckpointConfig(every={self.every}, resume={self.resume!r}, overwrite={self.overwrite}) "
                f"needs a directory"
            )
        if self.resume and self.overwrite:
            raise ConfigError(f"CheckpointConfig(resume={self.resume!r}, overwrite=True): give one of them")


@attrs.frozen
class TrainConfig:
    """The loop's settings (the layout and the optimizer are :func:`train`'s arguments).

    Attributes:
      steps: the run's total optimizer steps (a resumed run goes on to this many).
      seed: seeds the initial parameters.
      max_norm: clip the gradients' global norm to this (0: no clipping).
      jit_backend: compile the step with ``fs.jit`` and this ``torch.compile`` backend.
      skip_nonfinite: skip (do not apply) a step whose loss or gradients are not finite,
        and go on; default: raise :class:`~fshard.recipes.faults.NonFiniteError`.
      stop_at: end this run after this step (saving a checkpoint), as a preempted job would.
      checkpoint: where and when to save.
      log_every: print a line every this many steps (with a tqdm bar too on a terminal).
      progress: show progress (rank 0).
      profile: measure one step's peak memory and the median step time
        (``fs.plan.StepProbe``; the result's ``probe``).
      val_every: with :func:`train`'s ``val_batch_at``, the validation loss every this many
        steps and at the run's last step (0: at the last step only).
      val_batches: the held-out batches each validation averages over (``val_batch_at(0)``
        .. ``val_batch_at(val_batches - 1)``: the same ones every time).
      rate_window: ``tokens_per_s`` and the ETA are over the last this many steps.
    """

    steps: int = attrs.field(validator=attrs.validators.ge(1))
    seed: int = 0
    max_norm: float = 0.0
    jit_backend: str | None = None
    skip_nonfinite: bool = False
    stop_at: int | None = None
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_every: int = 25
    progress: bool = True
    profile: bool = False
    val_every: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    val_batches: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    rate_window: int = attrs.field(default=20, validator=attrs.validators.ge(1))


@attrs.frozen
class TrainResult:
    """What :func:`train` ran: the final state, one record per step run, and the step's pieces.

    Attributes:
      params, opt_state: the state after the last step.
      records: per step ``{"step", "loss", "tokens_per_s", "lr", "grad_norm",
        "step_time_s", "elapsed_s", "eta_s", "peak_mem_mib", "peak_mem_kind"}``, ``"mfu"``
        with ``train``'s ``mfu``, ``"val_loss"`` at a validation step, ``"skipped"`` for a
        skipped step. ``loss``, ``val_loss``, ``lr`` and ``grad_norm`` are the same on every
        rank; ``tokens_per_s`` (over the last ``rate_window`` steps' own time) and the
        timings and memory are this rank's (``peak_mem_kind``:
        :func:`fshard.recipes.metrics.peak_memory`).
      start, end: the steps run are ``start + 1 .. end`` (``start`` > 0 after a resume).
      composed: the :class:`~fshard.recipes.step.ComposedStep` (roles, pipeline, ...).
      probe: the ``fs.plan.StepProbe`` with ``config.profile``, else None.
      summary: the run's figures (:func:`fshard.recipes.metrics.summarize`: final and best
        validation loss, mean tokens/s and MFU, peak memory, elapsed time).
    """

    params: Any
    opt_state: Any
    records: list[dict[str, Any]]
    start: int
    end: int
    composed: ComposedStep
    probe: Any = None
    summary: dict[str, Any] = attrs.field(factory=dict)


def _quiet(*_: Any, **__: Any) -> None:
    pass


def train(
    model: ModelLike,
    layout: Layout,
    optimizer: GradientTransformation,
    batch_at: BatchAt,
    config: TrainConfig,
    *,
    mesh: Mesh | None = None,
    meta: dict[str, Any] | None = None,
    lr_at: Callable[[int], Any] | None = None,
    inject: Injection | None = None,
    say: Callable[..., None] = _quiet,
    val_batch_at: BatchAt | None = None,
    logs: Logs | None = None,
    mfu: MFU | None = None,
) -> TrainResult:
    """Trains ``model`` on ``layout`` for ``config.steps`` steps (collective: every rank calls it).

    Args:
      model: a ``LayeredModel``, or ``roles -> LayeredModel`` (``fs.recipes.transformer(cfg)``).
      layout: the ``fs.parallel.Layout``; ``layout.batch`` is the global batch per step.
      optimizer: an ``fs.optim`` transformation.
      batch_at: ``step -> (inputs, targets)``, the global batch of step ``step`` (0-based).
      config: the loop's settings.
      mesh: the mesh (default ``layout.mesh()``).
      meta: a small dict describing the model, saved with checkpoints and compared on resume.
      lr_at: ``step -> learning rate``, for the records (the optimizer counts its own steps).
      inject: a testing aid: make the loss or one gradient non-finite at a step.
      say: where messages go (rank 0's ``print``; default: nowhere), the summary table too.
      val_batch_at: ``i -> (inputs, targets)``, held-out batch ``i`` (of ``layout.batch``
        rows, as ``batch_at``'s); validation every ``config.val_every`` steps and at the
        end (:func:`fshard.recipes.validate.make_eval_loss`: forward only, a ``ModuleModel``
        in eval mode, or the pipeline's step with its gradients dropped). None: no validation.
      logs: where the records go as they are made (rank 0's :class:`~fshard.recipes.sinks.Logs`;
        a flush at the end, the caller closes it with the summary).
      mfu: the model's FLOPs per token and the peak (:func:`fshard.recipes.metrics.mfu_for`);
        None: no MFU.

    Returns:
      a :class:`TrainResult`.

    Raises:
      LayoutError: the layout does not fit the mesh, the model or the batch.
      ConfigError: ``inject`` names no parameter of the model, or the checkpoint being
        resumed holds another model (each differing field named; the checkpoint is kept),
        or ``val_batch_at`` is given for a model validation does not run on yet.
      NonFiniteError: a step was not finite and ``config.skip_nonfinite`` is off; the
        message names the step and the first non-finite gradient's parameter path.
      fs.checkpoint.CheckpointError: the checkpoint is incomplete or corrupt.
    """
    inject = inject or Injection()
    composed = compose_train_step(
        model, layout, optimizer, mesh=mesh, max_norm=config.max_norm, jit_backend=config.jit_backend, inject=inject
    )
    if inject.where != "loss" and inject.where not in composed.order:
        raise ConfigError(
            f"inject: no parameter {inject.where!r}; parameters are e.g. {', '.join(list(composed.order)[:3])}"
        )
    eval_loss = None
    if val_batch_at is not None:  # before anything runs: a model it cannot evaluate is refused
        from fshard.recipes.validate import make_eval_loss

        eval_loss = make_eval_loss(composed, layout.microbatches)
    params, opt_state = composed.init_state(config.seed)
    start, ck = 0, config.checkpoint
    if _resumes(ck):
        params, opt_state, start = _load(ck, params, opt_state, meta or {})
        say(f"resumed from {ck.directory} at step {start}")
    elif ck.resume == "auto":
        say(f"no checkpoint in {ck.directory} yet: starting from step 0 (resume auto)")
    _announce(composed, layout, config, say)
    step_fn, probe = composed.step, None
    if config.profile:
        from fshard.plan.probe import StepProbe  # the planner's measuring aid: only when asked

        probe = StepProbe(warmup=min(2, config.steps // 3))
        step_fn = probe.wrap(step_fn)  # one step's peak memory, profiled
    end = min(config.steps, config.stop_at) if config.stop_at is not None else config.steps
    # Rank 0 alone: every rank's records are the same (the loss is global), and N bars fill a log.
    progress = Progress(start, config.steps, config.progress and is_rank0(), config.log_every)
    device = composed.roles.mesh.device
    loop = _Loop(
        step_fn,
        batch_at,
        config,
        meta or {},
        lr_at,
        inject,
        say,
        Meter(config.rate_window, end),
        mfu,
        val_batch_at,
        eval_loss,
        logs,
    )
    if logs is not None:
        logs.begin(start)
    try:
        params, opt_state, records = loop.run(params, opt_state, range(start, end), device, progress)
    finally:  # what was written reaches the disk, also after an error
        progress.close()
        if logs is not None:
            logs.flush()
    if ck.directory and end > start:
        _save(ck.directory, params, opt_state, end, meta or {})
        say(f"checkpoint: {ck.directory} (step {end})")
    summary = summarize(records, loop.tokens, mfu, device, time.perf_counter() - loop.meter.t0)
    say(summary_table(summary))
    return TrainResult(params, opt_state, records, start, end, composed, probe, summary)


def _announce(composed: ComposedStep, layout: Layout, config: TrainConfig, say: Callable[..., None]) -> None:
    if config.jit_backend:
        say(f"fs.jit (backend {config.jit_backend}): the first step traces and compiles the train step")
    elif composed.pipe is not None:
        pipe = composed.pipe
        say(
            f"pipeline: schedule {pipe.schedule.name!r}, {pipe.schedule.n_stages} stages, "
            f"{layout.microbatches} microbatches; blocks per stage {[list(b) for b in pipe.layers]}"
        )


@attrs.define
class _Loop:
    step_fn: Callable[..., Any]
    batch_at: BatchAt
    config: TrainConfig
    meta: dict[str, Any]
    lr_at: Callable[[int], Any] | None
    inject: Injection
    say: Callable[..., None]
    meter: Meter
    mfu: MFU | None = None
    val_batch_at: BatchAt | None = None
    eval_loss: Callable[[Any, torch.Tensor, torch.Tensor], float] | None = None
    logs: Logs | None = None
    tokens: int = 0  # per step: the global batch's tokens

    def run(
        self, params: Any, opt_state: Any, steps: range, device: torch.device, progress: Progress
    ) -> tuple[Any, Any, list[dict[str, Any]]]:
        records: list[dict[str, Any]] = []
        ck = self.config.checkpoint
        for step in steps:
            inputs, targets = self.batch_at(step)
            self.inject.current = step + 1
            t0 = time.perf_counter()
            params, opt_state, loss, grad_norm, bad = self.step_fn(
                params, opt_state, inputs.to(device), targets.to(device)
            )
            loss_value = float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)  # waits for the step
            dt = time.perf_counter() - t0
            self.tokens = inputs.numel()
            record = self.record(step + 1, loss_value, grad_norm, dt, device)
            records.append(record)
            if bad is not None:
                if not self.config.skip_nonfinite:
                    self.log(record, progress)  # the failed step's record is in the log too
                    raise NonFiniteError(
                        f"step {step + 1}: {bad}; stopped before the update (skip_nonfinite skips such steps instead)"
                    )
                record["skipped"] = str(bad)
                self.say(
                    f"step {step + 1}: skipped (skip_nonfinite): {bad}; the parameters and the optimizer "
                    f"state are left as they were"
                )
            if self.eval_loss is not None and self.validates(step + 1, steps.stop):
                record["val_loss"] = self.validate(params, device)
            self.log(record, progress)
            if ck.every and (step + 1) % ck.every == 0 and step + 1 < steps.stop:
                assert ck.directory is not None  # CheckpointConfig's check
                _save(ck.directory, params, opt_state, step + 1, self.meta, blocking=not ck.background)
        return params, opt_state, records

    def record(self, step: int, loss: float, grad_norm: float, dt: float, device: torch.device) -> dict[str, Any]:
        timing = self.meter.step(step, self.tokens, dt)
        r: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "lr": None if self.lr_at is None else float(self.lr_at(step - 1)),
            "grad_norm": grad_norm,
            "step_time_s": dt,
            **timing,
        }
        if self.mfu is not None:
            r["mfu"] = self.mfu.of(timing["tokens_per_s"])
        r["peak_mem_mib"], r["peak_mem_kind"] = peak_memory(device)
        return r

    def validates(self, step: int, last: int) -> bool:
        return step == last or bool(self.config.val_every and step % self.config.val_every == 0)

    def validate(self, params: Any, device: torch.device) -> float:
        """The mean loss over the held-out batches (collective; no update)."""
        assert self.eval_loss is not None and self.val_batch_at is not None
        losses = []
        for i in range(self.config.val_batches):
            inputs, targets = self.val_batch_at(i)
            losses.append(self.eval_loss(params, inputs.to(device), targets.to(device)))
        return sum(losses) / len(losses)

    def log(self, record: dict[str, Any], progress: Progress) -> None:
        if self.logs is not None:
            self.logs.step(record)
        progress.update(record)


def _save(path: str, params: Any, opt_state: Any, step: int, meta: dict[str, Any], *, blocking: bool = True) -> None:
    # Every rank writes its own shards; a crash mid-save keeps the previous checkpoint.
    # blocking=False returns once the values are in CPU memory; the next save or load waits.
    ckpt.save(path, {"params": params, "opt": opt_state, "step": step, "model": meta}, blocking=blocking)


def _load(ck: CheckpointConfig, params: Any, opt_state: Any, meta: dict[str, Any]) -> tuple[Any, Any, int]:
    # The small "model" entry first: another model's checkpoint is refused before its
    # tensors are read (onto this run's mesh, which may differ from the one that wrote it).
    assert ck.directory is not None
    saved_meta = ckpt.load(ck.directory, like={"model": meta})["model"]
    if saved_meta != meta:
        diff = ", ".join(
            f"{k} {saved_meta.get(k)!r} (this run: {meta.get(k)!r})"
            for k in sorted(set(meta) | set(saved_meta))
            if saved_meta.get(k) != meta.get(k)
        )
        raise ConfigError(
            f"resume: the checkpoint at {ck.directory} holds another model: {diff}. Give {ck.hint}. "
            f"The checkpoint is left as it is."
        )
    saved = ckpt.load(ck.directory, like={"params": params, "opt": opt_state, "step": 0})
    return saved["params"], saved["opt"], int(saved["step"])


def _resumes(ck: CheckpointConfig) -> bool:
    """Whether to resume from ``ck.directory``; ConfigError where its contents and ``ck``
    disagree, before any step runs (every rank reads the same metadata: they agree)."""
    if ck.directory is None:
        return False
    present = _has_checkpoint(ck.directory)
    if ck.resume is True and not present:
        raise ConfigError(
            f"resume: there is no checkpoint in {ck.directory}; give the directory of the run to continue, "
            f"or resume 'auto' (--resume auto) to start from step 0 when there is none"
        )
    if present and not ck.resume and not ck.overwrite:
        raise ConfigError(
            f"{ck.directory} holds a checkpoint{_step_of(ck.directory)}; this run would replace it. Give resume "
            f"(--resume) to continue it, overwrite (--overwrite) to start over and replace it, or another "
            f"directory (--checkpoint-dir)"
        )
    return present and bool(ck.resume)


def _step_of(path: str) -> str:
    try:
        return f" (step {int(ckpt.load(path, like={'step': 0})['step'])})"
    except ckpt.CheckpointError:  # not one of train's: no step to name
        return ""


def _has_checkpoint(path: str | None) -> bool:
    if path is None:
        return False
    try:
        ckpt.read_metadata(path)
        return True
    except ckpt.CheckpointNotFoundError:
        return False
