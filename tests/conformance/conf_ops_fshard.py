"""The shim's fshard side, and the rank task that runs a batch of programs on gloo ranks."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.tensor import DTensor

import fshard as fs
from conf_compare import error, leaf_mismatches, ok, tree_map
from conf_programs import programs

class FshardOps:
    """``ops`` for fshard: fs.lax, fs.shard_map (results as global tensors), fs.grad, ..."""

    framework = "fshard"

    def __init__(self, mesh: fs.Mesh, check: bool) -> None:
        self.mesh, self.check = mesh, check

    # --- specs and collectives (jax.lax signatures) ---
    P = staticmethod(fs.P)
    psum = staticmethod(fs.lax.psum)
    pmean = staticmethod(fs.lax.pmean)
    pmax = staticmethod(fs.lax.pmax)
    pmin = staticmethod(fs.lax.pmin)
    all_gather = staticmethod(fs.lax.all_gather)
    psum_scatter = staticmethod(fs.lax.psum_scatter)
    ppermute = staticmethod(fs.lax.ppermute)
    all_to_all = staticmethod(fs.lax.all_to_all)
    axis_index = staticmethod(fs.lax.axis_index)
    axis_size = staticmethod(fs.lax.axis_size)
    pvary = staticmethod(fs.lax.pvary)
    pbroadcast = staticmethod(fs.lax.pbroadcast)
    pshuffle = staticmethod(fs.lax.pshuffle)
    pswapaxes = staticmethod(fs.lax.pswapaxes)
    pcast = staticmethod(fs.lax.pcast)
    ragged_all_to_all = staticmethod(fs.lax.ragged_all_to_all)

    # --- transforms ---
    def shard_map(self, f: Callable, in_specs: Any, out_specs: Any, check: bool | None = None) -> Callable:
        mapped = fs.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                              check=self.check if check is None else check)
        # full_tensor is differentiable: the results behave like JAX's global arrays.
        return lambda *args: tree_map(lambda y: y.full_tensor() if isinstance(y, DTensor) else y, mapped(*args))

    grad = staticmethod(fs.grad)
    value_and_grad = staticmethod(fs.value_and_grad)
    func_grad = staticmethod(torch.func.grad)

    @staticmethod
    def remat(f: Callable, policy: str | None = None) -> Callable:
        return fs.remat(f, policy=policy)

    @staticmethod
    def vmap(f: Callable, in_axes: Any = 0, out_axes: Any = 0) -> Callable:
        return torch.func.vmap(f, in_dims=in_axes, out_dims=out_axes)

    # --- array functions ---
    relu = staticmethod(torch.relu)
    tanh = staticmethod(torch.tanh)
    exp = staticmethod(torch.exp)

    @staticmethod
    def sum(x, axis=None):
        return x.sum() if axis is None else x.sum(dim=axis)

    @staticmethod
    def mean(x, axis=None):
        return x.mean() if axis is None else x.mean(dim=axis)

    @staticmethod
    def concat(xs, axis=0):
        return torch.cat(list(xs), dim=axis)

    @staticmethod
    def einsum(spec, *xs):
        return torch.einsum(spec, *xs)

    @staticmethod
    def int32(x):
        return x.to(torch.int32)

    @staticmethod
    def to_float(x):
        return float(x)

    @staticmethod
    def gt0_int(x):
        return (x > 0).long()

    @staticmethod
    def index(x, i):
        return x[i]

    @staticmethod
    def iadd(y, x):  # in place, as ordinary PyTorch code writes it
        y += x
        return y

    @staticmethod
    def setitem(y, i, v):  # in place, as ordinary PyTorch code writes it
        y[i] = v
        return y

    @staticmethod
    def moveaxis(x, source, destination):
        return torch.movedim(x, source, destination)

    where = staticmethod(torch.where)


def to_numpy(x: Any) -> Any:
    """A result leaf as numpy (a DTensor as its global value), as the comparison takes it."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().copy()
    if isinstance(x, (int, float, bool)):
        return np.asarray(x)
    return x


def run_batch(names: list[str]) -> dict[str, dict]:
    """Rank task: runs each program on this rank; returns ``{name: record}``.

    Every rank calls the same programs in the same order (their collectives pair up). A
    program that raises on every rank is recorded as an error and the batch goes on.
    """
    progs = programs()
    out = {}
    for name in names:
        p = progs[name]
        mesh = fs.make_mesh(p.mesh_axes)
        ops = FshardOps(mesh, p.check)
        inputs = tuple(torch.from_numpy(np.array(a)) for a in p.make_inputs())
        t0 = time.perf_counter()
        try:
            rec = ok(tree_map(to_numpy, p.fn(ops, *inputs)))
        except Exception as e:  # recorded; the parity test decides whether JAX raised too
            rec = error(e)
        rec["seconds"] = time.perf_counter() - t0
        out[name] = rec
    return out


def merge_ranks(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Rank 0's records, each marked where another rank's global result differs."""
    merged = {}
    for name, rec in per_rank[0].items():
        notes = []
        for r, other in enumerate(per_rank[1:], start=1):
            o = other[name]
            if o["status"] != rec["status"]:
                notes.append(f"rank {r}: {o['status']} ({o.get('error', '')[:200]}) vs rank 0: {rec['status']}")
            elif rec["status"] == "ok":
                probs = leaf_mismatches(o["value"], rec["value"])
                if probs:
                    notes.append(f"rank {r} vs rank 0: " + "; ".join(probs)[:1000])
        rec = dict(rec)
        if notes:
            rec["ranks_disagree"] = "\n".join(notes)
            rec["per_rank"] = [other[name].get("value") for other in per_rank]
        merged[name] = rec
    return merged


__all__ = ["FshardOps", "merge_ranks", "run_batch", "to_numpy"]
