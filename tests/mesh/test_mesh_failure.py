"""fshard.runtime.failure: what an uncaught error on a torchrun rank says (cause or casualty).

The end-to-end check, under torchrun, is tests/integration/test_faults.py; here the hook runs in this
process against an in-memory store, so each branch is seen deterministically.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch.distributed as dist

from fshard.runtime import failure


def _gloo_error() -> RuntimeError:
    return RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5547.")


@pytest.fixture()
def hook(monkeypatch):
    """Installs the hook on a fresh store as rank 1 of 4; sys.excepthook and the job are restored."""
    monkeypatch.setattr(sys, "excepthook", lambda *a: None)
    monkeypatch.setattr(failure, "_JOB", {})
    store = dist.HashStore()
    failure.install(store, 1, 4, wait_s=1.0)
    return store


def test_peer_loss_is_recognised_through_chained_errors():
    assert failure.is_peer_lost(_gloo_error())
    try:
        try:
            raise _gloo_error()
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as outer:
        assert failure.is_peer_lost(outer)
    assert not failure.is_peer_lost(ValueError("bad shape"))


def test_a_rank_that_raises_leaves_an_obituary(hook):
    sys.excepthook(ValueError, ValueError("boom on purpose"), None)
    assert hook.get("fshard/failed/1") == b"ValueError: boom on purpose"


def test_a_casualty_names_the_rank_that_failed_first_and_waits(hook, capsys):
    hook.set("fshard/failed/3", "InjectedFault: injected fault on rank 3")
    t0 = time.monotonic()
    sys.excepthook(RuntimeError, _gloo_error(), None)
    waited = time.monotonic() - t0
    err = capsys.readouterr().err
    assert "fshard: rank 1 of 4: the error above is a consequence" in err
    assert "fshard: rank 1 of 4: rank 3 failed first: InjectedFault: injected fault on rank 3" in err
    assert 0.9 <= waited < 5  # stays for wait_s, so that the launcher sees rank 3 exit first
    assert not hook.check(["fshard/failed/1"])  # a casualty leaves no obituary


def test_a_casualty_without_obituary_says_a_rank_was_killed(hook, capsys):
    sys.excepthook(RuntimeError, _gloo_error(), None)
    err = capsys.readouterr().err
    assert "no rank reported an exception within 1 s: a rank was killed or crashed" in err
    assert "torchrun: 'Root Cause'" in err
