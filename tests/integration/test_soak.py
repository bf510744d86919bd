"""tools/soak.py: a tiny soak run end to end, and a crashing run reported with its signal."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "tools" / "soak.py"


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_one_tiny_run(tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    # What is tested is the soak loop (torchrun, progress parsing, the JSON and the summary), so
    # the run is as small as it gets: 2 ranks (the later --mesh of --example-args wins over the
    # mesh's own dp=2,fsdp=2; its axes stay) and a smaller model: half the CPU of 4 ranks.
    proc = subprocess.run([sys.executable, str(SOAK), "--max-runs", "1", "--steps", "2", "--mesh", "dp_fsdp",
                           "--nproc", "2", "--example-args=--mesh dp=1,fsdp=2 --dim 16 --seq-len 16",
                           "--json", str(out), "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["runs"], result["steps"], result["crashes"], result["nproc"]) == (1, 2, 0, 2)
    (run,) = result["records"]
    assert run["mesh"] == "dp_fsdp" and run["status"] == "ok" and math.isfinite(run["final_loss"])
    assert run["argv"][-6:] == ["--mesh", "dp=1,fsdp=2", "--dim", "16", "--seq-len", "16"], run["argv"]
    assert "1 runs, 2 steps, 0 crashed" in proc.stdout
    assert not any((tmp_path / "logs").iterdir())  # a clean run keeps no files


# Rank 1 crashes only once rank 0 has printed its two steps (a marker file beside the script):
# crashing at once raced rank 0's start, and under load torchrun stopped rank 0 before it
# printed anything.
_CRASHING_EXAMPLE = textwrap.dedent("""
    import os, signal, sys, time
    steps = int(sys.argv[sys.argv.index("--steps") + 1])
    printed = __file__ + ".printed"
    if os.environ["RANK"] == "0":
        for s in range(1, 3):
            print(f"step {s:>5}/{steps}  loss 4.0000  1,000 tokens/s  lr 1.00e-02", flush=True)
        open(printed, "w").close()
    if os.environ["RANK"] == "1":
        deadline = time.monotonic() + 60
        while not os.path.exists(printed) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("Fatal Python error: Segmentation fault", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)  # the other rank waits, as in a collective, until torchrun stops it
""")


def test_soak_reports_a_crashed_run_with_its_signal(tmp_path, monkeypatch):
    soak = _load_soak()
    fake = tmp_path / "crashing_example.py"
    fake.write_text(_CRASHING_EXAMPLE)
    monkeypatch.setattr(soak, "EXAMPLE", fake)
    args = soak.parse_args(["--steps", "5", "--nproc", "2", "--log-dir", str(tmp_path / "logs"),
                            "--run-timeout", "120"])
    args.stamp = "test"
    run = soak.run_once(0, "fsdp_remat", args, tmp_path)
    assert run.status == "crash" and run.returncode != 0
    assert run.signal == "SIGSEGV (rank 1)", run
    assert run.first_error == "Fatal Python error: Segmentation fault"
    assert run.steps == 2 and run.final_loss is None
    assert Path(run.log).read_text().count("step ") >= 2  # the output is kept for a crashed run
    assert "SIGSEGV (rank 1) Fatal Python error" in soak.table([run])
    assert soak.summary([run], 1.0, args)["crashes_by_signal"] == {"SIGSEGV (rank 1)": 1}


def test_first_error_line_drops_another_ranks_output_on_the_same_line():
    # The ranks share torchrun's stdout: print() writes its text and its newline separately, so
    # one rank's progress line can follow another's error before the newline (seen in CI).
    soak = _load_soak()
    first = soak.first_error_line
    assert first("Fatal Python error: Segmentation faultstep     1/5  loss 4.0000  1,000 tokens/s\n") \
        == "Fatal Python error: Segmentation fault"
    assert first(" 40%|####      | 2/5 [00:01<00:02]malloc(): corrupted top size 60%|######    | 3/5 [") \
        == "malloc(): corrupted top size"
    assert first("step 1/5 loss 4.0\nRuntimeError: boom\n") == "RuntimeError: boom"
    assert first("step 1/5 loss 4.0\n") is None
