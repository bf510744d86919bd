"""Process start (fs.init), run_local and the multi-rank harness: results, failures, deadlocks."""

import time

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard.runtime.local import RankTimeoutError
from fshard.testing import run_on_ranks


def _rank_and_sum(scale):
    mesh = fs.make_mesh({"x": dist.get_world_size()})
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item() * scale, mesh.axis_index("x")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_pool_returns_per_rank_results(n):
    out = run_on_ranks(_rank_and_sum, 2.0, world_size=n)
    total = n * (n + 1) / 2
    assert out == [(r, total * 2.0, r) for r in range(n)]


def _fail_on_rank_1():
    if dist.get_rank() == 1:
        raise KeyError("boom on one rank")
    return "fine"


def test_pool_propagates_remote_failure_with_rank():
    with pytest.raises(KeyError, match="boom on one rank") as info:
        run_on_ranks(_fail_on_rank_1, world_size=2)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "rank 1 of 2" in notes
    assert "_fail_on_rank_1" in info.value.__cause__.text
    # The pool is still usable afterwards.
    assert run_on_ranks(_rank_and_sum, 1.0, world_size=2)[0][1] == 3.0


def _leak_a_collective():
    from fshard import comm

    mesh = fs.make_mesh({"x": dist.get_world_size()})
    handle = comm.all_reduce_async(torch.ones(4), mesh.group("x"), axes=("x",))
    return handle is not None  # dropped without wait()


def test_collective_left_in_flight_fails_the_test():
    with pytest.raises(RuntimeError, match="1 functional collective\\(s\\) started and never waited"):
        run_on_ranks(_leak_a_collective, world_size=2)
    # The pool is still usable, and later clean tasks pass (only an increase counts).
    assert run_on_ranks(_rank_and_sum, 1.0, world_size=2)[0][1] == 3.0


def _deadlock():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins
    else:
        time.sleep(60)
    return "unreachable"


def test_deadlock_fails_within_timeout_and_shows_stacks():
    t0 = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_on_ranks(_deadlock, world_size=2, timeout_s=4)
    assert time.monotonic() - t0 < 20
    msg = str(info.value)
    assert "ranks [0, 1]" in msg and "_deadlock" in msg
    assert run_on_ranks(_rank_and_sum, 1.0, world_size=2)[1][0] == 1  # rebuilt


def _raise_after_collective_mismatch():
    if dist.get_rank() == 0:
        raise ValueError("rank 0 gave up")
    dist.barrier()  # blocked forever: rank 0 is gone


def test_failure_that_strands_other_ranks_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank 0 gave up") as info:
        run_on_ranks(_raise_after_collective_mismatch, world_size=2, timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert "still blocked" in "\n".join(info.value.__notes__)


def test_run_local_from_plain_process_with_closure():
    offset = 10.0  # a closure: run_local forks, so nothing needs pickling by reference

    def body():
        t = torch.tensor([float(dist.get_rank())]) + offset
        dist.all_reduce(t)
        return t.item()

    assert fs.run_local(body, world_size=2) == [21.0, 21.0]


def test_run_local_propagates_failure_and_leaves_no_children():
    import multiprocessing as mp

    def body():
        if dist.get_rank() == 1:
            raise RuntimeError("remote trouble")
        dist.barrier()

    with pytest.raises(RuntimeError, match="remote trouble") as info:
        fs.run_local(body, world_size=2, timeout_s=60)
    notes = "\n".join(info.value.__notes__)
    assert "rank 1 of 2" in notes
    # Rank 1 is stopped as soon as it reports, so rank 0's barrier fails with a lost peer
    # there and then, rather than blocking until the grace period ends and it is killed.
    assert "rank 0 also failed" in notes and "still blocked" not in notes, notes
    assert [p for p in mp.active_children() if p.name.startswith("fshard-local-rank")] == []


def test_run_local_blames_the_raiser_not_a_peer_that_aborts_when_its_connection_closes():
    """A peer blocked in a native collective may abort when the failed rank is stopped and
    its connections close (the parent caused that death): the rank that raised is blamed."""
    import os
    import signal

    def body():
        if dist.get_rank() == 1:
            raise RuntimeError("the real trouble")
        try:
            dist.barrier()
        except Exception:
            os.kill(os.getpid(), signal.SIGABRT)  # as a native abort on the lost peer would

    with pytest.raises(RuntimeError, match="the real trouble") as info:
        fs.run_local(body, world_size=2, timeout_s=60)
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 1 of 2" in notes, notes
    assert "rank 0 also failed" in notes and "SIGABRT" in notes, notes


def test_cause_ranks_deaths_raises_late_deaths_and_lost_peers():
    from fshard.runtime.local import _cause

    died = (None, "rank 0 died (killed by SIGSEGV, exit code -11) during f")
    raised = (ValueError("x"), "Traceback ...\nValueError: x")
    lost = (RuntimeError("y"), "Traceback ...\nRuntimeError: Connection closed by peer")
    assert _cause({1: raised, 0: died}) == 0  # a death beats a raise
    assert _cause({1: raised, 0: died}, late_deaths={0}) == 1  # unless the parent caused it
    assert _cause({2: lost, 0: died}, late_deaths={0}) == 0  # still above a lost peer
    assert _cause({2: lost, 1: raised}) == 1
    assert _cause({3: raised, 1: raised}) == 3  # ties: the first to arrive


_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_init_is_noop_for_one_process(monkeypatch):
    for v in _TORCHRUN:
        monkeypatch.delenv(v, raising=False)
    fs.init()  # neither raises nor needs a group


def test_init_partial_torchrun_env_names_missing(monkeypatch):
    if dist.is_initialized():
        dist.destroy_process_group()
    for v in _TORCHRUN:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"MASTER_ADDR.*MASTER_PORT"):
        fs.init()


