"""``fs.plan``: predict step time and memory of a layout, and pick the best one.

Example:
    >>> model = fs.plan.get_model("llama3-8b", seq_len=8192)
    >>> machine = fs.plan.get_machine("h100")
    >>> est = fs.plan.estimate(model, machine, fs.plan.Layout({"fsdp": 64}, batch=1024))
    >>> est.step_s, est.peak_bytes, est.breakdown                       # doctest: +SKIP
    >>> best = fs.plan.search(model, machine, n_devices=64, global_batch=1024, memory_limit=80e9,
    ...                       config=fs.plan.SearchConfig(schedules=("1f1b",), top=5))

Layers: :mod:`~fshard.plan.model` (models as data, traced or from a config),
:mod:`~fshard.plan.machine` (machines as data), :mod:`~fshard.plan.axes` (one module
per parallelism: its checks, choices, collectives and memory, behind one registry),
:mod:`~fshard.plan.layout`, :mod:`~fshard.plan.shards` and :mod:`~fshard.plan.comm` (sizes
and collectives from the spec rules), :mod:`~fshard.plan.estimate`, :mod:`~fshard.plan.search`,
:mod:`~fshard.plan.calibrate`, :mod:`~fshard.plan.freshness` (whether a stored calibration
still holds), :mod:`~fshard.plan.probe` (measuring a real run).
"""

from fshard.plan.calibrate import calibrate as calibrate
from fshard.plan.comm import Collective as Collective
from fshard.plan.comm import collective_time as collective_time
from fshard.plan.comm import log_totals as log_totals
from fshard.plan.comm import step_collectives as step_collectives
from fshard.plan.estimate import Estimate as Estimate
from fshard.plan.estimate import estimate as estimate
from fshard.plan.estimate import model_flops as model_flops
from fshard.plan.estimate import pipeline_speedup as pipeline_speedup
from fshard.plan.layout import AXES as AXES
from fshard.plan.layout import Layout as Layout
from fshard.plan.layout import LayoutError as LayoutError
from fshard.plan.layout import check_layout as check_layout
from fshard.plan.layout import layout_schedule as layout_schedule
from fshard.plan.machine import MACHINES as MACHINES
from fshard.plan.machine import Link as Link
from fshard.plan.machine import Machine as Machine
from fshard.plan.machine import default_machine_path as default_machine_path
from fshard.plan.machine import get_machine as get_machine
from fshard.plan.machine import load_machine as load_machine
from fshard.plan.machine import machine_from_dict as machine_from_dict
from fshard.plan.machine import save_machine as save_machine
from fshard.plan.model import PRESETS as PRESETS
from fshard.plan.model import DescriptionError as DescriptionError
from fshard.plan.model import LayerDesc as LayerDesc
from fshard.plan.model import ModelDesc as ModelDesc
from fshard.plan.model import describe_llama as describe_llama
from fshard.plan.model import describe_transformer as describe_transformer
from fshard.plan.model import get_model as get_model
from fshard.plan.model import model_from_dict as model_from_dict
from fshard.plan.probe import StepProbe as StepProbe
from fshard.plan.search import SearchConfig as SearchConfig
from fshard.plan.search import SearchResult as SearchResult
from fshard.plan.search import search as search
from fshard.plan.trace import Work as Work
from fshard.plan.trace import trace_layer as trace_layer

__all__ = [
    "AXES",
    "Collective",
    "DescriptionError",
    "Estimate",
    "LayerDesc",
    "Layout",
    "LayoutError",
    "Link",
    "check_layout",
    "layout_schedule",
    "MACHINES",
    "Machine",
    "ModelDesc",
    "PRESETS",
    "SearchConfig",
    "SearchResult",
    "StepProbe",
    "Work",
    "calibrate",
    "collective_time",
    "default_machine_path",
    "describe_llama",
    "describe_transformer",
    "estimate",
    "get_machine",
    "get_model",
    "load_machine",
    "log_totals",
    "machine_from_dict",
    "model_flops",
    "pipeline_speedup",
    "save_machine",
    "search",
    "step_collectives",
    "trace_layer",
]
