"""Runs every GPU check in sequence (a dry run may run ``--jobs`` at once) under one time limit
and writes one summary (see run.sh).

Each check is its own process (a CUDA error or a hung collective cannot take the others
down), gets at most its own cap or what is left of the total, and is killed with its
process group when that runs out. A failed, crashed or killed check is recorded and the
next one runs. The summary is rewritten after every check, so a run cut short still
leaves what it measured.

Output directory:
    summary.json   {"mode", "ok", "note", "date", "git", "machine", "time_limit_s",
                    "total_seconds", "checks": [record per check]}
    summary.md     the same as a table
    logs/<check>.log, logs/<check>.json   each check's output and own record

A record (common.py): check, status (passed / failed / skipped), passed, seconds,
figures, assertions {checked, skipped_on_cpu}, parts, reason (why skipped), error, log.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# (name, script, seconds at most on a GPU; 3x in a dry run): cheap and basic first, the
# measurements last. Their sum exceeds the default total on purpose: a check that
# finishes early leaves its time to the next.
CHECKS: list[tuple[str, str, float]] = [
    ("nccl_init", "check_nccl.py", 90),
    ("init_sharded", "check_init_sharded.py", 90),
    ("train_lm", "check_train_lm.py", 180),
    ("offload", "offload_check.py", 150),
    ("gloo_cuda_ranks", "check_gloo_cuda.py", 180),
    ("fully_shard_overhead", "check_fully_shard.py", 120),
    ("jit", "check_jit.py", 90),
]
# The figures the table shows per check (all of them are in summary.json).
KEY_FIGURES = {
    "nccl_init": ["backend", "wire_collectives", "step_grad_err"],
    "init_sharded": ["device_peak_rise_bytes", "device_bound_bytes", "total_bytes"],
    "train_lm": ["float32_tokens_per_s_median", "bfloat16_tokens_per_s_median", "float32_last_loss",
                 "bfloat16_last_loss", "last_window_rel_diff", "max_step_rel_diff"],
    "offload": ["world2_host_to_device_copies", "world1_host_to_device_copies", "world2_max_shard_diff"],
    "gloo_cuda_ranks": ["torch_gloo_on_device", "fsdp_grad_err", "tp_grad_err", "pipeline_grad_err",
                        "init_device_peak_rise_bytes"],
    "fully_shard_overhead": ["torch_s_per_step", "fshard_s_per_step", "ratio_fshard_over_torch"],
    "jit": ["backend", "eager_s", "jit_s", "speedup"],
}
DRY_RUN_NOTE = (
    "CPU dry run: the same check scripts ran on the CPU over gloo. Every assertion about the "
    "device itself (tensors on CUDA, NCCL picked, pinned copies, CUDA memory) was skipped; each "
    "check lists them under assertions.skipped_on_cpu. Nothing in this summary ran on a GPU.")


def _git() -> dict[str, Any]:
    def out(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": out("rev-parse", "HEAD"), "dirty": bool(out("status", "--porcelain"))}


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# What a dry run's checks are forked from (see _preloaded): every check imports these.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "attrs", "fshard", "common")


def _preloaded(python: str) -> Any:
    """A dry run's checks are forked from one process that has imported torch and fshard
    once (a multiprocessing forkserver with :data:`PRELOAD`), instead of each starting an
    interpreter that imports them again (about 3.5 s of CPU per check, half the dry run's
    CPU; its ranks, forked from the check, inherit the imports too). Each check runs as
    ``__main__``, with its own argv, process, process group and log (:func:`_run_script`),
    but it ends as a multiprocessing child does (``os._exit``: no atexit handlers, no
    interpreter finalization), so the dry run does not exercise the exit path; the check
    records are written before that. A GPU run keeps fresh interpreters.
    """
    import multiprocessing

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # as common.py sets it before torch
    for path in (str(REPO), str(HERE)):  # the forkserver imports with this sys.path
        if path not in sys.path:
            sys.path.insert(0, path)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_executable(python)
    ctx.set_forkserver_preload(list(PRELOAD))
    # The forkserver imports PRELOAD before it forks anything: a first, empty process waits
    # for that now, so that it counts in no check's seconds and time limit.
    warm = ctx.Process(target=_nothing, name="check-warm-up")
    warm.start()
    warm.join()
    return ctx


def _nothing() -> None:
    pass


def _stop_forkserver() -> None:
    """Stops :func:`_preloaded`'s forkserver and waits for it, so that the CPU time of the
    checks (its children) counts as this process's children's, as fresh interpreters' did
    (``getrusage``, tests/_harness/_cpu_profile.py's ``reaped``)."""
    from multiprocessing import forkserver

    with contextlib.suppress(AttributeError, OSError):  # private API (CPython 3.8-3.13)
        forkserver._forkserver._stop()


def _run_script(script: str, argv: list[str], log: str) -> None:
    """In a process forked from :func:`_preloaded`'s forkserver: ``python script *argv``,
    output appended to ``log``, in a session of its own (the deadline kills its group)."""
    import runpy

    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(REPO)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as the interpreter does for a script
    runpy.run_path(script, run_name="__main__")  # its sys.exit(status) is this process's exit status


def run_check(name: str, script: str, limit_s: float, out: Path, dry_run: bool,
              python: str, preloaded: Any = None) -> dict[str, Any]:
    """Runs one check in its own process group; returns its record (made up if it left none).

    ``preloaded``: :func:`_preloaded`'s context, to fork the check from it (a dry run)."""
    log, result = out / "logs" / f"{name}.log", out / "logs" / f"{name}.json"
    result.unlink(missing_ok=True)
    argv = ["--result", str(result)] + (["--cpu-dry-run"] if dry_run else [])
    cmd = [python, str(HERE / script), *argv]
    t0 = time.perf_counter()
    timed_out = False
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}" + ("  (forked from the preloaded forkserver)" if preloaded else "") + "\n")
        f.flush()
        if preloaded is not None:
            proc = preloaded.Process(target=_run_script, args=(str(HERE / script), argv, str(log)),
                                     name=f"check-{name}")
            proc.start()
            proc.join(limit_s)
            if proc.exitcode is None:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the check and any ranks it forked
                proc.kill()  # in case it was killed before it made its own group
                proc.join()
            rc = proc.exitcode
        else:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the check and any ranks it forked
                rc = proc.wait()
    seconds = round(time.perf_counter() - t0, 3)
    rel_log = str(log.relative_to(out))
    if result.exists() and not timed_out:
        record = json.loads(result.read_text())
        record["log"] = rel_log
        return record
    why = (f"killed after {limit_s:.0f} s (its time limit)" if timed_out
           else f"exited with status {rc} without writing its record")
    return {"check": name, "status": "failed", "passed": False, "seconds": seconds,
            "mode": "cpu-dry-run" if dry_run else "gpu", "figures": {}, "assertions": {}, "parts": {},
            "reason": None, "error": f"{why}; last lines of {rel_log}:\n{_tail(log)}", "log": rel_log}


