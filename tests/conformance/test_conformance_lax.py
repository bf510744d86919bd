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
