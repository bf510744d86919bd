"""Soak test: train ``examples/train_lm.py`` on 4 ranks again and again, cycling meshes.

A crash that happens once in twenty runs never shows in a test suite. This runs the
example the way a user does (``torchrun --nproc-per-node 4``), one mesh after another,
until the time budget is spent, and reports every run: its steps, the loss at its end,
and, for a run that did not finish, how it ended (the signal that killed a rank, or a
timeout) with the first error line of its output::

    python tools/soak.py --minutes 30 --json soak.json
    python tools/soak.py --max-runs 1 --steps 5            # a smoke run
    python tools/soak.py --minutes 60 --mesh fsdp_remat     # one mesh only

The ranks inherit the environment, so a hunt can switch on glibc's heap checks
(``GLIBC_TUNABLES=glibc.malloc.perturb=165:...``) or pin the ranks (``taskset -c 0
python tools/soak.py ...``). The full output of every run that did not finish is kept
in ``--log-dir``. Exit status: 0 when every run finished, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import attrs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_lm.py"

# name -> train_lm.py flags (4 ranks each, but fsdp). zbv and dualpipev hold 2 stages per rank, so
# 4 stages over pp=2 need at least 4 layers; interleaved takes 2 virtual stages too.
MESHES: dict[str, tuple[str, ...]] = {
    "dp_fsdp": ("--mesh", "dp=2,fsdp=2"),
    "fsdp_tp_sp": ("--mesh", "fsdp=2,tp=2", "--sequence-parallel"),
    "pp_tp_zbv": ("--mesh", "pp=2,tp=2", "--schedule", "zbv", "--layers", "4"),
    "pp_fsdp_interleaved": ("--mesh", "pp=2,fsdp=2", "--schedule", "interleaved", "--layers", "4"),
    "fsdp_remat": ("--mesh", "fsdp=4", "--remat"),
    "pp_dp_dualpipev": ("--mesh", "pp=2,dp=2", "--schedule", "dualpipev", "--layers", "4"),
    # Every rank on fsdp (the example's default mesh), for any --nproc: a quick check of the
    # soak itself (tests/integration/test_soak.py runs it on 2 ranks). Not in the default cycle.
    "fsdp": (),
}
CYCLE = tuple(m for m in MESHES if m != "fsdp")  # the meshes a soak cycles through by default

# Lines that name what went wrong, in the order a reader wants the first one.
_ERROR = re.compile(r"Fatal Python error|malloc\(\)|free\(\)|corrupt|double free|Segmentation fault|"
                    r"Signal \d+ \(SIG\w+\)|Traceback|\w*(Error|Exception)\b|error:|Aborted|Killed")
_SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\)")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_RANK = re.compile(r"\brank\s*:\s*(\d+)")
_STEP = re.compile(r"step\s+(\d+)/(\d+)")  # the example's progress line without tqdm
_TQDM = re.compile(r"\|\s*(\d+)/(\d+) \[")  # tqdm's bar: " 83%|########  | 331/400 [06:37<02:01, ..."
_TQDM_START = re.compile(r"\s*\d+%\|")  # where a tqdm bar starts


@attrs.define
class Run:
    """One run of the example: how it was started and how it ended."""

    index: int
    mesh: str
    argv: list[str]
    status: str = "running"  # ok | crash | timeout
    returncode: int | None = None
    signal: str | None = None
    first_error: str | None = None
    steps: int = 0
    final_loss: float | None = None
    seconds: float = 0.0
    log: str | None = None


def first_error_line(text: str) -> str | None:
    """The first line that says what failed (a fatal signal, glibc's heap report, an exception)."""
    for line in text.replace("\r", "\n").splitlines():
        m = _ERROR.search(line)
        if m:  # from the match on: a progress bar may share the line
            error = line[m.start():]
            # The ranks share one file descriptor and print writes the text and its newline
            # separately, so another rank's progress line can land right after the error.
            cut = [p.start() for p in (_STEP.search(error), _TQDM_START.search(error)) if p]
            return error[:min(cut, default=len(error))].strip()[:300]
    return None


def crash_signal(text: str, returncode: int | None) -> str | None:
    """The signal that killed a rank, as torchrun reports its root cause (``SIGSEGV (rank 3)``).

    torchrun lists every failed rank; those it stopped itself get SIGTERM, so the
    "Root Cause" section names the one that died first.
    """
    root = text[text.find("Root Cause"):] if "Root Cause" in text else text
    m = _SIGNAL.search(root)
    rank = _RANK.search(root)
    where = f" (rank {rank.group(1)})" if rank else ""
    if m:
        return m.group(2) + where
    m = _EXITCODE.search(root)
    code = int(m.group(1)) if m else returncode
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name + where
        except ValueError:
            return f"signal {-code}{where}"
    return None


def steps_done(text: str) -> int:
    """The last step the progress output reported (``--log-every 1`` lines, or tqdm's bar)."""
    found = _STEP.findall(text) or _TQDM.findall(text)
    return int(found[-1][0]) if found else 0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop(proc: subprocess.Popen) -> None:
    """Stops torchrun and its ranks: SIGTERM (torchrun stops its workers), then SIGKILL."""
    ranks = _descendants(proc.pid) if os.path.isdir("/proc") else []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [proc.pid, *ranks]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=30)
            if not any(os.path.exists(f"/proc/{p}") for p in ranks):
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(1)


