"""``fs.jit``'s buffer donation against ``jax.jit``'s own, in float64 on CPU.

JAX's CPU backend implements donation in 0.10.2 (the platforms with donation include
"cpu"): a donated input that an output takes is aliased to it (the output's buffer is the
input's) and the input is deleted (``is_deleted()``; using it raises). So each case here
runs the same small step in both and compares what they do with the donated inputs:

- ``reuses``: for each output leaf, the input leaf whose memory it holds (JAX: the same
  ``unsafe_buffer_pointer``; fshard: the same ``data_ptr``), or ``None`` for a new buffer;
- ``consumed``: the donated inputs given to an output (JAX deletes exactly those);
- ``warned``: the warning for a donated buffer no output can use (JAX: "Some donated
  buffers were not usable"; fshard names the leaf);
- ``raised``: whether the call is refused (a donated array also passed as another
  argument);
- the output values (to 1e-12).

Each step is written once with operators both arrays share. Where fshard differs on
purpose, a ``test_difference_*`` test pins both sides (``fs.jit``'s docstring gives the
reason): JAX's second matching pass (a donated buffer for an output of another shape with
as many elements), its silence about a donated argument the function never reads, and where
an argument returned as is ends up. Using a consumed donated argument afterwards raises in
both.

JAX is imported lazily, in the pytest process only (as in test_optim_optax.py); x64 is
switched on in a scoped ``jax.enable_x64``.
"""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest
import torch

import fshard as fs
from fshard import tree as tree_util

from conf_jax_here import jax_in_this_process

TOL = 1e-12


@pytest.fixture(scope="module")
def jx() -> SimpleNamespace:
    """``jax`` and ``jnp``, imported on first use, CPU only, one thread."""
    return jax_in_this_process()


@dataclasses.dataclass(frozen=True)
class Case:
    """``make(arr) -> (args, kwargs)`` builds the inputs, ``arr(shape, seed)`` one array (the
    same object where a case passes it twice); ``fn(m)`` the step (``m``: ``cast32``)."""

    make: Callable[[Callable], tuple[tuple, dict]]
    fn: Callable[[Any], Callable]
    donate_argnums: Any = None
    donate_argnames: Any = None


@dataclasses.dataclass
class Outcome:
    reuses: tuple = ()
    consumed: tuple = ()
    warned: bool = False
    raised: bool = False
    values: list = dataclasses.field(default_factory=list)


def _step(p, m, x):
    """A pure step of the usual form: a loss, new params and state of the old ones' layouts."""
    g = {k: 2 * v * x.sum() for k, v in p.items()}
    m = {k: 0.9 * m[k] + g[k] for k in m}
    return (p["w"] * x).sum(), {k: p[k] - 0.1 * m[k] for k in p}, m


def _kw(a, b):
    return a + 1, b * 2


def _tree(arr, seed):
    return {"w": arr((4, 3), seed), "b": arr((3,), seed + 1)}


SAME = {
    # Each output takes the first unused donated input of its shape and dtype, in flattening order.
    "outputs_in_order": Case(lambda arr: ((arr((3,), 0), arr((3,), 1)), {}),
                             lambda m: lambda a, b: (a + b, a - b, a * b), (0, 1)),
    "first_donated_first_served": Case(lambda arr: ((arr((3,), 0), arr((3,), 1)), {}),
                                       lambda m: lambda a, b: (b * 2, a * 3), (0, 1)),
    "pytree_step": Case(lambda arr: ((_tree(arr, 0), _tree(arr, 2), arr((4, 3), 4)), {}),
                        lambda m: _step, (0, 1)),
    "only_state_donated": Case(lambda arr: ((_tree(arr, 0), _tree(arr, 2), arr((4, 3), 4)), {}),
                               lambda m: _step, 1),
    # A donated input no output can take: a warning, and the input is left as it is.
    "unusable": Case(lambda arr: ((arr((3,), 0), {"k": arr((2,), 1)}), {}),
                     lambda m: lambda a, b: a * 2 + b["k"].sum(), 1),
    "one_usable_one_not": Case(lambda arr: ((arr((3,), 0), arr((2,), 1)), {}),
                               lambda m: lambda a, b: (a * 2, b.sum()), (0, 1)),
    "dtype_differs": Case(lambda arr: ((arr((3,), 0), arr((3,), 1)), {}),
                          lambda m: lambda a, b: (m.cast32(a + b), a * b), 0),
    # The same array passed twice with one (or both) donated is refused.
    "same_array_twice": Case(lambda arr: ((a := arr((3,), 0), a), {}), lambda m: lambda a, b: a * 2 + b, 0),
    "same_array_twice_both_donated": Case(lambda arr: ((a := arr((3,), 0), a), {}),
                                          lambda m: lambda a, b: (a * 2, b * 3), (0, 1)),
    # donate_argnames / donate_argnums, by keyword and by position (the other one inferred from
    # the signature when only one is given; each as given when both are).
    "argnames_by_keyword": Case(lambda arr: ((), {"a": arr((3,), 0), "b": arr((3,), 1)}),
                                lambda m: _kw, None, "b"),
    "argnames_by_position": Case(lambda arr: ((arr((3,), 0), arr((3,), 1)), {}), lambda m: _kw, None, "b"),
    "argnums_by_keyword": Case(lambda arr: ((arr((3,), 0),), {"b": arr((3,), 1)}), lambda m: _kw, 1),
    "both_given_positional": Case(lambda arr: ((arr((3,), 0), arr((3,), 1)), {}), lambda m: _kw, 0, "b"),
    "both_given_keyword": Case(lambda arr: ((), {"a": arr((3,), 0), "b": arr((3,), 1)}), lambda m: _kw, 0, "b"),
}


