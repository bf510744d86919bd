"""Named regression programs against JAX (issue 29): ordinary PyTorch code (indexing,
reversed and in-place operators, axis_index arithmetic, nested grad) on which checked mode
once disagreed with JAX, in both compositions. float64, rtol=atol=1e-12. Programs:
conf_programs_regress.py.
"""

import pytest

from conf_programs import programs

PROGRAMS = [n for n, p in programs().items() if n.startswith("regress/") and p.differs is None
            and "jax_only" not in p.tags]


@pytest.mark.timeout(1800)  # the first test waits for the whole JAX and fshard batch
@pytest.mark.parametrize("conformance_program", PROGRAMS)
def test_regression_conforms(conformance, conformance_program):
    problem = conformance.mismatch(conformance_program)
    if problem:
        pytest.fail(problem, pytrace=False)
