"""pytest plugin for crash hunts: a full ``gc.collect()`` after every test, in the test
process and in every live rank of the shared worker pools.

Objects caught in reference cycles (process groups, collective works, tensors, autograd
graphs) are then finalized at test boundaries instead of at a random point inside a
later test, so a crash that a late finalizer causes shows up next to the test that made
the garbage::

    PYTHONPATH=.:tools python -m pytest -o addopts="" -p gc_between_tests -p no:randomly tests/parallel
"""

import gc


def pytest_runtest_teardown(item, nextitem):
    gc.collect()
    from fshard import testing

    for world_size, pool in list(testing._POOLS.items()):
        if pool.alive:
            try:
                pool.run(gc.collect, timeout_s=60)
            except Exception as e:  # noqa: BLE001 - report, and let the next test find the pool dead
                print(f"[gc_between_tests] gc.collect() on the {world_size}-rank pool failed: {e}")