# A donated argument returned as it is keeps its value in both, but JAX consumes it (the
# output holds its buffer) and fshard returns the argument itself: a difference, pinned below.
RETURNED_AS_IS = Case(lambda arr: ((arr((3,), 0), arr((3,), 1)), {}), lambda m: lambda x, y: (x, y + x), (0, 1))


def _np_arr(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def _paths(tree) -> list[str]:
    raw, _, _ = tree_util.tree_flatten_with_path(tree)
    return [tree_util.keystr(p) for p in raw]


def _run(case: Case, leaf_ptr, consumed, call, to_array) -> Outcome:
    """One framework's outcome; ``leaf_ptr(x)`` the address of an array's memory,
    ``consumed(i, x, reused)`` whether input leaf ``i`` was given to an output."""
    args, kwargs = case.make(lambda shape, seed: to_array(_np_arr(shape, seed)))
    paths, leaves = _paths((args, kwargs)), tree_util.leaves((args, kwargs))
    before = [leaf_ptr(x) for x in leaves]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = call(args, kwargs)
        except (ValueError, RuntimeError):  # fshard: ValueError; JAX: JaxRuntimeError
            return Outcome(raised=True)
    outs = tree_util.leaves(out)
    reuses = tuple(next((paths[i] for i, p in enumerate(before) if p == leaf_ptr(o)), None) for o in outs)
    gone = tuple(paths[i] for i, x in enumerate(leaves) if consumed(i, x, paths[i] in reuses))
    warned = any(("donated buffers were not usable" in str(w.message) or "no result could take" in str(w.message))
                 for w in caught)
    return Outcome(reuses, gone, warned, False, [np.asarray(o, dtype=np.float64) for o in outs])


def run_jax(jx, case: Case) -> Outcome:
    with jx.jax.enable_x64(True):
        f = jx.jax.jit(case.fn(SimpleNamespace(cast32=lambda x: x.astype(jx.jnp.float32))),
                       donate_argnums=case.donate_argnums, donate_argnames=case.donate_argnames)
        return _run(case, lambda x: x.unsafe_buffer_pointer(), lambda i, x, reused: x.is_deleted(),
                    lambda a, k: f(*a, **k), jx.jnp.asarray)


def run_fshard(case: Case) -> Outcome:
    f = fs.jit(case.fn(SimpleNamespace(cast32=lambda x: x.to(torch.float32))), backend=None,
               donate_argnums=case.donate_argnums, donate_argnames=case.donate_argnames)
    donated: set[int] = set()

    def call(a, k):
        donated.update(f._donated_indices(a, k))  # the donated leaves, as fs.jit resolves them
        return f(*a, **k)

    # A donated leaf is consumed where using it afterwards raises, as a deleted JAX array does.
    return _run(case, lambda x: x.data_ptr(), lambda i, x, reused: _unusable(x), call,
                lambda a: torch.from_numpy(a.copy()))


def _unusable(x) -> bool:
    try:
        x + 0
    except fs.DonatedTensorError:
        return True
    return False


def _assert_same(got: Outcome, want: Outcome) -> None:
    assert (got.raised, got.reuses, got.consumed, got.warned) == (want.raised, want.reuses, want.consumed,
                                                                  want.warned)
    assert len(got.values) == len(want.values)
    for g, w in zip(got.values, want.values):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=TOL * (1 + np.abs(w).max()))


@pytest.mark.parametrize("name", list(SAME))
def test_donation_matches_jax(jx, name):
    want, got = run_jax(jx, SAME[name]), run_fshard(SAME[name])
    _assert_same(got, want)
    # JAX consumes (deletes) exactly the donated inputs its outputs took.
    assert set(want.consumed) <= set(want.reuses)


def test_the_cases_cover_every_rule(jx):
    # Guards the comparison itself: each rule the cases claim to show is really shown by JAX.
    out = {n: run_jax(jx, SAME[n]) for n in ("pytree_step", "unusable", "same_array_twice",
                                             "argnames_by_position", "both_given_keyword")}
    out["returned_as_is"] = run_jax(jx, RETURNED_AS_IS)
    assert out["pytree_step"].reuses == (None, "0.0.b", "0.0.w", "0.1.b", "0.1.w")
    assert out["unusable"].warned and out["unusable"].consumed == ()
    assert out["returned_as_is"].consumed == ("0.0", "0.1")
    assert out["same_array_twice"].raised
    assert out["argnames_by_position"].consumed == ("0.1",)
    assert out["both_given_keyword"].consumed == ("1.b",)


