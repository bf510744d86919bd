"""Every fs.lax op and option against jax.lax: values and gradients (inside and outside
shard_map, checked and unchecked), float64, rtol=atol=1e-12. Programs: conf_programs_lax.py.

A program where fshard differs from JAX on purpose is not here but in
test_conformance_differences.py (docs/jax.md lists the differences).
"""

import pytest

from conf_programs import programs

PROGRAMS = [n for n, p in programs().items() if n.startswith("lax/") and p.differs is None
            and "jax_only" not in p.tags]


@pytest.mark.timeout(1800)  # the first test waits for the whole JAX and fshard batch
@pytest.mark.parametrize("conformance_program", PROGRAMS)
def test_lax_conforms(conformance, conformance_program):
    problem = conformance.mismatch(conformance_program)
    if problem:
        pytest.fail(problem, pytrace=False)


REFUSED = [n for n in programs() if n.startswith("lax/mixed_refused/")]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("conformance_program", REFUSED)
def test_mixed_state_refusals(conformance, conformance_program):
    """psum, pmean, psum_scatter and pvary over several axes, on a value varying over some
    of them only: JAX refuses while tracing, fshard's checked mode before communicating,
    naming the collective, the axes and the fix (conf_programs_mixed.py has the rule)."""
    op = conformance_program.rsplit("/", 1)[1].split(":")[0]
    jax_rec = conformance.jax(conformance_program)
    assert jax_rec["status"] == "error" and "can only accept axis_name" in jax_rec["error"], jax_rec
    fs_rec = conformance.fshard(conformance_program)
    assert fs_rec["status"] == "error", fs_rec
    assert fs_rec["error"].startswith(f"ValueError: fs.lax.{op} over ("), fs_rec["error"]
    assert "but not over" in fs_rec["error"] and "Fix: " in fs_rec["error"], fs_rec["error"]


# JAX's message, fshard's start, per refusal (conf_programs_lax.py: NEW_REFUSED).
NEW_REFUSED = {
    "pbroadcast_invariant": ("must be applied to a device-varying", "ValueError: fs.lax.pbroadcast over 'x'"),
    "pcast_bad_to": ("Got unexpected `to` value", "ValueError: fs.lax.pcast over 'x': to='invariant'"),
    "pcast_set": ("TypeError", "TypeError: fs.lax.pcast: axis_name={'x'}"),
    "all_gather_bad_to": ("unexpected `to` value for `jax.lax.all_gather`",
                          "ValueError: fs.lax.all_gather over 'x': to='invariant'"),
    "pshuffle_not_a_perm": ("does not represent a permutation", "ValueError: fs.lax.pshuffle over 'x'"),
    "pswapaxes_bad_size": ("all_to_all requires the size", "ValueError: fs.lax.all_to_all: dim 0"),
}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("conformance_program", [n for n in programs() if n.startswith("lax/new_refused/")])
def test_new_surface_refusals(conformance, conformance_program):
    """pbroadcast, pcast, all_gather(to=), pshuffle, pswapaxes: what JAX 0.10.2 refuses,
    fshard refuses too, with its own message naming the op and the axis."""
    jax_says, fs_starts = NEW_REFUSED[conformance_program.rsplit("/", 1)[1]]
    jax_rec, fs_rec = conformance.jax(conformance_program), conformance.fshard(conformance_program)
    assert jax_rec["status"] == "error" and jax_says in jax_rec["error"], jax_rec
    assert fs_rec["status"] == "error" and fs_rec["error"].startswith(fs_starts), fs_rec
