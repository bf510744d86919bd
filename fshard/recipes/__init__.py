"""``fs.recipes``: the composed training step, as a library call.

``build_train_step(model, layout, optimizer)`` returns ``(init_state, step)`` for a
:class:`LayeredModel` (fshard's Transformer: :func:`transformer`; a model of your own: its
``init``/``embed``/``block``/``head``/``loss``) on any ``fs.parallel.Layout``. The pieces it
composes (:mod:`~fshard.recipes.roles`, :mod:`~fshard.recipes.model`,
:mod:`~fshard.recipes.step`, :mod:`~fshard.recipes.pipeline`, :mod:`~fshard.recipes.faults`)
are importable for a step of your own, beside what a training script needs around it
(:mod:`~fshard.recipes.data`, :mod:`~fshard.recipes.progress`); ``examples/train_lm.py`` is a
command line over them.
"""

from fshard.recipes.faults import Injection as Injection
from fshard.recipes.faults import NonFinite as NonFinite
from fshard.recipes.faults import NonFiniteError as NonFiniteError
from fshard.recipes.model import LayeredModel as LayeredModel
from fshard.recipes.model import transformer as transformer
from fshard.recipes.pipeline import Pipeline as Pipeline
from fshard.recipes.roles import Roles as Roles
from fshard.recipes.step import TrainStep as TrainStep
from fshard.recipes.step import build_train_step as build_train_step

__all__ = [
    "Injection",
    "LayeredModel",
    "NonFinite",
    "NonFiniteError",
    "Pipeline",
    "Roles",
    "TrainStep",
    "build_train_step",
    "transformer",
]
