"""Issue 36 row 3: the configured timeout reaches every group fshard makes.

Before: ``FSHARD_TIMEOUT_S``, ``fs.init(timeout=)`` and ``run_local(timeout_s=)`` reached
only the world group; every mesh sub-group (one per axis, one per set of axes) and the
checkpoint group kept torch's 30-minute default, so a SIGSTOPped rank on a
``dp=2,fsdp=2`` mesh with ``FSHARD_TIMEOUT_S=20`` still hung the others at 300 s. Now each
group is made with ``fshard.runtime.process.group_timeout()`` (the world's timeout), and a
rank whose collective times out names the ranks that stopped responding (heartbeats in
the job's store, ``fshard.runtime.failure``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import fshard as fs
from fshard.runtime import failure, process
from fshard.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 10  # the short timeout of the SIGSTOP tests


def _timeout_of(group) -> timedelta:
    # Read here, not through fshard.runtime.process.read_group_timeout: the code under test
    # must not also be the measuring tool. torch 2.13 has no public getter.
    return group._get_backend(torch.device("cpu")).options._timeout


def _group_timeouts(mesh) -> dict[str, timedelta]:
    """The timeout of the world group and of every group ``mesh`` holds, by axes."""
    out = {"world": _timeout_of(dist.group.WORLD)}
    for a in mesh.axis_names:
        out[a] = _timeout_of(mesh.group(a))
    for axes in mesh._groups:
        out[",".join(axes)] = _timeout_of(mesh.group(axes))
    return out


def _timeouts_of_every_group() -> dict[str, timedelta]:
    from fshard.checkpoint import _common

    out = {}
    for shape in ({"dp": 2, "fsdp": 2}, {"pp": 2, "dp": 1, "fsdp": 2}, {"fsdp": 4}):
        mesh = fs.make_mesh(shape)
        out.update({f"{mesh!r} {k}": v for k, v in _group_timeouts(mesh).items()})
    out["checkpoint"] = _timeout_of(_common.group())
    return out


def test_run_local_timeout_reaches_every_mesh_pipeline_and_checkpoint_group():
    # 17 s: no torch default and no fshard default, so only propagation explains it.
    timeouts = fs.run_local(_timeouts_of_every_group, world_size=4, timeout_s=17)
    for rank_timeouts in timeouts:
        wrong = {k: v for k, v in rank_timeouts.items() if v != timedelta(seconds=17)}
        assert not wrong, f"groups without the configured 17 s timeout: {wrong}"
    # the pipeline axis and the multi-axis groups are among those checked
    assert any(" pp" in k for k in timeouts[0]) and any("pp,fsdp" in k for k in timeouts[0])


_INIT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import fshard as fs
    from fshard.runtime import process
    from fshard.checkpoint import _common

    if sys.argv[1] == "arg":
        fs.init(timeout=12)
    else:
        os.environ["FSHARD_TIMEOUT_S"] = "13"  # set after import: read when used
        fs.init()
    mesh = fs.make_mesh({"a": 1, "b": 1})
    groups = {"world": dist.group.WORLD, "a": mesh.group("a"), "b": mesh.group("b"),
              "a,b": mesh.group(("a", "b")), "checkpoint": _common.group()}
    out = {k: g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for k, g in groups.items()}
    out["group_timeout()"] = process.group_timeout().total_seconds()
    print(json.dumps(out))
    fs.shutdown()
""")


