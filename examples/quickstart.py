"""fshard in one screen: a 4-rank mesh from a plain Python process, specs, shard and gather.

    python examples/quickstart.py
"""

import torch

import fshard as fs
from fshard import P


def per_rank():
    mesh = fs.make_mesh({"dp": 2, "tp": 2})                 # 4 ranks, named axes
    torch.manual_seed(0)
    params = {"wq": torch.randn(8, 6), "b": torch.zeros(6)}  # global values, same on every rank
    specs = {"wq": P("dp", "tp"), "b": P("tp")}
    sharded = fs.shard(params, specs, mesh)                 # DTensors: each rank keeps its block
    if mesh.axis_index(("dp", "tp")) == 0:
        fs.visualize_sharding(sharded["wq"])
    full = fs.gather(sharded)                               # back to full tensors
    return tuple(sharded["wq"].to_local().shape), torch.equal(full["wq"], params["wq"])


if __name__ == "__main__":
    for rank, (local_shape, same) in enumerate(fs.run_local(per_rank, world_size=4)):
        print(f"rank {rank}: local block {local_shape}, gathered == original: {same}")
