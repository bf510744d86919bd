"""Bad input inside a shard_map body: both frameworks refuse, and fshard's error names what is
wrong (the argument path, argnums, the loss's shape). A value closed over from the caller
carries no per-device metadata and is treated as invariant, as in JAX.
"""

import pytest

TIMEOUT = pytest.mark.timeout(1800)
BAD = "bad/{}/x4/checked/inside"


def _both_refuse(conformance, name):
    jax_rec, fs_rec = conformance.jax(name), conformance.fshard(name)
    assert jax_rec["status"] == "error", f"JAX accepted {name}: {jax_rec}"
    assert fs_rec["status"] == "error", f"fshard accepted {name}: {fs_rec.get('value')}"
    return fs_rec["error"]


@TIMEOUT
@pytest.mark.conformance_programs(BAD.format("int_leaf"))
def test_grad_of_integer_leaf_names_its_path(conformance):
    # grad(f)({"w": float, "step": int32}): JAX raises TypeError ("grad requires real- or
    # complex-valued inputs ... got int32"); fshard must too, naming the leaf.
    err = _both_refuse(conformance, BAD.format("int_leaf"))
    assert err.startswith("TypeError") and "step" in err and "int32" in err, err


@TIMEOUT
@pytest.mark.conformance_programs(BAD.format("argnums_out_of_range"))
def test_argnums_out_of_range(conformance):
    err = _both_refuse(conformance, BAD.format("argnums_out_of_range"))
    assert err.startswith("TypeError") and "argnums=2" in err and "2 positional" in err, err


@TIMEOUT
@pytest.mark.conformance_programs(BAD.format("nonscalar_loss"))
def test_nonscalar_loss(conformance):
    err = _both_refuse(conformance, BAD.format("nonscalar_loss"))
    assert err.startswith("TypeError") and "scalar" in err and "(2, 2)" in err, err


CLOSURE = ["patterns/closure/x4/checked/inside", "patterns/closure/x4/checked/outside",
           "patterns/closure/x4/checked/replicated_out"]


@TIMEOUT
@pytest.mark.conformance_programs(*CLOSURE)
def test_closed_over_value_is_invariant(conformance):
    # Its gradient is summed over the batch axis (an implicit pvary), it may be returned
    # under out_specs P(), inside and outside grad: JAX's values, to 1e-12.
    problems = [p for p in map(conformance.mismatch, CLOSURE) if p]
    assert not problems, "\n".join(problems)