def test_one_process_mesh_needs_no_torchrun(monkeypatch):
    for v in _TORCHRUN:
        monkeypatch.delenv(v, raising=False)
    mesh = fs.make_mesh({"fsdp": 1})
    assert mesh.size == 1 and mesh.axis_index("fsdp") == 0
    with pytest.raises(ValueError, match=r"needs 4 processes.*run_local"):
        if dist.is_initialized():
            dist.destroy_process_group()
        fs.make_mesh({"fsdp": 4})


@pytest.mark.parametrize("cuda, expected", [(True, "nccl"), (False, "gloo")])
def test_one_process_group_uses_the_machines_backend(monkeypatch, cuda, expected):
    # A plain `python script.py` on a GPU machine must compute on the GPU, as the same
    # script under `torchrun --nproc-per-node 1` does (fs.init picks nccl there). This
    # machine has no GPU, so CUDA's presence is faked and the group start is recorded.
    from fshard.runtime import process

    if dist.is_initialized():
        dist.destroy_process_group()
    for v in _TORCHRUN:
        monkeypatch.delenv(v, raising=False)
    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: started.append((backend, kw["world_size"])))
    process.ensure_initialized(1)
    assert started == [(expected, 1)]


class _Unimportable(Exception):
    pass


def _raise_unimportable():
    import types

    mod = types.ModuleType("only_on_the_ranks")
    _Unimportable.__module__ = "only_on_the_ranks"  # the parent cannot import it to unpickle
    import sys

    sys.modules["only_on_the_ranks"] = mod
    mod._Unimportable = _Unimportable
    raise _Unimportable("from a module the caller lacks")


def test_error_the_caller_cannot_unpickle_is_reported_and_the_pool_stays_in_step():
    with pytest.raises(RuntimeError, match=r"cannot be unpickled here: ModuleNotFoundError"):
        run_on_ranks(_raise_unimportable, world_size=2)
    # No rank's stale reply is left in the pipes for the next call.
    assert run_on_ranks(_rank_and_sum, 1.0, world_size=2) == [(0, 3.0, 0), (1, 3.0, 1)]


def _rank():
    return dist.get_rank()


def test_run_local_after_this_process_destroyed_its_own_group(monkeypatch):
    # A one-process mesh stays in the mesh cache after its group is destroyed (as
    # test_one_process_mesh_needs_no_torchrun leaves it). The forked ranks inherit it and
    # must not free it: its destructor would join gloo threads that did not survive the
    # fork (seen as a start-up hang in a shuffled suite run).
    for v in _TORCHRUN:
        monkeypatch.delenv(v, raising=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    fs.make_mesh({"fsdp": 1})  # cached; no other reference
    dist.destroy_process_group()
    assert fs.run_local(_rank, world_size=2, timeout_s=60) == [0, 1]
    # A new world does not get the stale mesh back from the cache.
    mesh = fs.make_mesh({"fsdp": 1})
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.group("fsdp"))
    assert t.item() == 1.0
    dist.destroy_process_group()


def test_a_started_rank_waits_for_the_pool_before_it_connects(tmp_path):
    # A forked rank inherits the parent's locks as they were at the fork. Had it connected
    # to the store at once, the parent's store thread could hold glibc's resolver lock
    # (formatting an earlier rank's address) while the next rank was forked, and that rank
    # hung in getnameinfo (a 4-rank run_local of bench/plan_validate.py did). So a rank
    # connects only after the pool released it; here it is not released.
    import multiprocessing as mp

    from fshard.runtime import local

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=local._worker_main, args=(0, 1, 1, child, str(tmp_path / "stack"), 5.0), daemon=True)
    p.start()
    child.close()
    try:
        assert not parent.poll(1.0)  # waiting for the pool: no store connection tried (port 1 has none)
        parent.send("not go")
        assert parent.poll(30)
        kind, (_, tb) = parent.recv()
        assert kind == "err" and "not released by the pool" in tb, tb
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
