"""Issue 36, rows 12 and 13: fs.jit's recompile limit, and donated buffers with live aliases.

Row 12. Before: a Python float argument is part of the signature by value, so 12 calls with
12 learning rates traced and compiled 12 times (12 Inductor compiles), with no word. Now the
first recompile warns once (JitRecompileWarning) naming the argument and the fix, and past
``recompile_limit`` (default 8) a call raises JitRecompileLimitError naming the function, the
limit and the argument, or with ``on_recompile_limit="eager"`` runs eagerly.

Row 13. Before: with donation, a view or a ``.numpy()`` array taken before the call silently
showed the result's values afterwards. Now such a buffer is not donated at that call (JAX's
behaviour for a buffer with an external reference, checked with jax 0.10.2 on CPU): the
result goes to new memory, the argument and its aliases keep their values, and a warning
names the argument.

Most tests use ``backend=None`` (the captured graph run as it is: tracing is what a
signature costs here) and count signatures with ``cache_size``; one counts real compiles
with ``backend="aot_eager"`` and torch._dynamo's counters.
"""

import warnings

import numpy as np
import pytest
import torch

import fshard as fs
from fshard.jit import JitRecompileLimitError, JitRecompileWarning

F64 = torch.float64
TIMEOUT = pytest.mark.timeout(240)


def step(x, lr):
    return x - lr * x.sin()


def _calls(f, n, x):
    """Calls f(x, lr) with n learning rates; per call: the result or the exception, and the
    JitRecompileWarnings it gave."""
    out = []
    for i in range(n):
        lr = round(0.1 * (i + 1), 10)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                r = f(x, lr)
            except JitRecompileLimitError as e:
                r = e
        out.append((lr, r, [str(w.message) for w in caught if issubclass(w.category, JitRecompileWarning)]))
    return out


# --- row 12: recompile limit --------------------------------------------------------------
@TIMEOUT
def test_a_python_float_warns_at_the_first_recompile_and_raises_past_the_default_limit():
    x = torch.linspace(0, 1, 5, dtype=F64)
    f = fs.jit(step, backend=None)
    calls = _calls(f, 12, x)
    warned = [i + 1 for i, (_, _, w) in enumerate(calls) if w]
    assert warned == [2], [c[2] for c in calls]
    first = calls[1][2][0]
    for part in ("fs.jit(step) compiles again", "lr (args[1]): Python float 0.1 -> 0.2 is a compile-time constant",
                 "pass a tensor (torch.tensor(0.2))", "limit 8", "once per function"):
        assert part in first, first
    for lr, r, _ in calls[:8]:  # within the limit: compiled, values right
        assert torch.allclose(r, step(x, lr), rtol=0, atol=1e-12)
    assert all(isinstance(r, JitRecompileLimitError) for _, r, _ in calls[8:]), [type(c[1]) for c in calls]
    msg = str(calls[8][1])
    for part in ("fs.jit(step): recompile limit reached", "8 signatures", "the limit is 8 (the default)",
                 "lr (args[1]): Python float 0.8 -> 0.9", "recompile_limit=N", "FSHARD_JIT_RECOMPILE_LIMIT",
                 "on_recompile_limit='eager'"):
        assert part in msg, msg
    assert f.cache_size == 8  # 8 traces, none past the limit
    assert torch.allclose(f(x, 0.1), step(x, 0.1), rtol=0, atol=1e-12)  # a traced signature still runs


@TIMEOUT
def test_past_the_limit_eager_runs_equal_eager_and_warn_once():
    x = torch.linspace(0, 1, 5, dtype=F64)
    f = fs.jit(step, backend=None, on_recompile_limit="eager")
    calls = _calls(f, 12, x)
    for lr, r, _ in calls:
        assert isinstance(r, torch.Tensor) and torch.allclose(r, step(x, lr), rtol=0, atol=1e-12), (lr, r)
    warned = {i + 1: w for i, (_, _, w) in enumerate(calls) if w}
    assert list(warned) == [2, 9], warned
    assert "runs new signatures eagerly" in warned[2][0]
    assert "recompile limit 8 (the default) reached" in warned[9][0] and "run eagerly" in warned[9][0]
    assert "lr (args[1]): Python float 0.8 -> 0.9" in warned[9][0]
    assert f.cache_size == 8  # eager signatures are not cached: the cache does not grow per value


