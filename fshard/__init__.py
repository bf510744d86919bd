"""fshard: JAX-style functional sharding for PyTorch.

Models are pure functions over pytrees of sharded parameters; every parameter has a
``P`` spec on a named ``Mesh``; ``shard_map`` runs a per-device step on every rank.
"""

from fshard import tree as tree
from fshard.mesh import (
    Mesh as Mesh,
    NamedSharding as NamedSharding,
    P as P,
    PartitionSpec as PartitionSpec,
    RankTimeoutError as RankTimeoutError,
    current_mesh as current_mesh,
    gather as gather,
    init as init,
    shutdown as shutdown,
    init_sharded as init_sharded,
    make_mesh as make_mesh,
    reshard as reshard,
    run_local as run_local,
    shard as shard,
    spec_of as spec_of,
    visualize_sharding as visualize_sharding,
)

from fshard import checkpoint as checkpoint
from fshard import lax as lax
from fshard import models as models
from fshard import nn as nn
from fshard import optim as optim
from fshard import parallel as parallel
from fshard import plan as plan
from fshard import recipes as recipes
from fshard import runtime as runtime
from fshard import sched as sched
from fshard.comm import comm_log as comm_log
from fshard.jit import DonatedTensorError as DonatedTensorError, JitCaptureError as JitCaptureError, jit as jit
from fshard.parallel.specs import match_specs as match_specs
from fshard.transforms.policy import Policy as Policy
from fshard.transforms import grad as grad, remat as remat, shard_map as shard_map, value_and_grad as value_and_grad

__version__ = "0.1.0"
