"""Faults in a multi-rank job (issue 14): a rank killed with SIGKILL, or raising, in the middle of
a collective-heavy step of examples/train_lm.py (FSDP over 4 ranks, remat, a block's gather in
flight), under ``fs.run_local`` and under torchrun (3 ranks there). Every other rank must stop within 60 s with
an error that names the lost rank, and no process may be left behind.

The fault comes from tests/_harness/_faults.py, which wraps ``fs.parallel.scan_layers`` so that the
victim faults at its N-th block call (here the middle of step 3's forward).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import fshard as fs
from fshard.testing import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, where the _harness package is
from _harness import _faults  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# 4 blocks, remat: 8 block calls per step (4 forward, 4 recomputed); call 19 is step 3's 3rd block.
ARGV = ["--mesh", "fsdp=4", "--remat", "--steps", "40", "--dtype", "float64", "--dim", "16", "--layers", "4",
        "--heads", "4", "--seq-len", "16", "--batch-size", "8", "--quiet"]
VICTIM, AT_CALL = 2, 19
LIMIT_S = 60.0
# Under torchrun, 3 ranks (FSDP with uneven shards; a batch of 6, 2 rows per rank): the victim
# and two others to stop, one of them the store's host; each rank is a fresh interpreter
# (~2.5 s of CPU to start).
TORCHRUN_NPROC = 3
TORCHRUN_ARGV = list(ARGV)
TORCHRUN_ARGV[ARGV.index("--mesh") + 1] = "fsdp=3"
TORCHRUN_ARGV[ARGV.index("--batch-size") + 1] = "6"


def _left_behind(pid_dir: Path) -> list[int]:
    """Rank processes (by their pid files) that still exist and are not zombies."""
    alive = []
    for f in sorted(pid_dir.glob("rank*.pid")):
        pid = int(f.read_text())
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _faulty_train(argv: list[str], kind: str, pid_dir: str) -> list[dict]:
    """One rank of fs.run_local: arm the fault, then the example's main."""
    from _harness._examples import example

    train_lm = example("train_lm")
    _faults.arm(kind, VICTIM, AT_CALL, pid_dir)
    return train_lm.main(argv)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_rank_fault_under_run_local_stops_every_rank_and_names_it(kind, tmp_path):
    with pytest.raises(BaseException) as info:
        fs.run_local(_faulty_train, ARGV, kind, str(tmp_path), world_size=4, timeout_s=200)
    done = time.time()
    fault_at = float((tmp_path / "fault").read_text())
    assert done - fault_at < LIMIT_S, f"the other ranks took {done - fault_at:.0f} s to stop"
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if kind == "kill":
        assert isinstance(info.value, RuntimeError)
        assert f"died on rank {VICTIM} of 4" in str(info.value)
        assert f"rank {VICTIM} died (killed by SIGKILL, exit code -9)" in str(info.value)
    else:
        assert type(info.value).__name__ == "InjectedFault", repr(info.value)
        assert f"injected fault on rank {VICTIM}" in str(info.value)
        assert f"raised on rank {VICTIM} of 4" in notes
    assert len(list(tmp_path.glob("rank*.pid"))) == 4
    assert _left_behind(tmp_path) == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["kill", "raise"])
def test_rank_fault_under_torchrun_stops_every_rank_and_names_it(kind, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "FSHARD_TEST_FAULT": f"{kind}:{VICTIM}:{AT_CALL}",
           "FSHARD_TEST_PID_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(TORCHRUN_NPROC),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(ROOT / "tests" / "_harness" / "_faults.py"),
           *TORCHRUN_ARGV]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish:\n{out[-5000:]}")
    done = time.time()
    assert (tmp_path / "fault").exists(), f"the fault never fired:\n{out[-5000:]}"
    fault_at = float((tmp_path / "fault").read_text())
    assert proc.returncode != 0
    assert done - fault_at < LIMIT_S, f"the job took {done - fault_at:.0f} s to stop:\n{out[-3000:]}"
    # torchrun's report names the lost rank as the root cause...
    root = out[out.index("Root Cause"):]
    assert f"rank      : {VICTIM} (local_rank: {VICTIM})" in root, out[-5000:]
    if kind == "kill":
        assert "Signal 9 (SIGKILL)" in root
    else:
        # ...with the traceback (train_lm writes the error file torchrun reads, as @record would)
        assert f"InjectedFault: injected fault on rank {VICTIM}" in root, root
        # A rank that saw the broken connection before torchrun stopped it names the right
        # one (how many get that far is a race with torchrun's SIGTERM; the naming itself is
        # tested in tests/mesh/test_mesh_failure.py).
        named = [line for line in out.splitlines() if "failed first:" in line]
        assert all(f"rank {VICTIM} failed first: InjectedFault" in line for line in named), named
    assert len(list(tmp_path.glob("rank*.pid"))) == TORCHRUN_NPROC
    assert _left_behind(tmp_path) == []
