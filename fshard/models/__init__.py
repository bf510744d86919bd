"""Models as pure functions over parameter pytrees, each with an ``nn.Module`` twin.

Every model has a frozen config, ``*_init(cfg, seed) -> params`` and
``*_apply(params, inputs, cfg) -> outputs``; see :mod:`fshard.models.mlp` and
:mod:`fshard.models.transformer`.
"""

from fshard.models import mlp as mlp, transformer as transformer
from fshard.models.mlp import (
    MLPConfig as MLPConfig,
    MLPModule as MLPModule,
    MLPStackConfig as MLPStackConfig,
    MLPStackModule as MLPStackModule,
    mlp_apply as mlp_apply,
    mlp_init as mlp_init,
    mlp_stack_apply as mlp_stack_apply,
    mlp_stack_init as mlp_stack_init,
)
from fshard.models.transformer import (
    TransformerConfig as TransformerConfig,
    TransformerModule as TransformerModule,
    attention as attention,
    block as block,
    embed as embed,
    feed_forward as feed_forward,
    head as head,
    transformer_apply as transformer_apply,
    transformer_init as transformer_init,
)

__all__ = [
    "MLPConfig",
    "MLPModule",
    "MLPStackConfig",
    "MLPStackModule",
    "TransformerConfig",
    "TransformerModule",
    "attention",
    "block",
    "embed",
    "feed_forward",
    "head",
    "mlp",
    "mlp_apply",
    "mlp_init",
    "mlp_stack_apply",
    "mlp_stack_init",
    "transformer",
    "transformer_apply",
    "transformer_init",
]
