"""Pipeline schedules as data: IR, generators, lowering, validation, simulation, plots,
and the executor (:func:`pipeline_step`).

Example:
    >>> from fshard import sched
    >>> s = sched.lower(sched.one_f_one_b(4, 8))
    >>> sched.validate(s).n_stages
    4
    >>> float(sched.simulate(s).makespan)
    33.0
"""

from fshard.sched.generators import dualpipev as dualpipev
from fshard.sched.generators import gpipe as gpipe
from fshard.sched.generators import interleaved_1f1b as interleaved_1f1b
from fshard.sched.generators import looped_bfs as looped_bfs
from fshard.sched.generators import one_f_one_b as one_f_one_b
from fshard.sched.generators import zbv as zbv
from fshard.sched.generators import zero_bubble as zero_bubble
from fshard.sched.greedy import zb_h2 as zb_h2
from fshard.sched.ir import Action as Action
from fshard.sched.ir import Kind as Kind
from fshard.sched.ir import Schedule as Schedule
from fshard.sched.ir import ScheduleError as ScheduleError
from fshard.sched.ir import stage_to_rank as stage_to_rank
from fshard.sched.lower import add_reduce_grad as add_reduce_grad
from fshard.sched.lower import add_unshard_reshard as add_unshard_reshard
from fshard.sched.lower import lower as lower
from fshard.sched.plot import plot as plot
from fshard.sched.registry import build_schedule as build_schedule
from fshard.sched.registry import resolve_name as resolve_name
from fshard.sched.runtime import Executor as Executor
from fshard.sched.runtime import ExecutorConfig as ExecutorConfig
from fshard.sched.simulate import SimReport as SimReport
from fshard.sched.simulate import Span as Span
from fshard.sched.simulate import simulate as simulate
from fshard.sched.simulate import timeline as timeline
from fshard.sched.stage_fsdp import StageFSDP as StageFSDP
from fshard.sched.step import StepStats as StepStats
from fshard.sched.step import pipeline_step as pipeline_step
from fshard.sched.validate import validate as validate

__all__ = [
    "Action",
    "Executor",
    "ExecutorConfig",
    "Kind",
    "Schedule",
    "ScheduleError",
    "SimReport",
    "StageFSDP",
    "Span",
    "StepStats",
    "add_reduce_grad",
    "add_unshard_reshard",
    "build_schedule",
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "lower",
    "one_f_one_b",
    "pipeline_step",
    "plot",
    "resolve_name",
    "simulate",
    "stage_to_rank",
    "timeline",
    "validate",
    "zb_h2",
    "zbv",
    "zero_bubble",
]
