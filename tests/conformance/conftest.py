"""The conformance suite's session state: which programs the selected tests read, and their results.

Tests name their programs through the ``conformance_program`` parameter or the
``conformance_programs(*names)`` marker. JAX runs all of them in one subprocess, started
as soon as collection ends; fshard runs them (a few rank tasks) when the first test asks
for a result.

In the collection order (no ``FSHARD_SHUFFLE_SEED``), when other tests are collected too,
the conformance tests run after them and the JAX subprocess runs at a lower priority
(nice +10) meanwhile: its ~30 s of CPU (importing jax, ~90 XLA compiles) then fill the
cores the rest of the suite leaves idle instead of holding up the first conformance test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _harness.optional import missing, requires

# Every test here compares with JAX or optax (`pip install -e ".[conformance]"`, in .[test]):
# without them they skip (tests/integration/test_optional_deps.py reads this tuple).
REQUIRES = ("jax", "optax")
PARAM = "conformance_program"
HERE = Path(__file__).resolve().parent
_WANTED = pytest.StashKey[list]()
_STATE = pytest.StashKey[object]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "conformance_programs(*names): conformance programs whose results the test reads")


def _wanted(items) -> list[str]:
    wanted = []
    for item in items:
        cs = getattr(item, "callspec", None)
        if cs is not None and PARAM in cs.params:
            wanted.append(cs.params[PARAM])
        for m in item.iter_markers("conformance_programs"):
            wanted.extend(m.args)
    return wanted


def _is_conformance(item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(config, items):
    if missing(*REQUIRES):
        for item in items:
            if _is_conformance(item):
                item.add_marker(requires(*REQUIRES))
    config.stash[_WANTED] = _wanted(items)
    if os.environ.get("FSHARD_SHUFFLE_SEED", "").strip():
        return  # the shuffled order is the test; leave it
    mine = [i for i in items if _is_conformance(i)]
    if mine and len(mine) < len(items):
        items[:] = [i for i in items if not _is_conformance(i)] + mine


def _state(config):
    from conf_oracle import Conformance

    if _STATE not in config.stash:
        cache = None
        if os.environ.get("FSHARD_CONFORMANCE_CACHE", "1") != "0" and getattr(config, "cache", None) is not None:
            cache = config.cache.mkdir("fshard-conformance")
        config.stash[_STATE] = Conformance(config.stash.get(_WANTED, []), cache)
    return config.stash[_STATE]


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist every worker collects every test; only the one dealt the
        # "conformance" group (tests/conftest.py) runs them, and it starts JAX at its
        # first conformance test.
        return
    wanted = _wanted(session.items)  # after -k / -m deselection
    if not wanted or missing(*REQUIRES):
        return
    session.config.stash[_WANTED] = wanted
    conf = _state(session.config)
    conf.start_jax()
    proc = getattr(conf, "_proc", None)
    if proc is not None and not all(_is_conformance(i) for i in session.items):
        try:  # other tests run first: JAX takes the idle cores only
            os.setpriority(os.PRIO_PROCESS, proc.pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
        except OSError:
            pass


def pytest_sessionfinish(session):
    conf = session.config.stash.get(_STATE, None)
    proc = getattr(conf, "_proc", None)
    if proc is not None and proc.poll() is None:  # started, never waited for (e.g. -x stopped early)
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def conformance(request):
    return _state(request.config)
