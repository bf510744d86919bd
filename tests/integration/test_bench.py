"""The compiled sides of the bench scripts (issue 17, item 5) run and compute what the eager sides do.

Smoke tests, not timings: a tiny model, a few steps, the ``eager`` backend (Dynamo's
capture, ``fullgraph=True`` where the script asks for it, then the captured graph as it is:
no AOTAutograd, no code generation; three times cheaper than ``aot_eager`` here, and the
capture is the part of a ``--compiled`` path that rots), so that the paths cannot rot. For
fs.jit's sides ``"eager"`` runs fs.jit's own capture as it is, as the default Inductor path
compiles it (no Dynamo pass over it; tests/jit/test_jit.py covers that path). Each
side trains from the same initial weights on the same data, so its losses (or parameters)
must match its eager counterpart's: a compiled side that computed something else would
make its timing meaningless. The full-size runs and their numbers are in bench/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _harness.optional import requires

from fshard.testing import run_on_ranks

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = dict(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)
RTOL = 1e-4  # fp32, a few steps: compiled and eager round differently


def _bench(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return __import__(name)


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) and got, (what, got, want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"{what}: step {i}: {a} vs {b}"


# The compiled side whose peak memory each mode measures: peak_memory builds a side with the
# same _make_step that per_rank times, then profiles 3 steps, and fs.jit's side costs a second
# capture of its step; the two modes together measure both compiled sides.
_MEMORY_SIDE = {"fsdp": "torch_compiled", "ddp": "fshard_jit"}


def _data_parallel(mode):
    dp = _bench("data_parallel")
    out = dp.per_rank(mode, 1, 1, 25.0, False, True, "eager", TINY)
    side = _MEMORY_SIDE[mode]
    return out, {side: dp.peak_memory(side, mode, 1, 25.0, "eager", TINY)}


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_data_parallel_compiled_sides_match_eager(mode):
    # bench/fsdp.py / bench/ddp.py --compiled: fully_shard with per-block torch.compile, or
    # the module compiled under DDP; fshard's step under fs.jit.
    _bench("_limits")  # the ranks' Limit unpickles here
    (times, losses, _, _, first, limit), memory = run_on_ranks(_data_parallel, mode, world_size=2)[0]
    assert set(times) == {"torch", "fshard", "torch_compiled", "fshard_jit"}
    _check_limit(limit, {k: v[0] for k, v in times.items()}, wire=True)
    assert all(len(v) == 1 for v in times.values()) and set(first) == set(times)
    _close(losses["torch_compiled"], losses["torch"], "torch compiled vs torch")
    _close(losses["fshard_jit"], losses["fshard"], "fs.jit vs fshard eager")
    _close(losses["fshard"], losses["torch"], "fshard vs torch")
    assert set(memory) == {_MEMORY_SIDE[mode]}
    for side, (start, peak) in memory.items():  # the profiler saw the parameters, then the step's activations
        assert 0 < start < peak, (side, start, peak)


def _jit_step():
    # TINY's gradients are a few KiB: a 0.001 MiB bucket splits them over several all-reduces.
    return _bench("jit_step").per_rank("replicate", 1, "eager", TINY, bucket_mb=0.001, profile_steps=1)


def test_jit_step_times_native_compiled_too():
    first, med, ratio, losses, _, cpu, kinds = run_on_ranks(_jit_step, world_size=2)[0]
    small = "jit, 0.001 MB buckets"
    assert set(med) == set(ratio) == set(cpu) == {"native", "native compiled", "eager", "jit", small}
    # CPU per step of both ranks: the process's (compute and gloo's threads) >= the main threads'.
    assert all(proc >= main > 0 for proc, main in cpu.values()), cpu
    assert set(first) == {"jit", "native compiled", small}
    _close(losses["jit"], losses["eager"], "fs.jit vs fshard eager")
    _close(losses[small], losses["eager"], "fs.jit with small buckets vs fshard eager")
    # --profile: every side's step split by kind; the kinds add up to the step (host is the rest).
    kinds_of = _bench("breakdown").KINDS
    assert set(kinds) == set(med)
    for side, got in kinds.items():
        assert abs(sum(got[k] for k in kinds_of) - got["step"]) < 1e-6, (side, got)
        assert got["matrix products"] > 0 and got["collective launch"] > 0, (side, got)
    # fs.jit's collectives are functional ops with a recorded wait; DDP waits in Work.wait().
    assert kinds["jit"]["collective wait"] > 0 and kinds["native"]["collective wait"] == 0, kinds


def test_breakdown_kinds_by_op_name():
    kind = _bench("breakdown").kind
    assert [kind(n) for n in ("aten::mm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
                              "_c10d_functional::wait_tensor", "_c10d_functional::all_reduce", "c10d::allreduce_",
                              "## Call CompiledFxGraph fgloo ##", "aten::gelu", "FSDP::pre_forward",
                              "aten::broadcast_tensors", "autograd::engine::evaluate_function: MmBackward0",
                              "gloo:all_reduce")] == [
        "matrix products", "matrix products", "attention", "collective wait", "collective launch",
        "collective launch", "compiled kernels", "other aten ops", "host", "other aten ops", "host",
        "collective launch"]


def _tp():
    return _bench("tp").per_rank(1, 2, True, "eager", TINY)


def test_tp_compiled_sides_match_eager():
    # bench/tp.py --compiled: parallelize_module with per-block torch.compile; fshard's TP
    # and TP + SP steps under fs.jit.
    _bench("_limits")  # the ranks' Limit unpickles here
    times, losses, wire, first, limit = run_on_ranks(_tp, world_size=2)[0]
    _check_limit(limit, times, wire=True)
    assert set(times) == {"torch", "fshard", "fshard_sp", "torch_compiled", "fshard_jit", "fshard_sp_jit"}
    assert set(wire) == {"torch", "fshard", "fshard_sp"} and set(first) == set(times)
    _close(losses["torch_compiled"], losses["torch"], "torch compiled vs torch")
    _close(losses["fshard_jit"], losses["fshard"], "fs.jit TP vs fshard TP")
    _close(losses["fshard_sp_jit"], losses["fshard_sp"], "fs.jit TP + SP vs fshard TP + SP")


def test_optim_step_compiled_sides_update_like_eager():
    # run() itself checks that torch.compile(opt.step), torch's fused AdamW and fs.jit(update),
    # donated or not, end with the eager torch optimizer's parameters, and fs.optim.step's
    # fused update with torch's fused AdamW's.
    med, n, n_tensors, first = _bench("optim_step").run(torch.get_num_threads(), 1, True, "eager",
                                                        sizes=dict(d=16, n_layers=1, vocab=32))
    assert set(med) == {"torch", "torch fused", "fshard", "fshard donated", "fshard fused", "torch compiled",
                        "fshard jit", "fshard jit donated"}
    assert set(first) == {"torch compiled", "fshard jit", "fshard jit donated"} and n_tensors == 11


def test_overhead_compiled_sides_match_torch():
    # run() itself raises when any side's loss leaves torch's at any step.
    from fshard.models import TransformerConfig

    wall, cpu, first = _bench("overhead").run(1, 1, True, "eager", cfg=TransformerConfig(**TINY), batch=2)
    assert set(wall) == set(cpu) == {"torch", "torch fused", "fshard", "fshard donated", "torch compiled", "fshard jit",
                                     "fshard jit donated"}
    assert set(first) == {"torch compiled", "fshard jit", "fshard jit donated"}
    compute = _bench("overhead").compute_alone(1, TransformerConfig(**TINY), 2)
    _check_limit(_bench("_limits").Limit(compute), {k: min(v) for k, v in cpu.items()}, wire=False)


def _pp():
    return _bench("pp").per_rank(1, 4, [2], True, "eager", dict(TINY, n_layers=2))


def test_pp_compiled_sides_match_eager():
    # bench/pp.py --compiled: torch's schedules over per-block compiled stages; fshard's
    # pipeline_step under fs.jit, whose gradients are checked against torch 1F1B's.
    _bench("_limits")  # the ranks' Limit unpickles here
    out = run_on_ranks(_pp, world_size=2)
    times, first_loss, grad_err, first = out[1][0], out[1][3], out[1][5], out[1][7]
    kinds = {"torch", "fshard", "torch_compiled", "fshard_jit"}
    assert {k[0] for k in times} == kinds and {k[0] for k in first} == {"torch_compiled", "fshard_jit"}
    assert ("torch_compiled", "zb-h1", 2) not in times  # torch's ZB refuses compiled stage modules
    for name in ("gpipe", "1f1b", "zb-h1"):  # rank 1 holds the losses
        if name != "zb-h1":
            _close([first_loss[("torch_compiled", name, 2)]], [first_loss[("torch", name, 2)]],
                   f"torch compiled {name}")
        _close([first_loss[("fshard_jit", name, 2)]], [first_loss[("fshard", name, 2)]], f"fs.jit {name}")
    assert set(out[0][8]) == {(n, 2) for n in ("gpipe", "1f1b", "zb-h1")}
    for key, limit in out[0][8].items():  # every rank holds the same limits: the slowest stage's costs
        assert limit == out[1][8][key]
        _check_limit(limit, {"torch": times[("torch", *key)]}, wire=True)
    for r in out:
        assert set(r[5]) == {(n, 2) for n in ("gpipe", "1f1b", "zb-h1", "gpipe jit", "1f1b jit", "zb-h1 jit")}
        assert max(r[5].values()) <= 1e-5, r[5]  # fp32 gradients against torch 1F1B's


def _check_limit(limit, times, wire: bool) -> None:
    # The physical limit each script prints: measured compute, and (wire) bytes at a measured rate.
    assert limit.compute_s > 0 and limit.overlap_s <= limit.serial_s, limit
    assert (limit.sent_bytes > 0 and 0 < limit.rate < float("inf")) == wire, limit
    line = limit.line(times)
    assert line.startswith("physical limit: compute ") and "of the limit" in line, line
    assert all(f"{k} {t / limit.serial_s:.2f}" in line for k, t in times.items()), line


def test_limits_ring_bytes_and_sums():
    lim = _bench("_limits")
    assert [lim.ring_sent(k, 100, 4) for k in ("psum", "all_gather", "psum_scatter", "send")] == [150, 300, 75, 100]
    with pytest.raises(ValueError, match="kind 'p2p'"):
        lim.ring_sent("p2p", 1, 2)
    limit = lim.Limit(0.5, 2.0, 8.0, ranks=2, cores=2)  # wire 0.25 s
    assert (limit.wire_s, limit.serial_s, limit.overlap_s) == (0.25, 0.75, 0.5)
    assert "fshard 2.00 / 3.00" in limit.line({"fshard": 1.5})


def test_every_bench_script_prints_its_limit():
    # run_all.py's summary collects these lines: each script's main prints Limit.line.
    for script in ("data_parallel.py", "tp.py", "pp.py", "overhead.py"):
        assert "limit.line(" in (BENCH / script).read_text() or ".line({" in (BENCH / script).read_text(), script


def _collectives():
    import fshard as fs

    return _bench("collectives")._compiled(fs.make_mesh({"x": 2}), 64, 1, "eager")


def test_collectives_compiled_sides_match_eager():
    # bench/collectives.py --compiled: _compiled itself raises when fs.jit's or torch.compile's
    # result leaves its eager call's, or fs.jit's leaves torch's.
    for res in run_on_ranks(_collectives, world_size=2):
        assert set(res) == {"psum", "all_gather", "psum_scatter", "all_to_all"}
        assert all(t_torch > 0 and t_ours > 0 for t_torch, t_ours in res.values()), res


def test_run_all_passes_flags_each_script_takes():
    # bench/run_all.py --compiled: every script it passes --compiled / --backend to declares them.
    run_all = _bench("run_all")
    for name, (script, _, _) in run_all.BENCHES.items():
        args = run_all.command(name, 3, compiled=True, backend="eager")
        source = (BENCH / script).read_text()
        if name in run_all.ALWAYS_COMPILED:
            assert "--compiled" not in args, name
        for flag in ("--compiled", "--backend", "--steps"):
            if flag in args:
                assert f'"{flag}"' in source or (name in ("fsdp", "ddp") and f'"{flag}"' in
                                                  (BENCH / "data_parallel.py").read_text()), (name, flag)
    assert {"jit_step", "optim_step"} <= set(run_all.BENCHES)


def _jit_memory(mode):
    jm = _bench("jit_memory")
    return {side: jm._peak(side, mode, "eager", TINY) for side in jm.NATIVE}


@pytest.mark.parametrize("mode", ["fsdp", "replicate"])
def test_jit_memory_native_sides_profile(mode):
    # bench/jit_memory.py --sides native,native\ compiled: torch's step eager and compiled (its
    # losses against eager: test_data_parallel_compiled_sides_match_eager, the same _native_step).
    for res in run_on_ranks(_jit_memory, mode, world_size=2):
        assert set(res) == {"native", "native compiled"}
        for side, (start, peak) in res.items():  # the parameters and optimizer state, then the activations
            assert 0 < start < peak, (side, start, peak)


def _hf_fsdp_memory():
    hf = _bench("hf_fsdp_memory")
    return {side: hf.step_memory(side, 1, 32, 1, 8, steps=2, backend="eager")
            for side in ("per-block", "per-block jit")}


@requires("transformers")
def test_hf_fsdp_memory_jit_side_matches_eager():
    # bench/hf_fsdp_memory.py --compiled: per-block FSDP of the Llama with the whole step
    # (gradient and AdamW update) under fs.jit; its last loss (after an update) is the eager
    # side's. ~9 s of CPU: Dynamo tracing transformers' Llama.
    for res in run_on_ranks(_hf_fsdp_memory, world_size=2):
        (eager_steps, eager_loss), (jit_steps, jit_loss) = res["per-block"], res["per-block jit"]
        _close([jit_loss], [eager_loss], "per-block jit vs per-block")
        for start, peak in eager_steps + jit_steps:  # the profiler saw the model, then each step's tensors
            assert 0 < start < peak, res


def test_simulate_bench_runs_and_reports_the_floor(capsys):
    # bench/simulate.py: a tiny model, one step per block; the numbers are bench/README.md's.
    _bench("simulate").main(["--ranks", "2", "--steps", "1", "--dim", "16", "--batch", "4", "--seq", "8"])
    out = capsys.readouterr().out
    assert "x the N x floor" in out and "per-rank op loop" in out


def _cp_small(n):
    cp = _bench("cp")
    return cp.per_rank(64, n, 1), cp.peak_memory(64, n)


def test_cp_bench_sides_agree_and_measure():
    # bench/cp.py: fshard's ring and torch's context_parallel (with the CPU shim) compute the same
    # attention and gradients (per_rank asserts 1e-4), the limit is measured, the probe sees both.
    _bench("_limits")  # the ranks' Limit unpickles here
    (timed, memory), _ = run_on_ranks(_cp_small, 2, world_size=2)
    assert timed["worst"] < 1e-4 and set(timed["times"]) == {"fshard", "torch"}
    assert timed["limit"].compute_s > 0 and timed["limit"].sent_bytes == 3 * 2 * 2 * 4 * 32 * 16 * 4
    assert memory["fshard"] > 0 and memory["torch"] > 0


def _moe_small(n):
    return _bench("moe").per_rank(n, 64, 1)


def test_moe_bench_sides_agree_and_measure():
    # bench/moe.py: dropless and torchtitan's native recipe compute the same outputs and
    # gradients (per_rank asserts 1e-4) and move the same token bytes; the limit is measured.
    _bench("_limits")  # the ranks' Limit unpickles here
    r = run_on_ranks(_moe_small, 2, world_size=2)[0]
    assert r["worst"] < 1e-4 and set(r["times"]) == {"dropless", "dropless loop", "capacity 1.25", "native"}
    assert r["wire"]["dropless"]["ragged_all_to_all"] == r["wire"]["native"]["all_to_all_single"] > 0
    assert r["wire"]["dropless"]["all_gather"] > 0 and "all_to_all" in r["wire"]["capacity 1.25"]
    assert r["limit"].compute_s > 0
