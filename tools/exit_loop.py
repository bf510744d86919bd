"""The abort at exit: start small jobs again and again and count the ranks that abort as they exit.

A rank of a gloo job could die *after* its work was done, printing ``terminate called
without an active exception`` (exit code 134, SIGABRT); see docs/reliability.md, "The
abort at exit". This starts ``--nproc`` ranks the way torchrun does (its environment
variables; ``--torchrun`` uses torchrun itself), each running a small program (a
``--body``) that calls ``fs.init()``, issues a few collectives and exits, and counts how
the ranks ended::

    python tools/exit_loop.py --runs 50 --body late              # the race, made likely
    taskset -c 0 nice -n 19 python tools/exit_loop.py --runs 100 --body inflight --load 2
    python tools/exit_loop.py --runs 20 --body late --no-teardown  # without fshard's teardown
    python tools/exit_loop.py --runs 10 --body train_lm          # examples/train_lm.py --steps 2

Bodies (every one makes a dp x fsdp mesh, so sub-groups exist, on 4 ranks; a
1-axis mesh on 2):

- ``waited``: a few synchronous and asynchronous fshard collectives, all waited;
- ``inflight``: the same, then asynchronous all-gathers left un-waited at exit;
- ``late``: every rank starts a last all-gather (torch's ``async_op=True`` API) and
  exits without waiting for it; the last rank starts it 0.5 s after the others, so its
  gloo worker runs it, and drops it, just as that rank's interpreter finalizes;
- ``late_waited``: the same through ``fshard.comm``, waited: the worker drops the finished
  collective just after the main thread moved on to exit (a race that needs contention);
- ``destroy``: ``waited``, then ``dist.destroy_process_group()`` by hand (as
  ``examples/train_lm.py`` did before fshard's teardown);
- ``subgroups``: 8 more meshes (each with its sub-groups) and one collective on each;
- ``train_lm``: ``examples/train_lm.py --mesh fsdp=4 --remat --steps 2`` (``--train-args``).

``--no-teardown`` sets ``FSHARD_TEARDOWN_AT_EXIT=0`` in the ranks, which turns off the
teardown that ``fs.init()`` registers, to measure the same bodies without it.
``--load K`` runs K busy processes (nice 19) beside the ranks for the whole loop, for
contention; pin everything to one core by starting this under ``taskset -c 0``.

Prints one line per run (``ok`` or the ranks that aborted and their exit codes) and a
summary; ``--json`` writes it. A core file is left by an aborting rank in ``--log-dir``
when ``ulimit -c unlimited`` is set. Exit status: 0 when no rank aborted, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
BODIES = ("waited", "inflight", "late", "late_waited", "destroy", "subgroups", "train_lm")
ABORT_TEXT = "terminate called"


# --- the rank's side --------------------------------------------------------------------
def _mesh_axes(world: int) -> dict[str, int]:
    return {"dp": 2, "fsdp": world // 2} if world >= 4 and world % 2 == 0 else {"fsdp": world}


def rank_body(body: str) -> None:
    """One rank of a job: fs.init, a few collectives, then exit (the interpreter finalizes)."""
    import torch

    import fshard as fs
    from fshard import comm

    fs.init()
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = fs.make_mesh(_mesh_axes(world))
    axes = mesh.axis_names
    inner = mesh.group(axes[-1])
    n = mesh.shape[axes[-1]]
    x = torch.arange(64, dtype=torch.float32) + rank
    # A synchronous all-reduce over every axis (a sub-group on a 2-axis mesh), then
    # asynchronous all-gathers and a reduce-scatter, waited, as FSDP issues them.
    comm.all_reduce(x, mesh.group(axes), "sum", axes=axes)
    handles = [comm.all_gather_async(x * i, inner, n, axes=axes[-1:]) for i in range(3)]
    handles.append(comm.reduce_scatter_async(x, inner, n, axes=axes[-1:]))
    for h in handles:
        h.wait()
    if body == "subgroups":
        global _MESHES
        _MESHES = []
        for i in range(8):
            m = fs.make_mesh(dict(reversed(list(_mesh_axes(world).items()))) if i % 2 else _mesh_axes(world))
            # make_mesh caches by shape: a second shape is the only other one here, so make
            # the rest by hand as a user's dist.new_group would.
            g = dist.new_group(list(range(world)))
            comm.all_reduce(x, g, "sum", axes=("world",))
            _MESHES.append((m, g))
    if body == "inflight":
        global _KEPT
        _KEPT = [comm.all_gather_async(x + i, inner, n, axes=axes[-1:]) for i in range(2)]
        comm.all_gather_async(x, mesh.group(axes), world, axes=axes)  # dropped at once
    if body in ("late", "late_waited"):
        # The last rank enters the last all-gather late, so that its gloo worker runs it
        # (the others are in it already) while that rank's main thread is exiting.
        late = rank == world - 1
        if late:
            time.sleep(0.5)
        if body == "late":  # torch's own async API, dropped un-waited by every rank
            out = torch.empty(1000 * world)
            work = dist.all_gather_into_tensor(out, torch.ones(1000) * rank, async_op=True)
            del work, out
        else:  # fshard's, waited: the worker may still hold it when the main thread exits
            comm.all_gather_async(torch.ones(1000) * rank, mesh.group(axes), world, axes=axes).wait()
    if body == "destroy":
        dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


# --- the driver's side ------------------------------------------------------------------
def _free_port() -> int:
    """``fshard.testing.free_port``, loaded from its torch-free file by path: importing the
    ``fshard`` package would import torch into the driver."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_fshard_ports", ROOT / "fshard" / "_ports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.free_port()


