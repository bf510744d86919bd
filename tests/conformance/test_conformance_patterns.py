"""Gradient patterns against JAX: DP, FSDP, HSDP, Megatron TP (+SP, x DP), MoE all_to_all,
a ppermute ring, remat with policies (against jax.checkpoint), vmap of grad, has_aux,
tuple argnums and values closed over from the caller; gradients taken inside and outside
shard_map, checked and unchecked. float64, rtol=atol=1e-12. Programs: conf_programs_patterns.py.
"""

import pytest

from conf_programs import programs

PROGRAMS = [n for n, p in programs().items() if n.startswith("patterns/") and p.differs is None
            and "jax_only" not in p.tags]


@pytest.mark.timeout(1800)  # the first test waits for the whole JAX and fshard batch
@pytest.mark.parametrize("conformance_program", PROGRAMS)
def test_pattern_conforms(conformance, conformance_program):
    problem = conformance.mismatch(conformance_program)
    if problem:
        pytest.fail(problem, pytrace=False)
