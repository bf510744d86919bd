"""Issue 36, the checkpoint rows: 1 (two jobs, one path), 2 (background save and shutdown),
4 (save_hf on a full disk), 6 (load_hf's prefix fallback), 9 (ranks with different paths),
10 (disk full), 11 (deleted checksum file) and 16's dtype mismatch on resume.

Each test reproduces the probe's finding and fails on the code before the fix (68481d9):
there, a concurrent save deleted the other's temporary directory and committed a checkpoint
with no data; ``fs.shutdown()`` destroyed the groups under a background save and exited 0;
``save_hf`` raised on rank 0 only and left the others waiting; ``encoder.embed.weight``
loaded the file's ``embed.weight``; ranks given different paths mixed two checkpoints; a
full disk said ``unexpected pos``; a checkpoint without its checksum file loaded a flipped
byte; a float64 checkpoint in a float32 run raised a ``ValueError`` that
``examples/train_lm.py`` printed as a traceback per rank.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _harness.optional import requires

import fshard as fs
import fshard.checkpoint as ckpt
from fshard import P
from fshard.testing import FORKSERVER_PRELOAD, run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = pytest.mark.timeout(300)


def _forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # the rank pools' forkserver: no re-import
    return ctx


def _entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


# --- row 1: two jobs saving to one path ----------------------------------------------


def _stalled_saver(path: str, marker: str) -> None:
    """A job that starts a save and stalls mid-write until it is killed."""
    import torch.distributed.checkpoint.filesystem as dfs

    real = dfs._write_item

    def stall(*args, **kwargs):
        out = real(*args, **kwargs)
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
        return out

    dfs._write_item = stall
    ckpt.save(path, {"w": torch.full((64, 64), 9.0), "step": 9})


@TIMEOUT
def test_a_save_in_flight_refuses_a_second_job_and_a_dead_ones_lock_is_taken_over(tmp_path):
    path, marker = str(tmp_path / "ck"), str(tmp_path / "marker")
    ckpt.save(path, {"w": torch.full((64, 64), 1.0), "step": 1})
    other = _forkserver().Process(target=_stalled_saver, args=(path, marker))
    other.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert other.is_alive() and time.monotonic() < deadline, "the other job did not reach its write"
            time.sleep(0.05)
        in_flight = [e for e in _entries(tmp_path) if e.startswith(".ck.tmp-")]
        assert len(in_flight) == 1
        with pytest.raises(ckpt.CheckpointError) as info:
            ckpt.save(path, {"w": torch.full((64, 64), 2.0), "step": 2})
        msg = str(info.value)
        assert isinstance(info.value, ckpt.CheckpointLockedError)
        assert f"cannot save to '{path}': another save to it is in progress" in msg
        assert f"pid {other.pid} on host '{socket.gethostname()}'" in msg and ".ck.lock" in msg
        assert in_flight[0] in _entries(tmp_path)  # the other job's save in flight is untouched
        os.kill(other.pid, signal.SIGKILL)
        other.join(10)
    finally:
        if other.is_alive():
            other.kill()
    # The holder is dead: its lock is stale, the next save takes it over and clears its leftovers.
    ckpt.save(path, {"w": torch.full((64, 64), 3.0), "step": 3})
    assert _entries(tmp_path) == ["ck", "marker"]
    assert ckpt.load(path, like={"step": 0})["step"] == 3


def _write_lock(path: str, pid: int, token: str) -> None:
    """The lock file a save by ``pid`` holds (written by hand, as fshard's _lock does)."""
    with open(f"/proc/{pid}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    record = {"host": socket.gethostname(), "pid": pid, "start": start, "boot": boot, "token": token,
              "since": time.time()}
    with open(os.path.join(os.path.dirname(path), ".ck.lock"), "w") as f:
        json.dump(record, f)


@TIMEOUT
def test_stale_temp_dirs_are_deleted_only_when_their_owner_is_dead(tmp_path):
    path = str(tmp_path / "ck")
    ckpt.save(path, {"v": torch.ones(4), "step": 1})
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(path, live.pid, "aaaaaaaaaaaa")
        (tmp_path / ".ck.tmp-aaaaaaaaaaaa").mkdir()
        with pytest.raises(ckpt.CheckpointError, match=rf"held by pid {live.pid} on host"):
            ckpt.save(path, {"v": torch.zeros(4), "step": 2})
        assert ".ck.tmp-aaaaaaaaaaaa" in _entries(tmp_path)  # a live owner's save is left alone
        # The same lock, its owner killed and not yet reaped (a zombie, as a killed rank is
        # until its parent collects it): dead, so taken over, and its temp dir deleted.
        live.kill()
        deadline = time.monotonic() + 10
        while open(f"/proc/{live.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ckpt.save(path, {"v": torch.zeros(4), "step": 2})
    finally:
        live.kill()
        live.wait()
    assert _entries(tmp_path) == ["ck"]
    assert ckpt.load(path, like={"step": 0})["step"] == 2


def _hammer(path: str, job: int, saves: int, problems_file: str) -> dict:
    """One job's saves to the shared path; right after each commit (still under the save
    lock, so no other job can commit in between) the committed directory is read back."""
    from fshard.checkpoint import _dirs

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = fs.make_mesh({"x": 2}) if dist.is_initialized() else None
    real_commit = _dirs.commit
    problems: list[str] = []
    current: dict = {}

    def checked_commit(tmp, target):
        real_commit(tmp, target)
        try:
            flat = ckpt.load(target)
            if flat["tag"] != current["tag"] or not torch.equal(flat["w"], torch.full((8, 8), float(current["tag"]))):
                problems.append(f"job {job}: committed tag {flat['tag']}, values of another save")
        except Exception as e:  # a committed checkpoint missing data
            problems.append(f"job {job} save {current['tag']}: {type(e).__name__}: {e}")

    _dirs.commit = checked_commit
    committed, refusals = 0, []
    try:
        for i in range(saves):
            tag = job * 1000 + i
            current["tag"] = tag
            w = torch.full((8, 8), float(tag))
            tree = {"w": fs.shard(w, P("x"), mesh) if mesh is not None else w, "tag": tag,
                    "pad": torch.zeros(2000)}
            try:
                ckpt.save(path, tree)
                committed += 1
            except ckpt.CheckpointError as e:
                refusals.append(str(e))
            time.sleep(0.01 * (i % 3))
    finally:
        _dirs.commit = real_commit
    if rank == 0:
        with open(problems_file, "a") as f:
            f.writelines(p + "\n" for p in problems)
    return {"committed": committed, "refusals": refusals}


def _hammer_child(path: str, saves: int, problems_file: str, out_file: str, go: str) -> None:
    while not os.path.exists(go):
        time.sleep(0.01)
    out = _hammer(path, 2, saves, problems_file)
    with open(out_file, "w") as f:
        json.dump(out, f)


@TIMEOUT
def test_two_jobs_hammering_one_path_never_commit_a_checkpoint_missing_data(tmp_path):
    """Job 1 runs on 2 ranks, job 2 is one process; both save 15 times to the same path."""
    path = str(tmp_path / "ck")
    problems, out2, go = str(tmp_path / "problems"), str(tmp_path / "job2.json"), str(tmp_path / "go")
    open(problems, "w").close()
    other = _forkserver().Process(target=_hammer_child, args=(path, 15, problems, out2, go))
    other.start()
    try:
        open(go, "w").close()
        job1 = run_on_ranks(_hammer, path, 1, 15, problems, world_size=2, timeout_s=240)
        other.join(180)
        assert other.exitcode == 0, f"job 2 exited with {other.exitcode}"
    finally:
        if other.is_alive():
            other.kill()
    with open(out2) as f:
        job2 = json.load(f)
    with open(problems) as f:
        bad = f.read().splitlines()
    assert not bad, bad[:5]
    refusals = job1[0]["refusals"] + job2["refusals"]
    print(f"committed: job 1 {job1[0]['committed']}, job 2 {job2['committed']}; refused: {len(refusals)}")
    for r in refusals:  # the only failure allowed: a clear refusal
        assert f"cannot save to '{path}': another save to it is in progress" in r, r
    assert job1[0]["committed"] + job2["committed"] + len(refusals) == 30
    assert job1[0]["committed"] + job2["committed"] >= 1
    final = ckpt.load(path)  # whole, and one of the saves' values
    assert torch.equal(final["w"], torch.full((8, 8), float(final["tag"])))
    assert _entries(tmp_path) == ["ck", "go", "job2.json", "problems"]  # no lock, no leftovers


def _deleting_write_checksums(real):
    def wrapped(tmp, checksums):
        os.remove(os.path.join(tmp, "__0_0.distcp"))  # another process deletes a data file
        return real(tmp, checksums)
    return wrapped


def test_the_commit_checks_every_file_before_renaming(tmp_path, monkeypatch):
    from fshard.checkpoint import _save

    path = str(tmp_path / "ck")
    ckpt.save(path, {"w": torch.ones(16), "step": 1})
    monkeypatch.setattr(_save, "write_checksums", _deleting_write_checksums(_save.write_checksums))
    with pytest.raises(ckpt.CheckpointError, match=r"is not committed.*'w'.*__0_0.distcp' is missing.*unchanged"):
        ckpt.save(path, {"w": torch.zeros(16), "step": 2})
    monkeypatch.undo()
    assert _entries(tmp_path) == ["ck"]
    assert ckpt.load(path, like={"step": 0})["step"] == 1


# --- row 2: a background save, then fs.shutdown() or the exit --------------------------

_SHUTDOWN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed.checkpoint as dcp
    import fshard as fs

    def slow_then(fail):
        real = dcp.FileSystemWriter.write_data
        def write(self, plan, planner):
            time.sleep(1.0)
            if fail:
                raise OSError("write failed (injected)")
            return real(self, plan, planner)
        dcp.FileSystemWriter.write_data = write

    def body(path, fail):
        mesh = fs.make_mesh({"x": 2})
        slow_then(fail)
        fs.checkpoint.save(path, {"w": fs.shard(torch.ones(8, 4), fs.P("x"), mesh), "step": 7}, blocking=False)
        try:
            fs.shutdown()
        except fs.checkpoint.CheckpointError as e:
            return "raised: " + str(e)
        return "returned"

    root = sys.argv[1]
    print("ok:", fs.run_local(body, os.path.join(root, "ok"), False, world_size=2, timeout_s=120))
    print("failed:", fs.run_local(body, os.path.join(root, "bad"), True, world_size=2, timeout_s=120))
""")


def _python(code: str, *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@TIMEOUT
def test_shutdown_waits_for_a_background_save_and_raises_when_it_failed(tmp_path):
    proc = _python(_SHUTDOWN_SCRIPT, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert lines["ok"] == "['returned', 'returned']"
    assert "fs.shutdown() waits up to" in proc.stderr and str(tmp_path / "ok") in proc.stderr
    out = ckpt.load(str(tmp_path / "ok"), like={"w": torch.zeros(8, 4), "step": 0})
    assert out["step"] == 7 and torch.equal(out["w"], torch.ones(8, 4))
    # A background save that fails: fs.shutdown() raises it on every rank, naming the path.
    assert lines["failed"].count("raised: ") == 2, lines["failed"]
    assert str(tmp_path / "bad") in lines["failed"] and "write failed (injected)" in lines["failed"]
    assert not os.path.exists(tmp_path / "bad")


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed.checkpoint as dcp
    import fshard as fs

    fs.make_mesh({"x": 1})  # a one-rank group: fshard's teardown runs at exit
    def failing(self, plan, planner):
        raise OSError("write failed (injected)")
    dcp.FileSystemWriter.write_data = failing
    fs.checkpoint.save(sys.argv[1], {"w": torch.ones(4)}, blocking=False)
    print("script done")
""")


@TIMEOUT
def test_a_failed_background_save_nobody_waited_for_fails_the_exit(tmp_path):
    path = str(tmp_path / "ck")
    proc = _python(_EXIT_SCRIPT, path)
    assert "script done" in proc.stdout
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "fshard: error at exit" in proc.stderr and path in proc.stderr
    assert "write failed (injected)" in proc.stderr


# --- row 4: save_hf on a full disk -------------------------------------------------


def _save_hf_full_disk_body(root: str) -> dict:
    import safetensors
    import safetensors.torch as st

    mesh = fs.make_mesh({"x": 2})
    path = os.path.join(root, "hf")
    params = {"a.weight": fs.shard(torch.ones(4, 4), P("x"), mesh), "b.bias": fs.shard(torch.ones(4), P(), mesh)}
    ckpt.save_hf(path, params)
    real = st.save_file

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 10)  # part of the file, then the disk is full
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')

    st.save_file = full if dist.get_rank() == 0 else real
    try:
        ckpt.save_hf(path, {k: v * 2 for k, v in params.items()})
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    finally:
        st.save_file = real
    dist.barrier()
    back = ckpt.load_hf(path, like=params)
    return {"error": error, "entries": _entries(root),
            "intact": torch.equal(back["a.weight"].full_tensor(), torch.ones(4, 4))}


