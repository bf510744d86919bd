"""fshard's version: its own module, so that code inside the package can read it without
importing the package's top level (which imports every layer)."""

__version__ = "0.1.0"
