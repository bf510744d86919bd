"""Fault injection for tests/integration/test_faults.py: a rank of examples/train_lm.py killed or raising mid-step.

Used two ways: imported (``arm`` in an ``fs.run_local`` rank), and as a script standing in
for ``examples/train_lm.py`` under torchrun::

    FSHARD_TEST_FAULT=kill:2:7 FSHARD_TEST_PID_DIR=/tmp/x torchrun ... tests/_harness/_faults.py --mesh fsdp=4 ...

``kind:rank:call``: on ``rank``, the ``call``-th block evaluation of that process (forward
and, with remat, recomputation) SIGKILLs the process (``kill``) or raises
:class:`InjectedFault` (``raise``). A block runs inside ``fs.parallel.scan_layers``, with the
next block's all-gather in flight: the middle of a collective-heavy step. Every rank writes
its pid to ``<pid dir>/rank<r>.pid``; the victim writes ``<pid dir>/fault`` (the time)
just before the fault.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN_LM = ROOT / "examples" / "train_lm.py"


class InjectedFault(RuntimeError):
    """The error a ``raise`` fault raises."""


def arm(kind: str, victim: int, at_call: int, pid_dir: str) -> None:
    """Wraps ``fs.parallel.scan_layers`` (and the name ``fs.recipes.step`` calls it by) so that the
    ``at_call``-th block call on ``victim`` faults."""
    import fshard.parallel as par
    import fshard.recipes.step as recipe_step

    if kind not in ("kill", "raise"):
        raise ValueError(f"fault kind {kind!r}: expected kill or raise")
    rank = int(os.environ.get("RANK", "0"))
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    real = par.scan_layers
    calls = [0]

    def scan_layers(block_fn, *args, **kwargs):
        def counted(*a, **k):
            calls[0] += 1
            if rank == victim and calls[0] == at_call:
                Path(pid_dir, "fault").write_text(repr(time.time()))
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"injected fault on rank {rank} at block call {at_call}")
            return block_fn(*a, **k)

        return real(counted, *args, **kwargs)

    par.scan_layers = recipe_step.scan_layers = scan_layers


if __name__ == "__main__":
    kind, victim, at_call = os.environ["FSHARD_TEST_FAULT"].split(":")
    arm(kind, int(victim), int(at_call), os.environ["FSHARD_TEST_PID_DIR"])
    sys.argv[0] = str(TRAIN_LM)
    runpy.run_path(str(TRAIN_LM), run_name="__main__")
