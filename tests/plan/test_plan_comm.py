"""The planner's collectives equal fs.comm_log's on traced steps of examples/train_lm.py.

Each case runs two real steps of the example's train step on 4 gloo ranks (float64, a
tiny model) and logs the second; on every rank, the calls and bytes per (kind, axes)
must equal what ``fs.plan.step_collectives`` derives from the spec rules and the
schedule, for that rank's pipeline position.
"""

from __future__ import annotations

import pytest

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


def _layout(argv: list[str]) -> plan.Layout:
    T = _bodies.train_lm()
    args = T.parse_args(argv)
    shape = T.parse_mesh(args.mesh, 4)
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