def run_once(index: int, mesh: str, args: argparse.Namespace, workdir: Path) -> Run:
    """Runs the example once under torchrun; never raises for a failed run."""
    log_json = workdir / f"run{index}.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
            str(EXAMPLE), *MESHES[mesh], "--steps", str(args.steps), "--log-every", "1",
            "--sample-chars", "0", "--seed", str(args.seed + index), "--log-json", str(log_json),
            *shlex.split(args.example_args)]
    run = Run(index, mesh, argv[1:])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out_path = workdir / f"run{index}.log"
    # The ranks start in a directory of their own, so that a core dump (``ulimit -c
    # unlimited``) lands next to the run's output; it is kept only if the run failed.
    rundir = Path(args.log_dir) / f"{args.stamp}-run{index}-{mesh}"
    rundir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(out_path, "w") as out:
        # A session of its own: a timeout kills torchrun and every rank with one signal.
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=rundir,
                                start_new_session=True)
        try:
            proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            run.status = "timeout"
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): leave no rank behind
            _stop(proc)
            raise
    run.seconds = time.monotonic() - t0
    run.returncode = proc.returncode
    text = out_path.read_text(errors="replace")
    run.steps = steps_done(text)
    if log_json.exists():
        # JSON lines (fs.recipes.sinks.read_log, without importing torch here): every step written before
        # a crash; a last line without its newline was cut short.
        lines = [json.loads(line) for line in log_json.read_text().split("\n")[:-1] if line.strip()]
        records = [r for r in lines if r.get("kind") == "step"]
        if records:
            run.steps, run.final_loss = records[-1]["step"], float(records[-1]["loss"])
    if run.status != "timeout":
        run.status = "ok" if proc.returncode == 0 and run.steps == args.steps else "crash"
    if run.status != "ok":
        run.signal = crash_signal(text, proc.returncode)
        run.first_error = first_error_line(text)
        keep = rundir / "output.log"
        keep.write_text(text)
        run.log = str(keep)
    else:
        shutil.rmtree(rundir, ignore_errors=True)
    return run


def table(runs: Sequence[Run]) -> str:
    """The runs as a fixed-width table."""
    head = f"{'#':>3} {'mesh':<20} {'status':<8} {'steps':>5} {'loss':>8} {'secs':>6}  signal / first error"
    rows = [head, "-" * len(head)]
    for r in runs:
        loss = f"{r.final_loss:.4f}" if r.final_loss is not None else "-"
        why = " ".join(x for x in (r.signal, r.first_error) if x) if r.status != "ok" else ""
        rows.append(f"{r.index:>3} {r.mesh:<20} {r.status:<8} {r.steps:>5} {loss:>8} {r.seconds:>6.0f}  {why}")
    return "\n".join(rows)


def summary(runs: Sequence[Run], seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    bad = [r for r in runs if r.status != "ok"]
    return {"runs": len(runs), "steps": sum(r.steps for r in runs), "crashes": len(bad),
            "crashes_by_signal": {s: sum(1 for r in bad if (r.signal or r.status) == s)
                                  for s in sorted({r.signal or r.status for r in bad})},
            "seconds": round(seconds, 1), "steps_per_run": args.steps, "nproc": args.nproc,
            "example_args": args.example_args,
            "meshes": {m: sum(1 for r in runs if r.mesh == m) for m in dict.fromkeys(r.mesh for r in runs)},
            "env": {k: os.environ[k] for k in ("GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_CHECK_", "MALLOC_PERTURB_",
                                               "TORCH_DISTRIBUTED_DEBUG") if k in os.environ},
            "records": [attrs.asdict(r) for r in runs]}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0,
                   help="start no new run after this many minutes (default 30)")
    p.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run (default 400)")
    p.add_argument("--mesh", action="append", choices=sorted(MESHES),
                   help="a mesh to cycle through (repeatable; default: all but fsdp, in turn)")
    p.add_argument("--nproc", type=int, default=4, help="ranks per run (default 4)")
    p.add_argument("--seed", type=int, default=0, help="run i trains with --seed SEED+i")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="a run still going after this many seconds is killed and counted (default 1800)")
    p.add_argument("--example-args", default="", metavar="ARGS",
                   help="more flags for train_lm.py, e.g. --example-args=\"--dim 16 --seq-len 16\" (a smaller model runs "
                        "more steps, hence more collectives, per minute)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the summary and every run as JSON")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "fshard-soak"),
                   help="where the output of failed runs (and core dumps) are kept")
    a = p.parse_args(argv)
    if a.steps < 1 or a.nproc < 1 or (a.max_runs is not None and a.max_runs < 1):
        p.error("--steps, --nproc and --max-runs must be >= 1")
    return a


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped soak stops its run too
    args.stamp = time.strftime("%Y%m%d-%H%M%S")
    meshes = args.mesh or list(CYCLE)
    runs: list[Run] = []
    t0 = time.monotonic()
    interrupted = False
    with tempfile.TemporaryDirectory(prefix="fshard-soak-") as tmp:
        try:
            while time.monotonic() - t0 < args.minutes * 60 and (args.max_runs is None or len(runs) < args.max_runs):
                mesh = meshes[len(runs) % len(meshes)]
                run = run_once(len(runs), mesh, args, Path(tmp))
                runs.append(run)
                print(table([run]).splitlines()[-1], flush=True)
        except KeyboardInterrupt:  # the run in progress was stopped; report the finished ones
            interrupted = True
            print("interrupted: the run in progress is not counted", flush=True)
    result = summary(runs, time.monotonic() - t0, args)
    result["interrupted"] = interrupted
    print(table(runs))
    print(f"{result['runs']} runs, {result['steps']} steps, {result['crashes']} crashed "
          f"({result['crashes_by_signal'] or 'none'}), {result['seconds'] / 60:.1f} min")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 130 if interrupted else 0 if result["crashes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
