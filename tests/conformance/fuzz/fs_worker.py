"""The fshard side: a rank task that runs a batch of fuzz programs on gloo ranks.

Every rank runs the same programs in the same order, so their collectives pair up. A
program that raises is recorded and the batch goes on. Results are global values (shard_map
outputs as ``full_tensor()``), so a value under a replicated out_spec that differs between
ranks shows up as ranks disagreeing on the global result (``merge_ranks``).
"""

from __future__ import annotations

import time

import torch
from conf_compare import error, ok, tree_map
from conf_ops_fshard import merge_ranks, to_numpy

import fshard as fs

from .emit import compile_program, make_inputs


def run_one(prog: dict) -> dict:
    """One program's record on this rank."""
    t0 = time.perf_counter()
    try:
        mesh = fs.make_mesh({a: s for a, s in prog["mesh"]})
        run = compile_program(prog, "fshard", mesh)
        inputs = [torch.from_numpy(a) for a in make_inputs(prog)]
        rec = ok(tree_map(to_numpy, run(*inputs)))
    except Exception as e:  # noqa: BLE001 - recorded: the comparison decides whether JAX raised too
        rec = error(e)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def run_batch(progs: list[dict]) -> dict:
    """Rank task: ``{id: record}`` for each program, on this rank."""
    return {p["id"]: run_one(p) for p in progs}


__all__ = ["merge_ranks", "run_batch", "run_one"]
