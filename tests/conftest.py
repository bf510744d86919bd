"""Test set-up: one thread per process, and the shared multi-rank worker pools."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Rank workers fail a test body that returns with a functional collective never waited.
os.environ.setdefault("FSHARD_CHECK_LEAKS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    from fshard.testing import shutdown_pools

    shutdown_pools()
