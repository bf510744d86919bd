"""fs.recipes.run_script: how a training script ends, and what it prints."""

from __future__ import annotations

import re

import pytest

import fshard as fs


def _raises(e: BaseException):
    def main():
        raise e

    return main


def test_an_unexpected_error_is_one_line_naming_the_rank_before_the_traceback(capsys):
    with pytest.raises(RuntimeError, match="boom"):
        fs.recipes.run_script(_raises(RuntimeError("boom\nsecond line")), "prog.py")
    # "rank 0" when an earlier test in this process left a group of one started
    assert re.fullmatch(r"prog.py: (the process|rank 0) failed: RuntimeError: boom\n", capsys.readouterr().err)


@pytest.mark.parametrize("error, code", [(fs.recipes.ConfigError("bad mesh"), 2),
                                         (fs.recipes.NonFiniteError("step 2: nan"), 1)])
def test_a_known_error_is_one_line_and_an_exit_code(error, code, capsys):
    with pytest.raises(SystemExit) as e:
        fs.recipes.run_script(_raises(error), "prog.py")
    assert e.value.code == code
    assert capsys.readouterr().err == f"prog.py: error: {error}\n"


def test_under_simulation_the_line_names_the_simulation(capsys):
    with fs.simulate(2), pytest.raises(ValueError):
        fs.recipes.run_script(_raises(ValueError("no")), "prog.py")
    assert capsys.readouterr().err == "prog.py: the simulation of 2 ranks failed: ValueError: no\n"