# --- where fshard differs on purpose --------------------------------------------------------


def test_difference_another_shape_with_as_many_elements(jx):
    # JAX's second pass gives a donated buffer left over to an output of another shape with
    # the same number of elements. fshard matches layouts only: it warns and leaves x as is.
    case = Case(lambda arr: ((arr((3,), 0),), {}), lambda m: lambda x: x.reshape(1, 3) * 2, 0)
    want, got = run_jax(jx, case), run_fshard(case)
    assert (want.reuses, want.consumed, want.warned) == (("0.0",), ("0.0",), False)
    assert (got.reuses, got.consumed, got.warned) == ((None,), (), True)
    np.testing.assert_array_equal(got.values[0], want.values[0])


def test_difference_a_donated_argument_the_function_never_reads(jx):
    # JAX drops an unread argument before matching (keep_unused=False): no warning. fshard
    # warns all the same: the donation has no effect either way.
    case = Case(lambda arr: ((arr((3,), 0), arr((2,), 1)), {}), lambda m: lambda a, b: a * 2, 1)
    want, got = run_jax(jx, case), run_fshard(case)
    assert (want.consumed, want.warned) == ((), False)
    assert (got.consumed, got.warned) == ((), True)


def test_difference_a_donated_argument_returned_as_is_stays_usable(jx):
    # JAX gives the output x the buffer of x (or of another donated input) and deletes x;
    # fshard returns x itself, so x stays usable, with its unchanged value. y is consumed
    # in both.
    want, got = run_jax(jx, RETURNED_AS_IS), run_fshard(RETURNED_AS_IS)
    assert want.consumed == ("0.0", "0.1") and got.consumed == ("0.1",)
    assert want.reuses == ("0.0", "0.1") and got.reuses == ("0.0", "0.1")
    for g, w in zip(got.values, want.values):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("returns, donate, jax_reuses, fshard_reuses, jax_consumed, fshard_consumed", [
    pytest.param(lambda a, b: (a + b, a), (0, 1), ("0.0", "0.1"), ("0.1", "0.0"), ("0.0", "0.1"), ("0.1",),
                 id="(a+b,a)-both-donated"),
    pytest.param(lambda a, b: (a, b + a), 1, ("0.1", None), ("0.0", "0.1"), ("0.1",), ("0.1",),
                 id="(a,b+a)-b-donated"),
])
def test_difference_where_an_argument_returned_as_is_ends_up(jx, returns, donate, jax_reuses, fshard_reuses,
                                                             jax_consumed, fshard_consumed):
    # JAX gives a donated buffer to the first output of its shape even where that output is
    # another argument, returned as is, whose value XLA then copies there: (a + b, a) puts
    # a + b in a's buffer and a in b's; (a, b + a) with b donated puts a in b's buffer and
    # b + a in a new one. fshard leaves an argument returned as is where it is (the output
    # is that tensor) and computes only fresh results into donated arguments: copying
    # argument into argument at the end of the graph would make the order of the copies
    # matter. Same values; a donated argument returned as is stays usable in fshard (above).
    case = Case(lambda arr: ((arr((3,), 0), arr((3,), 1)), {}), lambda m: returns, donate)
    want, got = run_jax(jx, case), run_fshard(case)
    assert want.reuses == jax_reuses and got.reuses == fshard_reuses
    assert want.consumed == jax_consumed and got.consumed == fshard_consumed
    assert not want.warned and not got.warned
    for g, w in zip(got.values, want.values):
        np.testing.assert_array_equal(g, w)


def test_reading_a_donated_argument_afterwards_raises_as_in_jax(jx):
    # JAX deletes a consumed donated array: using it raises. fshard's result takes the
    # donated tensor's memory and the argument itself becomes unusable the same way. A
    # donated argument no result took is left as it is, and readable, in both.
    with jx.jax.enable_x64(True):
        a, b = jx.jnp.zeros(3), jx.jnp.zeros(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            jx.jax.jit(lambda a, b: a + 1 + b.sum(), donate_argnums=(0, 1))(a, b)
        with pytest.raises(RuntimeError, match="deleted"):
            a + 1
        assert not b.is_deleted() and float(b.sum()) == 0.0
    a, b = torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    ptr = a.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fs.jit(lambda a, b: a + 1 + b.sum(), backend=None, donate_argnums=(0, 1))(a, b)
    with pytest.raises(fs.DonatedTensorError, match=r"donated \(args\[0\], shape \(3,\), torch.float64\)"):
        a + 1
    assert out.data_ptr() == ptr and torch.equal(out, torch.ones(3, dtype=torch.float64))
    assert torch.equal(b, torch.zeros(2, dtype=torch.float64))
