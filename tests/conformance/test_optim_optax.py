"""fs.optim against optax itself, in float64: every optimizer, transform and schedule fshard exports.

Each case is one program written once against the shared API (``m.adamw(...)``,
``m.chain(...)``, ``m.linear_schedule(...)``) and run with ``m = fshard.optim`` and with
``m = optax``, on identical parameters and the same 12 gradients. Updates, params and
every optimizer state that maps (same NamedTuple names and fields: ``ScaleByAdamState``,
``TraceState``, ``ScaleByScheduleState``, ``EmptyState``) must agree to 1e-12 at every
step. Where fshard follows torch's numerics or defaults on purpose, a ``test_difference_*``
test pins the difference instead of a looser tolerance (docs/jax.md lists them).

JAX is imported lazily, by the ``ox`` fixture, in the pytest process only: the gloo rank
workers are spawned interpreters that import this module to find their bodies, and must
never load JAX. x64 is switched on in a scoped ``jax.enable_x64`` around each optax run,
so the global JAX config other tests see is left as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

import fshard as fs
import fshard.optim as optim
from fshard import P
from fshard import tree as tree_util
from fshard.testing import run_on_ranks

from conf_jax_here import jax_in_this_process

STEPS = 12
TOL = 1e-12  # |fshard - optax| <= TOL * (1 + |optax|), float64
MAX_NORM = 1.0  # the clipping threshold: grads of steps 0, 3, 6, 9 are under it, the others over


# --- JAX / optax, in this process only ----------------------------------------------------


@pytest.fixture(scope="module")
def ox() -> SimpleNamespace:
    """``jax``, ``jnp`` and ``optax``, imported on first use (never in the rank workers)."""
    return jax_in_this_process("optax")


def _int64_count(schedule: Callable) -> Callable:
    """An optax schedule called with its count as int64.

    optax keeps ``count`` as int32, and JAX divides int32 by int in float32 even under
    x64, so optax's own linear and warmup schedules carry float32 rounding (~1e-9
    relative) inside optimizers (see test_difference_optax_int32_count_rounds_schedules).
    fshard's schedules are Python floats. With an int64 count, optax computes in float64.
    """
    import jax.numpy as jnp

    return lambda count: schedule(jnp.asarray(count, jnp.int64))


# --- the data: identical pytrees on both sides --------------------------------------------


def _map(fn: Callable, tree: Any) -> Any:
    """Maps over the nested dicts/lists of params (works on numpy, torch and JAX leaves)."""
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(fn, v) for v in tree]
    return fn(tree)


def _params_np() -> dict:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((6, 4)), "b": rng.standard_normal(4),
            "layers": [{"wq": rng.standard_normal((3, 5, 2))}, {"wq": rng.standard_normal(7)}]}


def _grads_np(step: int) -> dict:
    """Step ``step``'s gradients: norm ~0.4 on every third step, ~8 on the others."""
    rng = np.random.default_rng(100 + step)
    scale = 0.05 if step % 3 == 0 else 1.0
    return _map(lambda x: scale * rng.standard_normal(x.shape), _params_np())


# Leaves to decay, as a tree of bools and as a function of the params (both APIs take both).
_MASK = {"w": True, "b": False, "layers": [{"wq": True}, {"wq": False}]}


def _mask_fn(params: Any) -> Any:
    return _map(lambda x: x.ndim > 1, params)


# --- running both sides -----------------------------------------------------------------


def _to_numpy_fs(tree: Any) -> Any:
    return tree_util.tree_map(lambda t: t.detach().numpy().copy(), tree)


def _run_fs(program: Callable, *, donate: bool = False, steps: int = STEPS) -> list:
    """``[(updates, params, state)]`` per step, as numpy, from ``program(fshard.optim)``."""
    opt = program(optim)
    params = _map(torch.tensor, _params_np())
    state = opt.init(params)
    trail = []
    for step in range(steps):
        grads = _map(torch.tensor, _grads_np(step))
        with optim.donate() if donate else contextlib.nullcontext():
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
        trail.append(_to_numpy_fs((updates, params, state)))
    return trail


