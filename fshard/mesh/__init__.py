"""Meshes, partition specs, sharded values and sharded init (process start: ``fshard.runtime``,
re-exported here)."""

from fshard.mesh.mesh import Mesh as Mesh
from fshard.mesh.mesh import current_mesh as current_mesh
from fshard.mesh.mesh import make_mesh as make_mesh
from fshard.mesh.sharding import (
    NamedSharding as NamedSharding,
)
from fshard.mesh.sharding import (
    gather as gather,
)
from fshard.mesh.sharding import (
    reshard as reshard,
)
from fshard.mesh.sharding import (
    shard as shard,
)
from fshard.mesh.sharding import (
    spec_of as spec_of,
)
from fshard.mesh.spec import P as P
from fshard.mesh.spec import PartitionSpec as PartitionSpec
from fshard.runtime.local import RankExitError as RankExitError
from fshard.runtime.local import RankTimeoutError as RankTimeoutError
from fshard.runtime.local import UnpicklableResultError as UnpicklableResultError
from fshard.runtime.local import WorkerPool as WorkerPool
from fshard.runtime.local import run_local as run_local
from fshard.runtime.process import init as init
from fshard.runtime.teardown import shutdown as shutdown

__all__ = [
    "P",
    "PartitionSpec",
    "Mesh",
    "make_mesh",
    "current_mesh",
    "init",
    "shutdown",
    "NamedSharding",
    "gather",
    "reshard",
    "shard",
    "spec_of",
    "run_local",
    "WorkerPool",
    "RankTimeoutError",
    "RankExitError",
    "UnpicklableResultError",
]

from fshard.mesh.inspect import inspect as inspect
from fshard.mesh.sharded_init import init_sharded as init_sharded
from fshard.mesh.visualize import visualize_sharding as visualize_sharding

__all__ += ["init_sharded", "visualize_sharding", "inspect"]
