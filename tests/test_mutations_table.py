"""The mutation table of ``tools/mutations.py`` cannot rot: every snippet is found exactly
once in the current source, the mutated file still compiles, and every listed test exists.
(The mutations themselves run after the suite: ``python tools/mutations.py``.)"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("fshard_tools_mutations", ROOT / "tools" / "mutations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_snippet_exists_once_and_every_test_exists():
    tool = _tool()
    assert len(tool.MUTATIONS) >= 15
    assert tool.check_table() == []


def test_a_stale_snippet_fails_loudly_naming_the_mutation():
    tool = _tool()
    stale = tool.Mutation("stale_one", "fshard/comm.py", "this text is not in comm.py", "x", ("tests/test_tree.py",), "")
    with pytest.raises(tool.SnippetError, match=r"mutation 'stale_one'.*0 times in fshard/comm.py"):
        tool.mutated_source(stale)
    problems = tool.check_table([stale, stale])
    assert any("duplicate mutation name 'stale_one'" in p for p in problems)
    assert any("'stale_one'" in p and "0 times" in p for p in problems)
