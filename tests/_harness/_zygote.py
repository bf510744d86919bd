"""Fresh processes without a fresh interpreter's start-up: a "zygote" that has imported torch
and fshard once forks a child per program (``python script.py ARGS`` or ``python -c CODE
ARGS``), for the tests that need a process of its own but not an interpreter of its own.

Why: each fresh ``python`` that imports torch and fshard spends ~2.5 s of CPU before it does
anything; the tests that start a dozen of them (teardown at exit, crash reports) spend most
of their CPU there. A forked child starts in milliseconds.

What the child is: a whole process (its own pid, session, cwd, environment, argv,
stdin/stdout/stderr), running the program as ``__main__`` at the top of the interpreter.
It exits through the interpreter's normal path: an uncaught exception goes to
``sys.excepthook`` and gives exit code 1, ``SystemExit`` gives its code, atexit handlers
run, then ``Py_FinalizeEx`` (the path the teardown tests observe). A fatal signal kills it
as it would a fresh one (the exit code is ``-signal``).

What differs from a fresh ``python``:
- torch and fshard are already imported. Their import-time effects ran in the zygote,
  under its environment: so a zygote serves only programs whose environment equals its
  own apart from :data:`CALL_TIME` variables (read when used) and ``PYTEST_*``;
  :class:`Zygotes` starts one per environment.
- The atexit handlers those imports registered come before the program's own (fshard's
  import registers only optree's).
- The objects made before the fork are frozen (``gc.freeze()``, as a pre-fork server
  should): the child's collections skip them; otherwise its exit copies every page they
  live on (0.85 s of CPU, against 0.2 s).
- The interpreter's start-up options are the zygote's.
The zygote starts no thread, so the fork is safe (as for ``multiprocessing``'s forkserver,
fshard.testing.FORKSERVER_PRELOAD).

Not for torchrun's workers (torchrun starts them), nor for programs that must import a
different fshard (tools/mutations.py's copies).

The zygote's own CPU (imports) and its children's are not in the pytest process's
``RUSAGE_CHILDREN`` until it is waited for: the session fixture's teardown
(:meth:`Zygotes.close`) waits for every zygote, so a CPU profile counts them (in the
session's last test).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Read when used (torchrun's variables, fshard's call-time switches, the tests' own), so
# they may differ between a zygote and its children.
CALL_TIME = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "FSHARD_TEARDOWN_AT_EXIT", "FSHARD_CHECK_LEAKS")
CALL_TIME_PREFIXES = ("PYTEST_", "TEST_", "FSHARD_TEST_")


def env(**extra: str) -> dict[str, str]:
    """The environment of a program the tests start: this one's, fshard importable, one thread,
    and a collective that hangs fails within a minute (``FSHARD_TIMEOUT_S``, read at import:
    one value for all, so that one zygote serves them all)."""
    e = dict(os.environ, OMP_NUM_THREADS="1", FSHARD_TIMEOUT_S="60")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    e.update(extra)
    return e


def _import_key(environ: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in environ.items()
                        if k not in CALL_TIME and not k.startswith(CALL_TIME_PREFIXES)))


# --- the tests' side -----------------------------------------------------------------


class Child:
    """A program a zygote runs: a small part of ``subprocess.Popen`` (``pid``, ``args``,
    ``returncode``, ``poll``, ``wait``, ``communicate``, ``kill``). Its output goes to
    temporary files, read once it has exited."""

    def __init__(self, args: list[str], conn: socket.socket, out, err) -> None:
        self.args = args
        self._conn = conn
        self._out, self._err = out, err
        self.pid = int(conn.recv(64))
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._conn.setblocking(False)
            try:
                self._take(self._conn.recv(64))
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if timeout is not None and timeout <= 0:  # settimeout(0) would make recv non-blocking
                if self.poll() is None:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                return self.returncode
            self._conn.settimeout(timeout)
            try:
                self._take(self._conn.recv(64))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def _take(self, msg: bytes) -> None:
        if not msg:
            # The zygote is gone, so nobody will report this child's exit: kill it (it is in
            # its own session) and report it as killed, for the caller's cleanup to go on.
            self.kill()
            self.returncode = -signal.SIGKILL
            self._conn.close()
            raise RuntimeError(f"the zygote running {self.args[:2]} is gone")
        self.returncode = int(msg)
        self._conn.close()

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        return self._read(self._out), (None if self._err is None else self._read(self._err))

    @staticmethod
    def _read(f) -> str:
        f.seek(0)
        text = f.read().decode(errors="replace")
        f.close()
        return text

    def kill(self) -> None:
        """SIGKILLs its process group (its own session)."""
        if self.returncode is None:
            for kill in (os.killpg, os.kill):  # the group, and the child itself if it has none yet
                try:
                    kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class Zygote:
    """One zygote process, for requests whose import-time environment is ``environ``."""

    def __init__(self, environ: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="zygote-")
        self.path = os.path.join(self._dir, "sock")
        here = str(Path(__file__).parent)
        code = f"import sys; sys.path.insert(0, {here!r}); import _zygote_main; _zygote_main.main({self.path!r}, {here!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=environ, cwd=self._dir,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if line != b"ready\n":
            self.proc.kill()
            raise RuntimeError(f"the zygote did not start (exit code {self.proc.wait()})")

    def start(self, argv: list[str], *, env: dict[str, str], cwd: Path | str, stderr_to_stdout: bool = False) -> Child:
        """Starts ``python *argv`` (``argv[0]`` a script, or ``-c`` and the code)."""
        out = tempfile.TemporaryFile()
        err = None if stderr_to_stdout else tempfile.TemporaryFile()
        devnull = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            fds = [devnull, out.fileno(), (out if err is None else err).fileno()]
            socket.send_fds(conn, [json.dumps({"argv": list(argv), "env": env, "cwd": str(cwd)}).encode()], fds)
        finally:
            os.close(devnull)
        return Child([sys.executable, *argv], conn, out, err)

    def close(self) -> None:
        """Ends the zygote once its children have exited, and waits for it."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        for name in os.listdir(self._dir):
            os.remove(os.path.join(self._dir, name))
        os.rmdir(self._dir)


class Zygotes:
    """The zygotes of a session, one per import-time environment (made on first use)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, Zygote] = {}

    def start(self, argv: list[str], *, env: dict[str, str], cwd: Path | str, stderr_to_stdout: bool = False) -> Child:
        key = _import_key(env)
        dead = self._by_key.get(key)
        if dead is not None and dead.proc.poll() is not None:  # it died: the next test gets a new one
            self._by_key.pop(key).close()
        if key not in self._by_key:
            self._by_key[key] = Zygote({k: v for k, v in env.items()
                                        if k not in CALL_TIME and not k.startswith(CALL_TIME_PREFIXES)})
        return self._by_key[key].start(argv, env=env, cwd=cwd, stderr_to_stdout=stderr_to_stdout)

    def close(self) -> None:
        for z in self._by_key.values():
            z.close()
        self._by_key.clear()


@pytest.fixture(scope="session")
def zygotes():
    """The session's :class:`Zygotes`; closed (and waited for) at the end of the session."""
    z = Zygotes()
    yield z
    z.close()


def run_together(zygotes: Zygotes, argvs: list[list[str]], *, cwd: Path | str, env: dict[str, str],
                 timeout_s: float = 120) -> list[subprocess.CompletedProcess]:
    """Like tests/_harness/_procs.run_together for ``python ARGV`` programs, forked from a zygote."""
    from ._procs import finish_together

    children = [zygotes.start(argv, env=env, cwd=cwd) for argv in argvs]
    return finish_together(children, timeout_s, kill=Child.kill)