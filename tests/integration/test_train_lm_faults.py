"""examples/train_lm.py under faults (issue 14): a rank killed during a synchronous or an
asynchronous checkpoint save, a truncated or corrupted checkpoint, a checkpoint of another
model, and a NaN or inf loss or gradient.

The runs are the tiny float64 model of tests/integration/test_examples.py. A killed save must leave the
previous checkpoint's files unchanged byte for byte, and ``--resume`` must continue the loss
curve of an uninterrupted run exactly; a bad checkpoint must stop ``--resume`` with an error
that names the data file and the key (or the model's differing fields) and change nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import fshard as fs
from fshard.testing import run_on_ranks

from _harness import _zygote
from _harness._examples import example

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
train_lm = example("train_lm")  # ranks' errors are train_lm's classes: unpickled here

TINY = ["--dtype", "float64", "--dim", "16", "--layers", "4", "--heads", "4", "--seq-len", "16",
        "--batch-size", "8", "--quiet"]
STEPS = ["--steps", "6"] + TINY
RTOL = 1e-9


def _train(argv: list[str]) -> list[dict]:
    return example("train_lm").main(argv)


def _hashes(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path(directory).iterdir())}


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def _same_curve(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b), (got, want)


# --- a rank killed during a save ---------------------------------------------------


def _killed_mid_save(argv: list[str], save_no: int, out_dir: str) -> list[dict]:
    """A rank of fs.run_local: train; rank 1 SIGKILLs itself after the first item of save ``save_no``.

    Just before, it records the hashes of the checkpoint directory's files (the previous
    checkpoint, which the save in progress must not touch).
    """
    import torch.distributed.checkpoint.filesystem as dfs

    from fshard.checkpoint import _save

    rank = int(os.environ["RANK"])
    ckpt_dir = argv[argv.index("--checkpoint-dir") + 1]
    # Which save is being written, counted where the writing starts: on the background
    # thread for an async save, which may start after the training thread called save again.
    writing = [0]
    real_commit, real_write = _save._write_and_commit, dfs._write_item

    def counting_write_and_commit(*args, **kwargs):
        writing[0] += 1
        return real_commit(*args, **kwargs)

    def write_then_die(*args, **kwargs):
        result = real_write(*args, **kwargs)
        if rank == 1 and writing[0] == save_no:
            Path(out_dir, "snapshot.json").write_text(json.dumps(_hashes(Path(ckpt_dir))))
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    _save._write_and_commit, dfs._write_item = counting_write_and_commit, write_then_die
    return _train(argv)


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    return _losses(run_on_ranks(_train, STEPS + ["--mesh", "fsdp=2"], world_size=2)[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_during_save_keeps_previous_checkpoint_and_resume_continues(mode, uninterrupted, tmp_path):
    ck = tmp_path / "ck"
    argv = STEPS + ["--mesh", "fsdp=2", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    argv += ["--async-checkpoint"] if mode == "async" else []
    # Saves at steps 2 and 4 (then at the end); rank 1 dies inside the one of step 4.
    with pytest.raises(RuntimeError, match=r"rank 1 died \(killed by SIGKILL"):
        fs.run_local(_killed_mid_save, argv, 2, str(tmp_path), world_size=2, timeout_s=200)
    snapshot = json.loads((tmp_path / "snapshot.json").read_text())
    assert ".metadata" in snapshot and ".fshard-checksums.json" in snapshot
    assert _hashes(ck) == snapshot  # the previous checkpoint: not a byte changed
    # The killed save's temporary directory: removed by rank 0 when its own write failed, or
    # left for the next save to clear.
    assert len([e for e in os.listdir(tmp_path) if e.startswith(".ck.tmp-")]) <= 1
    assert fs.checkpoint.load(str(ck))["step"] == 2  # loads (every item's checksum verified)

    tail = run_on_ranks(_train, argv + ["--resume"], world_size=2)[0]
    assert [r["step"] for r in tail] == [3, 4, 5, 6]
    _same_curve(_losses(tail), uninterrupted[2:])
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".ck.tmp-")]  # the next save cleared it
    assert fs.checkpoint.load(str(ck))["step"] == 6


# --- bad checkpoints on --resume -------------------------------------------------------


@pytest.fixture(scope="module")
def step_2(tmp_path_factory) -> Path:
    ck = tmp_path_factory.mktemp("resume") / "ck"
    run_on_ranks(_train, STEPS + ["--mesh", "fsdp=1", "--checkpoint-dir", str(ck), "--stop-at", "2"], world_size=1)
    return ck


def _item(ck: Path, key: str):
    md = fs.checkpoint.read_metadata(str(ck))
    return next(info for index, info in md.storage_data.items() if index.fqn == key)


def _corrupt(ck: Path, how: str) -> str:
    """Damages the checkpoint; returns what the error must say."""
    key = "params.layers.1.feed_forward.w2.weight"
    info = _item(ck, key)
    data = ck / info.relative_path
    if how == "corrupted":  # one flipped bit inside a tensor's bytes: only a checksum tells
        with open(data, "r+b") as f:
            f.seek(info.offset + info.length // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        return rf"data file '{info.relative_path}' of '.*ck' is corrupt: the bytes of key '{key}'"
    with open(data, "r+b") as f:
        f.truncate(info.offset + info.length // 2)
    return rf"data file '{info.relative_path}' is truncated.*|missing: \[.*'{key}'"


@pytest.mark.parametrize("how", ["truncated", "corrupted"])
def test_resume_from_damaged_checkpoint_names_file_and_key_and_changes_nothing(how, step_2, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(step_2, ck)
    message = _corrupt(ck, how)
    before = _hashes(ck)
    with pytest.raises(fs.checkpoint.CheckpointError, match=message) as info:
        run_on_ranks(_train, STEPS + ["--mesh", "fsdp=1", "--checkpoint-dir", str(ck), "--resume"], world_size=1)
    assert str(ck) in str(info.value)
    assert _hashes(ck) == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_resume_from_another_models_checkpoint_names_the_fields_and_changes_nothing(step_2, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(step_2, ck)
    before = _hashes(ck)
    argv = STEPS + ["--mesh", "fsdp=1", "--checkpoint-dir", str(ck), "--resume"]
    argv[argv.index("--dim") + 1] = "32"
    with pytest.raises(train_lm.ConfigError, match=r"holds another model: dim 16 \(this run: 32\)\. Give the flags"):
        run_on_ranks(_train, argv, world_size=1)
    assert _hashes(ck) == before


def _scripts(zygotes, *argvs: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Runs ``python train_lm.py ARGV`` for each argv, all at once, in processes forked from the
    zygote (tests/_harness/_zygote.py: torch and fshard imported once per session); their results in order."""
    return _zygote.run_together(zygotes, [[str(EXAMPLES / "train_lm.py"), *argv] for argv in argvs], cwd=cwd,
                                env=_zygote.env(), timeout_s=180)


