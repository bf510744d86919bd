"""One collective-kind enum and one wire-bytes rule (fshard/_wire.py) for comm_log, fs.jit and
fs.plan: the planner's bandwidth term is the bytes comm_log counts on the wire."""

from __future__ import annotations

import pytest
import torch

import fshard.plan as plan
from fshard._wire import CollectiveKind, c10d_kind, ring_hops, wire_bytes
from fshard.plan.machine import Link, Machine

F = torch.ops._c10d_functional


def test_kinds_are_comm_logs_names():
    assert CollectiveKind.PSUM == "psum" and hash(CollectiveKind.PSUM) == hash("psum")
    assert {"psum_scatter": 1}[CollectiveKind.PSUM_SCATTER] == 1 and str(CollectiveKind.ALL_GATHER) == "all_gather"
    assert c10d_kind(F.all_gather_into_tensor.default) is CollectiveKind.ALL_GATHER
    assert c10d_kind(F.reduce_scatter_tensor.default) is CollectiveKind.PSUM_SCATTER
    assert c10d_kind(F.all_to_all_single.default) is CollectiveKind.ALL_TO_ALL
    assert c10d_kind(F.all_reduce.default, (None, "sum", "g")) is CollectiveKind.PSUM
    assert c10d_kind(F.all_reduce_.default, (None, "max", "g")) is CollectiveKind.PMAX
    assert c10d_kind(F.all_reduce.default, (None, "bxor", "g")) is CollectiveKind.ALL_REDUCE
    assert c10d_kind(F.wait_tensor.default) is None


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_wire_bytes_are_the_ring_minimum(n):
    for nb in (0, 7, 4096, 12345):
        assert wire_bytes("all_gather", nb, n) == (n - 1) * nb
        assert wire_bytes("psum_scatter", nb, n) == nb * (n - 1) // n
        assert wire_bytes("psum", nb, n) == wire_bytes("pmax", nb, n) == 2 * nb * (n - 1) // n
        assert wire_bytes("send", nb, n) == nb and wire_bytes("recv", nb, n) == 0
    with pytest.raises(ValueError, match="broadcast's bytes depend on the rank's place"):
        wire_bytes("broadcast", 8, n)
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        ring_hops("gather", n)


def test_the_planners_bandwidth_term_is_the_wire_bytes():
    """With no latency, a ring collective's predicted time is its wire bytes over the link's
    bandwidth (psum: the ring, which the tree does not beat without latency at this size)."""
    bw = 1e9
    m = Machine(name="toy", memory_bytes=2**30, flops={"float32": 1e10}, mem_bandwidth=1e10, devices_per_node=8,
                links={"intra": Link(bw, 0.0), "inter": Link(bw, 0.0)})
    lay = plan.Layout({"fsdp": 4}, batch=4)
    nb = 4 * 2**20
    for kind in ("all_gather", "psum_scatter", "psum", "send"):
        t = plan.collective_time(m, lay, plan.Collective(kind, ("fsdp",), nb))
        assert t == pytest.approx(wire_bytes(kind, nb, 4) / bw, rel=1e-12), kind
    with pytest.raises(ValueError, match="collective_time: unknown kind 'all_to_all'"):
        plan.collective_time(m, lay, plan.Collective("all_to_all", ("fsdp",), nb))
