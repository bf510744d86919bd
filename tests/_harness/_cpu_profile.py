"""Where the suite's wall time goes: per test, wall time against the CPU time it caused.

Opt-in: ``FSHARD_TEST_CPU_PROFILE=profile.tsv python -m pytest -q ...`` (tests/conftest.py
registers this plugin only then). One row per test phase (setup, call, teardown):

- ``wall``: seconds on the clock;
- ``self``: CPU (user + sys) of the pytest process, threads included (``RUSAGE_SELF``);
- ``reaped``: CPU of children that exited and were waited for during the phase
  (``RUSAGE_CHILDREN``: subprocesses, torchrun and everything it reaped);
- ``live``: CPU of the worker pools' ranks (fshard.testing) and their forkserver, by psutil,
  less what they had at the start (they are the forkserver's children: ``RUSAGE_CHILDREN`` never sees them,
  nor does ``/usr/bin/time``);
- ``others``: CPU the rest of the machine used meanwhile (all cores' busy time less ours),
  the load the test ran under (under pytest-xdist, the other worker's tests included);
- ``wait = wall - (self + reaped + live)``: time the test spent neither computing nor
  having a child compute (sleeps, timeouts, start-up waits for a core, ...). On 2 cores a
  test whose ranks run in parallel can have ``wait`` below zero.

Under pytest-xdist each worker writes ``path.gwN`` and the summary adds them up. The
summary at the end prints the totals and the tests that wait the most. Measured CPU
is what the processes were given; under load the wall time also holds waiting for a core,
which ``others`` shows.
"""

from __future__ import annotations

import glob
import os
import resource
import time

import psutil
import pytest

ENV = "FSHARD_TEST_CPU_PROFILE"


def _cpu(ru) -> float:
    return ru.ru_utime + ru.ru_stime


def _live() -> dict[int, float]:
    """CPU seconds of each rank of fshard.testing's worker pools (children of the forkserver,
    so never in this process's ``RUSAGE_CHILDREN``) and of the forkserver. Only those:
    scanning every process of the machine for descendants costs milliseconds per test."""
    from multiprocessing import forkserver

    from fshard import testing

    pids = [proc.pid for pool in list(testing._POOLS.values()) for proc in list(pool._procs)]
    server = getattr(forkserver._forkserver, "_forkserver_pid", None)  # it imports torch and fshard once
    out = {}
    for pid in pids + ([server] if server else []):
        try:
            t = psutil.Process(pid).cpu_times()
            # The reaped children too: the C++ compilers a rank's Inductor compile starts and waits for.
            out[pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return out


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


class CpuProfile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[tuple] = []
        if not os.environ.get("PYTEST_XDIST_WORKER"):  # the files of an earlier run's workers
            for part in glob.glob(glob.escape(path) + ".gw*"):
                os.remove(part)

    def _snap(self):
        return (time.monotonic(), _cpu(resource.getrusage(resource.RUSAGE_SELF)),
                _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)), _live(), _machine_busy())

    def _phase(self, item, when):
        a = self._snap()
        try:
            yield
        finally:
            b = self._snap()
            # A rank gone since the start (its pool was killed) loses its last bit of CPU.
            live = sum(v - a[3].get(pid, 0.0) for pid, v in b[3].items())
            wall, own, reaped = b[0] - a[0], b[1] - a[1], b[2] - a[2]
            others = max(0.0, (b[4] - a[4]) - (own + reaped + live))
            self.rows.append((item.nodeid, when, wall, own, reaped, live, others, os.getloadavg()[0]))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._phase(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._phase(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._phase(item, "teardown")

    def _write(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("nodeid\tphase\twall\tself\treaped\tlive\tothers\tload1\n")
            for r in self.rows:
                f.write("\t".join([r[0], r[1]] + [f"{x:.3f}" for x in r[2:]]) + "\n")

    def pytest_sessionfinish(self):
        # Under pytest-xdist each worker writes its own file (the path plus ".gwN").
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        if self.rows:
            self._write(f"{self.path}.{worker}" if worker else self.path)

    def pytest_terminal_summary(self, terminalreporter):
        rows = self.rows
        if not rows:  # the pytest-xdist controller: the workers wrote their files
            for part in sorted(glob.glob(glob.escape(self.path) + ".gw*")):
                with open(part) as f:
                    next(f)
                    for line in f:
                        nodeid, phase, *nums = line.rstrip("\n").split("\t")
                        rows.append((nodeid, phase, *map(float, nums)))
            if rows:
                self._write(self.path)
        if not rows:
            return
        tot = [sum(r[i] for r in rows) for i in range(2, 7)]
        cpu = tot[1] + tot[2] + tot[3]
        w = terminalreporter.write_line
        w(f"cpu profile ({self.path}): tests' wall {tot[0]:.0f} s; CPU {cpu:.0f} s (pytest {tot[1]:.0f}, "
          f"reaped children {tot[2]:.0f}, live ranks {tot[3]:.0f}); others on the machine {tot[4]:.0f} s")
        by_wait = sorted(rows, key=lambda r: r[2] - (r[3] + r[4] + r[5]), reverse=True)[:15]
        w("waiting the most (wall - CPU):  wall  cpu  nodeid")
        for r in by_wait:
            w(f"  {r[2] - (r[3] + r[4] + r[5]):6.1f} {r[2]:6.1f} {r[3] + r[4] + r[5]:5.1f}  {r[1]} {r[0]}")
