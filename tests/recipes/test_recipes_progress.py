"""Logs that survive (issue 35, item 5): progress lines every --log-every steps with or without
tqdm (the bar only on a terminal), a windowed token rate, --log-json as JSON lines that a
SIGKILL leaves readable up to the last step written (and a run resumed after it appends),
TensorBoard scalars read back with tensorboard's own reader, and the loss plot."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import fshard as fs
from fshard.recipes import cli
from fshard.recipes.metrics import Meter
from fshard.recipes.progress import Progress, progress_line
from fshard.recipes.sinks import JsonLines, Logs, read_log

from _harness import _zygote
from _harness._examples import example

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--dtype", "float64", "--dim", "16", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--sample-chars", "0"]


def _record(step: int) -> dict:
    return {"step": step, "loss": 1.0 / step, "tokens_per_s": 100.0, "lr": 1e-3, "elapsed_s": 1.0, "eta_s": 2.0}


@pytest.mark.parametrize("tty", [False, True])
def test_a_line_every_log_every_steps_with_or_without_the_bar(tty, capsys):
    pytest.importorskip("tqdm", reason="the progress bar is tqdm's (pip install tqdm; transformers brings it)")
    progress = Progress(0, 5, True, every=2, tty=tty)
    assert (progress.bar is not None) == tty  # tqdm is installed: the bar only on a terminal
    for step in range(1, 6):
        progress.update(_record(step))
    progress.close()
    out, err = capsys.readouterr()
    assert [line.split()[1] for line in out.splitlines()] == ["2/5", "4/5", "5/5"]  # the lines, on stdout
    assert ("5/5" in err) == tty  # the bar, on stderr
    # Under pytest stderr is no terminal: the default is the lines alone.
    assert Progress(0, 5, True, every=2).bar is None


def test_a_progress_line_names_the_metrics():
    line = progress_line({**_record(4), "val_loss": 0.5, "mfu": 0.123, "peak_mem_mib": 300.0,
                          "peak_mem_kind": "rss"}, 10)
    assert line == ("step     4/10  loss 0.2500  val 0.5000  100 tokens/s  MFU 12.3%  lr 1.00e-03  "
                    "mem 300 MiB (rss)  elapsed 0:01  eta 0:02")


def test_tokens_per_s_is_a_windowed_rate():
    meter = Meter(window=3, end=5)
    rates = [meter.step(s, 100, dt)["tokens_per_s"] for s, dt in enumerate([1.0, 0.001, 0.001, 0.001, 0.001], 1)]
    # One step's rate would jump from 100 to 100,000; the window's moves with the last three steps.
    assert rates[:3] == pytest.approx([100.0, 200 / 1.001, 300 / 1.002])
    assert rates[4] == pytest.approx(100 / 0.001)
    assert meter.step(5, 100, 0.001)["eta_s"] == 0.0


def test_log_flags_are_in_the_logging_group_and_checked(tmp_path, capsys):
    args = example("train_lm").parse_args(["--log-every", "5", "--val-every", "10", "--tensorboard", "tb"])
    assert (args.log_every, args.val_every, args.val_batches, args.tensorboard) == (5, 10, 1, "tb")
    (tmp_path / "run.toml").write_text("[logging]\nlog-json = 'log.jsonl'\nval-every = 3\n")
    args = example("train_lm").parse_args(["--config", str(tmp_path / "run.toml")])
    assert (args.log_json, args.val_every) == ("log.jsonl", 3)
    with pytest.raises(SystemExit):
        example("train_lm").parse_args(["--log-every", "0"])
    assert "--log-every: 0: must be >= 1" in capsys.readouterr().err
    (tmp_path / "bad.toml").write_text("val-every = -1\n")
    with pytest.raises(SystemExit):
        example("train_lm").parse_args(["--config", str(tmp_path / "bad.toml")])
    assert "val-every = -1: -1: must be >= 0" in capsys.readouterr().err
    assert cli._add_logging_flags  # the group's own function (add_common_flags calls it)


def test_json_lines_are_written_one_per_record_and_a_resumed_run_appends(tmp_path):
    path = tmp_path / "logs" / "run.jsonl"
    log = JsonLines(path)
    log.begin(0)
    log.write({"step": 1, "loss": 2.0}, "step")
    # Written, not buffered: another reader sees the record before the sink is closed.
    assert read_log(path) == [{"kind": "step", "step": 1, "loss": 2.0}]
    log.close()
    with open(path, "a") as f:
        f.write('{"kind": "step", "st')  # a line a kill cut short
    assert [r["step"] for r in read_log(path)] == [1]
    again = JsonLines(path)
    again.begin(1)  # resumed after step 1: appended, the cut line dropped
    again.write({"step": 2, "loss": 1.0}, "step")
    again.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    fresh = JsonLines(path)
    fresh.begin(0)  # a run from step 0 starts the file afresh
    fresh.close()
    assert path.read_text() == ""


def test_a_run_killed_with_sigkill_leaves_every_record_and_a_resumable_checkpoint(zygotes, tmp_path):
    log, ck = tmp_path / "log.jsonl", tmp_path / "ck"
    argv = [str(ROOT / "examples" / "train_lm.py"), *TINY, "--steps", "100000", "--quiet", "--log-json", str(log),
            "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    child = zygotes.start(argv, cwd=tmp_path, env=_zygote.env())
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().count("\n") >= 5):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "no 5 records in 120 s"
            time.sleep(0.05)
    finally:
        child.kill()  # SIGKILL: no handler, no flush, no atexit
        child.wait(60)
    assert child.returncode == -9
    lines = log.read_text().split("\n")
    records = [json.loads(line) for line in lines[:-1]]  # every complete line is valid JSON
    assert lines[-1] == "" or len(read_log(log)) == len(records)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1)) and {r["kind"] for r in records} == {"step"}
    # The checkpoint resumes; the resumed run appends its records to the same log.
    saved = fs.checkpoint.load(str(ck), like={"step": 0})["step"]
    assert saved >= 2
    example("train_lm").main([*TINY, "--steps", "100000", "--stop-at", str(saved + 2), "--quiet", "--log-json",
                              str(log), "--checkpoint-dir", str(ck), "--resume"])
    after = read_log(log)
    assert [r["step"] for r in after] == steps + [saved + 1, saved + 2]
    assert read_log(log, "summary")[0]["first_step"] == saved + 1


def test_tensorboard_scalars_and_the_plot(tmp_path):
    pytest.importorskip("tensorboard", reason="--tensorboard needs tensorboard (pip install fshard[test-core])")
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install fshard[viz])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, png, log = tmp_path / "tb", tmp_path / "loss.png", tmp_path / "log.jsonl"
    records = example("train_lm").main([*TINY, "--steps", "4", "--quiet", "--val-every", "2", "--tensorboard",
                                        str(tb), "--plot", str(png), "--log-json", str(log)])
    events = EventAccumulator(str(tb))
    events.Reload()
    assert {"train/loss", "val/loss", "perf/tokens_per_s", "train/lr"} <= set(events.Tags()["scalars"])
    got = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert got == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["step"] for r in read_log(log)] == [1, 2, 3, 4]


def test_a_missing_sink_package_is_an_error_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    class Args:
        log_json, tensorboard, plot = None, str(tmp_path / "tb"), None

    with pytest.raises(fs.recipes.ConfigError, match=r"--tensorboard .*tb: needs the tensorboard package: "
                       r"pip install tensorboard"):
        Logs.from_flags(Args())
    Args.tensorboard, Args.plot = None, "loss.png"
    with pytest.raises(fs.recipes.ConfigError, match=r"--plot loss.png: needs matplotlib: pip install matplotlib"):
        Logs.from_flags(Args())
    assert Logs.from_flags(Args(), enabled=False).sinks == []  # ranks other than 0: nothing to import
