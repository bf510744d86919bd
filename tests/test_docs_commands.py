"""Every shell command in README.md and docs/*.md runs (issue 14), in short form where it trains.

Commands are read from the documents themselves: each line of a fenced ``bash``/``sh``/
``shell``/``console`` block (``\\`` continuations joined, ``#`` comments dropped, ``&&`` chains
split into steps) and each inline ``torchrun ...`` or ``python ...`` span in the prose. A
command that trains gets ``--steps 2``; torchrun runs on loopback with a free port (``python
-m torch.distributed.run``, the program behind ``torchrun``); relative paths that exist in
the repository are made absolute and the command runs in a temporary directory.

What is not run here is listed in :data:`NOT_RUN_HERE` with the reason (the install steps
and the test command are what ``.ci/run`` runs, verbatim); a template such as ``torchrun
--nproc-per-node N script.py`` is listed in :data:`TEMPLATES`. A command that is neither
run nor listed fails :func:`test_every_command_is_run_or_listed`, so a new command in the
docs cannot go unrun.

To keep the time modest, the README's "(or `dp=2,fsdp=2`, ...)" variants of a train_lm
torchrun command run in-process on the shared 4-rank pool (``train_lm.main(argv)``, the
same flags and defaults); the command itself, and the multi-node one, run under torchrun.
A command that is another documented command plus flags that only add output
(:data:`OUTPUT_ONLY_FLAGS`) runs once for both: its launch runs the shorter command's
argv word for word, then those flags (a torchrun launch costs 15-35 s of CI). The commands
that run as subprocesses run two at a time (each test's own and the next one's, see
:class:`_Launcher`), each with ``FSHARD_MACHINE`` in its own directory: the planner's
machine file is calibrated there, never read from or written to $HOME.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fshard.testing import free_port, run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:  # a rank's error may be train_lm's ConfigError: unpickled here
    sys.path.insert(0, str(EXAMPLES))
SHORT = ["--steps", "2"]  # appended to every command that trains (argparse: the last value wins)

# Inline spans that are fragments or templates, not commands.
TEMPLATES = {
    "torchrun --nproc-per-node 8": "a fragment of a sentence (no script)",
    "torchrun --nproc-per-node N script.py": "a template: N and script.py are the reader's",
}
# Steps that .ci/run runs instead (a fresh venv and the install need the network and minutes).
NOT_RUN_HERE = {
    r"python3 -m venv \.venv": ".ci/run makes a fresh venv",
    r"\. \.venv/bin/activate": ".ci/run activates its fresh venv",
    r'pip install -c \.ci/constraints\.txt -e "\.\[(viz|test)\]"': ".ci/run installs from scratch with the "
                                                                    "constraints (the [test] extra holds [viz]'s packages)",
    r"python -m pytest -q": "the suite itself; .ci/run runs the README's test command verbatim",
    r"python tools/mutations\.py": ".ci/run runs it after the suite (it reruns test files on mutated copies; "
                                   "tests/test_mutations_table.py checks its table)",
    # docs/reliability.md: the crash hunt's long runs, rerunnable by hand.
    r"ulimit -c unlimited": "a shell builtin: core files for the hunts that follow it in the same shell",
    r"(GLIBC_TUNABLES=\S+ LD_PRELOAD=\S+ PYTHONMALLOC=debug |taskset -c 0 )?nice -n (10|19) "
    r"python tools/soak\.py --minutes \d+ .*": "a soak of 30 minutes to hours; tests/test_soak.py runs "
                                              "tools/soak.py end to end on a tiny run",
    r"PYTHONPATH=\. nice -n 10 python tools/stress_(overlap|micro)\.py .*": "a stress hunt of hours; the "
                                                                        "pattern it stresses is pinned by "
                                                                        "tests/test_comm_one_at_a_time.py",
    r"PYTHONPATH=\.:tools python -m pytest .*": "the suite's own multi-rank modules, looped for the hunt",
    r"(taskset -c 0 )?nice -n (10|19) python tools/exit_loop\.py --runs \d+ .*": "the abort-at-exit loop, "
                                                                            "minutes (its --no-teardown arm exits 1 "
                                                                            "when it reproduces the abort); its short "
                                                                            "form runs here, and tests/mesh/"
                                                                            "test_mesh_teardown.py pins the fix",
    r"python bench/(fsdp|ddp)\.py --steps 10": "a timing benchmark, minutes a run on a CI machine; its "
                                              "numbers are reported, not checked",
    # docs/jax.md
    r"python tests/conformance/conf_report\.py": "every program against JAX, a minute: the same programs "
                                                 "tests/conformance compares in this suite (the `diff/` and "
                                                 "substring forms of the command run here)",
    # docs/plan.md
    r"python -m fshard\.plan --model llama3-8b --devices 64 .*": "a search over every 64-device layout, 45 s of "
                                                                "CPU; tests/plan's CLI tests run the search on "
                                                                "small cases (the --layout command here is run)",
    r"PYTHONPATH=\. nice -n 19 python bench/plan_validate\.py .*": "the validation runs, about 5 minutes; "
                                                                   "tests/plan checks each predicted quantity",
    r"PYTHONPATH=\. python bench/plan_validate\.py --report .*": "prints the table the run above saved",
    r"PYTHONPATH=\. python bench/plan_paper\.py": "40 s of search against published runs; its table is in "
                                                  "docs/plan.md and is reported, not checked",
}
# Placeholders of the multi-node command, as one node of 2 CPU ranks on loopback.
MULTI_NODE = [(r"--nnodes N\b", "--nnodes 1"), (r"--node-rank \$NODE_RANK", "--node-rank 0"),
              (r"--nproc-per-node 8\b", "--nproc-per-node 2"), (r"dp=N,fsdp=8", "dp=1,fsdp=2"),
              (r"\$HEAD_NODE:29500", "127.0.0.1:{port}")]


def _commands(path: Path) -> list[tuple[str, str]]:
    """``(kind, command)`` for each command in the document; kind is "block", "inline" or "variant"."""
    text = path.read_text()
    out: list[tuple[str, str]] = []
    prose = []
    for i, part in enumerate(re.split(r"^```", text, flags=re.M)):
        if i % 2 == 0:
            prose.append(part)
            continue
        info, _, body = part.partition("\n")
        if info.strip() not in ("bash", "sh", "shell", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line.strip().removeprefix("$ "))  # a trailing comment
            if line and not line.startswith("#"):
                out.append(("block", " ".join(line.split())))
    prose_text = "\n".join(prose)
    for m in re.finditer(r"`((?:torchrun|python3?) [^`]+)`", prose_text):
        out.append(("inline", " ".join(m.group(1).split())))
    # "`torchrun ... train_lm.py --mesh A` (or `B`, `C`)": the same command on meshes B and C.
    for m in re.finditer(r"`((?:torchrun|python3?) [^`]*train_lm\.py --mesh )[^`]+`\s*\(or\s+([^)]*)\)", prose_text):
        for alt in re.findall(r"`([^`]+)`", m.group(2)):
            out.append(("variant", " ".join((m.group(1) + alt).split())))
    return out


ALL = [(p.relative_to(ROOT).as_posix(), kind, cmd) for p in DOCS for kind, cmd in _commands(p)]


def _steps(cmd: str) -> list[str]:
    return [s.strip() for s in cmd.split("&&")]


def _not_run_reason(step: str) -> str | None:
    for pattern, reason in NOT_RUN_HERE.items():
        if re.fullmatch(pattern, step):
            return reason
    return None


def _runnable(cmd: str) -> list[str]:
    return [s for s in _steps(cmd) if _not_run_reason(s) is None]


RUN = [(doc, kind, step) for doc, kind, cmd in ALL if cmd not in TEMPLATES for step in _runnable(cmd)]

# train_lm.py flags (with their value) that add output and change nothing the run computes:
# --log-json writes the records (and profiles one step's memory for the prediction line).
OUTPUT_ONLY_FLAGS = {"--log-json"}


def _extends(longer: str, shorter: str) -> bool:
    """Whether ``longer`` is ``shorter`` word for word followed only by output-only flags."""
    a, b = shlex.split(longer), shlex.split(shorter)
    if len(a) <= len(b) or a[:len(b)] != b or not any(w.endswith("train_lm.py") for w in b):
        return False
    rest = a[len(b):]
    return len(rest) % 2 == 0 and all(f in OUTPUT_ONLY_FLAGS for f in rest[::2])


def _launches() -> list[tuple[str, str, str, list[tuple[str, str]]]]:
    """RUN, less the steps another step extends: ``(doc, kind, step, [(doc, step) it also runs])``."""
    out = []
    for doc, kind, step in RUN:
        if kind != "variant" and any(k != "variant" and _extends(s, step) for _, k, s in RUN):
            continue
        also = [(d, s) for d, k, s in RUN if k != "variant" and kind != "variant" and _extends(step, s)]
        out.append((doc, kind, step, also))
    return out


LAUNCHES = _launches()


def test_every_command_is_run_or_listed():
    assert any(kind == "block" for _, kind, _ in ALL) and any(kind == "inline" for _, kind, _ in ALL)
    for doc, kind, cmd in ALL:
        for step in _steps(cmd):
            listed = cmd in TEMPLATES or _not_run_reason(step) is not None
            runs = (doc, kind, step) in RUN
            assert listed != runs, f"{doc}: {step!r} is both run and listed, or neither"
    for step in (s for s in TEMPLATES):
        assert any(cmd == step for _, _, cmd in ALL), f"TEMPLATES names {step!r}, which no document has any more"


def test_every_run_step_is_launched_itself_or_by_a_command_that_extends_it():
    launched = {(doc, step) for doc, _, step, _ in LAUNCHES}
    also = {pair for *_, extra in LAUNCHES for pair in extra}
    assert {(doc, step) for doc, _, step in RUN} == launched | also
    assert also, "no documented command extends another one any more: drop OUTPUT_ONLY_FLAGS"
    assert _extends("torchrun x/train_lm.py --mesh a --log-json l.json", "torchrun x/train_lm.py --mesh a")
    assert not _extends("torchrun x/train_lm.py --mesh a --steps 9", "torchrun x/train_lm.py --mesh a")
    assert not _extends("torchrun x/train_lm.py --mesh ab --log-json l.json", "torchrun x/train_lm.py --mesh a")


def test_readme_test_command_is_what_ci_runs():
    readme = [cmd for doc, kind, cmd in ALL if doc == "README.md" and "pytest" in cmd]
    assert readme == ['pip install -c .ci/constraints.txt -e ".[test]" && python -m pytest -q']
    assert readme[0] in (ROOT / ".ci" / "run").read_text().splitlines()


def _argv(step: str) -> list[str]:
    """The command as an argv, in short form, runnable from any directory."""
    argv = shlex.split(step)
    if argv[0] == "torchrun":
        if "--rdzv-endpoint" in step:  # multi-node: its own rendezvous, on loopback
            text = step
            for pattern, repl in MULTI_NODE:
                text = re.sub(pattern, repl.format(port=free_port()), text)
            argv = shlex.split(text)
            argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1",
                    "--master-port", str(free_port()), *argv[1:]]
    elif argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    argv = [str(ROOT / a) if not a.startswith("-") and "/" in a and (ROOT / a).exists() else a for a in argv]
    if any(a.endswith("train_lm.py") for a in argv):
        argv += SHORT
    return argv


def _train(argv: list[str]) -> list[dict]:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train_lm

    return train_lm.main(argv)


LAUNCH_TIMEOUT_S = 240
MACHINE_FILE = "machine.json"


class _Launcher:
    """Runs the selected tests' commands as subprocesses, each test's own and, ahead of it,
    the next one's: two at a time. A launch spends much of its time on one core (torchrun's
    start-up, a one-process command) or waiting (rendezvous, exit), so the next one's
    start-up fills the other core. Each command runs once, in a directory of its own, with
    the same argv, environment and timeout as when it ran alone; its test asserts on its
    result. Under pytest-xdist (two tests at a time already) there is no look-ahead."""

    def __init__(self, order: list[tuple[str, str, str]], workdir: Path) -> None:
        self.order, self.workdir = order, workdir
        self.pool = cf.ThreadPoolExecutor(2, thread_name_prefix="docs-launch")
        self.started: dict[tuple[str, str, str], cf.Future] = {}
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.closed = False

    def _start(self, key: tuple[str, str, str]) -> cf.Future:
        if key not in self.started:
            cwd = self.workdir / f"launch{len(self.started)}"
            cwd.mkdir()
            self.started[key] = self.pool.submit(self._run, key[2], cwd)
        return self.started[key]

    def _run(self, step: str, cwd: Path) -> tuple[list[str], Path, subprocess.CompletedProcess]:
        argv = _argv(step)  # a free port drawn just before the launch that binds it
        # The planner's machine file (--mesh auto, --log-json's prediction) in the launch's
        # directory, not in $HOME: each run calibrates (a second of CPU) and saves it there.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "OMP_NUM_THREADS": "1", "FSHARD_MACHINE": str(cwd / MACHINE_FILE)}
        with self.lock:  # not after close(): it kills what was started
            if self.closed:
                raise RuntimeError("the launcher was closed before this command started")
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)
            self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            err += f"\n(killed: still running after {LAUNCH_TIMEOUT_S} s)"
        return argv, cwd, subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def result(self, key: tuple[str, str, str]) -> tuple[list[str], Path, subprocess.CompletedProcess]:
        future = self._start(key)
        if key in self.order:
            ahead = self.order[self.order.index(key) + 1:self.order.index(key) + 2]
            for nxt in ahead:
                self._start(nxt)
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        with self.lock:
            self.closed = True
            for proc in self.procs:
                if proc.poll() is None:  # a look-ahead launch whose test did not run (-x, Ctrl-C)
                    _kill_group(proc)
        self.pool.shutdown(wait=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def launcher(request, tmp_path_factory):
    order = []
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # this process runs every selected test, in this order
        order = [(p["doc"], p["kind"], p["step"]) for item in request.session.items
                 if item.path == request.path and getattr(item, "originalname", None) == "test_command_runs"
                 for p in [item.callspec.params] if p["kind"] != "variant"]
    launcher = _Launcher(order, tmp_path_factory.mktemp("launches"))
    yield launcher
    launcher.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("doc, kind, step, also", LAUNCHES,
                         ids=[f"{d}: {s}" + "".join(f" (also {d2}: {s2})" for d2, s2 in a) for d, _, s, a in LAUNCHES])
def test_command_runs(doc, kind, step, also, launcher):
    if kind == "variant":  # torchrun --nproc-per-node 4 examples/train_lm.py ARGS: ARGS on the 4-rank pool
        argv = _argv(step)
        n = int(argv[argv.index("--nproc-per-node") + 1])
        script = next(i for i, a in enumerate(argv) if a.endswith("train_lm.py"))
        records = run_on_ranks(_train, argv[script + 1:], world_size=n, timeout_s=240)
        assert [r["step"] for r in records[0]] == [1, 2]
        return
    argv, cwd, run = launcher.result((doc, kind, step))
    assert run.returncode == 0, f"{doc}: {step}\n$ {shlex.join(argv)}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    if "train_lm.py" in step:
        assert "loss" in run.stdout and "over steps 1-2" in run.stdout, run.stdout[-2000:]
    if "--mesh auto" in step:  # no machine file yet: a quick calibration, "saved there for the next run"
        assert json.loads((cwd / MACHINE_FILE).read_text())["flops"], run.stdout[-2000:]
    if "--log-json" in argv:  # what the flag adds: the records of both steps
        log = json.loads((cwd / argv[argv.index("--log-json") + 1]).read_text())
        assert [r["step"] for r in log] == [1, 2], log