@pytest.mark.parametrize("how, seconds", [("arg", 12), ("env", 13)])
def test_fs_init_timeout_and_env_reach_every_group(how, seconds, tmp_path):
    script = tmp_path / "init_timeout.py"
    script.write_text(_INIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("FSHARD_TIMEOUT_S", None)
    proc = subprocess.run([sys.executable, str(script), how], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == dict.fromkeys(found, float(seconds)), found


def test_a_non_positive_timeout_is_refused_naming_the_value(monkeypatch):
    with pytest.raises(ValueError, match=r"fs.init\(timeout=...\) must be a positive number of seconds, got -1.0"):
        process._timeout(-1)
    for bad in ("0", "-5", "abc", "nan"):
        monkeypatch.setenv("FSHARD_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=rf"FSHARD_TIMEOUT_S must be a positive number of seconds, got '{bad}'"):
            process._env_timeout()


# --- a SIGSTOPped rank on a 2-D mesh -----------------------------------------------

_STOP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    import fshard as fs

    out = Path(sys.argv[1])
    fs.init()
    rank = dist.get_rank()
    (out / f"rank{rank}.pid").write_text(str(os.getpid()))
    mesh = fs.make_mesh({"dp": 2, "fsdp": 2})
    x = torch.ones(4)
    dist.all_reduce(x, group=mesh.group("fsdp"))  # every pair connected
    if rank == 3:
        (out / "stopped").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(x, group=mesh.group("fsdp"))  # rank 2 waits for rank 3 here
    dist.all_reduce(x, group=mesh.group("dp"))    # ranks 0 and 1 wait for 2 and 3 here
    fs.shutdown()
""")


def _kill_left_behind(pid_dir: Path, script: Path) -> None:
    """SIGKILLs any rank of ``script`` still there (a stopped one ignores everything else);
    none should be. The command line is checked: a finished rank's pid may be reused."""
    for f in pid_dir.glob("rank*.pid"):
        try:
            p = psutil.Process(int(f.read_text()))
            if str(script) in p.cmdline():
                p.kill()
        except (psutil.Error, ValueError):
            pass


def _wait_until_gone(pids: list[int], deadline: float) -> float | None:
    """The time at which every process in ``pids`` had exited, or None at ``deadline``."""
    while time.time() < deadline:
        if not any(_alive(p) for p in pids):
            return time.time()
        time.sleep(0.2)
    return None


def _alive(pid: int) -> bool:
    # It may exit between the two questions (CI, shuffled run: NoSuchProcess from status()).
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(240)
def test_a_sigstopped_rank_on_a_2d_mesh_fails_the_others_within_the_timeout_and_is_named(tmp_path):
    script = tmp_path / "stop_rank.py"
    script.write_text(_STOP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FSHARD_TIMEOUT_S": str(STOP_TIMEOUT_S)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        start = time.time()
        while not (tmp_path / "stopped").exists():
            assert proc.poll() is None and time.time() - start < 120, "".join(output)[-5000:]
            time.sleep(0.2)
        stopped_at = float((tmp_path / "stopped").read_text())
        others = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(3)]
        # Before: the others hung 30 minutes in the sub-group collective.
        gone_at = _wait_until_gone(others, stopped_at + STOP_TIMEOUT_S + 30)
        assert gone_at is not None, f"ranks 0-2 still up {STOP_TIMEOUT_S + 30} s after rank 3 stopped"
        proc.wait(timeout=90)  # torchrun kills the stopped rank itself (SIGKILL after 30 s)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill_left_behind(tmp_path, script)
    out = "".join(output)
    assert proc.returncode != 0
    assert "Timed out waiting" in out, out[-5000:]
    named = [line for line in out.splitlines() if "stopped responding" in line]
    assert named, f"no rank named the stopped one:\n{out[-5000:]}"
    assert all("rank 3 stopped responding" in line for line in named), named


def _stop_rank_3_in_a_sub_group_collective():
    mesh = fs.make_mesh({"dp": 2, "fsdp": 2})
    x = torch.ones(4)
    dist.all_reduce(x, group=mesh.group("fsdp"))
    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(x, group=mesh.group("fsdp"))
    dist.all_reduce(x, group=mesh.group("dp"))


@pytest.mark.timeout(120)
def test_run_local_names_a_sigstopped_rank_as_the_likely_cause():
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        fs.run_local(_stop_rank_3_in_a_sub_group_collective, world_size=4, timeout_s=STOP_TIMEOUT_S)
    assert time.monotonic() - t0 < STOP_TIMEOUT_S + 30
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert "rank 3 was stopped (SIGSTOP" in text, text[-3000:]


# --- the heartbeat, in this process against an in-memory store --------------------

def test_a_timeout_is_recognised_through_chained_errors():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
    assert failure.is_timeout(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as outer:
        assert failure.is_timeout(outer)
    assert not failure.is_timeout(ValueError("bad shape"))


def test_heartbeats_tell_a_stopped_rank_from_a_waiting_one():
    store = dist.HashStore()
    stop = threading.Event()
    beating = [threading.Thread(target=failure._beat, args=(store, f"fshard/alive/{r}", 0.05, stop), daemon=True)
               for r in (0, 2)]
    for t in beating:
        t.start()
    store.add("fshard/alive/3", 5)  # rank 3 beat, then stopped
    store.add("fshard/alive/4", 5)  # rank 4 beat, then exited cleanly
    store.set("fshard/exited/4", "1")
    try:
        assert failure.unresponsive_ranks(store, 1, 5, 0.05) == [3]
    finally:
        stop.set()


def test_a_timed_out_rank_names_the_silent_rank_and_leaves_an_obituary(monkeypatch, capsys):
    monkeypatch.setattr(failure, "unresponsive_ranks", lambda *a: [3])
    store = dist.HashStore()
    failure._report_timeout(store, 1, 4, 0.05, RuntimeError("Timed out waiting 10000ms for recv"))
    err = capsys.readouterr().err
    assert "fshard: rank 1 of 4: the error above is a timeout: rank 3 stopped responding" in err
    assert store.get("fshard/failed/1").decode().endswith("(rank 3 stopped responding)")


def test_a_timeout_with_every_rank_alive_says_deadlock(monkeypatch, capsys):
    monkeypatch.setattr(failure, "unresponsive_ranks", lambda *a: [])
    failure._report_timeout(dist.HashStore(), 0, 2, 0.05, RuntimeError("Timed out waiting"))
    assert "every rank is still alive: a deadlock" in capsys.readouterr().err
