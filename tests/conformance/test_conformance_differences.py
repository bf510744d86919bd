"""Where fshard differs from JAX on purpose, and where JAX is not the oracle: one test per
row of the table in docs/jax.md, each asserting both sides of the difference, so that a
change on either side shows up here.
"""

import numpy as np
import pytest

from conf_compare import leaf_mismatches
from conf_programs import programs

_ALL = programs()
TIMEOUT = pytest.mark.timeout(1800)


def _differs(row):
    return [n for n, p in _ALL.items() if p.differs == row]


def _ok(rec, who, name):
    assert rec["status"] == "ok", f"{who} raised on {name}: {rec.get('error')}"
    return rec["value"]


# --- docs/jax.md: "replication promises are checked at run time" -------------------------
REP = "diff/replication/x4"


@TIMEOUT
@pytest.mark.conformance_programs(f"{REP}/all_gather_to_P/checked", f"{REP}/all_gather_to_P/unchecked",
                                  f"{REP}/varying_to_P/checked")
def test_static_replication_check(conformance):
    # JAX refuses an out_spec P() for all_gather's result (typed varying) before running it...
    name = f"{REP}/all_gather_to_P/checked"
    jax_rec = conformance.jax(name)
    assert jax_rec["status"] == "error" and "out_specs" in jax_rec["error"], jax_rec
    # ...fshard runs it, finds the values identical, and returns what JAX's unchecked mode
    # returns: the value, and the gradient with the replicated output's cotangent split n ways.
    fs_val = _ok(conformance.fshard(name), "fshard", name)
    jax_unchecked = _ok(conformance.jax(f"{REP}/all_gather_to_P/unchecked"), "JAX", "unchecked twin")
    assert not leaf_mismatches(fs_val, jax_unchecked), leaf_mismatches(fs_val, jax_unchecked)
    # A value that really differs: JAX refuses statically, fshard at run time, naming the
    # output, the axis and the largest difference.
    name = f"{REP}/varying_to_P/checked"
    assert conformance.jax(name)["status"] == "error"
    fs_rec = conformance.fshard(name)
    assert fs_rec["status"] == "error", fs_rec
    assert fs_rec["error"].startswith("ValueError") and "promises" in fs_rec["error"] \
        and "max difference" in fs_rec["error"], fs_rec["error"]


@TIMEOUT
@pytest.mark.conformance_programs(f"{REP}/all_gather_to_P/unchecked")
def test_unchecked_replicated_output(conformance):
    """Unchecked, a differentiated output whose spec omits an axis keeps its cotangent whole in
    fshard (psum's backward is the identity); JAX divides it by the axis size (its psum
    transposes to psum). Same result for psum/pmean outputs (test_conformance_lax); for a
    value replicated by other means, here all_gather's, fshard's gradient is n times JAX's."""
    name = f"{REP}/all_gather_to_P/unchecked"
    fs_val = _ok(conformance.fshard(name), "fshard", name)
    jax_val = _ok(conformance.jax(name), "JAX", name)
    assert not leaf_mismatches({k: v for k, v in fs_val.items() if k != "grads"},
                               {k: v for k, v in jax_val.items() if k != "grads"})
    n = 4
    assert not leaf_mismatches(fs_val["grads"], jax_val["grads"], scale=n), \
        leaf_mismatches(fs_val["grads"], jax_val["grads"], scale=n)


@TIMEOUT
@pytest.mark.parametrize("conformance_program", [n for n in _differs("unchecked_replicated_output")
                                                 if n.startswith("lax/all_gather_invarying/")])
def test_unchecked_invariant_all_gather_output(conformance, conformance_program):
    """The same row for all_gather(to="invarying") (replicated by value and by type) under
    out_specs=P(), unchecked: fshard's gradient is n times JAX's unchecked one, and equals
    JAX's checked one (the program's checked sibling)."""
    p = _ALL[conformance_program]
    n = int(next(t for t in p.tags if t.startswith("n="))[2:])
    fs_val = _ok(conformance.fshard(conformance_program), "fshard", conformance_program)
    jax_val = _ok(conformance.jax(conformance_program), "JAX", conformance_program)
    assert not leaf_mismatches({k: v for k, v in fs_val.items() if k != "dx"},
                               {k: v for k, v in jax_val.items() if k != "dx"})
    assert not leaf_mismatches(fs_val["dx"], jax_val["dx"], scale=n), leaf_mismatches(fs_val["dx"], jax_val["dx"],
                                                                                         scale=n)
    checked = conformance_program.replace("/unchecked/", "/checked/")
    assert not leaf_mismatches(fs_val, _ok(conformance.jax(checked), "JAX", checked))


