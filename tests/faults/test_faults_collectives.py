"""Issue 36 row 8: collectives that differ across ranks are an error on every rank.

Before: different shapes in ``all_gather`` died of SIGABRT (once ``double free or
corruption``), different dtypes in ``psum`` of SIGABRT, ``pmax`` on one rank and ``psum``
on the other gave 4 instead of 5, and shapes (2, 3) against (3, 2) were summed silently.
With ``FSHARD_CHECK_COLLECTIVES=1`` (fshard._contract) each rank raises
``CollectiveMismatchError`` before the collective runs, naming both sides' headers and
the caller's line. Without it, the every-N rolling-hash check names the first collective
that differed. A timeout names which collective each rank is in.
"""

import contextlib
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard import P, comm
from fshard._contract import CollectiveMismatchError, CollectiveTimeoutError
from fshard.testing import run_on_ranks

THIS = os.path.basename(__file__)


@contextlib.contextmanager
def _env(**values):
    """Sets environment variables in this rank for the block (the flag is read at call time)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _diverge(case):
    """Rank 0 and rank 1 run different collectives in one shard_map body; returns
    ``(error type, message, the value of a matching psum afterwards)`` on each rank."""
    mesh = fs.make_mesh({"x": 2})
    r = dist.get_rank()
    bodies = {
        "all_gather_shapes": lambda: fs.lax.all_gather(torch.ones(2 + 2 * r, 3), "x", tiled=True),
        "psum_dtypes": lambda: fs.lax.psum(torch.ones(3, dtype=(torch.float32, torch.float64)[r]), "x"),
        "pmax_vs_psum": lambda: (fs.lax.pmax, fs.lax.psum)[r](torch.full((3,), 2.0 + r), "x"),
        "transposed": lambda: fs.lax.psum(torch.ones(*((2, 3), (3, 2))[r]), "x"),
        "pmean_vs_psum": lambda: (fs.lax.pmean, fs.lax.psum)[r](torch.ones(3), "x"),
    }

    errors = []

    def body(x):
        try:
            bodies[case]()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - the error is the result
            errors.append((type(e).__name__, str(e)))
        return x

    with _env(FSHARD_CHECK_COLLECTIVES=1):
        fs.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check=False)(torch.zeros(2))
        # The group is still in step: a matching collective afterwards gives the right value.
        g = fs.shard_map(lambda x: fs.lax.psum(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P(), check=False)
        after = g(torch.arange(2.0)).to_local().tolist()
    return errors[0], after


@pytest.mark.parametrize("case, want", [
    ("all_gather_shapes", ["all_gather #", "shape (2, 3)", "shape (4, 3)"]),
    ("psum_dtypes", ["psum #", "float32", "float64"]),
    ("pmax_vs_psum", ["pmax #", "psum #"]),
    ("transposed", ["shape (2, 3)", "shape (3, 2)"]),
    ("pmean_vs_psum", ["pmean #", "psum #"]),
])
def test_different_collectives_raise_on_every_rank_naming_both(case, want):
    results = run_on_ranks(_diverge, case, world_size=2, timeout_s=60)
    for rank, (err, after) in enumerate(results):
        assert err is not None and err[0] == "CollectiveMismatchError", (rank, err)
        msg = err[1]
        for piece in want + ["rank 0", "rank 1", "over 'x'", THIS + ":"]:
            assert piece in msg, (rank, piece, msg)
        assert after == [1.0], (rank, after)


def _rolling(every):
    """Flag off: rank 0's pmax against rank 1's psum (silently wrong on the wire) is found by
    the every-N check, which names that first differing collective."""
    mesh = fs.make_mesh({"x": 2})
    r = dist.get_rank()
    err = None
    with _env(FSHARD_CHECK_COLLECTIVES=0, FSHARD_CHECK_EVERY=every):
        def body(x):
            nonlocal err
            try:
                # Fresh numbering for this group: the pool's ranks ran other tests on it.
                from fshard import _contract
                _contract.forget_groups()
                (fs.lax.pmax, fs.lax.psum)[r](x, "x")
                for _ in range(every - 1):
                    fs.lax.psum(x, "x")
            except CollectiveMismatchError as e:
                err = str(e)
            finally:
                _contract.forget_groups()  # the pool's next tests start in step
            return x
        fs.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check=False)(torch.ones(2))
    return err


def test_rolling_hash_without_the_flag_names_the_first_difference():
    for rank, msg in enumerate(run_on_ranks(_rolling, 4, world_size=2, timeout_s=60)):
        assert msg is not None, rank
        assert "pmax #1" in msg and "psum #1" in msg and "rank 0" in msg and "rank 1" in msg, (rank, msg)
        assert "FSHARD_CHECK_EVERY" in msg, msg


def _comm_mismatch():
    """fshard.comm directly (the layer loops' path): shapes differ on an all_gather."""
    r = dist.get_rank()
    with _env(FSHARD_CHECK_COLLECTIVES=1):
        try:
            comm.all_gather(torch.ones(1 + r, 2), dist.group.WORLD, 2, axes=("fsdp",))
        except CollectiveMismatchError as e:
            return str(e)
    return None


def test_comm_level_collectives_are_checked_too():
    for msg in run_on_ranks(_comm_mismatch, world_size=2, timeout_s=60):
        assert msg and "all_gather #" in msg and "shape (1, 2)" in msg and "shape (2, 2)" in msg, msg


def _timeout(stuck):
    """Rank 0 all-gathers over group a while rank 1 sums over group b (or sleeps): both
    groups time out after 3 s; the error says where each rank is."""
    r = dist.get_rank()
    a = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    b = dist.new_group([0, 1], timeout=timedelta(seconds=3))
    x = torch.ones(2)
    with _env(FSHARD_CHECK_COLLECTIVES=1, FSHARD_TIMEOUT_REPORT_S=6):
        try:
            if r == 0:
                comm.all_gather(x, a, 2, axes=("fsdp",))
            elif stuck == "other_group":
                comm.all_reduce(x, b, "sum", axes=("dp",))
            else:
                import time
                time.sleep(12)
                return None
        except CollectiveTimeoutError as e:
            return str(e)
    return None


@pytest.mark.parametrize("stuck", ["other_group", "sleeping"])
def test_timeout_names_each_ranks_collective(stuck):
    msgs = fs.run_local(_timeout, stuck, world_size=2, timeout_s=90)
    msg = msgs[0]
    assert msg is not None and "timed out" in msg, msg
    assert "rank 0 is in all_gather #1 over 'fsdp' (" + THIS in msg, msg
    if stuck == "other_group":
        assert "rank 1 is in psum #1 over 'dp' (" + THIS in msg, msg
        assert msgs[1] is not None and "rank 0 is in all_gather #1" in msgs[1], msgs[1]
    else:
        assert "rank 1: no report of an fshard collective" in msg, msg


def _mismatch_in_run_local():
    """Shapes differ on an all_gather, with whatever flag run_local's ranks were given."""
    r = dist.get_rank()
    try:
        comm.all_gather(torch.ones(1 + r, 2), dist.group.WORLD, 2, axes=("fsdp",))
    except CollectiveMismatchError as e:
        return os.environ.get("FSHARD_CHECK_COLLECTIVES"), str(e)
    return os.environ.get("FSHARD_CHECK_COLLECTIVES"), None


def test_run_local_checks_collectives_by_default(monkeypatch):
    monkeypatch.delenv("FSHARD_CHECK_COLLECTIVES", raising=False)
    for flag, msg in fs.run_local(_mismatch_in_run_local, world_size=2, timeout_s=60):
        assert flag == "1" and msg and "shape (1, 2)" in msg and "shape (2, 2)" in msg, (flag, msg)
    assert "FSHARD_CHECK_COLLECTIVES" not in os.environ  # the caller's environment is untouched


def _flag_in_rank():
    return os.environ.get("FSHARD_CHECK_COLLECTIVES")


def test_run_local_keeps_an_explicit_off(monkeypatch):
    monkeypatch.setenv("FSHARD_CHECK_COLLECTIVES", "0")
    assert fs.run_local(_flag_in_rank, world_size=2, timeout_s=60) == ["0", "0"]
