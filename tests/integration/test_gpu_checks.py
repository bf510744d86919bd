"""bench/gpu_checks/run.sh: the GPU checks' logic runs on the CPU, and the runner's bookkeeping.

``run.sh --cpu-dry-run`` runs every check script exactly as on a GPU, with the device
(cuda -> cpu) and backend (nccl -> gloo) swapped and the device assertions skipped; the
summary must say every check passed or was skipped for a stated reason, and list the
device assertions each one skipped. Dry-run sizes are tiny (a few steps) and the jit
check compiles with ``aot_eager`` (no Inductor C++ build, see check_jit.py). The 7 check
processes (and the ranks they fork) are forked from one process that imported torch and
fshard once (driver.py's ``_preloaded``; fresh interpreters cost 45 s of CPU, this about 18 s),
two at a time (``--jobs 2``: the checks are independent, and no dry-run assertion is about
time), so that the second core is busy while one check is waiting on its ranks.

The runner itself (time limit, keeping going past a failure, a check that leaves no
record) is tested with a stand-in interpreter, without torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "gpu_checks" / "run.sh"
CHECKS = ["nccl_init", "init_sharded", "train_lm", "offload", "gloo_cuda_ranks", "fully_shard_overhead", "jit"]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHON"] = sys.executable
    return subprocess.run([str(RUN), *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(900)
def test_cpu_dry_run_passes_and_says_what_it_skipped(tmp_path):
    proc = _run(["--cpu-dry-run", "--jobs", "2", "--out", str(tmp_path), "--time-limit", "600"], 780)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert summary["mode"] == "cpu-dry-run" and summary["ok"]
    assert "Nothing in this summary ran on a GPU" in summary["note"]
    assert [r["check"] for r in summary["checks"]] == CHECKS
    for r in summary["checks"]:
        assert r["status"] in ("passed", "skipped"), (r["check"], r["error"])
        assert (tmp_path / r["log"]).exists()
        if r["status"] == "skipped":
            assert r["reason"], r["check"]
            continue
        assert r["mode"] == "cpu-dry-run" and r["device"]["device"] == "cpu"
        assert r["assertions"]["checked"], f"{r['check']} asserted nothing"
        assert r["assertions"]["skipped_on_cpu"], f"{r['check']} does not say which device assertions it skipped"
        assert all(p["passed"] for p in r["parts"].values()), r["parts"]
    by_name = {r["check"]: r for r in summary["checks"]}
    import fshard

    if not hasattr(fshard, "jit"):
        assert by_name["jit"]["status"] == "skipped" and by_name["jit"]["reason"] == "fs.jit not built"
    else:
        assert by_name["jit"]["figures"]["backend"] == "aot_eager"
    assert set(by_name["gloo_cuda_ranks"]["parts"]) == {"collectives", "init_sharded", "fsdp", "tp", "pipeline"}
    assert "Nothing in this summary ran on a GPU" in (tmp_path / "summary.md").read_text()


# A stand-in for the checks' interpreter (--python): `fake.py SCRIPT --result PATH`. It fails
# check_nccl.py without a record, sleeps through offload_check.py, and writes a passing
# record for the others.
_FAKE = '''#!{python}
import json, sys, time
script, result = sys.argv[1], sys.argv[sys.argv.index("--result") + 1]
if script.endswith("check_nccl.py"):
    print("boom: NCCL error"); sys.exit(3)
if script.endswith("offload_check.py"):
    time.sleep(60)
name = script.rsplit("/", 1)[-1]
json.dump({{"check": name, "status": "passed", "passed": True, "seconds": 0.1, "mode": "gpu",
           "device": {{"device": "Fake GPU"}}, "figures": {{"x": 1}},
           "assertions": {{"checked": ["a"], "skipped_on_cpu": []}}, "parts": {{}}, "reason": None,
           "error": None}}, open(result, "w"))
'''


@pytest.mark.timeout(120)
def test_runner_keeps_going_and_records_failures(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text(_FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    # The time limit is waited out (offload sleeps through it): 8 s leaves the 3 checks before
    # it 3 s to start (the driver runs no check with under 5 s left).
    proc = _run(["--out", str(out), "--time-limit", "8", "--python", str(fake), "--only",
                 "nccl_init,init_sharded,train_lm,offload,gloo_cuda_ranks"], 100)
    assert proc.returncode == 1, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    got = {r["check"]: r for r in summary["checks"]}
    assert list(got) == ["nccl_init", "check_init_sharded.py", "check_train_lm.py", "offload", "gloo_cuda_ranks"]
    assert got["nccl_init"]["status"] == "failed" and "exited with status 3" in got["nccl_init"]["error"]
    assert "boom: NCCL error" in got["nccl_init"]["error"]  # the log's tail comes with it
    # Past the failure, the next checks ran.
    assert got["check_init_sharded.py"]["passed"] and got["check_train_lm.py"]["passed"]
    assert got["offload"]["status"] == "failed" and "killed after" in got["offload"]["error"]
    # The time left after the killed check is under 5 s: the rest is recorded as not run.
    assert got["gloo_cuda_ranks"]["status"] == "failed" and "not run" in got["gloo_cuda_ranks"]["error"]
    assert not summary["ok"] and summary["mode"] == "gpu" and summary["machine"]["device"] == "Fake GPU"
    assert "NOT OK" in (out / "summary.md").read_text()


def _checker(dry_run):
    sys.path.insert(0, str(ROOT / "bench" / "gpu_checks"))
    from common import Checker, CheckFailed

    return Checker("c", dry_run), CheckFailed


def test_device_assertions_assert_on_a_gpu_and_are_listed_in_a_dry_run():
    gpu, CheckFailed = _checker(dry_run=False)
    gpu.require_on_device("holds", lambda: (True, "detail"))
    with pytest.raises(CheckFailed, match="does not hold: 3 B > 2 B"):
        gpu.require_on_device("does not hold", lambda: (False, "3 B > 2 B"))
    assert gpu.checked == ["holds"] and gpu.skipped == []
    dry, _ = _checker(dry_run=True)

    def cuda_only():
        raise RuntimeError("Torch not compiled with CUDA enabled")
    dry.require_on_device("needs CUDA", cuda_only)        # the CPU cannot answer: skipped
    dry.require_on_device("false on the CPU", lambda: False)
    assert dry.skipped == ["needs CUDA", "false on the CPU"] and dry.checked == []
    # A broken assertion fails even in a dry run, so the GPU run does not find it first.
    with pytest.raises(CheckFailed, match="is broken"):
        dry.require_on_device("typo", lambda: {}["peak"] > 0)
    with pytest.raises(CheckFailed, match="is broken"):
        dry.require_on_device("bad shape", lambda: (True,))
