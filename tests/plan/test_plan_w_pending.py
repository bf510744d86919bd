"""What a schedule that splits backward into I and W holds between the two: the gradients
``fs.sched.SplitBackward`` captures for W (``LayerDesc.wgrad_bytes``), counted per pipeline
rank for the microbatches between their I and their W.

Each count of the planner is checked against one made here a different way: the captured
bytes against the layer's output size (what a linear layer's frontier node receives), and
the held chunks against the simulator's timeline (spans in time, not the action order the
planner walks) or a schedule small enough to count by hand.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import fshard as fs
import fshard.plan as plan
from fshard.models import TransformerConfig
from fshard.plan.estimate import held_peak, held_states
from fshard.plan.machine import Link, Machine
from fshard.sched.ir import Kind, Schedule

CFG = TransformerConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16)


def _machine() -> Machine:
    return Machine(name="toy", memory_bytes=2**30, flops={"float32": 1e10}, mem_bandwidth=1e10,
                   devices_per_node=8, links={"intra": Link(1e9, 1e-5), "inter": Link(1e8, 1e-4)})


def test_traced_wgrad_bytes_are_the_gradients_of_the_weights_outputs():
    """``y = tanh(x @ W1) @ W2``: I captures d(x @ W1) (batch x 8 floats) and the seed dy
    reaching the W2 product (batch x 3); a layer whose input takes no gradient holds none."""
    w1, w2 = torch.randn(5, 8), torch.randn(8, 3)
    t = plan.trace_layer(lambda p, x: torch.tanh(x @ p["w1"]) @ p["w2"], {"w1": w1, "w2": w2},
                         [torch.randn(6, 5)], batch=6)
    assert t.wgrad_bytes == (8 + 3) * 4
    emb = plan.trace_layer(lambda p, i: p["e"][i], {"e": torch.randn(10, 4)}, [torch.tensor([1, 2])], batch=2)
    assert emb.wgrad_bytes == 0


def test_transformer_block_holds_each_projection_and_norm_output_gradient():
    """fshard's block (LayerNorm, q/k/v/o projections, a 4x MLP): per token, the gradients of
    q, k, v, wo, w1 (4 D), w2 and both norms' outputs: 11 D floats, of which q, k, v and w1
    (7 D: the column-parallel outputs) are split over tp."""
    model = plan.describe_transformer(CFG)
    block = model.layers[model.repeated]
    per_token = CFG.dim * 4 * CFG.max_seq_len
    assert block.wgrad_bytes == 11 * per_token
    assert block.wgrad_split == pytest.approx(7 * per_token)


def _by_hand(actions: list[str]) -> Schedule:
    return Schedule(actions=[actions], n_stages=1, n_microbatches=2)


def test_held_states_of_schedules_counted_by_hand():
    # All I before any W: both microbatches alive and both between I and W at once.
    s = held_states(_by_hand(["0F0", "0F1", "0I0", "0I1", "0W0", "0W1"]))[0]
    assert held_peak(s, 1.0, 0.5) == (2, 2)
    # W right after the next F: never more than one microbatch waiting for its W.
    s = held_states(_by_hand(["0F0", "0I0", "0F1", "0W0", "0I1", "0W1"]))[0]
    assert held_peak(s, 1.0, 0.5) == (2, 1)
    assert max(p for _, p in s) == 1 and s[-1] == (0, 0)
    # A full backward holds nothing for a W.
    s = held_states(_by_hand(["0F0", "0F1", "0B0", "0B1"]))[0]
    assert max(p for _, p in s) == 0 and held_peak(s, 1.0, 0.5) == (2, 0)


def _timeline_peak(schedule: Schedule, rank: int, act: Fraction, wgrad: Fraction) -> Fraction:
    """The most bytes rank ``rank`` holds at any moment of fs.sched.simulate's timeline:
    a chunk costs ``act`` from its F's start to its W's (or B's) end, and ``wgrad`` more
    from its I's end to its W's end; at equal times releases come first."""
    rep = fs.sched.simulate(schedule, f=1, b=1, w=1)
    spans = rep.spans[rank]
    f_start, i_end, done = {}, {}, {}
    for sp in spans:
        for p in sp.action.parts:
            key = (p.stage, p.microbatch)
            if p.kind is Kind.F:
                f_start[key] = sp.start
            elif p.kind is Kind.I:
                i_end[key] = sp.end
            elif p.kind in (Kind.W, Kind.B):
                done[key] = sp.end
    best = Fraction(0)
    for t in sorted({sp.start for sp in spans} | {sp.end for sp in spans}):
        held = sum(act for k, s in f_start.items() if s <= t < done[k]) + \
            sum(wgrad for k, e in i_end.items() if e <= t < done[k])
        best = max(best, held)
    return best


@pytest.mark.parametrize("name,pp,m", [("zb", 2, 8), ("zb", 4, 8), ("zbv", 2, 6), ("1f1b", 2, 4)])
def test_held_peak_matches_the_simulated_timeline(name, pp, m):
    from fshard.plan.layout import _schedule

    sch = _schedule(name, pp, m, None)
    act, wgrad = Fraction(3), Fraction(2)
    for r, states in enumerate(held_states(sch)):
        alive, pending = held_peak(states, float(act), float(wgrad))
        assert alive * act + pending * wgrad == _timeline_peak(sch, r, act, wgrad), (name, r)
        if name == "1f1b":
            assert pending == 0


def test_zero_bubble_estimate_counts_the_captured_gradients():
    """pp=2 x tp=2, ZB, 8 microbatches: the memory kind ``w_pending`` is a number of chunks
    held between I and W times one chunk's captured bytes at tp = 2, summed here from the
    layer descriptions; 1F1B holds none."""
    from fshard.plan.shards import stage_layers

    model = plan.describe_transformer(CFG)
    machine = _machine()
    zb = plan.Layout({"pp": 2, "tp": 2}, batch=16, microbatches=8, schedule="zb")
    est = plan.estimate(model, machine, zb)
    sch = plan.layout_schedule(zb)
    stages = stage_layers(model, sch.n_stages)
    b = zb.microbatch_size

    def chunk_wgrad(s: int) -> float:
        return sum(k * (model.layers[i].wgrad_split / 2 + model.layers[i].wgrad_bytes - model.layers[i].wgrad_split)
                   * b for i, k in stages[s])

    # On the rank of the peak: some number (>= 1) of chunks between I and W, each holding
    # its stage's captured gradients; never more than that rank ever holds.
    assert est.memory["w_pending"] > 0
    hits = []
    for r, states in enumerate(held_states(sch)):
        w = chunk_wgrad(r)  # one stage per rank (pp=2, no virtual stages)
        hits += [n for n in range(1, max(p for _, p in states) + 1) if est.memory["w_pending"] == pytest.approx(n * w)]
    assert hits, est.memory["w_pending"]
    one = plan.estimate(model, machine, plan.Layout({"pp": 2, "tp": 2}, batch=16, microbatches=8, schedule="1f1b"))
    assert one.memory["w_pending"] == 0
    assert sum(est.memory.values()) == pytest.approx(est.peak_bytes)