# --- docs/jax.md: "unchecked mode is Megatron-style" ----------------------------------------
def _megatron_row(conformance, name):
    twin = _ALL[name].oracle
    # fshard's unchecked mode gives the gradients of checked mode (psum's backward is the
    # identity, an explicit pvary's is a psum)...
    problem = conformance.mismatch(name)
    assert problem is None, problem
    # ...and JAX's unchecked mode does not (psum transposes to psum, pvary to nothing).
    jax_unchecked = conformance.jax(name)
    assert jax_unchecked["status"] == "ok", jax_unchecked
    assert leaf_mismatches(jax_unchecked["value"], _ok(conformance.jax(twin), "JAX", twin)), (
        f"JAX's unchecked mode now agrees with its checked mode on {name}: the row in docs/jax.md is stale")


@TIMEOUT
@pytest.mark.parametrize("conformance_program", _differs("unchecked_psum_transpose"))
def test_unchecked_psum_transpose(conformance, conformance_program):
    _megatron_row(conformance, conformance_program)


@TIMEOUT
@pytest.mark.parametrize("conformance_program", _differs("unchecked_pvary"))
def test_unchecked_pvary(conformance, conformance_program):
    _megatron_row(conformance, conformance_program)


DP = "patterns/dp/x4"


@TIMEOUT
@pytest.mark.conformance_programs(f"{DP}/unchecked/outside_no_pvary", f"{DP}/checked/outside",
                                  f"{DP}/checked/local_grads")
def test_unchecked_no_implicit_pvary(conformance):
    name = f"{DP}/unchecked/outside_no_pvary"
    # JAX's unchecked transpose sums the cotangent of a P() input over the axes it does not
    # name: the true gradient.
    true = _ok(conformance.jax(f"{DP}/checked/outside"), "JAX", "checked outside")
    jax_unchecked = _ok(conformance.jax(name), "JAX", name)
    assert not leaf_mismatches(jax_unchecked, true), leaf_mismatches(jax_unchecked, true)
    # fshard's unchecked mode adds nothing: each rank keeps its own, unsummed gradient of the
    # replicated w (the ranks disagree) until the user places a pvary (Megatron's "f").
    fs_rec = conformance.fshard(name)
    assert fs_rec["status"] == "ok", fs_rec
    local = _ok(conformance.jax(f"{DP}/checked/local_grads"), "JAX", "local grads")["local_grads"]
    per_rank = fs_rec.get("per_rank") or [fs_rec["value"]] * local.shape[0]
    for r, value in enumerate(per_rank):
        assert np.allclose(value["loss"], true["loss"], rtol=1e-12, atol=1e-12)
        assert np.allclose(value["grads"], local[r], rtol=1e-12, atol=1e-12), (
            f"rank {r}: fshard {value['grads']} vs JAX's local gradient of device {r} {local[r]}")


NIP = "unchecked_invariant_meets_varying"


