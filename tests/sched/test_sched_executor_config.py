"""``fs.sched.ExecutorConfig``: where one rank runs its actions (rank, group, axis, device)
and how (hooks, receive prefetch, stage view), as one frozen object.

``Executor(schedule, stage_fn, loss_fn, params, inputs, targets, seed, config=...)`` and the
old positional form (deprecated for one release) give bitwise identical pipeline losses and
gradients on real ranks; the old form warns, naming what moved and the config call; a
config together with an old keyword is a TypeError naming both; ``pipeline_step`` (the
repo's caller) warns nothing.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

import fshard as fs
import fshard.sched.step as step_mod
from fshard.sched import Executor, ExecutorConfig, Kind
from fshard.testing import run_on_ranks

D, N_LAYERS = 4, 4


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {str(i): {"w": torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5,
                     "b": torch.randn(D, generator=g, dtype=torch.float64) * 0.1} for i in range(N_LAYERS)}


def _stage_fn(params, x, stage):
    for key in sorted(params, key=int):
        x = torch.tanh(x @ params[key]["w"] + params[key]["b"])
    return x


def _loss_fn(y, t):
    return ((y - t) ** 2).mean()


def _old_form(schedule, stage_fn, loss_fn, params, inputs, targets, seed, *, config):
    """``pipeline_step``'s Executor call in the deprecated form, everything passed through."""
    return Executor(schedule, config.rank, config.group, config.axis, stage_fn, loss_fn, params, inputs, targets,
                    seed, config.device, hooks=config.hooks, prefetch=config.prefetch, stages=config.stages)


def _pipeline(form, name):
    mesh = fs.make_mesh({"pp": dist.get_world_size()})
    rank = mesh.axis_index("pp")
    sch = getattr(fs.sched, name)(2, 4)
    per = N_LAYERS // sch.n_stages
    params = _params()
    held = sch.stages_of(rank)
    sp = [{str(i): params[str(i)] for i in range(s * per, (s + 1) * per)} if s in held else None
          for s in range(sch.n_stages)]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, D, generator=g, dtype=torch.float64), torch.randn(8, D, generator=g, dtype=torch.float64)
    original = step_mod.Executor
    step_mod.Executor = _old_form if form == "old" else original
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, grads = fs.sched.pipeline_step(_stage_fn, _loss_fn, sp, (x, y), schedule=sch, mesh=mesh)
    finally:
        step_mod.Executor = original
    deprecations = [(str(w.message), w.filename) for w in caught if issubclass(w.category, DeprecationWarning)]
    flat = [t.clone() for e in grads if e is not None for t in fs.tree.leaves(e)]
    return loss.item(), flat, deprecations


def _both(name):
    return _pipeline("config", name), _pipeline("old", name)


@pytest.mark.parametrize("name", ["one_f_one_b", "zero_bubble"])
def test_config_and_deprecated_form_give_bitwise_identical_pipeline_results(name):
    for (loss_c, grads_c, warned_c), (loss_o, grads_o, warned_o) in run_on_ranks(_both, name, world_size=2):
        assert loss_c == loss_o
        assert len(grads_c) == len(grads_o) > 0 and all(torch.equal(a, b) for a, b in zip(grads_c, grads_o))
        assert warned_c == []  # pipeline_step itself uses the config form
        ((msg, filename),) = warned_o
        assert filename.endswith("test_sched_executor_config.py")  # points at the caller
        for needle in ("rank, group, axis, device, hooks, prefetch, stages", "next release",
                       "config=ExecutorConfig(rank=..., group=..., axis=..., device=..., hooks=..., prefetch=..., "
                       "stages=...)"):
            assert needle in msg, (needle, msg)


def _config(**kw):
    return ExecutorConfig(rank=0, group=None, axis="pp", device=torch.device("cpu"), **kw)


def test_config_and_old_keyword_together_is_a_type_error_naming_both():
    sch = fs.sched.lower(fs.sched.one_f_one_b(1, 1))
    with pytest.raises(TypeError) as e:
        Executor(sch, _stage_fn, _loss_fn, {}, [], [], 1.0, config=_config(), prefetch=0)
    assert "config=" in str(e.value) and "prefetch=" in str(e.value)
    assert "attrs.evolve(config, prefetch=...)" in str(e.value)


def test_arguments_that_fit_neither_form_say_the_new_one():
    sch = fs.sched.lower(fs.sched.one_f_one_b(1, 1))
    with pytest.raises(TypeError, match=r"Executor\(\).*config=ExecutorConfig\(rank=\.\.\."):
        Executor(sch, _stage_fn, _loss_fn)
    with pytest.raises(TypeError, match=r"Executor\(\) missing 1 required positional argument: 'seed'"):
        Executor(sch, _stage_fn, _loss_fn, {}, [], [], config=_config())


@pytest.mark.parametrize("bad, kind, needles", [
    (dict(rank=-1), ValueError, ["ExecutorConfig.rank=-1", "int >= 0"]),
    (dict(prefetch=-2), ValueError, ["ExecutorConfig.prefetch=-2", "int >= 0"]),
    (dict(hooks={Kind.F: print}), TypeError, ["ExecutorConfig.hooks", "Kind.UNSHARD", "fn(stage, executor)"]),
    (dict(hooks={Kind.REDUCE_GRAD: 3}), TypeError, ["ExecutorConfig.hooks", "=3"]),
])
def test_bad_options_are_refused_when_the_config_is_built(bad, kind, needles):
    kw = dict(rank=0, group=None, axis="pp", device=torch.device("cpu"))
    kw.update(bad)
    with pytest.raises(kind) as e:
        ExecutorConfig(**kw)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_config_defaults_and_hooks_copied():
    hooks = {Kind.REDUCE_GRAD: print}
    c = _config(hooks=hooks)
    hooks[Kind.UNSHARD] = print
    assert c.hooks == {Kind.REDUCE_GRAD: print} and c.prefetch == 2 and c.stages is None
    assert _config().hooks == {}
