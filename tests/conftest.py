"""Test set-up: one thread per process, the shared multi-rank worker pools, and an optional
seeded shuffle of the test order (``FSHARD_SHUFFLE_SEED=N``; ``.ci/run``'s second run)."""

import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Rank workers fail a test body that returns with a functional collective never waited.
os.environ.setdefault("FSHARD_CHECK_LEAKS", "1")
# Every fshard collective first agrees on its header across the ranks (fshard._contract):
# a test whose ranks diverge fails with both sides named instead of a crash or a wrong value.
os.environ.setdefault("FSHARD_CHECK_COLLECTIVES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    # Registered here too, so that the mark is known when pytest-xdist is not installed.
    config.addinivalue_line("markers", "xdist_group(name): tests that pytest-xdist runs on one worker")
    # FSHARD_TEST_CPU_PROFILE=path: per test, wall time against the CPU it caused (tests/_harness/_cpu_profile.py).
    path = os.environ.get("FSHARD_TEST_CPU_PROFILE")
    if path:
        from _harness._cpu_profile import CpuProfile

        config.pluginmanager.register(CpuProfile(path), "fshard-cpu-profile")


@pytest.fixture(autouse=True, scope="module")
def _release_pool_groups():
    """After each module, the pool ranks destroy the process groups of the meshes its tests
    made (fshard.testing.release_pool_groups): kept, their gloo threads wake every 10 ms
    for the rest of the suite."""
    yield
    from fshard.testing import release_pool_groups

    release_pool_groups()


def pytest_sessionfinish(session, exitstatus):
    from fshard.testing import shutdown_pools

    shutdown_pools()


# --- pytest-xdist (pyproject's addopts: -n 2 --dist loadgroup) ------------------
# Two tests at a time: the suite's own processes use about one of the machine's two cores
# on average (subprocess start-ups, grace periods and timeouts it waits through, one-rank
# phases). Each xdist worker has its own worker pools (fshard.testing) and forkserver;
# ports for children come from fshard.testing.free_port, drawn per worker outside the
# ephemeral range. Tests that share session state run on one worker:
_CONFORMANCE = os.path.join("tests", "conformance") + os.sep


def _xdist_groups(items):
    for item in items:
        # The conformance session runs every selected program on its first request (on
        # 4 ranks, and JAX in a subprocess): split over two workers, both would run all.
        if _CONFORMANCE in str(item.path):
            item.add_marker(pytest.mark.xdist_group("conformance"))


# The modules whose tests start whole programs (torchrun jobs, the GPU checks' dry run, a
# notebook kernel: 10-60 s each) go first in the collection order under xdist, so that the
# run does not end with one worker busy on one of them and the other idle.
_LONG = ("test_docs_commands.py", "test_gpu_checks.py", "test_examples.py", "test_faults.py",
         "test_notebook.py", "test_soak.py", "test_sched_stage_fsdp.py", "test_train_lm_faults.py")


def _long_first(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.path.name not in _LONG)  # stable: the rest keep their order


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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    _xdist_groups(items)
    seed = _shuffle_seed()
    if seed is None:
        _long_first(items)
    else:
        _shuffle(items, seed)


def pytest_collection_finish(session):
    # After every plugin's reordering (the cache plugin's --lf / --ff come after ours).
    _jax_last(session.items)


def _shuffle(items, seed):
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


# --- JAX in the pytest process: last --------------------------------------------------
# A few modules import JAX into the pytest process (optax's side of the optimizer
# conformance). JAX starts threads, and many tests fork from the pytest process
# (fs.run_local, the pools' children): a fork of a multithreaded process may copy a lock
# that another thread holds. So those modules run after every other test, in both orders,
# and a test elsewhere that loads JAX here fails (``_no_jax_here``).
_JAX_IN_PROCESS = ("test_optim_optax.py", "test_donation_jax.py")


def _jax_last(items):
    items.sort(key=lambda item: item.path.name in _JAX_IN_PROCESS)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _no_jax_here(request):
    import sys

    had = "jax" in sys.modules
    yield
    if not had and "jax" in sys.modules and request.node.path.name not in _JAX_IN_PROCESS:
        pytest.fail(f"{request.node.nodeid} imported JAX into the pytest process, whose later tests fork: "
                    f"import it in a subprocess (tests/conformance/conf_jax_worker.py) or list the module in "
                    f"tests/conftest.py's _JAX_IN_PROCESS, which runs last", pytrace=False)


# Fresh processes forked from an interpreter that has imported torch and fshard (tests/_harness/_zygote.py).
from _harness._zygote import zygotes  # noqa: E402, F401