@TIMEOUT
def test_the_limit_comes_from_the_keyword_else_the_environment(monkeypatch):
    x = torch.ones(3, dtype=F64)
    monkeypatch.setenv("FSHARD_JIT_RECOMPILE_LIMIT", "2")
    calls = _calls(fs.jit(step, backend=None), 3, x)
    assert isinstance(calls[2][1], JitRecompileLimitError)
    assert "the limit is 2 (FSHARD_JIT_RECOMPILE_LIMIT=2)" in str(calls[2][1])
    calls = _calls(fs.jit(step, backend=None, recompile_limit=3), 4, x)  # the keyword wins
    assert [isinstance(r, JitRecompileLimitError) for _, r, _ in calls] == [False, False, False, True]
    assert "the limit is 3 (recompile_limit=3)" in str(calls[3][1])
    monkeypatch.setenv("FSHARD_JIT_RECOMPILE_LIMIT", "many")
    f = fs.jit(step, backend=None)
    f(x, 0.1)  # the first signature needs no limit
    with pytest.raises(ValueError, match="FSHARD_JIT_RECOMPILE_LIMIT='many'; use an int >= 1"):
        f(x, 0.2)


def test_bad_recompile_options_are_refused_at_jit():
    for bad in (0, -1, True, "8", 2.5):
        with pytest.raises(ValueError, match=r"recompile_limit=.*use an int >= 1"):
            fs.jit(step, recompile_limit=bad)
    with pytest.raises(ValueError, match="on_recompile_limit='ignore'; use 'raise' or 'eager'"):
        fs.jit(step, on_recompile_limit="ignore")
    with pytest.raises(ValueError, match="on_recompile_limit"):  # the decorator form checks too
        fs.jit(backend=None, on_recompile_limit="warn")


