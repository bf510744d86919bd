"""fs.recipes.cli: the flags training scripts share (config files, threads, checkpoints)."""

from __future__ import annotations

import argparse

import pytest
import torch

import fshard as fs
from _harness._examples import example
from fshard.testing import run_on_ranks

cli = fs.recipes.cli


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=5)
    g.add_argument("--lr", type=float, default=0.1)
    g.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    g.add_argument("--remat", action="store_true")
    g.add_argument("--mesh", default=None)
    cli.add_common_flags(p)
    return p


@pytest.fixture(autouse=True)
def _keep_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.parse(_parser(), argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_a_config_file_sets_flags_and_the_command_line_overrides_it(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(
        'lr = 1\nmesh = "dp=2"\n[training]\nsteps = 7\ndtype = "float64"\nremat = true\n'
        '[checkpoints]\ncheckpoint-dir = "ck"\nresume = "auto"\n'
    )
    args = cli.parse(_parser(), ["--config", str(f), "--steps", "9"])
    assert (args.steps, args.lr, args.dtype, args.remat, args.mesh) == (9, 1.0, "float64", True, "dp=2")
    assert isinstance(args.lr, float)
    assert cli.checkpoint_config(args, "h") == fs.recipes.CheckpointConfig("ck", resume="auto", hint="h")


@pytest.mark.parametrize(
    "text, says",
    [
        ("stepz = 3\n", r"--config .*run.toml: no flag --stepz; the settings are: .*steps"),
        ('steps = "x"\n', r"steps = 'x': invalid literal for int"),
        ("remat = 1\n", r"remat = 1: must be true or false"),
        ('dtype = "float16"\n', r"dtype = 'float16': must be one of float32, float64"),
        ("steps = [1]\n", r"steps = \[1\]: must be a single int"),
        ("steps = \n", r"not valid TOML"),
    ],
)
def test_a_bad_config_file_is_an_error_naming_the_key(text, says, tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text(text)
    assert __import__("re").search(says, _error(["--config", str(f)], capsys))


def test_print_config_writes_a_file_that_gives_the_same_settings(tmp_path, capsys):
    argv = ["--steps", "3", "--remat", "--lr", "0.25", "--checkpoint-dir", 'a b"c', "--resume", "auto"]
    want = cli.parse(_parser(), argv)
    with pytest.raises(SystemExit) as e:
        cli.parse(_parser(), [*argv, "--print-config"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "[training]\nsteps = 3\nlr = 0.25" in text and "# mesh =  (not set)" in text
    (tmp_path / "run.toml").write_text(text)
    got = cli.parse(_parser(), ["--config", str(tmp_path / "run.toml")])
    assert vars(got) == {**vars(want), "config": str(tmp_path / "run.toml")}


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--overwrite"], "--overwrite needs --checkpoint-dir"),
        (["--checkpoint-dir", "d", "--resume", "--overwrite"], "--resume and --overwrite: give one"),
        (["--threads", "0"], "--threads 0: must be >= 1"),
    ],
)
def test_bad_flag_combinations_are_errors(argv, says, capsys):
    assert says in _error(argv, capsys)


def test_one_thread_unless_the_user_says_otherwise(monkeypatch):
    torch.set_num_threads(2)
    cli.parse(_parser(), [])
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cli.set_threads(None) == 2 and torch.get_num_threads() == 2
    cli.parse(_parser(), ["--threads", "1"])
    assert torch.get_num_threads() == 1


TINY = [
    "--dim",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "8",
    "--batch-size",
    "4",
    "--quiet",
    "--mesh",
    "fsdp=1",
]


def test_train_lm_keeps_an_existing_checkpoint_unless_told(tmp_path):
    train_lm, ck = example("train_lm"), str(tmp_path / "ck")
    with pytest.raises(fs.recipes.ConfigError, match="there is no checkpoint in"):
        train_lm.main([*TINY, "--steps", "2", "--checkpoint-dir", ck, "--resume"])
    assert [r["step"] for r in train_lm.main([*TINY, "--steps", "2", "--checkpoint-dir", ck, "--resume", "auto"])] == [
        1,
        2,
    ]
    with pytest.raises(fs.recipes.ConfigError, match=r"holds a checkpoint \(step 2\).*--overwrite"):
        train_lm.main([*TINY, "--steps", "3", "--checkpoint-dir", ck])
    assert [r["step"] for r in train_lm.main([*TINY, "--steps", "3", "--checkpoint-dir", ck, "--resume"])] == [3]
    assert [r["step"] for r in train_lm.main([*TINY, "--steps", "1", "--checkpoint-dir", ck, "--overwrite"])] == [1]


def test_train_lm_help_gives_every_flag_a_text_and_its_default_once(capsys):
    with pytest.raises(SystemExit):
        example("train_lm").parse_args(["--help"])
    entries, text = [], capsys.readouterr().out.split("\noptions:", 1)[1]
    for line in text.splitlines():
        if line.startswith("  -"):
            entries.append(line)
        elif line.startswith("    ") and entries:
            entries[-1] += "  " + line.strip()
    assert len(entries) > 40
    for entry in entries:
        flag, _, rest = entry.strip().partition("  ")
        assert rest.strip(), f"{flag}: no help text"
        assert entry.count("(default:") + entry.count("default:") // 2 <= 1, entry
    assert any("--seed SEED" in e and "(default: 0)" in e for e in entries)  # a zero default is still named


def _printed(argv: list[str]) -> str:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as out:
        example("train_lm").main(argv)
    return out.getvalue()


def test_only_rank_0_prints_unless_all_ranks():
    argv = [a for a in TINY if a not in ("--quiet", "--mesh", "fsdp=1")] + ["--steps", "2", "--log-every", "1",
                                                                          "--sample-chars", "5"]
    rank0, rank1 = run_on_ranks(_printed, argv, world_size=2)
    assert "step     2/2  loss" in rank0 and "summary" in rank0 and "And God said" in rank0
    assert rank1 == ""
    rank0, rank1 = run_on_ranks(_printed, argv + ["--all-ranks"], world_size=2)
    assert "[rank 0] mesh {'fsdp': 2}" in rank0 and "[rank 1] mesh {'fsdp': 2}" in rank1
    assert "step     2/2" not in rank1  # the progress lines (the same on every rank) stay rank 0's
