"""fs.checkpoint under fs.simulate against real gloo ranks: a save/load round trip (blocking
and in the background, resharded on load), Hugging Face safetensors in and out, and
checkpoints crossing over: written under ``fs.simulate(4)`` and read on 4 and 2 real ranks
(another mesh), and the other way round. Every rank's values are equal bit for bit (float64)
and a simulated save writes the files 4 real ranks write."""

from __future__ import annotations

import os

import pytest
import torch
from _harness import hf_models
from _harness.optional import requires

import fshard as fs
from fshard import P
from fshard.testing import assert_bitwise_equal, run_on_ranks, run_simulated


def _mesh(n: int):
    return fs.make_mesh({"a": 2, "b": 2} if n == 4 else {"a": n, "b": 1})


def _data(seed: int, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


SAVED = {"w": P("a", "b"), "u": P(("a", "b")), "r": P(), "mu": P(None, "b")}
LOADED = {"w": P(None, ("b", "a")), "u": P("b"), "r": P("a"), "mu": P()}  # another layout


def _state(n: int, specs: dict, zero: bool = False):
    mesh = _mesh(n)
    shapes = {"w": (6, 4), "u": (7, 3), "r": (4, 2), "mu": (2, 6)}
    vals = {k: torch.zeros(*s, dtype=torch.float64) if zero else _data(i, *s) for i, (k, s) in enumerate(shapes.items())}
    sharded = {k: fs.shard(v, specs[k], mesh, uneven=True) for k, v in vals.items()}
    return {
        "params": {"w": sharded["w"], "u": sharded["u"], "r": sharded["r"]},
        "opt": {"mu": sharded["mu"], "count": torch.tensor(3)},
        "step": 0 if zero else 7,
        "data": {"epoch": 0 if zero else 2, "index": 0 if zero else 96},
        "rng": torch.zeros(5, dtype=torch.float64) if zero else _data(9, 5),
    }


def _blocks(tree):
    def one(x):
        if isinstance(x, torch.distributed.tensor.DTensor):
            return (x.to_local().detach().clone(), fs.gather(x).detach())
        return x.detach().clone() if isinstance(x, torch.Tensor) else x

    return fs.tree.tree_map(one, tree)


def _roundtrip(n, path, blocking):
    fs.checkpoint.save(path, _state(n, SAVED), blocking=blocking).wait()
    names = sorted(os.listdir(path))
    loaded = fs.checkpoint.load(path, like=_state(n, LOADED, zero=True))
    flat = fs.checkpoint.load(path)  # no template: full values
    return _blocks(loaded), names, {k: flat[k] for k in sorted(flat)}


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("n", [2, 4])
def test_a_round_trip_resharded_on_load_equals_the_real_ranks(n, blocking, tmp_path):
    real = run_on_ranks(_roundtrip, n, str(tmp_path / "real"), blocking, world_size=n)
    simulated = run_simulated(_roundtrip, n, str(tmp_path / "sim"), blocking, world_size=n)
    for r in range(n):
        assert_bitwise_equal(simulated[r], real[r], what=f"round trip, rank {r}")
    assert [f"__{r}_0.distcp" in simulated[0][1] for r in range(n)] == [True] * n  # a file per rank
    assert simulated[0][0]["params"]["w"][1].equal(_data(0, 6, 4))  # the values saved, in another layout


def _save(n, path):
    fs.checkpoint.save(path, _state(n, SAVED))
    return sorted(os.listdir(path))


def _load(n, path):
    return _blocks(fs.checkpoint.load(path, like=_state(n, LOADED, zero=True)))


@pytest.mark.parametrize("n_load", [4, 2])
def test_a_checkpoint_crosses_between_simulated_and_real_ranks(n_load, tmp_path):
    real_dir, sim_dir = str(tmp_path / "real"), str(tmp_path / "sim")
    real_files = run_on_ranks(_save, 4, real_dir, world_size=4)[0]
    sim_files = run_simulated(_save, 4, sim_dir, world_size=4)[0]
    assert sim_files == real_files  # the files 4 real ranks write, by name
    reference = run_on_ranks(_load, n_load, real_dir, world_size=n_load)  # real -> real
    sim_to_real = run_on_ranks(_load, n_load, sim_dir, world_size=n_load)
    real_to_sim = run_simulated(_load, n_load, real_dir, world_size=n_load)
    for r in range(n_load):
        assert_bitwise_equal(sim_to_real[r], reference[r], what=f"simulated save, real load, rank {r}")
        assert_bitwise_equal(real_to_sim[r], reference[r], what=f"real save, simulated load, rank {r}")
    assert reference[0]["params"]["w"][1].equal(_data(0, 6, 4))


def _hf(n, native, out):
    mesh = _mesh(n)
    _, params, _ = fs.nn.functionalize(hf_models.gpt2(seed=1))  # the template's values must not leak
    fsdp = fs.checkpoint.load_hf(native, like=fs.shard(params, fs.parallel.fsdp_specs(params, ("a", "b")), mesh, uneven=True))
    fs.checkpoint.save_hf(out, fsdp, max_shard_size=4096)
    tp = fs.shard(params, fs.parallel.tp_specs(params, fs.parallel.HF_GPT2_TP_PLAN, "a"), mesh)
    return _blocks(fsdp), _blocks(fs.checkpoint.load_hf(out, like=tp)), sorted(os.listdir(out))


@requires("transformers")
@pytest.mark.parametrize("n", [2, 4])
def test_hf_safetensors_in_and_out_equal_the_real_ranks(n, tmp_path):
    native = str(tmp_path / "native")
    hf_models.gpt2().save_pretrained(native)
    real = run_on_ranks(_hf, n, native, str(tmp_path / "real"), world_size=n)
    simulated = run_simulated(_hf, n, native, str(tmp_path / "sim"), world_size=n)
    for r in range(n):
        assert_bitwise_equal(simulated[r], real[r], what=f"load_hf/save_hf, rank {r}")


def test_a_simulated_save_that_fails_on_one_rank_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from fshard.checkpoint import _checksums

    path = str(tmp_path / "ck")
    original = _checksums.ChecksumWriter.write_data

    def write_data(self, plan, planner):
        if self.rank == 1:  # simulated rank 1's write fails midway
            raise OSError("disk went away")
        return original(self, plan, planner)

    with fs.simulate(2):
        fs.checkpoint.save(path, {"x": fs.shard(_data(0, 4, 2), P("a"), _mesh(2)), "step": 1})
        monkeypatch.setattr(_checksums.ChecksumWriter, "write_data", write_data)
        with pytest.raises(fs.checkpoint.CheckpointError, match="disk went away"):
            fs.checkpoint.save(path, {"x": fs.shard(_data(1, 4, 2), P("a"), _mesh(2)), "step": 2})
        monkeypatch.undo()
        assert fs.checkpoint.load(path)["step"] == 1
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".lock")) == ["ck"]  # no temporary left