@TIMEOUT
@requires("safetensors")
def test_save_hf_failure_on_rank_0_is_raised_on_every_rank_and_its_temp_dir_removed(tmp_path):
    for out in run_on_ranks(_save_hf_full_disk_body, str(tmp_path), world_size=2, timeout_s=60, grace_s=2):
        assert out["error"] and "no space left" in out["error"] and str(tmp_path / "hf") in out["error"]
        assert "bytes" in out["error"]
        assert out["entries"] == ["hf"]  # no temporary directory, no lock
        assert out["intact"]


# --- row 6: load_hf's prefix fallback ---------------------------------------------------


def test_load_hf_does_not_guess_a_prefix_while_other_names_match():
    w, h = torch.randn(4, 3), torch.randn(2)
    with pytest.raises(ckpt.CheckpointError, match=r"'encoder.embed.weight'.*'embed.weight'.*prefix 'encoder.'"):
        ckpt.load_hf({"embed.weight": w, "head.bias": h},
                     like={"encoder.embed.weight": torch.zeros(4, 3), "head.bias": torch.zeros(2)})
    # Two template names, one file name: the second must not silently read the first's tensor.
    with pytest.raises(ckpt.CheckpointError, match=r"'encoder.embed.weight'.*'embed.weight'"):
        ckpt.load_hf({"embed.weight": w}, like={"embed.weight": torch.zeros(4, 3),
                                                "encoder.embed.weight": torch.zeros(4, 3)}, strict=False)
    with pytest.raises(ckpt.CheckpointError, match=r"different prefixes dropped.*'a.x' -> 'x'.*'b.y' -> 'y'"):
        ckpt.load_hf({"x": w, "y": h}, like={"a.x": torch.zeros(4, 3), "b.y": torch.zeros(2)})
    # A base-model checkpoint: no name matches as it is, one prefix for all of them (GPT-2's hub files).
    out = ckpt.load_hf({"embed.weight": w, "head.bias": h},
                       like={"transformer.embed.weight": torch.zeros(4, 3), "transformer.head.bias": torch.zeros(2)})
    assert torch.equal(out["transformer.embed.weight"], w) and torch.equal(out["transformer.head.bias"], h)


