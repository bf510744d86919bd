"""Where a training run's records go: JSON lines, TensorBoard, a loss plot.

A run's records are dicts (one per step, then one summary: :mod:`fshard.recipes.metrics`).
:class:`Logs` hands each to its sinks as it is made:

- :class:`JsonLines` (``--log-json PATH``): one JSON object per line, ``"kind": "step"`` or
  ``"summary"``, each written with one ``write`` as soon as it exists, so a run killed at
  any point (SIGKILL included) leaves every record up to the last one written; fsynced
  every few seconds and at the end (against a power cut, not needed against a kill).
  :func:`read_log` reads one back.
- :class:`TensorBoard` (``--tensorboard DIR``): the numbers as scalars through
  ``torch.utils.tensorboard.SummaryWriter`` (needs ``pip install tensorboard``).
- :class:`Plot` (``--plot loss.png``): the loss and validation curves, drawn at the end
  with matplotlib.

Only rank 0 writes (``Logs.from_flags(args, enabled=rank0)``; the others get no sinks).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol, Sequence

from fshard.recipes.errors import ConfigError

__all__ = ["JsonLines", "Logs", "Plot", "Sink", "TensorBoard", "read_log"]


class Sink(Protocol):
    def begin(self, start: int) -> None: ...
    def write(self, record: dict[str, Any], kind: str) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class JsonLines:
    """Records as JSON lines at ``path``, each on disk (in the kernel's cache) once written.

    A run from step 0 starts the file afresh; a resumed run (``start`` > 0) appends, after
    cutting off a line a kill left half-written, so that the file holds the whole curve
    (the steps after the resumed checkpoint appear twice: the later line is the resumed
    run's).

    Args:
      fsync_every_s: ``os.fsync`` at most this often (and at the end).
    """

    def __init__(self, path: str | os.PathLike, fsync_every_s: float = 5.0) -> None:
        self.path, self.fsync_every_s = Path(path), fsync_every_s
        self.fd: int | None = None
        self.synced = 0.0

    def begin(self, start: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start > 0 and self.path.exists():
            data = self.path.read_bytes()
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            os.truncate(self.path, data.rfind(b"\n") + 1)  # a line cut short by a kill: dropped
        else:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.synced = time.monotonic()

    def write(self, record: dict[str, Any], kind: str) -> None:
        if self.fd is None:
            self.begin(0)
        assert self.fd is not None
        line = memoryview((json.dumps({"kind": kind, **record}, default=str) + "\n").encode())
        while line:  # one write() for a line this short; the loop only for a short write
            line = line[os.write(self.fd, line) :]
        if time.monotonic() - self.synced >= self.fsync_every_s:
            self.flush()

    def flush(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)
            self.synced = time.monotonic()

    def close(self) -> None:
        if self.fd is not None:
            self.flush()
            os.close(self.fd)
            self.fd = None


def read_log(path: str | os.PathLike, kind: str | None = "step") -> list[dict[str, Any]]:
    """The records of a :class:`JsonLines` file, of ``kind`` (``"step"``, ``"summary"``; None:
    all). A last line without its newline (a write cut short by a kill) is left out."""
    lines = Path(path).read_text().split("\n")[:-1]  # after the last "\n": an unfinished line, or nothing
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


# Record field -> TensorBoard tag.
TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "peak_mem_mib": "perf/peak_mem_mib",
}


class TensorBoard:
    """The records' numbers as TensorBoard scalars (tags: :data:`TAGS`) in ``directory``.

    Raises:
      ConfigError: tensorboard is not installed (the message says how to install it).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package
            raise ConfigError(
                f"--tensorboard {directory}: needs the tensorboard package: pip install tensorboard"
            ) from None
        self.writer = SummaryWriter(log_dir=str(directory), flush_secs=10)

    def begin(self, start: int) -> None:
        pass

    def write(self, record: dict[str, Any], kind: str) -> None:
        if kind != "step":
            return
        for key, tag in TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag, value, record["step"])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Plot:
    """The loss curve and the validation curve, drawn into ``path`` (e.g. ``loss.png``) at
    the end of the run.

    Raises:
      ConfigError: matplotlib is not installed.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(f"--plot {path}: needs matplotlib: pip install matplotlib (or fshard[viz])") from None
        self.path = Path(path)
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []

    def begin(self, start: int) -> None:
        pass

    def write(self, record: dict[str, Any], kind: str) -> None:
        if kind == "step":
            self.train.append((record["step"], record["loss"]))
            if record.get("val_loss") is not None:
                self.val.append((record["step"], record["val_loss"]))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        import matplotlib

        matplotlib.use("Agg")  # a file, not a window: no display needed
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for points, label, style in ((self.train, "train", "-"), (self.val, "validation", "o-")):
            if points:
                ax.plot(*zip(*points), style, label=label, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(self.path, dpi=120, bbox_inches="tight")
        plt.close(fig)


class Logs:
    """The sinks of one run: :func:`~fshard.recipes.trainer.train` calls :meth:`begin` and
    :meth:`step`; the caller :meth:`close` s it with the summary (after adding what it
    knows, e.g. the planner's prediction)."""

    def __init__(self, sinks: Sequence[Sink] = ()) -> None:
        self.sinks = list(sinks)

    @classmethod
    def from_flags(cls, args: Any, enabled: bool = True) -> Logs:
        """The sinks the logging flags ask for (``--log-json``, ``--tensorboard``, ``--plot``);
        none where not ``enabled`` (ranks other than 0).

        Raises:
          ConfigError: a sink's package is missing.
        """
        if not enabled:
            return cls()
        sinks: list[Sink] = []
        if getattr(args, "log_json", None):
            sinks.append(JsonLines(args.log_json))
        if getattr(args, "tensorboard", None):
            sinks.append(TensorBoard(args.tensorboard))
        if getattr(args, "plot", None):
            sinks.append(Plot(args.plot))
        return cls(sinks)

    def begin(self, start: int) -> None:
        for s in self.sinks:
            s.begin(start)

    def step(self, record: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(record, "step")

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Writes ``summary`` (a ``"kind": "summary"`` record) and closes every sink."""
        for s in self.sinks:
            if summary is not None:
                s.write(summary, "summary")
            s.close()
        self.sinks = []
