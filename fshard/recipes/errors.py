"""The recipes' settings error, below every recipe module (the trainer, its sinks and its
validation all raise it; defined here so that none imports another for it)."""

from __future__ import annotations

from fshard.parallel.layout import LayoutError

__all__ = ["ConfigError"]


class ConfigError(LayoutError):
    """Settings that do not fit together, this world size or the checkpoint being resumed;
    reported without a traceback, as a ``LayoutError`` is."""
