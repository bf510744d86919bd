"""The example scripts as modules, loaded from their files (``examples/`` is not a package and
never goes on ``sys.path``): ``example("train_lm").main(argv)``.

The module is registered in ``sys.modules`` under its name, so that a rank's exception of
one of its classes (``train_lm.ConfigError``) unpickles in the test process.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> ModuleType:
    """``examples/<name>.py``, executed once per process."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
