"""The optional packages some tests need, and the mark that skips those tests without them.

``pip install -e ".[test-core]"`` runs the suite without JAX, optax and transformers;
``.[test]`` adds them (the ``conformance`` and ``hf`` extras). A test that needs one says so
with ``pytestmark = requires("jax")`` (the module), ``@requires("transformers")`` (one test),
``skip_without("jax")`` (inside a fixture or test), or ``pytest.importorskip``;
tests/integration/test_optional_deps.py checks statically that every test module that reaches
one of these packages has such a guard.

The check looks the package up (``importlib.util.find_spec``) without importing it: importing
JAX in the pytest process would put its threads into every rank that ``fs.run_local`` forks.
"""

from __future__ import annotations

import importlib.util

import pytest

# Package -> the extra that installs it.
OPTIONAL = {"jax": "conformance", "optax": "conformance", "transformers": "hf", "safetensors": "hf"}


def missing(*packages: str) -> list[str]:
    """The packages among ``packages`` that are not installed."""
    return [p for p in packages if importlib.util.find_spec(p) is None]


def requires(*packages: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark: skip unless every package in ``packages`` is installed.

    Raises:
      ValueError: a package that :data:`OPTIONAL` does not list (the reason names its extra).
    """
    unknown = [p for p in packages if p not in OPTIONAL]
    if unknown:
        raise ValueError(f"requires{packages}: {unknown} not in tests/_harness/optional.OPTIONAL {sorted(OPTIONAL)}")
    gone = missing(*packages)
    extras = sorted({OPTIONAL[p] for p in gone})
    return pytest.mark.skipif(
        bool(gone), reason=f'needs {", ".join(gone)}: pip install -e ".[{",".join(extras)}]" (or .[test])'
    )


def skip_without(*packages: str) -> None:
    """Inside a test or fixture: ``pytest.skip`` unless every package in ``packages`` is installed."""
    mark = requires(*packages)
    if mark.args[0]:
        pytest.skip(mark.kwargs["reason"])


# Commands of README.md and docs/*.md (regex on the command) that need an optional package:
# tests/integration/test_docs_commands.py skips them without it.
DOC_COMMAND_NEEDS = {r"tests/conformance/|tests\.conformance": ("jax",)}