# --- row 9: ranks passing different paths --------------------------------------------


def _different_paths_body(root: str) -> dict:
    mesh = fs.make_mesh({"x": 2})
    ckpt.save(os.path.join(root, "both"), {"w": fs.shard(torch.ones(4, 4), P("x"), mesh)})
    mine = os.path.join(root, f"r{dist.get_rank()}")
    out = {}
    try:
        ckpt.save(mine, {"w": fs.shard(torch.ones(4, 4), P("x"), mesh)})
        out["save"] = "saved"
    except ckpt.CheckpointError as e:
        out["save"] = str(e)
    path = os.path.join(root, "both") if dist.get_rank() == 0 else os.path.join(root, "r0")
    try:
        ckpt.load(path, like={"w": fs.shard(torch.zeros(4, 4), P("x"), mesh)})
        out["load"] = "loaded"
    except ckpt.CheckpointError as e:
        out["load"] = str(e)
    dist.barrier()
    out["entries"] = _entries(root)
    return out


@TIMEOUT
def test_ranks_with_different_paths_fail_on_every_rank_naming_ranks_and_paths(tmp_path):
    r0, r1, both = str(tmp_path / "r0"), str(tmp_path / "r1"), str(tmp_path / "both")
    for out in run_on_ranks(_different_paths_body, str(tmp_path), world_size=2, timeout_s=90):
        assert f"fs.checkpoint.save: the ranks passed different paths (rank 0: '{r0}'; rank 1: '{r1}')" in out["save"]
        assert f"(rank 0: '{both}'; rank 1: '{r0}')" in out["load"] and "fs.checkpoint.load" in out["load"]
        assert out["entries"] == ["both"]  # nothing written at either path


