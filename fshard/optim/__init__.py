"""Optax-style optimizers over pytrees of sharded parameters.

An optimizer is a :class:`GradientTransformation`: ``init(params) -> state`` and
``update(grads, state, params) -> (updates, state)``, both pure. Leaves may be DTensors
on any mesh (the state is sharded exactly like the params: ZeRO) or plain tensors
(one process, or local shards inside ``shard_map``). The moment arithmetic is
torch.optim's functional kernels run on the local shards::

    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(lr=3e-4))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = fs.optim.apply_updates(params, updates)

or, in one call that donates the old params and state and runs torch's fused kernel where
it can (``adamw(..., fused=True)``)::

    params, state = fs.optim.step(opt, grads, state, params)
"""

from fshard.optim.alias import adam as adam
from fshard.optim.alias import adamw as adamw
from fshard.optim.alias import sgd as sgd
from fshard.optim.base import EmptyState as EmptyState
from fshard.optim.base import GradientTransformation as GradientTransformation
from fshard.optim.base import OptState as OptState
from fshard.optim.base import Params as Params
from fshard.optim.base import ScalarOrSchedule as ScalarOrSchedule
from fshard.optim.base import Schedule as Schedule
from fshard.optim.base import Updates as Updates
from fshard.optim.base import apply_updates as apply_updates
from fshard.optim.base import chain as chain
from fshard.optim.base import donate as donate
from fshard.optim.base import identity as identity
from fshard.optim.clipping import clip_by_global_norm as clip_by_global_norm
from fshard.optim.clipping import global_norm as global_norm
from fshard.optim.fused import step as step
from fshard.optim.schedules import constant_schedule as constant_schedule
from fshard.optim.schedules import cosine_decay_schedule as cosine_decay_schedule
from fshard.optim.schedules import join_schedules as join_schedules
from fshard.optim.schedules import linear_schedule as linear_schedule
from fshard.optim.schedules import warmup_cosine_decay_schedule as warmup_cosine_decay_schedule
from fshard.optim.transforms import ScaleByAdamState as ScaleByAdamState
from fshard.optim.transforms import ScaleByScheduleState as ScaleByScheduleState
from fshard.optim.transforms import TraceState as TraceState
from fshard.optim.transforms import add_decayed_weights as add_decayed_weights
from fshard.optim.transforms import scale as scale
from fshard.optim.transforms import scale_by_adam as scale_by_adam
from fshard.optim.transforms import scale_by_learning_rate as scale_by_learning_rate
from fshard.optim.transforms import scale_by_schedule as scale_by_schedule
from fshard.optim.transforms import trace as trace

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "OptState",
    "Params",
    "ScalarOrSchedule",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "Schedule",
    "TraceState",
    "Updates",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "donate",
    "global_norm",
    "identity",
    "join_schedules",
    "linear_schedule",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "step",
    "trace",
    "warmup_cosine_decay_schedule",
]