@TIMEOUT
@pytest.mark.parametrize("conformance_program", _differs(NIP))
def test_unchecked_invariant_meets_varying(conformance, conformance_program):
    """``(x + psum(x)) * w`` differentiated w.r.t. x, with no explicit pvary: both JAX modes
    give ``w + psum(w)`` (checked: the implicit pvary's transpose; unchecked: psum's), fshard's
    unchecked mode ``2 w`` (no implicit pvary, psum's backward the identity): it differs from
    both. With w = 1: 5 against 2. Its checked mode agrees with JAX."""
    p = _ALL[conformance_program]
    _, w = p.make_inputs()
    blocks = w.reshape(4, -1, w.shape[1])
    jax_dx = (blocks + blocks.sum(0)).reshape(w.shape)
    for rec, who in ((conformance.jax(conformance_program), "JAX unchecked"), (conformance.jax(p.oracle), "JAX checked")):
        got = _ok(rec, who, conformance_program)["dx"]
        assert np.allclose(got, jax_dx, rtol=1e-12, atol=1e-12), (who, got, jax_dx)
    fs_dx = _ok(conformance.fshard(conformance_program), "fshard", conformance_program)["dx"]
    assert np.allclose(fs_dx, 2 * w, rtol=1e-12, atol=1e-12), (fs_dx, 2 * w)
    assert conformance.mismatch(p.oracle) is None, conformance.mismatch(p.oracle)


@TIMEOUT
@pytest.mark.parametrize("conformance_program", _differs("unchecked_out_spec_splits_invariant"))
def test_unchecked_out_spec_splitting_an_invariant_value(conformance, conformance_program):
    """``grad(sum(shard_map(lambda w: 2 * w, in_specs=P(), out_specs=P("x"))(w) ** 2))`` on
    x4: the global output holds 4 copies, so both JAX modes give 4 * 8 w = 32 w; fshard's
    unchecked mode, which has no types to see the value invariant, adds no pvary at the
    boundary: 8 w. Its checked mode gives JAX's."""
    p = _ALL[conformance_program]
    (w,) = p.make_inputs()
    for rec, who in ((conformance.jax(conformance_program), "JAX unchecked"), (conformance.jax(p.oracle), "JAX checked")):
        got = _ok(rec, who, conformance_program)["grad"]
        assert np.allclose(got, 32 * w, rtol=1e-12, atol=1e-12), (who, got, 32 * w)
    got = _ok(conformance.fshard(conformance_program), "fshard", conformance_program)["grad"]
    assert np.allclose(got, 8 * w, rtol=1e-12, atol=1e-12), (got, 8 * w)
    assert conformance.mismatch(p.oracle) is None, conformance.mismatch(p.oracle)


@TIMEOUT
@pytest.mark.parametrize("conformance_program", _differs("pvary_already_varying"))
def test_pvary_of_a_varying_value(conformance, conformance_program):
    """Checked ``pvary`` of a value already varying over all of its axes: JAX refuses it,
    fshard returns the value as it is (its oracle: JAX on the program without the pvary)."""
    jax_rec = conformance.jax(conformance_program)
    assert jax_rec["status"] == "error" and "Unsupported pcast from=varying" in jax_rec["error"], jax_rec
    problem = conformance.mismatch(conformance_program)
    assert problem is None, problem


@TIMEOUT
@pytest.mark.parametrize("conformance_program", _differs("values_leave_the_types"))
def test_values_that_leave_the_types(conformance, conformance_program):
    """``float()`` of a varying value inside a body: JAX refuses (a tracer cannot become a
    Python number); fshard computes it eagerly (its oracle: JAX with the value kept as an
    array), and verifies the body's replication promises over those axes at run time
    (tests/transforms/test_transforms_vma.py)."""
    jax_rec = conformance.jax(conformance_program)
    assert jax_rec["status"] == "error" and "Concretization" in jax_rec["error"], jax_rec
    problem = conformance.mismatch(conformance_program)
    assert problem is None, problem


# --- docs/jax.md: "where JAX is not the oracle" ---------------------------------------------
@TIMEOUT
@pytest.mark.parametrize("conformance_program", [n for n, p in _ALL.items() if p.jax_quirk])
def test_jax_quirk_still_present(conformance, conformance_program):
    """The programs whose oracle is an equivalent formulation, because JAX raises on them or
    contradicts itself: fails once JAX changes, so that the workaround can go."""
    p = _ALL[conformance_program]
    jax_rec = conformance.jax(conformance_program)
    oracle = _ok(conformance.jax(p.oracle), "JAX", p.oracle)
    if jax_rec["status"] == "ok":
        assert leaf_mismatches(jax_rec["value"], oracle), (
            f"JAX now agrees with the oracle on {conformance_program} ({p.jax_quirk}): drop the workaround")
