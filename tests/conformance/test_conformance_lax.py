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
