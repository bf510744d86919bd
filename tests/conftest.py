"""Test set-up: one thread per process, the shared multi-rank worker pools, and an optional
seeded shuffle of the test order (``FSHARD_SHUFFLE_SEED=N``; ``.ci/run``'s second run)."""

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Rank workers fail a test body that returns with a functional collective never waited.
os.environ.setdefault("FSHARD_CHECK_LEAKS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    from fshard.testing import shutdown_pools

    shutdown_pools()


# --- seeded shuffled order --------------------------------------------------------
# FSHARD_SHUFFLE_SEED=N runs the suite in an order drawn from N: the modules in a random
# order, and the tests of each module in a random order, so that a test that only passes
# after another one (module-level state, a pool left in some state, a process group in
# the pytest process) fails. Tests stay grouped by module, as pytest-randomly does, so a
# module-scoped fixture is built once and not once per interleaving.
_SHUFFLE_ENV = "FSHARD_SHUFFLE_SEED"


def _shuffle_seed():
    text = os.environ.get(_SHUFFLE_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise pytest.UsageError(f"{_SHUFFLE_ENV}={text!r}: expected an integer seed") from None


def pytest_collection_modifyitems(session, config, items):
    seed = _shuffle_seed()
    if seed is None:
        return
    rng = random.Random(seed)
    modules = {}
    for item in items:
        modules.setdefault(str(item.path), []).append(item)
    groups = [modules[k] for k in sorted(modules)]
    rng.shuffle(groups)
    for group in groups:
        rng.shuffle(group)
    items[:] = [item for group in groups for item in group]


def pytest_report_header(config):
    seed = _shuffle_seed()
    return None if seed is None else f"test order shuffled: {_SHUFFLE_ENV}={seed}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    seed = _shuffle_seed()
    if seed is not None:  # also under -q, where the header is not shown
        terminalreporter.write_line(f"test order shuffled with {_SHUFFLE_ENV}={seed} "
                                    f"(the same order again: {_SHUFFLE_ENV}={seed} python -m pytest -q)")
