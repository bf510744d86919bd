"""The mutation table of ``tools/mutations.py`` cannot rot: every snippet is found exactly
once in the current source, the mutated file still compiles, and every listed test exists.
(The mutations themselves run after the suite: ``python tools/mutations.py``.)"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_tool_reports_caught_and_survived(monkeypatch, capsys):
    # Two cheap faults against a test file without ranks: one the tests catch, one they
    # cannot see (a comment); the tool must tell them apart and exit 1 for the survivor.
    tool = _tool()
    fake = (
        tool.Mutation("keystr_dots_become_slashes", "fshard/tree.py", '    body = ".".join(parts)\n',
                      '    body = "/".join(parts)\n', ("tests/test_tree.py::test_keystr_paths",), ""),
        tool.Mutation("comment_only", "fshard/tree.py", '    body = ".".join(parts)\n',
                      '    body = ".".join(parts)  # harmless\n', ("tests/test_tree.py::test_keystr_paths",), ""),
    )
    monkeypatch.setattr(tool, "MUTATIONS", fake)
    assert tool.main(["--budget-s", "240", "--per-test-timeout", "120"]) == 1
    out = capsys.readouterr().out
    names = {m.name for m in fake}
    rows = {w[0]: w[1] for w in (line.split() for line in out.splitlines()) if len(w) > 1 and w[0] in names}
    assert rows == {"keystr_dots_become_slashes": "caught", "comment_only": "SURVIVED"}, out
    assert "tests/test_tree.py::test_keystr_paths" in out and "1/2 caught, 1 survived" in out
