"""Programs started together by the tests that run examples (one process each leaves the
second core idle while it starts up), each in its own session so that a timeout kills it
with its children (torchrun and its ranks)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest


def run_together(cmds: list[list[str]], *, cwd: Path, env: dict[str, str],
                 timeout_s: float = 120) -> list[subprocess.CompletedProcess]:
    """Runs every command at once; their results in order. A command still running after
    ``timeout_s`` (one deadline for all) fails the test; none is left behind."""
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for cmd in cmds]
    return finish_together(procs, timeout_s, kill=lambda p: os.killpg(p.pid, signal.SIGKILL))


def finish_together(procs: list[Any], timeout_s: float, *, kill: Callable[[Any], None]) -> list[subprocess.CompletedProcess]:
    """Collects started programs (``Popen``-like: ``communicate``, ``poll``, ``args``,
    ``returncode``) against one deadline; one still running then is killed (``kill``) and
    fails the test, and so is every other one left running when a test fails."""
    deadline = time.monotonic() + timeout_s
    try:
        done = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill(p)
                out, err = p.communicate()
                pytest.fail(f"{shlex.join(p.args)} did not finish in {timeout_s:.0f} s:\n{out[-2000:]}\n{err[-3000:]}")
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done
    finally:
        for p in procs:
            if p.poll() is None:  # another one failed the test first
                kill(p)
                p.communicate()
