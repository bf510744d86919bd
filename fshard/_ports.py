"""``free_port``: a loopback port for a child process to bind later.

No torch and no fshard import here: ``tools/exit_loop.py``'s driver loads this file by
path so that it stays a torch-free process (``fshard.testing`` re-exports it).
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["free_port"]

_PORT_RNG = random.Random()  # its own: a test that seeds ``random`` must not fix the ports


def free_port() -> int:
    """A loopback TCP port that nothing listens on, for a child process to bind later
    (torchrun's ``--master-port``, ``MASTER_PORT`` of hand-started ranks).

    Not ``bind(0)``: that port comes from the kernel's ephemeral range, which every
    ``bind(0)`` and outgoing connection draws from, and between this pick and the child's
    bind (seconds: the child imports torch first) the gloo groups of tests running beside
    this one (pytest-xdist) take ports from that range by the hundred. The port is drawn at
    random below that range (skipping torchrun's default 29500 and its neighbours), from
    this pytest-xdist worker's share of it, so two workers never draw the same port, and
    checked free by binding it.

    Returns:
      The port number.

    Raises:
      OSError: no free port found in 200 draws.
    """
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    first = 20000
    if low - first < 1000:  # an unusual ephemeral range: the kernel's own choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = _PORT_RNG.randrange(first, low)
        if port % count != index % count or 29400 <= port < 29600:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise OSError(f"free_port: no free port in [{first}, {low}) after 200 draws")
