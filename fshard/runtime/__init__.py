"""Process lifecycle: start (``fs.init``), teardown (``fs.shutdown``), failure attribution, local runs.

The modules that own process groups (mesh, comm, checkpoint) register with
:func:`fshard.runtime.teardown.register_group_owner`; nothing here imports them.
"""

from fshard.runtime.local import (
    RankExitError as RankExitError,
)
from fshard.runtime.local import (
    RankTimeoutError as RankTimeoutError,
)
from fshard.runtime.local import (
    UnpicklableResultError as UnpicklableResultError,
)
from fshard.runtime.local import (
    WorkerPool as WorkerPool,
)
from fshard.runtime.local import (
    run_local as run_local,
)
from fshard.runtime.process import init as init
from fshard.runtime.process import is_rank0 as is_rank0
from fshard.runtime.process import started as started
from fshard.runtime.simulation import RankBranchError as RankBranchError
from fshard.runtime.simulation import simulate as simulate
from fshard.runtime.teardown import shutdown as shutdown

__all__ = [
    "init",
    "shutdown",
    "run_local",
    "simulate",
    "RankBranchError",
    "WorkerPool",
    "RankTimeoutError",
    "RankExitError",
    "UnpicklableResultError",
]
