"""The zygote process of tests/_harness/_zygote.py (kept apart: it must import neither pytest nor the
tests' helpers, only what a fresh ``python`` would have plus :data:`PRELOAD`)."""

from __future__ import annotations

import builtins
import gc
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

PRELOAD = ("torch", "fshard")


def _serve(path: str) -> None:
    """The zygote's loop; returns only in a forked child, which then runs its program."""
    import importlib

    base_path = list(sys.path)
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    while True:
        # stdin is the pytest process's pipe: its end (EOF) ends the zygote.
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            for pid in children:  # left running by a test that was cut short: none may outlive the session
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.waitpid(pid, 0)
            os._exit(0)
        if listener in ready:
            conn, _ = listener.accept()
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(msg)
            except (OSError, ValueError):  # a client gone before its request: serve the others
                conn.close()
                continue
            # Frozen, the zygote's objects (torch's and fshard's modules) are not traversed
            # by the child's collections: see tests/_harness/_zygote.py.
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for c in children.values():
                    c.close()
                _become(request, fds, base_path)
                return
            for fd in fds:
                os.close(fd)
            try:
                conn.send(str(pid).encode())
            except OSError:
                pass  # the test is gone; the child still gets reaped below
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:
                pass  # the test is gone
            conn.close()


def _become(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked child: the process ``python ARGV`` would be, up to its program."""
    os.setsid()  # like start_new_session=True: a timeout kills its group
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    import __main__

    main = __main__.__dict__
    main.clear()
    main.update(__name__="__main__", __doc__=None, __package__=None, __spec__=None, __builtins__=builtins)
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[:] = [""] + base_path[1:]
        code = compile(argv[1], "<string>", "exec")
    else:
        script = os.path.abspath(argv[0])
        sys.argv = list(argv)
        sys.path[:] = [os.path.dirname(script)] + base_path[1:]
        main.update(__file__=argv[0], __cached__=None)
        code = compile(Path(script).read_bytes(), argv[0], "exec")
    _CHILD_CODE.append(code)


_CHILD_CODE: list = []


def main(path: str, here: str) -> None:
    """``python -c 'import _zygote_main; _zygote_main.main(PATH, HERE)'``: serves until stdin
    closes; in a child, runs its program in ``__main__`` (an exception leaves through the top)."""
    sys.path.remove(here)  # put there to import this module: a fresh interpreter's path has no such entry
    _serve(path)
    import __main__

    exec(_CHILD_CODE.pop(), __main__.__dict__)


