"""The teardown at exit (``fs.shutdown``, registered by ``fs.init``): no gloo worker thread
may outlive it, because one that drops a finished collective while the interpreter
finalizes aborts the process (docs/reliability.md, "The abort at exit").

The abort itself is a race (``tools/exit_loop.py`` measures it); these tests pin the
mechanism that removes it. Each runs a real program in fresh processes (forked from a
zygote that has imported torch and fshard, tests/_harness/_zygote.py: the program runs as
``__main__`` and its process exits through the interpreter's normal path, atexit and
finalization) and lets it exit normally; a hook the program registers *before* fshard's (atexit runs them last-in,
first-out, so it runs after fshard's teardown) reports, as the interpreter is about to
finalize: the gloo worker threads still alive, whether the process groups the program
made are still alive, and whether the default group still exists. The control arm
(``FSHARD_TEARDOWN_AT_EXIT=0``) shows the same program with its gloo threads still alive
at that point, so the tests can fail.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from fshard.testing import free_port

from _harness import _zygote

TIMEOUT_S = 180

# Runs before the program and reports after fshard's teardown. Gloo's threads name
# themselves: "pt_gloo_runloop" (a group's workers), "gloo_tcp_loop" (its I/O loop).
_PRELUDE = """
import atexit, json, os, sys, weakref
import torch
import torch.distributed as dist

def gloo_threads():
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            n += "gloo" in open(f"/proc/self/task/{t}/comm").read()
        except OSError:
            pass
    return n

GROUPS = []

def report():
    alive = [r() is not None for r in GROUPS]
    print("REPORT " + json.dumps({"gloo_threads": gloo_threads(), "groups_alive": alive,
                                  "initialized": dist.is_initialized()}), flush=True)
    if os.environ.get("TEST_SHUTDOWN_AFTER_REPORT"):
        # A program whose groups fshard leaves alive on purpose (not started by fshard,
        # or after an uncaught exception) would otherwise be open to the very abort at
        # exit these tests are about: it tears down itself, after the observation.
        fs.shutdown()

atexit.register(report)
import fshard as fs
from fshard import comm
"""

# fshard's collectives, one left in flight at exit (kept by the program), and a mesh
# with sub-groups (two axes), as a training script leaves them.
_TRAIN = """
fs.init()
world = dist.get_world_size() if dist.is_initialized() else 1
rank = dist.get_rank() if dist.is_initialized() else 0
mesh = fs.make_mesh({"a": world, "b": 1})
x = torch.arange(8.0) + rank
y = comm.all_reduce(x, mesh.group(("a", "b")), "sum", axes=("a", "b"))
assert torch.equal(y, sum(torch.arange(8.0) + r for r in range(world))), y
g = comm.all_gather_async(x, mesh.group("a"), world, axes=("a",))
g.wait()
comm.reduce_scatter_async(torch.ones(4 * world), mesh.group("a"), world, axes=("a",)).wait()
KEPT = comm.all_gather_async(x * 2, mesh.group("a"), world, axes=("a",))  # in flight at exit
GROUPS.extend(weakref.ref(g) for g in (dist.group.WORLD, mesh.group("a"), mesh.group(("a", "b"))))
print("gloo threads before exit", gloo_threads(), flush=True)
"""


def _run(zygotes, tmp_path: Path, body: str, *, world: int = 1, torchrun_env: bool = True,
         teardown: bool = True, shutdown_after_report: bool = False) -> list[tuple[int, str, dict | None]]:
    """Runs the program on ``world`` processes; returns (exit code, output, report) per rank."""
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(_PRELUDE) + textwrap.dedent(body))
    env = _zygote.env(FSHARD_TIMEOUT_S="60")
    env.pop("FSHARD_TEARDOWN_AT_EXIT", None)
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    if not teardown:
        env["FSHARD_TEARDOWN_AT_EXIT"] = "0"
    if shutdown_after_report:
        env["TEST_SHUTDOWN_AFTER_REPORT"] = "1"
    port = free_port()
    procs = []
    for r in range(world):
        renv = dict(env)
        if torchrun_env:
            renv.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(zygotes.start([str(script)], cwd=tmp_path, env=renv, stderr_to_stdout=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            reports = [json.loads(line[len("REPORT "):]) for line in out.splitlines() if line.startswith("REPORT ")]
            results.append((p.returncode, out, reports[-1] if reports else None))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _check_clean(results) -> None:
    for rank, (code, out, rep) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out}"
        assert rep is not None, f"rank {rank} printed no report:\n{out}"
        assert rep["gloo_threads"] == 0, f"rank {rank}: gloo threads alive at finalization: {rep}\n{out}"
        assert not any(rep["groups_alive"]), f"rank {rank}: process groups alive at finalization: {rep}\n{out}"
        assert not rep["initialized"], f"rank {rank}: the default group was not destroyed: {rep}"
        assert "terminate called" not in out and "unwaited collective" not in out, out


def test_teardown_at_exit_two_ranks(zygotes, tmp_path):
    """Under torchrun's environment, fs.init()'s hook completes the collective left in
    flight, destroys the groups (sub-groups included) and joins every gloo thread."""
    _check_clean(_run(zygotes, tmp_path, _TRAIN, world=2))


def test_without_teardown_gloo_threads_survive_to_finalization(zygotes, tmp_path):
    """The control: the same program with the hook off reaches finalization with its gloo
    worker threads and groups alive (what lets a late worker abort the process)."""
    results = _run(zygotes, tmp_path, _TRAIN, world=2, teardown=False)
    for rank, (code, out, rep) in enumerate(results):
        assert rep is not None, f"rank {rank} printed no report (exit code {code}):\n{out}"
        assert rep["gloo_threads"] > 0 and all(rep["groups_alive"]) and rep["initialized"], rep


def test_teardown_at_exit_one_rank_group(zygotes, tmp_path):
    """A plain one-process script: the one-rank gloo group fshard starts for the mesh has
    worker threads too, and the hook joins them."""
    _check_clean(_run(zygotes, tmp_path, _TRAIN, world=1, torchrun_env=False))


def test_teardown_after_destroy_process_group(zygotes, tmp_path):
    """A script that destroys the default group itself (as train_lm did): the mesh still held
    the groups and their threads; the hook drops fshard's references and joins them."""
    body = _TRAIN + "\nKEPT.wait()\ndist.destroy_process_group()\n"
    _check_clean(_run(zygotes, tmp_path, body, world=2))


