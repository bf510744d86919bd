"""Mixed precision: ``Policy(param_dtype, reduce_dtype, output_dtype)``.

Masters (and optimizer state) stay in their own dtype, usually fp32. Compute runs in
``param_dtype``: FSDP casts each shard before gathering it (half the bytes in bf16);
gradients are reduced in ``reduce_dtype`` and land in the masters' dtype.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from fshard import tree as tree_util

__all__ = ["Policy"]


def _floating_or_none(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(
            f"Policy.{attribute.name}={value!r}: must be a floating torch.dtype "
            f"(torch.float32, torch.bfloat16, torch.float16, torch.float64) or None."
        )


@attrs.frozen(kw_only=True)
class Policy:
    """What dtype each phase uses; ``None`` keeps the value's own dtype.

    Attributes:
      param_dtype: dtype parameters are gathered and computed in.
      reduce_dtype: dtype gradients are reduced in (default: ``param_dtype``).
      output_dtype: dtype the forward's outputs are cast to.
    """

    param_dtype: torch.dtype | None = attrs.field(default=None, validator=_floating_or_none)
    reduce_dtype: torch.dtype | None = attrs.field(default=None, validator=_floating_or_none)
    output_dtype: torch.dtype | None = attrs.field(default=None, validator=_floating_or_none)

    def cast_params(self, tree: Any) -> Any:
        """Casts floating leaves to ``param_dtype`` (differentiably)."""
        return _cast(tree, self.param_dtype)

    def cast_output(self, tree: Any) -> Any:
        """Casts floating leaves to ``output_dtype``."""
        return _cast(tree, self.output_dtype)

    @property
    def grad_reduce_dtype(self) -> torch.dtype | None:
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


def _cast(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return tree_util.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree
    )
