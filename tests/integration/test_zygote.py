"""tests/_harness/_zygote.py: a program forked from the zygote sees and ends as under a fresh ``python``.

The teardown tests (tests/mesh/test_mesh_teardown.py) rely on it: the program is
``__main__`` with its argv, cwd and environment, and its process exits through
``sys.excepthook``, atexit and the interpreter's finalization, with the exit code a fresh
interpreter gives.
"""

from __future__ import annotations

import textwrap

from _harness import _zygote

_PROGRAM = textwrap.dedent("""
    import atexit, os, sys, threading, time

    def hook(*exc):
        print("EXCEPTHOOK", exc[0].__name__, flush=True)
        sys.__excepthook__(*exc)

    sys.excepthook = hook
    atexit.register(lambda: print("ATEXIT", flush=True))

    def late():  # a non-daemon thread: the interpreter waits for it before atexit
        time.sleep(0.3)
        print("THREAD DONE", flush=True)

    threading.Thread(target=late).start()
    print("MAIN", __name__, sys.argv[1:], os.getcwd(), os.environ["ZYGOTE_TEST"], sys.path[0], flush=True)
    how = sys.argv[1]
    if how == "raise":
        raise RuntimeError("boom")
    if how == "exit":
        sys.exit(3)
    if how == "segfault":
        import ctypes
        ctypes.string_at(0)
""")


def test_a_child_runs_as_main_and_exits_like_a_fresh_interpreter(zygotes, tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(_PROGRAM)
    env = _zygote.env(ZYGOTE_TEST="seen")
    results = _zygote.run_together(zygotes, [[str(script), how] for how in ("return", "raise", "exit", "segfault")],
                                   cwd=tmp_path, env=env, timeout_s=60)
    codes = {r.args[2]: r.returncode for r in results}
    assert codes == {"return": 0, "raise": 1, "exit": 3, "segfault": -11}, results
    for r in results:
        how = r.args[2]
        assert f"MAIN __main__ ['{how}'] {tmp_path} seen {tmp_path}" in r.stdout, r
        if how == "segfault":
            assert "ATEXIT" not in r.stdout, r  # killed by the signal
            continue
        # The thread is joined, then atexit runs: the order of Py_FinalizeEx.
        assert r.stdout.index("THREAD DONE") < r.stdout.index("ATEXIT"), r
    (raised,) = [r for r in results if r.args[2] == "raise"]
    assert "EXCEPTHOOK RuntimeError" in raised.stdout and "RuntimeError: boom" in raised.stderr, raised
