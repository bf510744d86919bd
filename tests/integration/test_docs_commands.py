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
that run as subprocesses run one at a time (:func:`_procs.run_together`), each in a
directory of its own, with ``FSHARD_MACHINE`` in one directory for the module
(:func:`machine_file`): the planner's machine file is calibrated there by the first
command that plans and read by the next, never read from or written to $HOME.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from _harness._examples import example
from _harness._procs import run_together
from _harness.optional import DOC_COMMAND_NEEDS, skip_without
from fshard.recipes.sinks import read_log
from fshard.testing import free_port, run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = ROOT / "examples"
example("train_lm")  # a rank's error may be train_lm's ConfigError: unpickled here
SHORT = ["--steps", "2"]  # appended to every command that trains (argparse: the last value wins)

# Inline spans that are fragments or templates, not commands.
TEMPLATES = {
    "torchrun --nproc-per-node 8": "a fragment of a sentence (no script)",
    "torchrun --nproc-per-node N script.py": "a template: N and script.py are the reader's",
    # docs/guide.md: train.py is the reader's file of the guide's python blocks.
    "python train.py": "docs/guide.md's program; tests/integration/test_guide.py runs it on 2 ranks",
    "torchrun --nproc-per-node 2 train.py": "docs/guide.md's program under torchrun; test_guide.py runs it",
}
# Steps that .ci/run runs instead (a fresh venv and the install need the network and minutes).
NOT_RUN_HERE = {
    r"python3 -m venv \.venv": ".ci/run makes a fresh venv",
    r"\. \.venv/bin/activate": ".ci/run activates its fresh venv",
    r'pip install -c \.ci/constraints\.txt -e "\.\[(viz|test)\]"': (
        ".ci/run installs from scratch with the constraints (the [test] extra holds [viz]'s packages)"),
    # README.md, "Install": PyTorch's own index and the package, for machines other than CI's.
    r"pip install torch( --index-url https://download\.pytorch\.org/whl/cpu)?": (
        "PyTorch's index over the network (CPU or CUDA wheel); .ci/run installs the torch the "
        "constraints pin, and this suite runs on it"),
    r'pip install -e "\.\[viz\]"': ".ci/run installs the package from scratch ([test] holds [viz]'s packages)",
    r"python -m pytest -q": "the suite itself; .ci/run runs the README's test command verbatim",
    r"python tools/mutations\.py": ".ci/run runs it after the suite (it reruns test files on mutated copies; "
                                   "tests/integration/test_mutations_table.py checks its table)",
    # docs/reliability.md: the crash hunt's long runs, rerunnable by hand.
    r"ulimit -c unlimited": "a shell builtin: core files for the hunts that follow it in the same shell",
    r"(GLIBC_TUNABLES=\S+ LD_PRELOAD=\S+ PYTHONMALLOC=debug |taskset -c 0 )?(nice -n (10|19) )?"
    r"python tools/soak\.py --minutes \d+ .*": "a soak of 30 minutes to hours; tests/integration/test_soak.py runs "
                                              "tools/soak.py end to end on a tiny run",
    r"PYTHONPATH=\. nice -n 10 python tools/stress_(overlap|micro)\.py .*": "a stress hunt of hours; the "
                                                                        "pattern it stresses is pinned by "
                                                                        "tests/test_comm_one_at_a_time.py",
    r"PYTHONPATH=\.:tools python -m pytest .*": "the suite's own multi-rank modules, looped for the hunt",
    r"FSHARD_TEST_INDUCTOR_STEP=1 python -m pytest .*": "the suite's opt-in Inductor tests, minutes of cold "
                                                        "compiles; run by hand, their last run recorded there",
    r"(taskset -c 0 )?nice -n (10|19) python tools/exit_loop\.py --runs \d+ .*": "the abort-at-exit loop, "
                                                                            "minutes (its --no-teardown arm exits 1 "
                                                                            "when it reproduces the abort); its short "
                                                                            "form runs here, and tests/mesh/"
                                                                            "test_mesh_teardown.py pins the fix",
    r"python bench/(fsdp|ddp)\.py --steps 10": "a timing benchmark, minutes a run on a CI machine; its "
                                              "numbers are reported, not checked",
    r"python bench/cp\.py": "a timing benchmark, minutes a run; tests/integration/test_bench.py runs its sides, "
                            "the limit and the memory probe at a small size",
    r"python bench/gloo_workers\.py --mode (fsdp|ddp)": "a timing A/B, a minute or two a run; its numbers are "
                                                     "reported, not checked (tests/runtime/test_gloo_workers.py "
                                                     "checks the worker counts it compares)",
    # docs/jax.md
    r"python tests/conformance/conf_report\.py": "every program against JAX, a minute: the same programs "
                                                 "tests/conformance compares in this suite (the `diff/` and "
                                                 "substring forms of the command run here)",
    r"python -m tests\.conformance\.fuzz --seeds 0:10000 .*": "10,000 fuzzed programs, about 10 minutes; "
                                                            "tests/conformance/test_fuzz.py runs seeds 0-499 and "
                                                            "this command's short form (--seeds 0:4)",
    # docs/plan.md
    r"python -m fshard\.plan --model llama3-8b --devices 64 .*": "a search over every 64-device layout, 45 s of "
                                                                "CPU; tests/plan's CLI tests run the search on "
                                                                "small cases (the --layout command here is run)",
    r"PYTHONPATH=\. nice -n 19 python bench/plan_validate\.py .*": "the validation runs, 10-20 minutes; "
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
    return example("train_lm").main(argv)


LAUNCH_TIMEOUT_S = 240
MACHINE_FILE = "machine.json"


@pytest.fixture(scope="module")
def machine_file(tmp_path_factory) -> Path:
    """The planner's machine file (``FSHARD_MACHINE``) of every command this module runs,
    never $HOME's. docs/plan.md: without ``--machine``, train_lm.py reads this host's machine
    file, "else a quick calibration that is saved there for the next run": the first
    command that plans (``--mesh auto``, in the documents' order) calibrates and saves it,
    the next (``--log-json``'s prediction) reads it (a 4-rank calibration costs 2-7 s of
    CPU and 3-14 s of wall on 2 cores; tests/plan/test_plan_measure.py checks what it
    measures)."""
    return tmp_path_factory.mktemp("planner") / MACHINE_FILE


def _plans(argv: list[str]) -> bool:
    """Whether train_lm.py consults the planner's machine (``--mesh auto``, ``--log-json``)."""
    if not any(a.endswith("train_lm.py") for a in argv):
        return False
    return "--log-json" in argv or ("--mesh" in argv and argv[argv.index("--mesh") + 1] == "auto")


def _state(path: Path) -> tuple[bytes, int, int] | None:
    """The file's bytes and identity (a save replaces it: a new inode and mtime), or None."""
    try:
        st = path.stat()
        return path.read_bytes(), st.st_ino, st.st_mtime_ns
    except FileNotFoundError:
        return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("doc, kind, step, also", LAUNCHES,
                         ids=[f"{d}: {s}" + "".join(f" (also {d2}: {s2})" for d2, s2 in a) for d, _, s, a in LAUNCHES])
def test_command_runs(doc, kind, step, also, tmp_path, machine_file):
    for pattern, packages in DOC_COMMAND_NEEDS.items():  # e.g. the JAX oracle's commands, under .[test-core]
        if re.search(pattern, step):
            skip_without(*packages)
    if kind == "variant":  # torchrun --nproc-per-node 4 examples/train_lm.py ARGS: ARGS on the 4-rank pool
        argv = _argv(step)
        n = int(argv[argv.index("--nproc-per-node") + 1])
        script = next(i for i, a in enumerate(argv) if a.endswith("train_lm.py"))
        records = run_on_ranks(_train, argv[script + 1:], world_size=n, timeout_s=240)
        assert [r["step"] for r in records[0]] == [1, 2]
        return
    argv = _argv(step)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "FSHARD_MACHINE": str(machine_file)}
    before = _state(machine_file)
    (run,) = run_together([argv], cwd=tmp_path, env=env, timeout_s=LAUNCH_TIMEOUT_S)
    assert run.returncode == 0, f"{doc}: {step}\n$ {shlex.join(argv)}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    if "train_lm.py" in step:
        assert "loss" in run.stdout and "over steps 1-2" in run.stdout, run.stdout[-2000:]
    if before is None and _plans(argv):  # no machine file yet: a quick calibration, saved for the next run
        assert json.loads(machine_file.read_text())["flops"], run.stdout[-2000:]
    else:  # read (a command that plans after the first), or not used at all: not measured or written again
        assert _state(machine_file) == before, f"{step}: the machine file was written again"
    if "--log-json" in argv:  # what the flag adds: the records of both steps
        log = read_log(tmp_path / argv[argv.index("--log-json") + 1])
        assert [r["step"] for r in log] == [1, 2], log
    if "exit_loop.py" in step:  # the loop's own verdict, besides its exit status
        assert re.search(r"\): 0 with an abort at exit \(0 ranks\), 0 failed", run.stdout), run.stdout[-2000:]
