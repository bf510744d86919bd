"""Models as pure functions over parameter pytrees, each with an ``nn.Module`` twin.

Every model has a frozen config, ``*_init(cfg, seed) -> params`` and
``*_apply(params, inputs, cfg) -> outputs``; see :mod:`fshard.models.mlp` and
:mod:`fshard.models.transformer`.
"""

from fshard.models import mlp as mlp
from fshard.models import transformer as transformer
from fshard.models.mlp import (
    MLPConfig as MLPConfig,
)
from fshard.models.mlp import (
    MLPModule as MLPModule,
)
from fshard.models.mlp import (
    MLPStackConfig as MLPStackConfig,
)
from fshard.models.mlp import (
    MLPStackModule as MLPStackModule,
)
from fshard.models.mlp import (
    mlp_apply as mlp_apply,
)
from fshard.models.mlp import (
    mlp_init as mlp_init,
)
from fshard.models.mlp import (
    mlp_stack_apply as mlp_stack_apply,
)
from fshard.models.mlp import (
    mlp_stack_init as mlp_stack_init,
)
from fshard.models.sample import generate as generate
from fshard.models.transformer import (
    TransformerConfig as TransformerConfig,
)
from fshard.models.transformer import (
    TransformerModule as TransformerModule,
)
from fshard.models.transformer import (
    attention as attention,
)
from fshard.models.transformer import (
    block as block,
)
from fshard.models.transformer import (
    embed as embed,
)
from fshard.models.transformer import (
    feed_forward as feed_forward,
)
from fshard.models.transformer import (
    head as head,
)
from fshard.models.transformer import (
    transformer_apply as transformer_apply,
)
from fshard.models.transformer import (
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
    "generate",
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
