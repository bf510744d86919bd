"""Data parallelism as spec rules plus one layer loop: FSDP, replicate (DDP), HSDP."""

from fshard.parallel.accumulate import GradAccumulator as GradAccumulator
from fshard.parallel.scan import fsdp_loop as fsdp_loop, gather_params as gather_params, scan_layers as scan_layers
from fshard.parallel.specs import fsdp_specs as fsdp_specs, hsdp_specs as hsdp_specs
from fshard.parallel.specs import match_specs as match_specs, replicate_specs as replicate_specs

__all__ = ["GradAccumulator", "scan_layers", "fsdp_loop", "gather_params", "fsdp_specs", "hsdp_specs", "match_specs", "replicate_specs"]

from fshard.parallel.tp import MLP_STACK_TP_PLAN as MLP_STACK_TP_PLAN, TRANSFORMER_TP_PLAN as TRANSFORMER_TP_PLAN
from fshard.parallel.tp import sp_params as sp_params, tp_enter as tp_enter, tp_exit as tp_exit
from fshard.parallel.tp import tp_embed as tp_embed, tp_logits as tp_logits, tp_mlp as tp_mlp
from fshard.parallel.tp import tp_rules as tp_rules, tp_specs as tp_specs, tp_transformer_block as tp_transformer_block
from fshard.parallel.tp import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from fshard.parallel.tp import vocab_parallel_embed as vocab_parallel_embed
from fshard.parallel.tp import tp_dropout as tp_dropout, tp_rng as tp_rng

__all__ += ["MLP_STACK_TP_PLAN", "TRANSFORMER_TP_PLAN", "tp_rules", "tp_specs", "tp_enter", "tp_exit", "sp_params",
            "vocab_parallel_embed", "vocab_parallel_cross_entropy", "tp_mlp", "tp_embed", "tp_transformer_block",
            "tp_logits", "tp_dropout", "tp_rng"]

from fshard.parallel.ep import ep_rules as ep_rules, ep_specs as ep_specs, moe_ffn as moe_ffn, moe_init as moe_init
__all__ += ["ep_rules", "ep_specs", "moe_ffn", "moe_init"]

from fshard.parallel.module import FSDPApply as FSDPApply, fsdp_apply as fsdp_apply
__all__ += ["FSDPApply", "fsdp_apply"]
from fshard.parallel.module_tp import HF_GPT2_TP_PLAN as HF_GPT2_TP_PLAN, HF_LLAMA_TP_PLAN as HF_LLAMA_TP_PLAN
from fshard.parallel.module_tp import TPApply as TPApply, tp_apply as tp_apply
__all__ += ["HF_GPT2_TP_PLAN", "HF_LLAMA_TP_PLAN", "TPApply", "tp_apply"]
from fshard.parallel.layout import Layout as Layout, LayoutError as LayoutError
__all__ += ["Layout", "LayoutError"]
