"""Differential fuzzing of fshard against JAX (issue 29, item 3).

A seed becomes a random per-device program in a neutral form (``gen.py``: plain data, a
mesh, inputs with specs, an op list, outputs with specs, a gradient wrapping). One emitter
(``emit.py``) turns that data into JAX source and into fshard source; the JAX side runs in
its own process (``jax_worker.py``: forced host devices, x64) and the fshard side on 4
gloo ranks (``fs_worker.py``). ``compare.py`` classifies each program as agreeing,
labelled by a named row of docs/jax.md (``labels.py``), or a mismatch; ``shrink.py``
reduces a mismatch to a minimal program; ``run.py`` is the command
(``python -m tests.conformance.fuzz --seeds 0:1000``).

Everything here but ``fs_worker.py`` and ``run.py`` imports numpy only (the JAX process
imports it without torch).
"""