def _rank_cmd(args: argparse.Namespace) -> list[str]:
    if args.body == "train_lm":
        return [sys.executable, str(ROOT / "examples" / "train_lm.py"), *shlex.split(args.train_args)]
    return [sys.executable, str(Path(__file__).resolve()), "--rank-body", args.body]


def run_once(args: argparse.Namespace, index: int, log_dir: Path) -> dict[str, Any]:
    """Starts one job; returns each rank's exit code and whether it aborted."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    if args.no_teardown:
        env["FSHARD_TEARDOWN_AT_EXIT"] = "0"
    run_dir = log_dir / f"{args.stamp}-{args.body}-run{index:04d}"
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               "--master-port", str(_free_port()), "--tee", "3", *_rank_cmd(args)[1:]]
        procs = [subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)]
    else:
        port = _free_port()
        procs = []
        for r in range(args.nproc):
            renv = dict(env, RANK=str(r), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(r),
                        LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(_rank_cmd(args), cwd=run_dir, env=renv, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    outputs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, args.run_timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        outputs.append(out)
        codes.append(p.returncode)
    text = "\n".join(outputs)
    aborted = text.count(ABORT_TEXT)
    if args.torchrun:  # torchrun reports a rank's SIGABRT as "exitcode: -6"
        aborted = max(aborted, text.count("exitcode  : -6"), text.count("Signal 6 (SIGABRT)"))
    else:
        aborted = max(aborted, sum(c in (134, -6, 135, -7) for c in codes))  # SIGBUS: faulthandler's dump died
    failed = any(c != 0 for c in codes)
    rec = {"run": index, "codes": codes, "aborted": aborted, "failed": failed,
           "seconds": round(time.monotonic() - t0, 2)}
    if failed or aborted:
        (run_dir / "output.txt").write_text(text)
        rec["log"] = str(run_dir / "output.txt")
    else:
        for f in run_dir.iterdir():
            f.unlink()
        run_dir.rmdir()
    return rec


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="jobs to start (default 20)")
    p.add_argument("--minutes", type=float, default=None, help="stop starting jobs after this long")
    p.add_argument("--body", choices=BODIES, default="late", help="what each rank does (default late)")
    p.add_argument("--nproc", type=int, default=4, help="ranks per job (default 4)")
    p.add_argument("--torchrun", action="store_true", help="start the ranks with torchrun")
    p.add_argument("--no-teardown", action="store_true",
                   help="FSHARD_TEARDOWN_AT_EXIT=0 in the ranks: no teardown at exit (the 'before' arm)")
    p.add_argument("--load", type=int, default=0, help="busy processes (nice 19) beside the ranks")
    p.add_argument("--train-args", default="--mesh fsdp=4 --remat --steps 2 --quiet",
                   help="examples/train_lm.py's arguments for --body train_lm")
    p.add_argument("--run-timeout", type=float, default=120.0, help="seconds before a job is killed")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "fshard-exit-loop"))
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON")
    p.add_argument("--rank-body", choices=BODIES, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_body is not None:
        rank_body(args.rank_body)
        return 0
    args.stamp = time.strftime("%Y%m%d-%H%M%S") + ("-noteardown" if args.no_teardown else "")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(19))
            for _ in range(args.load)]
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for i in range(args.runs):
            if args.minutes is not None and time.monotonic() - t0 > 60 * args.minutes:
                break
            rec = run_once(args, i, log_dir)
            records.append(rec)
            state = "ok" if not rec["failed"] else (f"ABORT x{rec['aborted']}" if rec["aborted"] else "FAILED")
            print(f"run {i:4d}  {state:<10} codes {rec['codes']}  {rec['seconds']:6.1f} s"
                  + (f"  {rec['log']}" if "log" in rec else ""), flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    summary = {
        "body": args.body, "nproc": args.nproc, "torchrun": args.torchrun, "teardown": not args.no_teardown,
        "load": args.load, "runs": len(records),
        "runs_with_abort": sum(1 for r in records if r["aborted"]),
        "ranks_aborted": sum(r["aborted"] for r in records),
        "runs_failed": sum(1 for r in records if r["failed"]),
        "minutes": round((time.monotonic() - t0) / 60, 2),
    }
    print(f"{summary['runs']} runs ({args.body}, {args.nproc} ranks, teardown "
          f"{'on' if summary['teardown'] else 'off'}, load {args.load}): {summary['runs_with_abort']} with "
          f"an abort at exit ({summary['ranks_aborted']} ranks), {summary['runs_failed']} failed in all, "
          f"{summary['minutes']} min")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": records}, indent=1))
    return 0 if summary["runs_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
