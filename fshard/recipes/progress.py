"""Progress of a training run on rank 0: a line every ``every`` steps, and a tqdm bar on a terminal.

The lines come every ``every`` steps (and at the last step) whether tqdm is installed or
not; the bar only when stderr is a terminal and tqdm is installed, with the lines written
above it. A redirected log (a file, a pipe, a job scheduler's output) gets the lines alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from fshard.recipes.metrics import clock

__all__ = ["Progress", "progress_line", "write_log"]


def progress_line(r: dict[str, Any], total: int) -> str:
    """One record as a log line: step, loss, validation loss, tokens/s, MFU, lr, peak memory,
    elapsed time and ETA (the fields the record has)."""
    parts = [f"step {r['step']:>5}/{total}", f"loss {r['loss']:.4f}"]
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.4f}")
    parts.append(f"{r['tokens_per_s']:,.0f} tokens/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu']:.1%}")
    if r.get("lr") is not None:
        parts.append(f"lr {r['lr']:.2e}")
    if r.get("peak_mem_mib") is not None:
        parts.append(f"mem {r['peak_mem_mib']:,.0f} MiB{' (rss)' if r.get('peak_mem_kind') == 'rss' else ''}")
    if r.get("elapsed_s") is not None:
        parts.append(f"elapsed {clock(r['elapsed_s'])}  eta {clock(r.get('eta_s'))}")
    return "  ".join(parts)


class Progress:
    """Rank 0's progress output (``enabled``: this rank shows it).

    Args:
      start: the step the run starts after (a resumed run's checkpoint step).
      total: the run's total steps.
      enabled: show anything at all.
      every: a line every this many steps (>= 1), and at step ``total``.
      tty: whether to draw the bar (default: stderr is a terminal).
    """

    def __init__(self, start: int, total: int, enabled: bool, every: int, tty: bool | None = None) -> None:
        self.enabled, self.every, self.total = enabled, max(1, every), total
        self.bar = None
        self.write: Callable[[str], None] = lambda line: print(line, flush=True)
        if enabled and (sys.stderr.isatty() if tty is None else tty):
            try:
                from tqdm.auto import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
                self.write = lambda line: tqdm.write(line, file=sys.stdout)

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
            self.bar.update(1)
        if record["step"] % self.every == 0 or record["step"] == self.total:
            self.write(progress_line(record, self.total))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def write_log(path: str, records: list[dict[str, Any]]) -> None:
    """Writes the records as one JSON list, atomically (a reader never sees half a file).

    The run's own log is :class:`fshard.recipes.sinks.JsonLines` (written as the records are
    made); this writes a finished list in one go."""
    tmp = f"{path}.tmp"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1)
    os.replace(tmp, path)