@pytest.mark.timeout(200)
def test_script_reports_bad_checkpoint_and_nonfinite_loss_in_one_line(zygotes, step_2, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(step_2, ck)
    _corrupt(ck, "corrupted")
    run, nonfinite = _scripts(zygotes, STEPS + ["--checkpoint-dir", str(ck), "--resume"],
                              ["--steps", "3", "--inject-nonfinite", "2"] + TINY, cwd=tmp_path)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "train_lm.py: error: reading the checkpoint" in run.stderr and "is corrupt" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert nonfinite.returncode == 1, nonfinite.stderr[-3000:]
    assert "train_lm.py: error: step 2: the loss is nan" in nonfinite.stderr, nonfinite.stderr[-3000:]
    assert "Traceback" not in nonfinite.stderr


# --- NaN / inf ---------------------------------------------------------------------


@pytest.mark.parametrize("mesh, inject, says", [
    # fsdp: both ranks hold rows of the gradient; the loss is finite.
    ("fsdp=2", "2:layers.1.feed_forward.w2.weight",
     r"step 2: the loss is finite \(.*\) and the first non-finite gradient is "
     r"'layers.1.feed_forward.w2.weight' \(on rank 0\)"),
    # pipeline: an inf loss makes every gradient non-finite; the first in the tree's order
    # is in block 0, held by pp rank 0.
    ("pp=2", "2:loss:inf", r"step 2: the loss is inf and the first non-finite gradient is 'layers.0.attention.wk.weight' \(on rank 0\)"),
    # pipeline: block 3 lives on pp rank 1 only.
    ("pp=2", "3:layers.3.attention.wq.weight:-inf",
     r"step 3: .* the first non-finite gradient is 'layers.3.attention.wq.weight' \(on rank 1\)"),
])
def test_nonfinite_step_stops_naming_step_and_first_leaf(mesh, inject, says):
    with pytest.raises(fs.recipes.NonFiniteError, match=says + r"; stopped before the update"):
        run_on_ranks(_train, STEPS + ["--mesh", mesh, "--inject-nonfinite", inject], world_size=2)


def test_skip_nonfinite_leaves_params_and_optimizer_state_as_they_were(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    run_on_ranks(_train, STEPS + ["--mesh", "fsdp=2", "--checkpoint-dir", str(before), "--stop-at", "1"], world_size=2)
    records = run_on_ranks(_train, STEPS + ["--mesh", "fsdp=2", "--checkpoint-dir", str(after), "--stop-at", "2",
                                            "--skip-nonfinite", "--inject-nonfinite", "2"], world_size=2)[0]
    assert [r["step"] for r in records] == [1, 2]
    assert "skipped" not in records[0]
    assert records[1]["skipped"].startswith("the loss is nan and the first non-finite gradient is")
    a, b = fs.checkpoint.load(str(before)), fs.checkpoint.load(str(after))
    assert (a.pop("step"), b.pop("step")) == (1, 2)
    assert sorted(a) == sorted(b)
    for key in a:  # the skipped step changed nothing, the optimizer's step count included
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, key
