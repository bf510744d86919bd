"""Parallelism as spec rules plus small transformations: FSDP, replicate (DDP), HSDP, TP/SP, EP, CP, the
layer loop, nn.Module application, and the ``Layout`` that describes a whole layout."""

from fshard.parallel.accumulate import GradAccumulator as GradAccumulator
from fshard.parallel.cp import cp_order as cp_order
from fshard.parallel.cp import cp_positions as cp_positions
from fshard.parallel.cp import cp_shard as cp_shard
from fshard.parallel.cp import cp_unshard as cp_unshard
from fshard.parallel.cp import ring_attention as ring_attention
from fshard.parallel.ep import ep_rules as ep_rules
from fshard.parallel.ep import ep_specs as ep_specs
from fshard.parallel.ep import moe_ffn as moe_ffn
from fshard.parallel.ep import moe_init as moe_init
from fshard.parallel.layout import Layout as Layout
from fshard.parallel.layout import LayoutError as LayoutError
from fshard.parallel.module import FSDPApply as FSDPApply
from fshard.parallel.module import fsdp_apply as fsdp_apply
from fshard.parallel.module_tp import HF_GPT2_TP_PLAN as HF_GPT2_TP_PLAN
from fshard.parallel.module_tp import HF_LLAMA_TP_PLAN as HF_LLAMA_TP_PLAN
from fshard.parallel.module_tp import TPApply as TPApply
from fshard.parallel.module_tp import tp_apply as tp_apply
from fshard.parallel.scan import fsdp_loop as fsdp_loop
from fshard.parallel.scan import gather_params as gather_params
from fshard.parallel.scan import scan_layers as scan_layers
from fshard.parallel.scan_config import ScanConfig as ScanConfig
from fshard.parallel.specs import fsdp_specs as fsdp_specs
from fshard.parallel.specs import hsdp_specs as hsdp_specs
from fshard.parallel.specs import match_specs as match_specs
from fshard.parallel.specs import replicate_specs as replicate_specs
from fshard.parallel.tp import MLP_STACK_TP_PLAN as MLP_STACK_TP_PLAN
from fshard.parallel.tp import TRANSFORMER_TP_PLAN as TRANSFORMER_TP_PLAN
from fshard.parallel.tp import sp_params as sp_params
from fshard.parallel.tp import tp_dropout as tp_dropout
from fshard.parallel.tp import tp_embed as tp_embed
from fshard.parallel.tp import tp_enter as tp_enter
from fshard.parallel.tp import tp_exit as tp_exit
from fshard.parallel.tp import tp_logits as tp_logits
from fshard.parallel.tp import tp_mlp as tp_mlp
from fshard.parallel.tp import tp_rng as tp_rng
from fshard.parallel.tp import tp_rules as tp_rules
from fshard.parallel.tp import tp_specs as tp_specs
from fshard.parallel.tp import tp_transformer_block as tp_transformer_block
from fshard.parallel.tp import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from fshard.parallel.tp import vocab_parallel_embed as vocab_parallel_embed

__all__ = [
    "GradAccumulator",
    "scan_layers",
    "ScanConfig",
    "fsdp_loop",
    "gather_params",
    "fsdp_specs",
    "hsdp_specs",
    "match_specs",
    "replicate_specs",
    "MLP_STACK_TP_PLAN",
    "TRANSFORMER_TP_PLAN",
    "tp_rules",
    "tp_specs",
    "tp_enter",
    "tp_exit",
    "sp_params",
    "vocab_parallel_embed",
    "vocab_parallel_cross_entropy",
    "tp_mlp",
    "tp_embed",
    "tp_transformer_block",
    "tp_logits",
    "tp_dropout",
    "tp_rng",
    "ep_rules",
    "ep_specs",
    "moe_ffn",
    "moe_init",
    "ring_attention",
    "cp_shard",
    "cp_unshard",
    "cp_order",
    "cp_positions",
    "FSDPApply",
    "fsdp_apply",
    "HF_GPT2_TP_PLAN",
    "HF_LLAMA_TP_PLAN",
    "TPApply",
    "tp_apply",
    "Layout",
    "LayoutError",
]
