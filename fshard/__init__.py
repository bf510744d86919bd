"""fshard: JAX-style functional sharding for PyTorch.

Models are pure functions over pytrees of sharded parameters; every parameter has a
``P`` spec on a named ``Mesh``; ``shard_map`` runs a per-device step on every rank.
"""

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
from fshard import tree as tree
from fshard._version import __version__ as __version__
from fshard.comm import comm_log as comm_log
from fshard.jit import DonatedTensorError as DonatedTensorError
from fshard.jit import JitCaptureError as JitCaptureError
from fshard.jit import jit as jit
from fshard.mesh import (
    Mesh as Mesh,
)
from fshard.mesh import (
    NamedSharding as NamedSharding,
)
from fshard.mesh import (
    P as P,
)
from fshard.mesh import (
    PartitionSpec as PartitionSpec,
)
from fshard.mesh import (
    RankTimeoutError as RankTimeoutError,
)
from fshard.mesh import (
    current_mesh as current_mesh,
)
from fshard.mesh import (
    gather as gather,
)
from fshard.mesh import (
    init as init,
)
from fshard.mesh import (
    init_sharded as init_sharded,
)
from fshard.mesh import inspect as inspect
from fshard.mesh import (
    make_mesh as make_mesh,
)
from fshard.mesh import (
    reshard as reshard,
)
from fshard.mesh import (
    run_local as run_local,
)
from fshard.mesh import (
    shard as shard,
)
from fshard.mesh import (
    shutdown as shutdown,
)
from fshard.mesh import (
    spec_of as spec_of,
)
from fshard.mesh import (
    visualize_sharding as visualize_sharding,
)
from fshard.parallel.specs import match_specs as match_specs
from fshard.runtime.simulation import simulate as simulate
from fshard.transforms import grad as grad
from fshard.transforms import remat as remat
from fshard.transforms import shard_map as shard_map
from fshard.transforms import value_and_grad as value_and_grad
from fshard.transforms.policy import Policy as Policy
