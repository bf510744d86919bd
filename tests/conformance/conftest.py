"""The conformance suite's session state: which programs the selected tests read, and their results.

Tests name their programs through the ``conformance_program`` parameter or the
``conformance_programs(*names)`` marker; the first test that asks for a result starts JAX
on all of them (one subprocess) and runs fshard on all of them (a few rank tasks).
"""

from __future__ import annotations

import os

import pytest

PARAM = "conformance_program"
_WANTED = pytest.StashKey[list]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "conformance_programs(*names): conformance programs whose results the test reads")


def pytest_collection_modifyitems(config, items):
    wanted = []
    for item in items:
        cs = getattr(item, "callspec", None)
        if cs is not None and PARAM in cs.params:
            wanted.append(cs.params[PARAM])
        for m in item.iter_markers("conformance_programs"):
            wanted.extend(m.args)
    config.stash[_WANTED] = wanted


@pytest.fixture(scope="session")
def conformance(request):
    from conf_oracle import Conformance

    cache = None
    if os.environ.get("FSHARD_CONFORMANCE_CACHE", "1") != "0" and getattr(request.config, "cache", None) is not None:
        cache = request.config.cache.mkdir("fshard-conformance")
    return Conformance(request.config.stash.get(_WANTED, []), cache)
