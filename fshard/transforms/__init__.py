"""Transformations of per-device functions: shard_map, grad, remat."""

from fshard.transforms.grad import grad as grad
from fshard.transforms.grad import value_and_grad as value_and_grad
from fshard.transforms.remat import remat as remat
from fshard.transforms.shard_map import shard_map as shard_map

__all__ = ["shard_map", "value_and_grad", "grad", "remat"]
