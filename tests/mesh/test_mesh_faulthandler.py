"""A rank killed by a fatal signal prints every thread's Python stack (fs.init, run_local, pools).

Without it a rank that dies of a segfault or of glibc's heap checks exits without a word,
and the other ranks only report a lost connection.
"""

import ctypes
import os
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

import fshard as fs
from fshard.testing import free_port, run_on_ranks

from _harness import _zygote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sleeping_helper_thread():
    time.sleep(60)


def _crash_in_native_code():
    ctypes.string_at(0)  # reads address 0: SIGSEGV inside C code, as a heap corruption would


def _segfault_on_rank_1():
    if dist.get_rank() == 1:
        threading.Thread(target=_sleeping_helper_thread, daemon=True).start()
        time.sleep(0.2)
        _crash_in_native_code()
    dist.barrier()  # rank 0 waits for the dead rank: the harness must report rank 1
    return dist.get_rank()


def _rank_of():
    return dist.get_rank()


def _assert_crash_report(text: str) -> None:
    assert "Fatal Python error: Segmentation fault" in text, text[-3000:]
    assert "_crash_in_native_code" in text and "_segfault_on_rank_1" in text, text[-3000:]
    # all_threads=True: the other Python thread's stack is printed too.
    assert "_sleeping_helper_thread" in text, text[-3000:]


def test_pool_rank_segfault_prints_python_stacks():
    with pytest.raises(RuntimeError, match=r"rank 1 died \(killed by SIGSEGV, exit code -11\)") as info:
        run_on_ranks(_segfault_on_rank_1, world_size=2, timeout_s=60)
    _assert_crash_report(str(info.value))
    assert run_on_ranks(_rank_of, world_size=2) == [0, 1]  # the pool is rebuilt


def test_run_local_rank_segfault_prints_python_stacks():
    with pytest.raises(RuntimeError, match=r"rank 1 died \(killed by SIGSEGV, exit code -11\)") as info:
        fs.run_local(_segfault_on_rank_1, world_size=2, timeout_s=60)
    _assert_crash_report(str(info.value))


_SCRIPT = textwrap.dedent("""
    import ctypes, sys, threading, time
    import torch.distributed as dist
    import fshard as fs

    def _sleeping_helper_thread():
        time.sleep(60)

    def _crash_in_native_code():
        ctypes.string_at(0)

    def _segfault_on_rank_1():
        threading.Thread(target=_sleeping_helper_thread, daemon=True).start()
        time.sleep(0.2)
        _crash_in_native_code()

    if sys.argv[1] == "init":
        fs.init()  # a one-rank torchrun environment: starts the group, enables the stacks
        assert dist.is_initialized()
    _segfault_on_rank_1()
""")


def _start_torchrun_like(zygotes, mode: str):
    # Forked from a zygote (tests/_harness/_zygote.py), which has not enabled faulthandler either.
    env = _zygote.env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    env.pop("PYTHONFAULTHANDLER", None)
    return zygotes.start(["-c", _SCRIPT, mode], env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def torchrun_like(zygotes):
    """Both one-process runs, started together; ``torchrun_like(mode)`` waits for that
    run's ``(returncode, stderr)``."""
    procs = {mode: _start_torchrun_like(zygotes, mode) for mode in ("init", "plain")}
    done: dict[str, tuple[int, str]] = {}

    def result(mode: str) -> tuple[int, str]:
        if mode not in done:
            _, err = procs[mode].communicate(timeout=120)
            done[mode] = (procs[mode].returncode, err)
        return done[mode]

    yield result
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def test_init_makes_a_crashing_rank_print_its_python_stacks(torchrun_like):
    returncode, stderr = torchrun_like("init")
    assert returncode == -11, (returncode, stderr[-3000:])
    _assert_crash_report(stderr)


def test_without_init_a_crashing_process_prints_no_python_stack(torchrun_like):
    # The control: the stack above comes from fs.init(), not from the interpreter.
    returncode, stderr = torchrun_like("plain")
    assert returncode == -11, (returncode, stderr[-3000:])
    assert "_crash_in_native_code" not in stderr


def test_the_crashing_thread_comes_first_however_many_threads_precede_it():
    """faulthandler lists the newest thread first, so the main thread that crashed can come
    after many idle ones (a rank's thread pools, tqdm's monitor): the report puts it first."""
    from fshard.runtime.local import _trim_stack

    idle = "".join(f"Thread 0x{i:04x} (most recent call first):\n  File \"pool.py\", line 81 in _worker\n"
                   f"  File \"threading.py\", line 982 in run\n" for i in range(30))
    dump = ("Fatal Python error: Segmentation fault\n\n" + idle
            + "Current thread 0xbeef (most recent call first):\n  File \"t.py\", line 1 in _crash_in_native_code\n")
    text = _trim_stack(dump)
    lines = text.splitlines()
    assert lines[:3] == ["Fatal Python error: Segmentation fault", "Current thread 0xbeef (most recent call first):",
                         '  File "t.py", line 1 in _crash_in_native_code']
    assert "Thread 0x0000" in text and text.endswith("(and 10 more thread(s))")
    assert _trim_stack("no header\nat all") == "no header\nat all"
