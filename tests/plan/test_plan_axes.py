"""fs.plan's one home per parallelism: plan/axes/<name>.py, one row of RULES each, and the
planner's engines ask every row (so a new parallelism is one file plus its row)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fshard.plan as plan
import fshard.plan.comm as comm
import fshard.plan.layout as layout_mod
from fshard.parallel.layout import AXES, DATA_AXES
from fshard.plan.axes import RULES, AxisRule, Collective, rule
from fshard.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]


def test_a_rule_per_axis_each_in_its_own_module():
    assert sorted(r.name for r in RULES) == sorted(AXES)
    assert {r.name for r in RULES if r.splits_batch} == set(DATA_AXES)
    assert [r.name for r in RULES if r.takes_rest] == ["fsdp"]
    assert [r.name for r in RULES if r.gathers_params] == ["fsdp"]
    files = {"dp": "data", "fsdp": "fsdp", "tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp"}
    for r in RULES:
        assert type(r).__module__ == f"fshard.plan.axes.{files[r.name]}"
        assert (ROOT / "fshard" / "plan" / "axes" / f"{files[r.name]}.py").exists()
    assert rule("tp").name == "tp"
    with pytest.raises(KeyError, match="no rule for axis 'xp'"):
        rule("xp")


class _Toy(AxisRule):
    """A toy parallelism on the dp axis: refuses odd batches, and sums one scalar per step."""

    name = "toy"

    def check(self, layout, model):
        if layout.batch % 2:
            raise plan.LayoutError(f"Layout.batch {layout.batch} must be even for toy")

    def collectives(self, step, phase):
        return [Collective("psum", ("dp",), 4, 1, "toy")] if phase == "loss" else []


def test_a_new_rule_is_asked_by_the_engines(monkeypatch):
    model = plan.get_model("llama3-8b", seq_len=1024)
    lay = plan.Layout({"dp": 2, "fsdp": 2}, batch=8)
    before = plan.step_collectives(model, lay)
    monkeypatch.setattr(comm, "RULES", RULES + (_Toy(),))
    monkeypatch.setattr(layout_mod, "RULES", RULES + (_Toy(),))
    after = plan.step_collectives(model, lay)
    assert [c for c in after if c.what == "toy"] == [Collective("psum", ("dp",), 4, 1, "toy")]
    assert [c for c in after if c.what != "toy"] == before
    pipe = plan.Layout({"pp": 2, "dp": 2}, batch=8, microbatches=4)
    assert sum(c.what == "toy" for c in plan.step_collectives(model, pipe, pp_rank=1)) == 1
    with pytest.raises(plan.LayoutError, match="must be even for toy"):
        plan.check_layout(plan.Layout({"fsdp": 1}, batch=7), model)


def _ring_kernels(n):
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    import fshard as fs
    from fshard.parallel import ring_attention

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def body(q):
        q = q.detach().requires_grad_()
        fwd, bwd = Count(), Count()
        with fwd:
            out = ring_attention(q, q, q, "cp") if n > 1 else F.scaled_dot_product_attention(q, q, q, is_causal=True)
        dense = torch.ones_like(out)  # as a projection's backward gives (out.sum()'s is stride-0: one copy more)
        with bwd:
            torch.autograd.grad(out, q, dense)
        return torch.tensor([float(fwd.n), float(bwd.n)])

    mesh = fs.make_mesh({"cp": n})
    spec = fs.P(None, None, "cp")
    return fs.gather(fs.shard_map(body, mesh=mesh, in_specs=spec, out_specs=fs.P("cp"), check=False)(
        torch.randn(1, 2, 16, 4))).tolist()[:2]


def test_cp_rule_counts_the_rings_kernels():
    # plan/axes/cp.py's extra kernels per block call equal fshard's ring's, beyond one SDPA's.
    from fshard.plan.axes.cp import RING_BWD_KERNELS, RING_FWD_KERNELS

    sdpa = _ring_kernels(1)
    for n in (2, 4):
        fwd, bwd = run_on_ranks(_ring_kernels, n, world_size=n)[0]
        assert fwd - sdpa[0] == RING_FWD_KERNELS[0] * n + RING_FWD_KERNELS[1], (n, fwd, sdpa)
        assert bwd - sdpa[1] == RING_BWD_KERNELS[0] * n + RING_BWD_KERNELS[1], (n, bwd, sdpa)