def test_the_warning_names_nested_paths_shapes_and_keyword_arguments():
    def g(params, *, scale):
        return {k: v * scale for k, v in params.items()}

    f = fs.jit(g, backend=None)
    f({"w": torch.ones(4)}, scale=2)
    with pytest.warns(JitRecompileWarning, match=r"params\.w \(args\[0\]\.w\): shape \(4,\) -> \(6,\)"
                                                 r".*pad to a few fixed shapes"):
        f({"w": torch.ones(6)}, scale=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per function
        f({"w": torch.ones(6)}, scale=3)
    h = fs.jit(g, backend=None)
    h({"w": torch.ones(4)}, scale=2)
    with pytest.warns(JitRecompileWarning, match=r"scale: Python int 2 -> 3 is a compile-time constant"):
        h({"w": torch.ones(4)}, scale=3)


@TIMEOUT
def test_compiles_are_counted_and_capped_with_a_real_backend():
    from torch._dynamo.utils import counters

    x = torch.linspace(0, 1, 5, dtype=F64)
    f = fs.jit(step, backend="aot_eager", recompile_limit=2, on_recompile_limit="eager")
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JitRecompileWarning)
        for lr in (0.1, 0.2, 0.3, 0.4):
            assert torch.allclose(f(x, lr), step(x, lr), rtol=0, atol=1e-12)
    assert counters["stats"]["unique_graphs"] - before == 2  # two compiles, then eager
    # The fix the warning names: a tensor learning rate is one signature for every value.
    t = fs.jit(step, backend="aot_eager")
    before = counters["stats"]["unique_graphs"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", JitRecompileWarning)
        for lr in (0.1, 0.2, 0.3):
            assert torch.allclose(t(x, torch.tensor(lr, dtype=F64)), step(x, lr), rtol=0, atol=1e-12)
    assert counters["stats"]["unique_graphs"] - before == 1 and t.cache_size == 1


# --- row 13: donated buffers with live aliases --------------------------------------------
def _double(a):
    return a * 2


@pytest.mark.parametrize("alias", ["view", "numpy", "detach"])
def test_a_donated_buffer_with_a_live_alias_is_not_donated_and_the_alias_keeps_its_values(alias):
    f = fs.jit(_double, backend=None, donate_argnums=0)
    x = torch.arange(4, dtype=F64)
    kept = {"view": lambda: x[1:], "numpy": lambda: x.numpy(), "detach": lambda: x.detach()}[alias]()
    with pytest.warns(UserWarning, match=r"fs.jit\(_double\): donated args\[0\] \(shape \(4,\), torch.float64\) is "
                                         r"not donated at this call: 1 other tensor\(s\) or NumPy array\(s\) share "
                                         r"its memory .*\.numpy\(\).*keeps its value and stays usable"):
        y = f(x)
    assert torch.equal(y, torch.arange(4, dtype=F64) * 2)
    assert y.data_ptr() != x.data_ptr()  # new memory
    assert torch.equal(x, torch.arange(4, dtype=F64))  # the argument keeps its value, and is usable
    want = np.arange(4.0)[1:] if alias == "view" else np.arange(4.0)
    assert np.array_equal(np.asarray(kept), want), kept  # the alias does not see the result
    # Without the alias the same call donates again: the result on x's memory, x consumed.
    del kept
    ptr = x.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = f(x)
    assert y.data_ptr() == ptr and torch.equal(y, torch.arange(4, dtype=F64) * 2)
    with pytest.raises(fs.DonatedTensorError):
        x + 1


def test_a_view_of_a_donated_view_base_is_an_alias_but_the_base_is_its_owner():
    # Parameters in one flat buffer: the donated views write into it, on every call (the
    # results stay views of it); another view of the buffer, held by the caller, is an alias.
    def two(a, b):
        return a * 2, b + 1

    f = fs.jit(two, backend=None, donate_argnums=(0, 1))
    flat = torch.arange(6, dtype=F64)
    a, b = flat[:3], flat[3:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            want = two(a.clone(), b.clone())
            a, b = f(a, b)
            assert torch.equal(flat, torch.cat(want)) and a.data_ptr() == flat.data_ptr()
    peek = flat[1:2]
    before = flat.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a2, b2 = f(a, b)
    # Counted per storage, so b (not under peek) is kept from donation too.
    assert sorted(str(w.message).split(" (shape")[0] for w in caught) == [
        "fs.jit(two): donated args[0]", "fs.jit(two): donated args[1]"]
    assert all("1 other tensor(s)" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert torch.equal(peek, before[1:2])  # the caller's view does not change under it
    assert torch.equal(a2, before[:3] * 2) and torch.equal(b2, before[3:] + 1)


def _dtensor_alias_body():
    """A donated DTensor whose local shard has a live view (to_local() in grad mode is a
    view): that call keeps it; without the view the next call donates it."""
    from fshard import P

    mesh = fs.make_mesh({"x": torch.distributed.get_world_size()})
    f = fs.jit(_double, backend=None, donate_argnums=0)
    d = fs.shard(torch.arange(8, dtype=F64), P("x"), mesh)
    view = d.to_local()
    first = view.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = f(d)
    out = {"warned": [str(w.message) for w in caught],
           "view_kept": torch.equal(view, first), "arg_kept": torch.equal(d.to_local(), first),
           "new_memory": y.to_local().data_ptr() != d.to_local().data_ptr(),
           "result": torch.equal(y.full_tensor(), torch.arange(8, dtype=F64) * 2)}
    del view
    ptr = d._local_tensor.data_ptr()
    y = f(d)
    out["donated_after"] = y.to_local().data_ptr() == ptr
    return out


@TIMEOUT
def test_a_donated_dtensor_with_a_live_view_of_its_shard_is_not_donated():
    from fshard.testing import run_on_ranks

    for r in run_on_ranks(_dtensor_alias_body, world_size=2):
        assert len(r["warned"]) == 1 and "donated args[0] (shape (8,), torch.float64) is not donated" in r["warned"][0]
        assert r["view_kept"] and r["arg_kept"] and r["new_memory"] and r["result"] and r["donated_after"], r
