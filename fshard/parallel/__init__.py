"""Data parallelism as spec rules plus one layer loop: FSDP, replicate (DDP), HSDP."""

from fshard.parallel.scan import fsdp_loop as fsdp_loop, gather_params as gather_params, scan_layers as scan_layers
from fshard.parallel.specs import fsdp_specs as fsdp_specs, hsdp_specs as hsdp_specs
from fshard.parallel.specs import match_specs as match_specs, replicate_specs as replicate_specs

__all__ = ["scan_layers", "fsdp_loop", "gather_params", "fsdp_specs", "hsdp_specs", "match_specs", "replicate_specs"]
