"""Meshes, partition specs, sharded values and sharded init (process start: ``fshard.runtime``,
re-exported here)."""

from fshard.mesh.spec import P as P, PartitionSpec as PartitionSpec
from fshard.mesh.mesh import Mesh as Mesh, make_mesh as make_mesh, current_mesh as current_mesh
from fshard.runtime.process import init as init
from fshard.runtime.teardown import shutdown as shutdown
from fshard.mesh.sharding import (
    NamedSharding as NamedSharding,
    gather as gather,
    reshard as reshard,
    shard as shard,
    spec_of as spec_of,
)
from fshard.runtime.local import run_local as run_local, WorkerPool as WorkerPool, RankTimeoutError as RankTimeoutError
from fshard.runtime.local import RankExitError as RankExitError, UnpicklableResultError as UnpicklableResultError

__all__ = [
    "P", "PartitionSpec", "Mesh", "make_mesh", "current_mesh", "init", "shutdown", "NamedSharding",
    "gather", "reshard", "shard", "spec_of", "run_local", "WorkerPool", "RankTimeoutError",
    "RankExitError", "UnpicklableResultError",
]

from fshard.mesh.sharded_init import init_sharded as init_sharded
from fshard.mesh.visualize import visualize_sharding as visualize_sharding

__all__ += ["init_sharded", "visualize_sharding"]