def _table(summary: dict[str, Any]) -> str:
    lines = [f"# GPU checks: {summary['mode']} on {summary['machine'].get('device', '?')}, {summary['date']}", ""]
    if summary["mode"] == "cpu-dry-run":
        lines += [DRY_RUN_NOTE, ""]
    lines += [f"Overall: {'OK' if summary['ok'] else 'NOT OK'}; {summary['total_seconds']:.0f} s of "
              f"{summary['time_limit_s']:.0f} s; commit {summary['git']['commit'][:12]}"
              f"{' (dirty)' if summary['git']['dirty'] else ''}", "",
              "| check | status | s | key figures | device assertions skipped |", "|---|---|---|---|---|"]
    for r in summary["checks"]:
        figs = ", ".join(f"{k}={r['figures'][k]}" for k in KEY_FIGURES.get(r["check"], []) if k in r["figures"])
        note = r.get("reason") or (r.get("error") or "").split("\n")[0][:200]
        status = r["status"] + (f" ({note})" if note else "")
        lines.append(f"| {r['check']} | {status} | {r['seconds']:.1f} | {figs} | "
                     f"{len(r.get('assertions', {}).get('skipped_on_cpu', []))} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU: run every check on the CPU with the device assertions skipped (and listed)")
    ap.add_argument("--out", default=None,
                    help="output directory (default: $OUT if set, else bench/results/gpu_<date>[_cpu-dry-run])")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds for all checks together (max 600)")
    ap.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the checks")
    ap.add_argument("--jobs", type=int, default=1,
                    help="checks run at once (default 1; more only with --cpu-dry-run: on a GPU they would share it)")
    args = ap.parse_args()
    if args.time_limit > 600:
        ap.error("--time-limit: at most 600 s (a GPU is lent for 10 minutes per command)")
    if args.jobs < 1 or (args.jobs > 1 and not args.cpu_dry_run):
        ap.error("--jobs: 1, or more with --cpu-dry-run (checks sharing a GPU would skew its figures)")
    now = _dt.datetime.now()
    suffix = "_cpu-dry-run" if args.cpu_dry_run else ""
    out = Path(args.out or os.environ.get("OUT") or REPO / "bench" / "results" /
               f"gpu_{now:%Y-%m-%d_%H%M}{suffix}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    checks = CHECKS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {c[0] for c in CHECKS})
        if unknown:
            ap.error(f"--only: unknown checks {unknown}; checks are {[c[0] for c in CHECKS]}")
        checks = [c for c in CHECKS if c[0] in wanted]
    mode = "cpu-dry-run" if args.cpu_dry_run else "gpu"
    summary: dict[str, Any] = {
        "mode": mode, "ok": False, "note": DRY_RUN_NOTE if args.cpu_dry_run else "ran on the GPU named in machine",
        "date": now.isoformat(timespec="seconds"), "git": _git(),
        "machine": {"host": platform.node(), "python": platform.python_version()},
        "time_limit_s": args.time_limit, "total_seconds": 0.0, "checks": []}
    preloaded = _preloaded(args.python) if args.cpu_dry_run else None
    t0 = time.perf_counter()
    deadline = t0 + args.time_limit
    lock = threading.Lock()
    done: dict[int, dict[str, Any]] = {}

    def one(i: int, name: str, script: str, cap: float) -> None:
        left = deadline - time.perf_counter()
        if left < 5:
            record = {"check": name, "status": "failed", "passed": False, "seconds": 0.0, "mode": mode,
                      "figures": {}, "assertions": {}, "parts": {}, "reason": None,
                      "error": f"not run: the total time limit of {args.time_limit:.0f} s was used up", "log": None}
        else:
            # The caps are sized for a GPU; a shared CPU running the dry run may be far slower.
            limit = min(cap * (3 if args.cpu_dry_run else 1), left)
            print(f"--- {name} (at most {limit:.0f} s)", flush=True)
            record = run_check(name, script, limit, out, args.cpu_dry_run, args.python, preloaded)
        with lock:
            print(f"    {name}: {record['status']} in {record['seconds']:.1f} s"
                  + (f": {record['reason']}" if record.get("reason") else "")
                  + (f": {record['error'].splitlines()[0]}" if record.get("error") else ""), flush=True)
            done[i] = record
            summary["checks"] = [done[k] for k in sorted(done)]  # in the table's order, whatever finished first
            if record.get("device") and summary["machine"].get("device") in (None, "cpu"):
                summary["machine"].update(record["device"])
            summary["total_seconds"] = round(time.perf_counter() - t0, 3)
            summary["ok"] = all(r["status"] == "passed" or (r["status"] == "skipped" and r.get("reason"))
                                for r in summary["checks"])
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    # --jobs 1 (always on a GPU): one check after another, in order. A dry run may run
    # several at once (each is its own process; none of its assertions is about time).
    try:
        with cf.ThreadPoolExecutor(args.jobs) as pool:
            for f in [pool.submit(one, i, *c) for i, c in enumerate(checks)]:
                f.result()
    finally:
        if preloaded is not None:
            _stop_forkserver()
    table = _table(summary)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"summary: {out / 'summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
