"""The planner's collectives equal fs.comm_log's on traced steps of examples/train_lm.py.

Each case runs two real steps of the example's train step on 4 gloo ranks (float64, a
tiny model) and logs the second; on every rank, the calls and bytes per (kind, axes)
must equal what ``fs.plan.step_collectives`` derives from the spec rules and the
schedule, for that rank's pipeline position.
"""

from __future__ import annotations

import pytest

import fshard as fs
import fshard.plan as plan
from fshard.models import TransformerConfig
from fshard.testing import run_on_ranks

import _plan_bodies as _bodies

TINY = ["--dtype", "float64", "--dim", "16", "--heads", "4", "--seq-len", "16", "--batch-size", "8", "--quiet"]


def _layers(case: str) -> int:
    # Pipelines need 4 (zbv and interleaved hold 2 stages per rank on pp=2); without one,
    # 3 layers (a first, a middle and a last one: prefetch and reshard treat each
    # differently) show the per-layer terms as well as 4 do, at less cost.
    return 4 if case.startswith("pp=") else 3


CASES = {
    "fsdp=4": [],
    "dp=2,fsdp=2": [],
    "dp=4": [],
    "fsdp=2,tp=2": [],
    "fsdp=2,tp=2 sp": ["--sequence-parallel"],
    "fsdp=4 remat": ["--remat"],
    "fsdp=4 m=2": ["--microbatches", "2"],
    "dp=2,fsdp=2 m=2": ["--microbatches", "2"],
    "dp=4 m=2": ["--microbatches", "2"],
    "dp=2,tp=2 sp remat": ["--sequence-parallel", "--remat"],
    "pp=2,fsdp=2": [],
    "pp=2,tp=2 zbv": ["--schedule", "zbv"],
    "pp=2,tp=2 sp remat": ["--sequence-parallel", "--remat"],
    "pp=2,dp=2 interleaved": ["--schedule", "interleaved"],
    "pp=2,fsdp=2 gpipe remat": ["--schedule", "gpipe", "--remat"],
    "cp=2,fsdp=2": [],
    "cp=2,tp=2": [],
    "dp=2,cp=2 remat": ["--remat"],
    "cp=4 m=2": ["--microbatches", "2"],
    "pp=2,cp=2": [],
}


def _layout(argv: list[str], world: int = 4) -> plan.Layout:
    T = _bodies.train_lm()
    args = T.parse_args(argv)
    shape = T.parse_mesh(args.mesh, world)
    m = args.microbatches or (2 * shape["pp"] if "pp" in shape else 1)
    return plan.Layout(shape, batch=args.batch_size, microbatches=m, schedule=args.schedule, virtual=args.virtual,
                       remat=args.remat, sequence_parallel=args.sequence_parallel, dtype=args.dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_collectives_equal_comm_log(case):
    argv = TINY + ["--layers", str(_layers(case)), "--mesh", case.split()[0]] + CASES[case]
    results = run_on_ranks(_bodies.traced_step, argv, world_size=4, timeout_s=240)
    cfg = TransformerConfig(vocab_size=results[0]["vocab"], dim=16, n_layers=_layers(case), n_heads=4,
                            max_seq_len=16)
    model = plan.describe_transformer(cfg, dtype="float64")
    layout = _layout(argv)
    for rank, res in enumerate(results):
        predicted = plan.log_totals(plan.step_collectives(model, layout, pp_rank=res["pp_rank"]))
        assert predicted == res["totals"], (
            f"{case}, rank {rank} (pp rank {res['pp_rank']}): predicted {sorted(predicted.items())} "
            f"!= comm_log {sorted(res['totals'].items())}")
        assert predicted, "a traced step with no collectives cannot check anything"


# Dropless experts (--moe 4, top-2): the ragged exchanges' bytes follow the routing, so a
# rank's differ from the balanced prediction; their mean over the ranks that hold the same
# stage is the prediction exactly (every routed row is sent once and received once).
MOE_CASES = {
    "ep=4": [],
    "ep=2,fsdp=2": [],
    "dp=2,ep=2 m=2": ["--microbatches", "2"],
    "ep=4 remat": ["--remat"],
    "pp=2,ep=2": [],
    "pp=2,fsdp=2,ep=2 m=2": ["--microbatches", "2"],  # 8 ranks: the one 3-D case
}
RAGGED = ("ragged_all_to_all", ("ep",))


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_collectives_equal_comm_log(case):
    argv = TINY + ["--layers", "3", "--moe", "4", "--mesh", case.split()[0]] + MOE_CASES[case]
    world = 8 if case.startswith("pp=2,fsdp=2,ep=2") else 4
    results = run_on_ranks(_bodies.traced_step, argv, world_size=world, timeout_s=300)
    cfg = TransformerConfig(vocab_size=results[0]["vocab"], dim=16, n_layers=3, n_heads=4, max_seq_len=16)
    model = plan.describe_transformer(cfg, dtype="float64", moe=fs.recipes.MoE(4))
    layout = _layout(argv, world)
    for pp_rank in sorted({r["pp_rank"] for r in results}):
        held = [r["totals"] for r in results if r["pp_rank"] == pp_rank]
        predicted = plan.log_totals(plan.step_collectives(model, layout, pp_rank=pp_rank))
        assert RAGGED in predicted, predicted
        for rank, totals in enumerate(held):
            assert set(totals) == set(predicted), (case, pp_rank, rank, sorted(totals), sorted(predicted))
            for key, (calls, nbytes) in predicted.items():
                assert totals[key][0] == calls, (case, pp_rank, rank, key, totals[key], calls)
                if key != RAGGED:
                    assert totals[key][1] == nbytes, (case, pp_rank, rank, key, totals[key], nbytes)
        mean = sum(t[RAGGED][1] for t in held) / len(held)
        assert mean == predicted[RAGGED][1], (case, pp_rank, [t[RAGGED][1] for t in held], predicted[RAGGED])
