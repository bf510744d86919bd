"""Stress of gloo collectives across several groups of one process, and back to back on one
group, as fshard issues them (docs/reliability.md, "Seen again"). No model.

``--mode cross``: a dp=2 x fsdp mesh (4 ranks). Per iteration, collectives in flight on
three groups at once (an all-gather over fsdp, an all-reduce over dp, an all-to-all over
the world group), each started through ``fshard.comm`` (so with
``FSHARD_CHECK_COLLECTIVES=1`` every start runs its header all-gather on its own group
while the others are in flight), small and mixed sizes, allocation churn between, every
result checked. The hypothesis it tests: state shared by gloo groups of one process.

``--mode serial``: one group, strictly one collective at a time (each waited before the
next, as ``comm.one_at_a_time`` leaves them), tiny tensors so that each completes in
microseconds, alternating ops whose gloo names differ in length (the functional
all-gather runs as ``ALLGATHER_COALESCED``, 19 characters; ``all_gather_single`` as
``_ALLGATHER_BASE``, ``all_reduce`` as ``ALLREDUCE``). What it tests: gloo's worker
thread goes on after a collective has completed (``ProcessGroupGloo::runLoop`` writes the
group's ``pgStatus_->lastCompletedWorkName``, a ``std::string``, without a lock), so the
group's other worker may run the next collective and reach the same write at once.
``--threads 1`` runs it on a group with one worker thread: the control arm. ``--ops long``
issues only the functional all-gather, ``--ops short`` only ops whose names fit in
``std::string``'s inline buffer (15 characters: no heap memory behind them).

The race window is a few instructions wide; ``tools/gloo_status_race.cpp`` (built and
``LD_PRELOAD``-ed, see its header) lines two gloo workers up just before it, without
changing any value. Run ``--mode serial`` with ``FSHARD_CHECK_COLLECTIVES=0`` under it (the
headers are short-named collectives of their own).

    PYTHONPATH=. nice -n 10 python tools/stress_groups.py --mode cross --calls 10 --iters 500
    PYTHONPATH=. nice -n 10 python tools/stress_groups.py --mode serial --calls 10 --iters 5000 --threads 2
"""

import argparse
import sys
import time
import traceback

import torch

SIZES = [1, 2, 3, 5, 8, 17, 64, 257, 1024, 4099]


def body_cross(iters: int, seed: int) -> int:
    import torch.distributed as dist

    import fshard as fs
    from fshard import comm

    n_world = dist.get_world_size()
    mesh = fs.make_mesh({"dp": 2, "fsdp": n_world // 2})
    fsdp, dp, world = mesh.group("fsdp"), mesh.group("dp"), dist.group.WORLD
    nf, r = mesh.axis_size("fsdp"), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)  # same sizes on every rank
    checks = 0
    for _ in range(iters):
        m1, m2, m3 = (SIZES[int(torch.randint(len(SIZES), (1,), generator=gen))] for _ in range(3))
        a = comm.all_gather_async(torch.full((m1,), float(r)), fsdp, nf, axes=("fsdp",))
        b = comm.all_reduce_async(torch.full((m2,), 1.0), dp, axes=("dp",))
        c = comm.reduce_scatter_async(torch.full((n_world * m3,), 1.0), world, n_world)
        junk = [torch.empty(int(torch.randint(1, 300, (1,), generator=gen))) for _ in range(16)]
        d = comm.all_reduce_async(torch.full((m3,), 2.0), fsdp, axes=("fsdp",))  # completes a on fsdp
        e = comm.all_gather_async(torch.full((m2,), 3.0), dp, 2, axes=("dp",))  # completes b on dp
        del junk
        assert a.wait().numel() == nf * m1, "ag fsdp"
        assert torch.all(b.wait() == 2.0), "ar dp"
        assert torch.all(c.wait() == n_world), "rs world"
        assert torch.all(d.wait() == 2.0 * nf), "ar fsdp"
        assert torch.all(e.wait() == 3.0), "ag dp"
        checks += 5
    return checks


def body_serial(iters: int, seed: int, threads: int, ops: str = "mixed") -> tuple[int, int]:
    import torch.distributed as dist

    from fshard import comm
    from tools.stress_overlap import _group

    g = _group(threads)
    n, r = dist.get_world_size(), dist.get_rank()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    checks = 0
    for it in range(iters):
        m = SIZES[it % 4]  # tiny: each collective completes in microseconds
        if ops == "short":  # names of at most 15 characters: std::string keeps them inline
            out = comm.reduce_scatter_async(torch.ones(n * m), g, n).wait()  # ALLTOALL_BASE
            assert torch.all(out == n), "rs"
        else:
            out = comm.all_gather_async(torch.full((m,), float(r)), g, n).wait()  # ALLGATHER_COALESCED
            assert out[-1] == n - 1, "ag"
        checks += 1
        if ops == "long":  # only ALLGATHER_COALESCED: every name the worker writes is on the heap
            continue
        hdr = torch.empty(3 * n, dtype=torch.int64)
        gather(hdr, torch.tensor([it, 1, 2]), group=g)  # the contract's header: _ALLGATHER_BASE
        assert int(hdr[3 * (n - 1)]) == it, "hdr"
        s = torch.tensor([1.0])
        dist.all_reduce(s, group=g)  # ALLREDUCE
        assert s.item() == n, "ar"
        checks += 2
    if g is not dist.group.WORLD:
        torch._C._distributed_c10d._unregister_process_group(g.group_name)
    return checks, _meetings()  # (results checked, race amplifier meetings)


def _meetings() -> int:
    """How often the race amplifier (docs/reliability.md) lined two gloo workers up; 0 without it."""
    import ctypes

    try:
        return int(ctypes.CDLL(None).race_meetings())
    except AttributeError:
        return 0


def main() -> None:
    from fshard.testing import run_on_ranks, shutdown_pools

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("cross", "serial"), default="cross")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="serial: gloo worker threads of the group")
    ap.add_argument(
        "--ops",
        choices=("mixed", "long", "short"),
        default="mixed",
        help="serial: ops with short and long gloo names, only the long one, or only short ones",
    )
    ap.add_argument("--minutes", type=float, default=9.0, help="stop starting calls after this long")
    a = ap.parse_args()
    fails, t0 = 0, time.time()
    for c in range(a.calls):
        if time.time() - t0 > a.minutes * 60:
            print(f"stopped after {c} calls ({a.minutes} min)", flush=True)
            break
        try:
            if a.mode == "cross":
                run_on_ranks(body_cross, a.iters, c, world_size=a.world, timeout_s=600)
            else:
                res = run_on_ranks(body_serial, a.iters, c, a.threads, a.ops, world_size=a.world, timeout_s=600)
                print(f"[{c}] checks per rank {res}", flush=True)
        except Exception as e:  # noqa: BLE001 - count and show every failure
            fails += 1
            print(f"[{c}] FAILED: {''.join(traceback.format_exception_only(type(e), e))[:6000]}", flush=True)
        print(f"{c + 1} calls x {a.iters} iters, {fails} failures, {time.time() - t0:.0f}s", flush=True)
    shutdown_pools()
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