def test_no_teardown_after_an_uncaught_exception(zygotes, tmp_path):
    """After an uncaught exception the hook does nothing (peers may be gone or stuck in a
    collective, and this rank must exit without waiting for them)."""
    body = _TRAIN + "\nraise RuntimeError('boom')\n"
    (code, out, rep), = _run(zygotes, tmp_path, body, world=1, torchrun_env=False, shutdown_after_report=True)
    assert code == 1 and "RuntimeError: boom" in out, out
    assert rep is not None and rep["initialized"], f"the hook tore down after a failure: {rep}\n{out}"


def test_no_teardown_of_a_group_fshard_did_not_start(zygotes, tmp_path):
    """A group the program started itself is the program's to destroy (fs.shutdown())."""
    body = """
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    fs.init()  # a no-op: the group exists
    mesh = fs.make_mesh({"a": 1})
    comm.all_reduce(torch.ones(2), mesh.group("a"), "sum", axes=("a",))
    """
    (code, out, rep), = _run(zygotes, tmp_path, body, world=1, torchrun_env=False, shutdown_after_report=True)
    assert code == 0 and rep is not None and rep["initialized"], f"{rep}\n{out}"
    body += "fs.shutdown()\n"
    (code, out, rep), = _run(zygotes, tmp_path, body, world=1, torchrun_env=False)
    assert code == 0 and rep == {"gloo_threads": 0, "groups_alive": [], "initialized": False}, f"{rep}\n{out}"


def test_shutdown_completes_the_collective_in_flight(zygotes, tmp_path):
    """fs.shutdown() waits for the collective fshard has in flight; the handle the program
    kept still gives its result afterwards, and no longer holds its group."""
    body = _TRAIN + """
fs.shutdown()
out = KEPT.wait()
assert torch.equal(out, torch.cat([(torch.arange(8.0) + r) * 2 for r in range(world)])), out
assert KEPT._group is None
print("RESULT ok", flush=True)
"""
    results = _run(zygotes, tmp_path, body, world=2)
    _check_clean(results)
    assert all("RESULT ok" in out for _, out, _ in results)


# --- release_groups: a long-lived rank (a test pool's, a notebook's) drops its meshes' groups ---
def _gloo_threads() -> int:
    import os

    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += "gloo" in f.read()
        except OSError:  # the thread ended meanwhile
            pass
    return n


def _meshes_then_release():
    import torch

    import fshard as fs
    from fshard import P
    from fshard.runtime.teardown import release_groups

    release_groups()  # what earlier tests of this pool left
    base = _gloo_threads()
    sums = []
    for shape in ({"a": 2, "b": 2}, {"c": 4}, {"d": 2, "e": 2}):
        mesh = fs.make_mesh(shape)
        first, both = tuple(shape)[0], tuple(shape)
        f = fs.shard_map(lambda x: fs.lax.psum(x, first) + fs.lax.psum(x, both), mesh=mesh, in_specs=P(),
                         out_specs=P())
        sums.append(float(f(torch.ones(())).full_tensor()))
    grown = _gloo_threads()
    release_groups()
    released = _gloo_threads()
    # A mesh made after the release (it may reuse a freed mesh's id) has groups of its own.
    mesh = fs.make_mesh({"a": 4})
    after = float(fs.shard_map(lambda x: fs.lax.psum(x, "a"), mesh=mesh, in_specs=P(), out_specs=P())(
        torch.ones(())).full_tensor())
    return base, grown, released, sums, after


def test_release_groups_ends_the_meshes_gloo_threads_and_new_meshes_work():
    from fshard.testing import run_on_ranks

    for base, grown, released, sums, after in run_on_ranks(_meshes_then_release, world_size=4, timeout_s=TIMEOUT_S):
        assert grown > base, (base, grown)  # the meshes' groups have threads: the check can fail
        assert released == base, (base, grown, released)
        assert sums == [2 + 4, 4 + 4, 2 + 4] and after == 4
