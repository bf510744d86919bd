"""Progress of a training run on rank 0: a tqdm bar or log lines, and the per-step records as JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["Progress", "write_log"]


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
            print(
                f"step {record['step']:>5}/{self.total}  loss {record['loss']:.4f}  "
                f"{record['tokens_per_s']:,.0f} tokens/s  lr {record['lr']:.2e}",
                flush=True,
            )

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
