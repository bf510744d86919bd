"""``fs.recipes``: the composed training step, as a library call.

``build_train_step(model, layout, optimizer)`` returns ``(init_state, step)`` for a
:class:`LayeredModel` (fshard's Transformer: :func:`transformer`; a model of your own: its
``init``/``embed``/``block``/``head``/``loss``) on any ``fs.parallel.Layout``. The pieces it
composes (:mod:`~fshard.recipes.roles`, :mod:`~fshard.recipes.model`,
:mod:`~fshard.recipes.step`, :mod:`~fshard.recipes.pipeline`, :mod:`~fshard.recipes.faults`)
are importable for a step of your own, beside what a training script needs around it
(:mod:`~fshard.recipes.data`, :mod:`~fshard.recipes.progress`, :mod:`~fshard.recipes.cli`: the
flags scripts share); ``examples/train_lm.py`` is a
command line over them.
"""

from fshard.recipes import cli as cli
from fshard.recipes.faults import Injection as Injection
from fshard.recipes.faults import NonFinite as NonFinite
from fshard.recipes.faults import NonFiniteError as NonFiniteError
from fshard.recipes.model import LayeredModel as LayeredModel
from fshard.recipes.model import MoE as MoE
from fshard.recipes.model import transformer as transformer
from fshard.recipes.module import ModuleModel as ModuleModel
from fshard.recipes.pipeline import Pipeline as Pipeline
from fshard.recipes.roles import Roles as Roles
from fshard.recipes.script import run_script as run_script
from fshard.recipes.step import ComposedStep as ComposedStep
from fshard.recipes.step import TrainStep as TrainStep
from fshard.recipes.step import build_train_step as build_train_step
from fshard.recipes.step import compose_train_step as compose_train_step
from fshard.recipes.trainer import CheckpointConfig as CheckpointConfig
from fshard.recipes.trainer import ConfigError as ConfigError
from fshard.recipes.trainer import TrainConfig as TrainConfig
from fshard.recipes.trainer import TrainResult as TrainResult
from fshard.recipes.trainer import train as train

__all__ = [
    "CheckpointConfig",
    "ComposedStep",
    "ConfigError",
    "Injection",
    "LayeredModel",
    "MoE",
    "ModuleModel",
    "NonFinite",
    "NonFiniteError",
    "Pipeline",
    "Roles",
    "TrainConfig",
    "TrainResult",
    "TrainStep",
    "build_train_step",
    "compose_train_step",
    "run_script",
    "train",
    "transformer",
]