def _run_optax(ox: SimpleNamespace, program: Callable, *, steps: int = STEPS) -> list:
    """``[(updates, params, state)]`` per step, as numpy, from ``program(optax)`` in float64."""
    with ox.jax.enable_x64(True):
        opt = program(ox.optax)
        params = _map(ox.jnp.asarray, _params_np())
        state = opt.init(params)
        trail = []
        for step in range(steps):
            grads = _map(ox.jnp.asarray, _grads_np(step))
            updates, state = opt.update(grads, state, params)
            params = ox.optax.apply_updates(params, updates)
            trail.append(ox.jax.tree.map(np.array, (updates, params, state)))
    return trail


def _worst(a: Any, b: Any, path: str = "") -> tuple[float, str]:
    """The largest ``|a - b| / (1 + |b|)`` over two trees, and where; raises if they do not map.

    NamedTuples must have the same class name and fields (fshard's states mirror optax's);
    integer leaves (step counts: int64 in fshard, int32 in optax) must be equal.
    """
    if hasattr(a, "_fields") or hasattr(b, "_fields"):
        kind_a, kind_b = ((type(x).__name__, getattr(x, "_fields", None)) for x in (a, b))
        assert kind_a == kind_b, f"{path or '<root>'}: {kind_a} vs {kind_b}"
        pairs = [(f"{path}.{f}", x, y) for f, x, y in zip(a._fields, a, b)]
    elif isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys(), f"{path}: {a!r} vs {b!r}"
        pairs = [(f"{path}.{k}", a[k], b[k]) for k in a]
    elif isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a).__name__}[{len(a)}] vs {b!r}"
        pairs = [(f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{path}: shape {a.shape} vs {b.shape}"
        if a.dtype.kind in "iu" or b.dtype.kind in "iu":
            assert a.dtype.kind in "iu" and b.dtype.kind in "iu" and np.array_equal(a, b), f"{path}: {a} vs {b}"
            return 0.0, path
        assert a.dtype == b.dtype == np.float64, f"{path}: dtypes {a.dtype} vs {b.dtype}"
        return float(np.max(np.abs(a - b) / (1.0 + np.abs(b)), initial=0.0)), path
    return max((_worst(x, y, p) for p, x, y in pairs), default=(0.0, path), key=lambda t: t[0])


def _compare_trails(fs_trail: list, ox_trail: list, fs_state: Callable, ox_state: Callable) -> float:
    """Asserts both runs agree to TOL at every step; returns the worst difference seen."""
    worst = 0.0
    for step, ((fu, fp, fst), (ou, op, ost)) in enumerate(zip(fs_trail, ox_trail, strict=True)):
        for what, a, b in [("updates", fu, ou), ("params", fp, op), ("state", fs_state(fst), ox_state(ost))]:
            diff, where = _worst(a, b, what)
            assert diff <= TOL, f"step {step}: {where} differs by {diff:.3g} (relative to 1 + |optax|)"
            worst = max(worst, diff)
    return worst


# --- the programs -------------------------------------------------------------------------

# Every schedule, written once against both APIs (same names and arguments).
_SCHEDULES: dict[str, Callable[[Any], Callable]] = {
    "constant": lambda m: m.constant_schedule(0.05),
    "linear": lambda m: m.linear_schedule(0.1, 0.01, transition_steps=7, transition_begin=2),
    "cosine_decay": lambda m: m.cosine_decay_schedule(0.1, decay_steps=8),
    "cosine_decay_alpha_exponent": lambda m: m.cosine_decay_schedule(0.1, decay_steps=8, alpha=0.1, exponent=2.0),
    "warmup_cosine_decay": lambda m: m.warmup_cosine_decay_schedule(
        0.0, 0.1, warmup_steps=3, decay_steps=9, end_value=0.01, exponent=1.5),
    "warmup_cosine_decay_no_warmup": lambda m: m.warmup_cosine_decay_schedule(
        0.02, 0.1, warmup_steps=0, decay_steps=7),
    "join": lambda m: m.join_schedules(
        [m.constant_schedule(0.1), m.linear_schedule(0.1, 0.0, 4), m.cosine_decay_schedule(0.05, 3)], [3, 8]),
}


def _sched(m: Any, name: str) -> Callable:
    """Schedule ``name`` of API ``m``; optax's is called with an int64 count (see _int64_count)."""
    s = _SCHEDULES[name](m)
    return s if m is optim else _int64_count(s)


def _drop_l2_slot(state: tuple) -> tuple:
    """fshard's sgd/adam chain starts with add_decayed_weights (torch's L2 ``weight_decay``);
    optax's has no such slot. With weight_decay=0 it is an EmptyState; drop it."""
    assert state[0] == optim.EmptyState(), state[0]
    return state[1:]


def _torch_rule_clip(optax: Any, max_norm: float) -> Any:
    """optax's clip_by_global_norm with torch's rule ``min(1, max_norm / (norm + 1e-6))``.

    The reference fs.optim.clip_by_global_norm is held to (by design: it is
    torch.nn.utils.clip_grad_norm_'s rule; test_difference_clip_epsilon pins how it
    differs from optax's own).
    """
    import jax
    import jax.numpy as jnp

    def update(updates, state, params=None):
        coef = jnp.minimum(1.0, max_norm / (optax.tree.norm(updates) + 1e-6))
        return jax.tree.map(lambda u: u * coef, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _same(state: Any) -> Any:
    return state


@dataclasses.dataclass(frozen=True)
class Case:
    """One program for both APIs (``ox`` set only where optax spells it differently)."""

    fs: Callable[[Any], Any]
    ox: Callable[[Any], Any] | None = None
    fs_state: Callable[[Any], Any] = _same  # maps each side's state to the common part
    ox_state: Callable[[Any], Any] = _same


_CASES: dict[str, Case] = {
    # --- optimizers ---
    "sgd": Case(lambda m: m.sgd(0.1), fs_state=_drop_l2_slot),
    "sgd_momentum": Case(lambda m: m.sgd(0.1, momentum=0.9), fs_state=_drop_l2_slot),
    "sgd_nesterov": Case(lambda m: m.sgd(0.1, momentum=0.8, nesterov=True), fs_state=_drop_l2_slot),
    # torch's SGD weight_decay is L2: added to the gradient before momentum. optax.sgd has no
    # weight_decay; its spelling is add_decayed_weights in front.
    "sgd_l2": Case(lambda m: m.sgd(0.1, momentum=0.9, weight_decay=0.05),
                   lambda o: o.chain(o.add_decayed_weights(0.05), o.sgd(0.1, momentum=0.9)),
                   fs_state=lambda s: (s[0], s[1:])),
    # fshard's momentum=0 means no momentum (torch); optax's momentum=0.0 (unlike None) builds
    # trace(0) with a zero TraceState. Same updates; the state slot differs.
    "sgd_momentum_zero": Case(lambda m: m.sgd(0.1, momentum=0.0),
                              fs_state=lambda s: _drop_l2_slot(s)[1:], ox_state=lambda s: s[1:]),
    # Adam: eps outside the square root, after bias correction (m_hat / (sqrt(v_hat) + eps)),
    # bias correction with the count from 1: torch's placement is optax's (eps_root=0).
    "adam": Case(lambda m: m.adam(0.01), fs_state=_drop_l2_slot),
    "adam_hparams": Case(lambda m: m.adam(0.01, b1=0.8, b2=0.99, eps=1e-6), fs_state=_drop_l2_slot),
    # torch's Adam weight_decay is L2 (coupled), as for sgd.
    "adam_l2": Case(lambda m: m.adam(0.01, weight_decay=0.1),
                    lambda o: o.chain(o.add_decayed_weights(0.1), o.adam(0.01)),
                    fs_state=lambda s: (s[0], s[1:])),
    "adamw": Case(lambda m: m.adamw(0.01, weight_decay=0.01)),
    "adamw_hparams": Case(lambda m: m.adamw(0.02, b1=0.85, b2=0.95, eps=1e-7, weight_decay=0.3)),
    # optax wraps a masked transform's state in MaskedState(inner_state=...).
    "adamw_mask": Case(lambda m: m.adamw(0.01, weight_decay=0.3, mask=_MASK),
                       ox_state=lambda s: (s[0], s[1].inner_state, s[2])),
    "adamw_mask_fn": Case(lambda m: m.adamw(0.01, weight_decay=0.3, mask=_mask_fn),
                          ox_state=lambda s: (s[0], s[1].inner_state, s[2])),
    # --- transforms ---
    "identity": Case(lambda m: m.identity()),
    "scale": Case(lambda m: m.scale(-0.3)),
    "scale_by_adam": Case(lambda m: m.scale_by_adam()),
    "scale_by_adam_hparams": Case(lambda m: m.scale_by_adam(b1=0.5, b2=0.9, eps=1e-3)),
    "scale_by_learning_rate": Case(lambda m: m.scale_by_learning_rate(0.1)),
    "scale_by_learning_rate_no_flip": Case(lambda m: m.scale_by_learning_rate(0.1, flip_sign=False)),
    "trace": Case(lambda m: m.trace(0.9)),
    "trace_nesterov": Case(lambda m: m.trace(0.7, nesterov=True)),
    "add_decayed_weights": Case(lambda m: m.add_decayed_weights(0.1)),
    "add_decayed_weights_zero": Case(lambda m: m.add_decayed_weights(0.0)),
    "add_decayed_weights_mask": Case(lambda m: m.add_decayed_weights(0.1, mask=_MASK),
                                     ox_state=lambda s: s.inner_state),
    "add_decayed_weights_mask_fn": Case(lambda m: m.add_decayed_weights(0.1, mask=_mask_fn),
                                        ox_state=lambda s: s.inner_state),
    # Norms stay under 100: neither rule scales, so optax's own clip agrees exactly.
    "clip_by_global_norm_inactive": Case(lambda m: m.clip_by_global_norm(100.0)),
    # Clipping on 8 of 12 steps: against optax with torch's rule (see _torch_rule_clip).
    "clip_by_global_norm": Case(lambda m: m.clip_by_global_norm(MAX_NORM), lambda o: _torch_rule_clip(o, MAX_NORM)),
    # --- chains ---
    "chain_nested": Case(
        lambda m: m.chain(m.trace(0.5), m.chain(m.scale_by_adam(b1=0.8), m.scale(0.5)),
                          m.add_decayed_weights(0.1, mask=_MASK), m.scale_by_learning_rate(_sched(m, "join"))),
        ox_state=lambda s: (s[0], s[1], s[2].inner_state, s[3])),
    "chain_clip_adamw": Case(
        lambda m: m.chain(m.clip_by_global_norm(MAX_NORM), m.adamw(_sched(m, "warmup_cosine_decay"), weight_decay=0.1)),
        lambda o: o.chain(_torch_rule_clip(o, MAX_NORM), o.adamw(_sched(o, "warmup_cosine_decay"), weight_decay=0.1))),
    "chain_clip_sgd_nesterov": Case(
        lambda m: m.chain(m.clip_by_global_norm(MAX_NORM), m.sgd(0.1, momentum=0.9, nesterov=True)),
        lambda o: o.chain(_torch_rule_clip(o, MAX_NORM), o.sgd(0.1, momentum=0.9, nesterov=True)),
        fs_state=lambda s: (s[0], _drop_l2_slot(s[1]))),
}

# Every schedule as a learning rate (scale_by_schedule, and inside sgd and adamw).
for _name in _SCHEDULES:
    _CASES[f"scale_by_schedule[{_name}]"] = Case(lambda m, n=_name: m.scale_by_schedule(_sched(m, n)))
    _CASES[f"sgd_momentum_lr[{_name}]"] = Case(lambda m, n=_name: m.sgd(_sched(m, n), momentum=0.9),
                                               fs_state=_drop_l2_slot)
    _CASES[f"adamw_lr[{_name}]"] = Case(lambda m, n=_name: m.adamw(_sched(m, n), weight_decay=0.1))

# Donation (state and params overwritten in place) on a few programs; all of them pure.
_DONATED = ["sgd_nesterov", "adamw_mask", "chain_nested", "chain_clip_adamw"]
_RUNS = [pytest.param(n, False, id=n) for n in _CASES] + [pytest.param(n, True, id=f"{n}-donated") for n in _DONATED]


@pytest.mark.parametrize("name,donate", _RUNS)
def test_matches_optax(ox, name, donate):
    """12 steps of the program in fshard and in optax: updates, params, states agree to TOL."""
    case = _CASES[name]
    fs_trail = _run_fs(case.fs, donate=donate)
    ox_trail = _run_optax(ox, case.ox or case.fs)
    _compare_trails(fs_trail, ox_trail, case.fs_state, case.ox_state)


# --- schedules, global_norm, apply_updates on their own -------------------------------------


@pytest.mark.parametrize("name", list(_SCHEDULES))
def test_schedule_values_match_optax(ox, name):
    fs_sched = _SCHEDULES[name](optim)
    with ox.jax.enable_x64(True):
        ox_sched = _SCHEDULES[name](ox.optax)
        for step in range(25):  # past every schedule's end
            got = fs_sched(step)
            assert isinstance(got, float), type(got)  # host floats: no device sync per step
            for count in (step, ox.jnp.asarray(step, ox.jnp.int64)):
                want = float(ox_sched(count))
                assert abs(got - want) <= TOL * (1 + abs(want)), (step, got, want)


def test_global_norm_matches_optax(ox):
    trees = [_params_np(), _grads_np(0), _grads_np(1), {"one": np.array([3.0, -4.0])}]
    with ox.jax.enable_x64(True):
        for tree in trees:
            got = optim.global_norm(_map(torch.tensor, tree))
            assert got.dtype == torch.float64 and got.shape == ()
            want = float(ox.optax.tree.norm(_map(ox.jnp.asarray, tree)))
            assert abs(float(got) - want) <= TOL * want, (float(got), want)


@pytest.mark.parametrize("param_dtype", [np.float64, np.float32])
def test_apply_updates_matches_optax(ox, param_dtype):
    # float64 updates of float32 params: both add in float64 and round once to float32,
    # so the results are bitwise equal (fshard rounded twice before 5cb1291).
    params = _map(lambda x: x.astype(param_dtype), _params_np())
    updates = _map(lambda x: 1e-3 * x, _grads_np(1))
    got = _to_numpy_fs(optim.apply_updates(_map(torch.tensor, params), _map(torch.tensor, updates)))
    with ox.jax.enable_x64(True):
        want = ox.jax.tree.map(np.array, ox.optax.apply_updates(_map(ox.jnp.asarray, params),
                                                               _map(ox.jnp.asarray, updates)))
    for g, w in zip(tree_util.leaves(got), tree_util.leaves(want), strict=True):
        assert g.dtype == w.dtype == param_dtype
        np.testing.assert_array_equal(g, w)


# --- where fshard differs from optax on purpose: each difference pinned -----------------


def _clip_both(ox, max_norm: float, grads_np: dict) -> tuple[list, list]:
    got, _ = optim.clip_by_global_norm(max_norm).update(_map(torch.tensor, grads_np), optim.EmptyState())
    with ox.jax.enable_x64(True):
        want, _ = ox.optax.clip_by_global_norm(max_norm).update(_map(ox.jnp.asarray, grads_np), ox.optax.EmptyState())
        want = ox.jax.tree.map(np.array, want)
    return tree_util.leaves(_to_numpy_fs(got)), tree_util.leaves(want)


def test_difference_clip_epsilon(ox):
    """Clipping follows torch.nn.utils.clip_grad_norm_, not optax.clip_by_global_norm.

    fshard scales by ``min(1, max_norm / (norm + 1e-6))``; optax leaves the updates as
    they are when ``norm < max_norm`` and else scales by ``max_norm / norm``. Clipped
    updates are therefore smaller than optax's by the factor ``norm / (norm + 1e-6)``
    (relative 1e-6 / norm), and norms in ``[max_norm - 1e-6, max_norm]`` are scaled a
    hair by fshard, not at all by optax. Far under the threshold both are exact no-ops.
    """
    grads = _grads_np(1)
    norm = float(optim.global_norm(_map(torch.tensor, grads)))
    assert norm > 1.0
    for max_norm in (MAX_NORM, norm):  # clipped; exactly at the threshold
        got, want = _clip_both(ox, max_norm, grads)
        optax_scale = max_norm / norm
        for g, w, raw in zip(got, want, tree_util.leaves(grads)):
            np.testing.assert_allclose(w, raw * optax_scale, rtol=TOL, atol=0)
            np.testing.assert_allclose(g, w * norm / (norm + 1e-6), rtol=TOL, atol=0)
            rel = np.abs(g - w) / np.abs(w)
            np.testing.assert_allclose(rel, 1e-6 / (norm + 1e-6), rtol=1e-6)  # ~1e-7: far above TOL
    got, want = _clip_both(ox, 2 * norm, grads)  # under the threshold: both untouched, bitwise
    for g, w, raw in zip(got, want, tree_util.leaves(grads)):
        np.testing.assert_array_equal(g, raw)
        np.testing.assert_array_equal(w, raw)


def test_difference_optax_int32_count_rounds_schedules(ox):
    """optax's schedules, called at an optimizer's int32 count, compute in float32.

    JAX divides int32 by int in float32 even under x64, so optax's linear and warmup
    schedules inside its optimizers are rounded to float32 (~1e-9 relative); fshard's
    schedules are Python floats (float64). The comparisons above pass optax an int64
    count (_int64_count); this pins why.
    """
    for name in ("linear", "warmup_cosine_decay", "join"):
        fs_sched = _SCHEDULES[name](optim)
        with ox.jax.enable_x64(True):
            ox_sched = _SCHEDULES[name](ox.optax)
            worst32 = worst64 = 0.0
            for step in range(12):
                v32 = ox_sched(ox.jnp.asarray(step, ox.jnp.int32))
                v64 = ox_sched(ox.jnp.asarray(step, ox.jnp.int64))
                assert v32.dtype == ox.jnp.float32 and v64.dtype == ox.jnp.float64, (name, v32.dtype, v64.dtype)
                worst32 = max(worst32, abs(float(v32) - fs_sched(step)))
                worst64 = max(worst64, abs(float(v64) - fs_sched(step)))
        assert worst64 <= TOL and 1e-12 < worst32 < 1e-7, (name, worst32, worst64)


def test_difference_schedule_edge_cases(ox):
    """Arguments optax accepts and fshard refuses, and one value where they part."""
    with ox.jax.enable_x64(True):
        o = ox.optax
        # transition_steps <= 0: optax holds init_value; fshard refuses.
        assert float(o.linear_schedule(0.1, 0.0, transition_steps=0)(5)) == 0.1
        with pytest.raises(ValueError, match="transition_steps=0"):
            optim.linear_schedule(0.1, 0.0, transition_steps=0)
        # transition_begin < 0: optax starts at 0; fshard refuses.
        assert float(o.linear_schedule(0.1, 0.0, 4, transition_begin=-1)(2)) == pytest.approx(0.05)
        with pytest.raises(ValueError, match="transition_begin=-1"):
            optim.linear_schedule(0.1, 0.0, 4, transition_begin=-1)
        # Boundaries that do not number len(schedules) - 1: optax ignores the extra ones; fshard refuses.
        two = [o.constant_schedule(1.0), o.constant_schedule(2.0)]
        assert float(o.join_schedules(two, [3, 5])(4)) == 2.0
        with pytest.raises(ValueError, match="2 schedules need 1 boundaries, got 2"):
            optim.join_schedules([optim.constant_schedule(1.0), optim.constant_schedule(2.0)], [3, 5])
        # peak_value=0 with end_value != 0: optax's decay is 0 throughout (its alpha is
        # end/peak, taken as 0 when peak is 0); fshard decays from 0 to end_value as documented.
        args = dict(init_value=0.0, peak_value=0.0, warmup_steps=3, decay_steps=9, end_value=0.01)
        assert float(o.warmup_cosine_decay_schedule(**args)(9)) == 0.0
        assert optim.warmup_cosine_decay_schedule(**args)(9) == 0.01
        # Agreement: both refuse a decay that does not outlast the warmup, or no decay steps.
        for m in (o, optim):
            with pytest.raises(ValueError, match="decay_steps"):
                m.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=5, decay_steps=5)
            with pytest.raises(ValueError, match="decay_steps"):
                m.cosine_decay_schedule(0.1, decay_steps=0)


def test_difference_defaults_follow_torch(ox):
    """adamw's weight_decay defaults to torch.optim.AdamW's 0.01, not optax's 1e-4;
    adam's lr defaults to torch's 1e-3 where optax requires one."""
    default = lambda f, name: inspect.signature(f).parameters[name].default
    assert default(optim.adamw, "weight_decay") == default(torch.optim.AdamW, "weight_decay") == 0.01
    assert default(ox.optax.adamw, "weight_decay") == 1e-4
    assert default(optim.adam, "lr") == default(torch.optim.Adam, "lr") == 1e-3
    assert default(ox.optax.adam, "learning_rate") is inspect.Parameter.empty
    # The comparisons above hold because they pass weight_decay explicitly.
    fs_trail = _run_fs(lambda m: m.adamw(0.01), steps=3)
    ox_trail = _run_optax(ox, lambda o: o.adamw(0.01, weight_decay=0.01), steps=3)
    _compare_trails(fs_trail, ox_trail, _same, _same)


def test_difference_state_details(ox):
    """Where the states do not map one to one (the comparisons above map them explicitly)."""
    params = _map(torch.tensor, _params_np())
    with ox.jax.enable_x64(True):
        o, jparams = ox.optax, _map(ox.jnp.asarray, _params_np())
        # Step counts: int64 (torch's step dtype) vs optax's int32.
        assert optim.adam(0.1).init(params)[1].count.dtype == torch.int64
        assert o.adam(0.1).init(jparams)[0].count.dtype == ox.jnp.int32
        # sgd/adam carry a leading slot for torch's L2 weight_decay, absent from optax's.
        assert len(optim.sgd(0.1).init(params)) == 3 and len(o.sgd(0.1).init(jparams)) == 2
        assert len(optim.adam(0.1).init(params)) == 3 and len(o.adam(0.1).init(jparams)) == 2
        # A masked add_decayed_weights: fshard's state is EmptyState, optax's MaskedState(EmptyState).
        assert optim.add_decayed_weights(0.1, mask=_MASK).init(params) == optim.EmptyState()
        assert type(o.add_decayed_weights(0.1, mask=_MASK).init(jparams)).__name__ == "MaskedState"
        # A schedule as weight_decay: optax takes one (with a step count in its state); fshard refuses.
        assert type(o.add_decayed_weights(o.constant_schedule(0.1)).init(jparams)).__name__ == "WeightDecaySchedule"
        with pytest.raises(ValueError, match="weight_decay=.* must be a number"):
            optim.add_decayed_weights(optim.constant_schedule(0.1))
        # chain() of nothing: fshard's is the identity with state (); optax 0.2.8 raises.
        assert optim.chain().init(params) == ()
        with pytest.raises(ValueError):
            o.chain()


# --- sharded: fsdp=2 over 2 gloo ranks gives the same numbers ----------------------------

# Rows sharded, columns sharded, a dim 2 does not divide (5: cut 3 + 2), and a replicated leaf.
_SPECS = {"w": P("fsdp"), "b": P("fsdp"), "layers": [{"wq": P(None, "fsdp")}, {"wq": P()}]}


def _chain_clip_adamw(m: Any) -> Any:
    return m.chain(m.clip_by_global_norm(MAX_NORM), m.adamw(_sched(m, "warmup_cosine_decay"), weight_decay=0.1))


def _block(x: Any, spec: P, rank: int, n: int) -> Any:
    """Rank ``rank``'s block of ``x`` under ``spec`` on a 1-D mesh of ``n``, cut like torch.chunk
    (computed here, independently of fshard's layout code)."""
    idx = []
    for d, size in enumerate(x.shape):
        if d < len(spec) and spec[d] is not None:
            c = -(-size // n)
            idx.append(slice(min(rank * c, size), min((rank + 1) * c, size)))
        else:
            idx.append(slice(None))
    return x[tuple(idx)]


def _local_view(entry: tuple, rank: int, n: int) -> tuple:
    """(updates, params, mu, nu, counts) of one step, cut to ``rank``'s blocks."""
    updates, params, state = entry
    adam, lr = state[1][0], state[1][2]
    cut = lambda tree: {"w": _block(tree["w"], _SPECS["w"], rank, n), "b": _block(tree["b"], _SPECS["b"], rank, n),
                        "layers": [{"wq": _block(t["wq"], s["wq"], rank, n)}
                                   for t, s in zip(tree["layers"], _SPECS["layers"])]}
    return cut(updates), cut(params), cut(adam.mu), cut(adam.nu), (adam.count, lr.count)


def _sharded_body(n: int, donate: bool) -> dict:
    """Rank body: the chain on DTensors sharded over fsdp=n.

    Returns this rank's local blocks at every step (no collective: gathering everything
    every step cost most of the test's time), the global norm of every step's grads, and
    the full (gathered) updates, params and state after the last step.
    """
    mesh = fs.make_mesh({"fsdp": n})
    shard = lambda tree: fs.shard(_map(torch.tensor, tree), _SPECS, mesh, uneven=True)
    local = lambda tree: _to_numpy_fs(tree_util.tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, tree))
    opt = _chain_clip_adamw(optim)
    params = shard(_params_np())
    state = opt.init(params)
    adam = state[1][0]
    out = {"blocks": [], "norms": [], "jax_loaded": "jax" in sys.modules,
           "state_specs_like_params": fs.spec_of(adam.mu) == fs.spec_of(adam.nu) == fs.spec_of(params) == _SPECS}
    for step in range(STEPS):
        grads = shard(_grads_np(step))
        out["norms"].append(float(optim.global_norm(grads)))
        with optim.donate() if donate else contextlib.nullcontext():
            updates, state = opt.update(grads, state, params)
            params = optim.apply_updates(params, updates)
        adam, lr = state[1][0], state[1][2]
        out["blocks"].append(local((updates, params, adam.mu, adam.nu, (adam.count, lr.count))))
    out["last"] = _to_numpy_fs(fs.gather((updates, params, state)))
    return out


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_sharded_chain_clip_adamw_matches_optax(ox, donate):
    n = 2
    ranks = run_on_ranks(_sharded_body, n, donate, world_size=n)
    fs_trail = _run_fs(_chain_clip_adamw)
    ox_trail = _run_optax(ox, lambda o: o.chain(_torch_rule_clip(o, MAX_NORM),
                                                o.adamw(_sched(o, "warmup_cosine_decay"), weight_decay=0.1)))
    full_norms = [float(optim.global_norm(_map(torch.tensor, _grads_np(s)))) for s in range(STEPS)]
    for rank, r in enumerate(ranks):
        assert not r["jax_loaded"], rank  # the spawned ranks import this module, never JAX
        assert r["state_specs_like_params"], rank  # ZeRO: the moments are sharded like the params
        for step, got in enumerate(r["blocks"]):
            for ref, what in ((ox_trail, "optax"), (fs_trail, "fshard on one process")):
                diff, where = _worst(got, _local_view(ref[step], rank, n), "(updates, params, mu, nu, counts)")
                assert diff <= TOL, f"rank {rank} step {step}: {where} differs from {what} by {diff:.3g}"
        # After the last step the gathered trees map one to one, states included.
        _compare_trails([r["last"]], ox_trail[-1:], _same, _same)
        _compare_trails([r["last"]], fs_trail[-1:], _same, _same)
        # The global norm of the sharded grads is the full one, and clipping ran both ways.
        np.testing.assert_allclose(r["norms"], full_norms, rtol=TOL, atol=0)
        assert sum(x > MAX_NORM for x in r["norms"]) == 8 and sum(x < MAX_NORM for x in r["norms"]) == 4
    # Rank 1's blocks are not rank 0's (the layout really is sharded) and both sides are covered.
    assert ranks[0]["blocks"][0][1]["w"].shape == ranks[1]["blocks"][0][1]["w"].shape == (3, 4)
    assert ranks[0]["blocks"][0][1]["layers"][0]["wq"].shape == (3, 3, 2)
    assert ranks[1]["blocks"][0][1]["layers"][0]["wq"].shape == (3, 2, 2)