# --- row 10: disk full -------------------------------------------------------------------


def _disk_full_body(path: str) -> dict:
    import torch.distributed.checkpoint.filesystem as dfs

    mesh = fs.make_mesh({"x": 2})
    ckpt.save(path, {"w": fs.shard(torch.ones(64, 64), P("x"), mesh), "step": 1})
    real = dfs._write_item

    def full(*args, **kwargs):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    dfs._write_item = full
    try:
        ckpt.save(path, {"w": fs.shard(torch.zeros(64, 64), P("x"), mesh), "step": 2})
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    finally:
        dfs._write_item = real
    back = ckpt.load(path, like={"w": fs.shard(torch.zeros(64, 64), P("x"), mesh), "step": 0})
    dist.barrier()
    return {"error": error, "step": back["step"], "intact": torch.equal(back["w"].full_tensor(), torch.ones(64, 64)),
            "entries": _entries(os.path.dirname(path))}


@TIMEOUT
def test_disk_full_says_no_space_left_with_path_and_bytes_and_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    for out in run_on_ranks(_disk_full_body, path, world_size=2, timeout_s=90):
        err = out["error"]
        assert err and f"saving the checkpoint '{path}' failed: no space left on the device of '{tmp_path}'" in err
        needed = int(err.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
        assert needed >= 64 * 64 * 4
        assert out["step"] == 1 and out["intact"] and out["entries"] == ["ck"]


def test_a_write_failure_on_a_full_file_system_says_no_space_left(tmp_path, monkeypatch):
    """torch's own words for a short write (``unexpected pos``) name no space: the free space does."""
    import torch.distributed.checkpoint.filesystem as dfs

    from fshard.checkpoint import _space

    path = str(tmp_path / "ck")
    ckpt.save(path, {"w": torch.ones(256), "step": 1})

    def short(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing "
                           "file data/0: unexpected pos 704 vs 598")

    monkeypatch.setattr(dfs, "_write_item", short)
    real_free = _space.free_bytes
    calls = []

    def free_after_first(directory):  # room at the start, none once the write failed
        calls.append(directory)
        return real_free(directory) if len(calls) == 1 else 100

    monkeypatch.setattr(_space, "free_bytes", free_after_first)
    with pytest.raises(ckpt.CheckpointError, match=rf"'{path}' failed: no space left .*needs about [\d,]+ bytes"):
        ckpt.save(path, {"w": torch.zeros(256), "step": 2})
    monkeypatch.setattr(_space, "free_bytes", lambda d: 1000)  # too little from the start: refused before writing
    with pytest.raises(ckpt.CheckpointError, match=r"no space left.*1,000 bytes are free"):
        ckpt.save(path, {"w": torch.zeros(256), "step": 2})
    monkeypatch.undo()
    assert _entries(tmp_path) == ["ck"] and ckpt.load(path, like={"step": 0})["step"] == 1


# --- row 11: a deleted checksum file -----------------------------------------------------


def _flip_first_item(path: str) -> None:
    md = ckpt.read_metadata(path)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length - 4)
        byte = f.read(1)
        f.seek(info.offset + info.length - 4)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_deleted_checksum_file_is_detected(tmp_path):
    path = str(tmp_path / "ck")
    ckpt.save(path, {"w": torch.arange(64.0), "step": 1})
    _flip_first_item(path)
    os.remove(os.path.join(path, ".fshard-checksums.json"))
    with pytest.raises(ckpt.CheckpointError, match=r"ck' is incomplete: its .fshard-checksums.json is missing"):
        ckpt.load(path, like={"w": torch.zeros(64), "step": 0})
    with pytest.raises(ckpt.CheckpointError, match=r"fshard-checksums.json is missing"):
        ckpt.load(path)
    os.remove(os.path.join(path, ".fshard-manifest.json"))  # both: the .metadata still says so
    with pytest.raises(ckpt.CheckpointError, match=r"ck' is incomplete: its .metadata says the save wrote "
                                                   r".fshard-manifest.json"):
        ckpt.load(path, like={"w": torch.zeros(64), "step": 0})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_from_before_the_manifest_still_loads(tmp_path):
    path = str(tmp_path / "old")
    dcp.save({"w": torch.arange(4.0)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    assert torch.equal(ckpt.load(path, like={"w": torch.zeros(4)})["w"], torch.arange(4.0))


# --- row 16: a dtype mismatch on resume ------------------------------------------------------


def test_a_dtype_mismatch_on_resume_is_one_line_and_a_checkpoint_error(tmp_path):
    path = str(tmp_path / "ck")
    ckpt.save(path, {"params": {"w": torch.ones(4, dtype=torch.float64), "b": torch.ones(2, dtype=torch.float64)},
                     "step": 3})
    like = {"params": {"w": torch.zeros(4), "b": torch.zeros(2)}, "step": 0}
    with pytest.raises(ckpt.CheckpointError) as info:  # what train_lm.py reports in one line
        ckpt.load(path, like=like)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg
    assert f"the checkpoint '{path}' was saved in another dtype: 2 keys hold torch.float64 where the template " \
           f"has torch.float32" in msg


def _train_lm(argv: list[str]) -> list[dict]:
    from _harness._examples import example

    return example("train_lm").main(argv)


@TIMEOUT
def test_train_lm_resume_in_another_dtype_is_a_checkpoint_error(tmp_path):
    """What ``examples/train_lm.py`` prints in one line (it catches CheckpointError), not a
    traceback per rank."""
    ck = str(tmp_path / "ck")
    tiny = ["--dim", "16", "--layers", "2", "--heads", "4", "--seq-len", "16", "--batch-size", "8", "--quiet",
            "--steps", "4", "--mesh", "fsdp=1", "--checkpoint-dir", ck]
    run_on_ranks(_train_lm, tiny + ["--dtype", "float64", "--stop-at", "2"], world_size=1, timeout_s=200)
    with pytest.raises(ckpt.CheckpointError, match=r"was saved in another dtype: \d+ keys hold torch.float64 "
                                                   r"where the template has torch.float32"):
        run_on_ranks(_train_lm, tiny + ["--dtype", "float32", "--resume"], world_size=1, timeout_s=200)
