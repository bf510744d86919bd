"""fshard.runtime.gloo_workers: every gloo group fshard makes has one worker thread.

Two workers on one group race in torch's ``ProcessGroupGloo::runLoop`` (an unlocked
``std::string`` write after each collective; docs/reliability.md, "Seen again"). The race
itself is shown under ``tools/gloo_status_race.cpp`` by ``tools/stress_groups.py``; here,
that no group of fshard's is left with two.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import fshard as fs
from fshard.checkpoint import _common as ckpt_common
from fshard.mesh import mesh as mesh_mod
from fshard.runtime import gloo_workers
from fshard.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]


def _threads_of_every_group():
    mesh = fs.make_mesh({"dp": 2, "fsdp": dist.get_world_size() // 2})
    groups = {
        "world": dist.group.WORLD,
        "dp": mesh.group("dp"),
        "fsdp": mesh.group("fsdp"),
        "dp,fsdp": mesh.group(("dp", "fsdp")),
        "checkpoint": ckpt_common.group(),
    }
    out = {name: gloo_workers.worker_threads(g) for name, g in groups.items()}
    x = torch.full((3,), float(dist.get_rank()))
    dist.all_reduce(x, group=mesh.group("fsdp"))  # a one-worker group still runs collectives
    return out, x.tolist(), c10d.ProcessGroupGloo.__module__ == "torch.distributed.distributed_c10d"


def test_every_group_fshard_makes_has_one_gloo_worker():
    for threads, summed, restored in run_on_ranks(_threads_of_every_group, world_size=4):
        assert threads == dict.fromkeys(threads, 1), threads
        assert summed in ([1.0] * 3, [5.0] * 3)  # fsdp pairs (0, 1) and (2, 3)
        assert restored, "one_worker() must put torch's class back"


def test_one_worker_restores_torch_class_on_error_and_nests():
    base = c10d.ProcessGroupGloo
    with pytest.raises(KeyError), gloo_workers.one_worker():
        assert c10d.ProcessGroupGloo is not base and issubclass(c10d.ProcessGroupGloo, base)
        with gloo_workers.one_worker():
            inner = c10d.ProcessGroupGloo
        assert c10d.ProcessGroupGloo is inner  # the inner block leaves the outer's swap
        raise KeyError("boom")
    assert c10d.ProcessGroupGloo is base


def test_one_worker_group_in_process():
    with gloo_workers.one_worker():
        pg = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=timedelta(seconds=30))
    assert pg.options._threads == 1
    x = torch.ones(2)
    pg.allreduce([x]).wait()
    assert x.tolist() == [1.0, 1.0]
    del pg  # its worker thread is joined now, not at interpreter exit (fshard.runtime.teardown)


def test_a_caller_made_two_worker_world_group_is_not_reused_for_a_world_axis(monkeypatch):
    monkeypatch.setattr(gloo_workers, "worker_threads", lambda group=None: 2)
    monkeypatch.setattr(mesh_mod.torch.cuda, "is_available", lambda: False)
    assert "fsdp" in mesh_mod._timeout_overrides({"fsdp": 4}, 4, "gloo")
    monkeypatch.setattr(gloo_workers, "worker_threads", lambda group=None: 1)
    assert mesh_mod._timeout_overrides({"fsdp": 4}, 4, "gloo") == {}


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build tools/gloo_status_race.cpp")
def test_fshard_groups_survive_the_race_amplifier(tmp_path):
    """With the amplifier lining gloo workers up at the unlocked write, a two-worker group
    dies within a few thousand collectives (5 of 5 runs of 2,000 in docs/reliability.md);
    fshard's one-worker world group must run them all."""
    lib = tmp_path / "libgloo_status_race.so"
    src = ROOT / "tools" / "gloo_status_race.cpp"
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True, timeout=120)
    env = {**os.environ, "LD_PRELOAD": str(lib), "FSHARD_CHECK_COLLECTIVES": "0", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(ROOT / "tools" / "stress_groups.py"), "--mode", "serial", "--world", "2"]
    argv += ["--calls", "1", "--iters", "1000", "--threads", "0", "--ops", "mixed"]
    r = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 failures" in r.stdout
