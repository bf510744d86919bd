"""fs.sched.pipeline_step under fs.simulate against real gloo ranks: every schedule, on
pp=2 (2 ranks), pp=2 x dp=2 and pp=4 (4 ranks), and stage-level FSDP on pp=2 x fsdp=2; each
rank's loss and gradients (float64) equal bit for bit. A pipeline is MPMD: under simulation
each pipeline coordinate's ranks run their part as one program (fshard/sched/simulated.py)."""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard.testing import assert_bitwise_equal, run_on_ranks, run_simulated

D, BATCH, MICROBATCHES = 6, 8, 4
SCHEDULES = ["gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "zero_bubble", "zbv", "dualpipev"]


def _params(n_stages: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"w": torch.randn(D, D, generator=g, dtype=torch.float64) * 0.5, "b": torch.randn(D, generator=g, dtype=torch.float64)}
        for _ in range(n_stages)
    ]


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, D, generator=g, dtype=torch.float64), torch.randn(BATCH, D, generator=g, dtype=torch.float64)


def _stage(p, x, s):
    return torch.tanh(x @ p["w"].T + p["b"])


def _loss(y, t):
    return ((y - t) ** 2).mean()


def _program(n, schedule, pp, fsdp):
    """Every stage's parameters on every rank (each pipeline rank reads its own), the loss and
    this rank's gradient blocks out."""
    extra = {} if n == pp else {("fsdp" if fsdp else "dp"): n // pp}
    mesh = fs.make_mesh({"pp": pp, **extra})
    sch = fs.sched.build_schedule(schedule, pp, MICROBATCHES)
    params = _params(sch.n_stages)
    if fsdp:
        params = [{k: fs.shard(v, fs.P("fsdp") if k == "w" else fs.P(), mesh) for k, v in p.items()} for p in params]
    loss, grads = fs.sched.pipeline_step(
        _stage, _loss, params, _batch(), schedule=sch, mesh=mesh, data_axes=tuple(extra), fsdp="fsdp" if fsdp else None
    )
    local = [None if g is None else {k: v.to_local() if fsdp else v for k, v in g.items()} for g in grads]
    return loss, local


def _held(result):
    """A stage this rank does not hold: None on a real rank, no block in the simulation."""
    loss, grads = result
    return loss, [None if g is None or all(v is None for v in g.values()) else g for g in grads]


def _compare(n, schedule, pp, fsdp=False):
    real = run_on_ranks(_program, n, schedule, pp, fsdp, world_size=n)
    simulated = run_simulated(_program, n, schedule, pp, fsdp, world_size=n)
    for r in range(n):
        assert_bitwise_equal(_held(simulated[r]), _held(real[r]), what=f"{schedule} on {n} ranks (pp={pp}), rank {r}")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_simulated_equals_the_real_ranks_bit_for_bit(schedule, n):
    _compare(n, schedule, 2)  # n=4: pp=2 x dp=2, the loss broadcast over the strided pp groups


def test_four_pipeline_coordinates_simulated_equal_the_real_ranks():
    _compare(4, "one_f_one_b", 4)


def test_stage_fsdp_simulated_equals_the_real_ranks():
    _compare(4, "interleaved_1f1b", 2, fsdp=True)


def test_step_stats_are_refused_under_simulation_naming_the_reason():
    with fs.simulate(2):
        mesh = fs.make_mesh({"pp": 2})
        sch = fs.sched.one_f_one_b(2, 2)
        with pytest.raises(ValueError, match=r"return_stats=True\) under fs.simulate\(2.*wall-clock"):
            fs.sched.pipeline_step(_stage, _loss, _params(2), _batch(), schedule=sch, mesh=mesh, return_stats=True)


def test_a_stage_gradient_is_held_by_its_coordinates_ranks_only():
    with fs.simulate(4):
        mesh = fs.make_mesh({"pp": 2, "dp": 2})
        params = _params(2)
        _, grads = fs.sched.pipeline_step(
            _stage, _loss, params, _batch(), schedule=fs.sched.gpipe(2, 2), mesh=mesh, data_axes="dp"
        )
        assert [sorted(g["w"]._ranks) for g in grads] == [[0, 1], [2, 3]]
        stepped = params[1]["w"] - 0.1 * grads[1]["w"]  # computes on the ranks holding stage 1
        assert sorted(stepped._ranks) == [2, 3]


def test_the_recipe_pipeline_is_refused_under_simulation_naming_the_schedule_and_the_reason():
    model = fs.recipes.LayeredModel(
        init=lambda seed, dtype: {"layers": [{"w": torch.zeros(D, D, dtype=dtype)} for _ in range(2)]},
        embed=lambda root, x: x, block=lambda layer, x: x @ layer["w"], head=lambda root, x: x, loss=_loss,
    )
    with fs.simulate(2):
        layout = fs.parallel.Layout.parse("pp=2", batch=BATCH, dtype="float64", microbatches=2, schedule="gpipe")
        with pytest.raises(NotImplementedError, match=r"Layout.schedule gpipe on pp=2 under fs.simulate\(2.*per-rank tree"):
            fs.recipes.build_train_step(model, layout, fs.optim.sgd(0.1))
