"""Issue 36 rows 5 and 16: ``run_local`` misuse says which rank did what.

Before: a rank calling ``sys.exit(0)`` made the caller exit 0 with no output, and
``sys.exit(3)`` exit 3 silently (the rank's ``SystemExit`` was re-raised in the caller); a
nested ``run_local`` failed with ``AssertionError: daemonic processes are not allowed to
have children``; an unpicklable result's error (``cannot pickle '_thread.lock' object``)
named no rank and no part of the result.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

import fshard as fs
from fshard.runtime import local

ROOT = Path(__file__).resolve().parents[2]


def _exit_on_rank_1(code):
    if dist.get_rank() == 1:
        sys.exit(code)
    return dist.get_rank()


@pytest.mark.parametrize("code", [0, 3])
def test_sys_exit_in_a_rank_is_an_error_naming_the_rank_and_code(code):
    with pytest.raises(local.RankExitError, match=rf"rank 1 of 2 called sys.exit\({code}\) in _exit_on_rank_1 "
                                            rf"instead of returning \(exit code {code}\)"):
        fs.run_local(_exit_on_rank_1, code, world_size=2, timeout_s=60)


def test_a_script_whose_rank_calls_sys_exit_does_not_exit_silently(tmp_path):
    # What the user saw: the script itself exited 0 (or 3) and printed nothing.
    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent("""
        import sys
        import fshard as fs

        def task():
            sys.exit(0)

        if __name__ == "__main__":
            fs.run_local(task, world_size=2, timeout_s=60)
            print("returned normally")
    """))
    proc = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "returned normally" not in proc.stdout
    assert "RankExitError: rank 0 of 2 called sys.exit(0)" in proc.stderr or \
        "RankExitError: rank 1 of 2 called sys.exit(0)" in proc.stderr, proc.stderr[-2000:]


def _inner():
    return 1


def _nested():
    return fs.run_local(_inner, world_size=2, timeout_s=30)


def test_a_nested_run_local_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"fs.run_local was called inside a rank \(rank \d of 2\) of another "
                                           r"fs.run_local or WorkerPool: a rank cannot start ranks of its own"):
        fs.run_local(_nested, world_size=2, timeout_s=60)


def _nested_pool():
    local.WorkerPool(2)


def test_a_worker_pool_inside_a_rank_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"WorkerPool was called inside a rank"):
        fs.run_local(_nested_pool, world_size=2, timeout_s=60)


def _unpicklable_on_rank_1():
    if dist.get_rank() == 1:
        return {"loss": 1.0, "extras": [2, threading.Lock()]}
    return {"loss": 1.0, "extras": [2, 3]}


def test_an_unpicklable_result_names_the_rank_and_the_part_to_blame():
    with pytest.raises(local.UnpicklableResultError) as info:
        fs.run_local(_unpicklable_on_rank_1, world_size=2, timeout_s=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2: the result of _unpicklable_on_rank_1 cannot be sent back"), msg
    assert "result['extras'][1] is a _thread.lock, which cannot be pickled" in msg, msg


class _Box:
    def __init__(self):
        self.ok = 1
        self.fn = lambda: None


def test_the_unpicklable_part_of_an_object_is_found_through_its_attributes():
    path, bad = local._unpicklable_part((1, {"box": _Box()}))
    assert path == "result[1]['box'].fn" and callable(bad)
