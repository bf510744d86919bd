"""Running a training script's ``main`` as a program: one line for the errors every rank
raises alike, a traceback in torchrun's error file for the rest, a clean shutdown after."""

from __future__ import annotations

import sys
from typing import Any, Callable

from fshard.checkpoint import CheckpointError
from fshard.parallel.layout import LayoutError
from fshard.recipes.data import DataError
from fshard.recipes.faults import NonFiniteError
from fshard.runtime.process import is_rank0

__all__ = ["run_script"]


def run_script(main: Callable[[], Any], prog: str) -> None:
    """Calls ``main()`` as the program ``prog``, and exits as a command line tool should.

    - A ``LayoutError`` or ``DataError`` (settings or data that do not fit): one line
      ``prog: error: ...`` from rank 0 on stderr, exit code 2.
    - A ``NonFiniteError`` or ``fs.checkpoint.CheckpointError``: the same line, exit code 1.
      Every rank raises these alike (the checkpoint's checks agree across ranks), so rank
      0's line says it all.
    - Any other exception: one line ``prog: rank R failed: Type: message`` on stderr first
      (torchrun's report and the traceback follow it), recorded in torchrun's error file
      (what ``@record`` does), then raised. A rank that only lost a peer prints and records
      nothing: the peer that failed says why.
    - After a clean run: ``fs.shutdown()``.
    """
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    from fshard.runtime.failure import is_peer_lost
    from fshard.runtime.teardown import shutdown

    try:
        main()
    except (LayoutError, DataError, NonFiniteError, CheckpointError) as e:
        if is_rank0():
            print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, (LayoutError, DataError)) else 1)
    except Exception as e:
        # Not for a rank that only lost a peer: torchrun stops such ranks with SIGTERM, and
        # an error file cut short by it crashes torchrun's report.
        if not is_peer_lost(e):
            print(f"{prog}: {_rank_name()} failed: {_one_line(e)}", file=sys.stderr, flush=True)
            get_error_handler().record_exception(e)
        raise
    # Only after a clean run: after an error, other ranks may be gone, and this rank must
    # exit (and fs.init's hook say why) without waiting on them. fs.shutdown(), not
    # dist.destroy_process_group(): the meshes hold the groups, whose gloo threads must be
    # joined before the interpreter finalizes (docs/reliability.md, "The abort at exit").
    shutdown()


def _rank_name() -> str:
    import torch.distributed as dist

    from fshard.runtime import simulation

    if simulation.active() is not None:  # one process holds every rank
        return f"the simulation of {simulation.world_size()} ranks"
    return f"rank {dist.get_rank()}" if dist.is_initialized() else "the process"


def _one_line(e: BaseException) -> str:
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
