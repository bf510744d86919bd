"""JAX in the pytest process, for the conformance tests that call it directly (optax's side of
the optimizer tests, ``jax.jit``'s donation): imported on first use, CPU only, and no Eigen
thread pool (this machine's cores run the gloo ranks). tests/conftest.py runs those modules
last (``_JAX_IN_PROCESS``): JAX's threads must not be copied into the processes forked later."""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace


def jax_in_this_process(*extra: str) -> SimpleNamespace:
    """``jax`` and ``jnp``, and the modules named in ``extra`` (e.g. ``"optax"``) by name.
    Flags already set (the other conformance tests' forced host devices) are kept."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_multi_thread_eigen" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    import jax
    import jax.numpy as jnp

    return SimpleNamespace(jax=jax, jnp=jnp, **{name: importlib.import_module(name) for name in extra})
