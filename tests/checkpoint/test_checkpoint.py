"""fs.checkpoint: save on 2 ranks and load on 1, 4 and 2x2 (exact values), Python values, RNG
and data position, async save, crash safety (an exception mid-write and a SIGKILL mid-write),
the error of each bad checkpoint or template, and plain state-dict interop."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fshard as fs
import fshard.checkpoint as ckpt
from fshard import P
from fshard import tree as tree_util
from fshard.testing import FORKSERVER_PRELOAD, run_on_ranks

DT = torch.float64


class _Moments(NamedTuple):
    count: torch.Tensor
    mu: dict


def _full_tree(seed: int = 0) -> dict:
    """Global values, identical on every rank; every dim divides by 4."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, dtype=DT, generator=g)
    return {
        "params": {"w": r(8, 12), "v": r(4, 16), "b": r(8), "layers": [{"wq": r(4, 8)}, {"wq": r(8, 4)}]},
        "moments": _Moments(count=torch.tensor(7), mu={"w": r(8, 12)}),
        "scale": r(3),  # a plain tensor: a global value
    }


def _specs(axes: tuple[str, ...]) -> dict:
    if len(axes) == 1:
        (a,) = axes
        return {"params": {"w": P(a), "v": P(None, a), "b": P(), "layers": [{"wq": P(a)}, {"wq": P()}]},
                "moments": _Moments(count=P(), mu={"w": P(None, a)}), "scale": P()}
    a, b = axes
    return {"params": {"w": P(b, a), "v": P(None, (b, a)), "b": P((a, b)),  # (b, a): _StridedShard
                       "layers": [{"wq": P(a, b)}, {"wq": P(None, b)}]},
            "moments": _Moments(count=P(), mu={"w": P((a, b))}), "scale": P()}


_EXTRAS = {"step": 3, "lr": 2.5e-4, "name": "run-a", "done": False,
           "data": {"epoch": 1, "index": 96, "order": [3, 1, 2]}}


def _save_body(path: str) -> list[str]:
    mesh = fs.make_mesh({"x": 2})
    torch.manual_seed(123)
    tree = fs.shard(_full_tree(), _specs(("x",)), mesh)
    tree = {**tree, **_EXTRAS, "rng": torch.get_rng_state()}
    ckpt.save(path, tree)
    return sorted(os.listdir(path))


def _load_body(path: str, shape: dict, plain: bool = False) -> dict:
    axes = tuple(shape)
    mesh = fs.make_mesh(shape)
    template = tree_util.tree_map(torch.zeros_like, _full_tree(seed=99))
    if not plain:
        template = fs.shard(template, _specs(axes), mesh)
    template = {**template, "step": 0, "lr": 0.0, "name": "", "done": True,
                "data": {"epoch": 0, "index": 0, "order": [0, 0, 0]},
                "rng": torch.zeros_like(torch.get_rng_state())}
    out = ckpt.load(path, like=template)
    expect = _full_tree()
    torch.set_rng_state(out["rng"])
    draw = torch.randn(4)
    torch.manual_seed(123)
    return {
        "equal": {k: torch.equal(a, b) for k, a, b in zip(*_zip_paths(fs.gather(out), expect))},
        "specs_kept": fs.spec_of(out) == fs.spec_of(template),
        "dtensor": [type(x).__name__ for x in tree_util.leaves(out["params"])],
        "extras": {k: out[k] for k in _EXTRAS},
        "rng_same": torch.equal(draw, torch.randn(4)),
        "count": out["moments"].count.item(),
    }


def _zip_paths(a, b):
    pa, la, _ = tree_util.zip_with_path({k: a[k] for k in ("params", "moments", "scale")})
    pb, lb, _ = tree_util.zip_with_path(b)
    assert pa == pb
    return pa, la, lb


@pytest.fixture(scope="module")
def saved_on_2(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("ck") / "step_3")
    listing = run_on_ranks(_save_body, path, world_size=2)
    assert listing[0] == [".fshard-checksums.json", ".fshard-manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    return path


@pytest.mark.parametrize("shape, plain", [({"x": 1}, True), ({"x": 1}, False), ({"x": 4}, False),
                                          ({"a": 2, "b": 2}, False)],
                         ids=["1-plain", "1", "4", "2x2"])
def test_save_on_2_load_on_other_meshes_exactly(saved_on_2, shape, plain):
    n = 1
    for s in shape.values():
        n *= s
    for rank_out in run_on_ranks(_load_body, saved_on_2, shape, plain, world_size=n):
        assert rank_out["equal"] and all(rank_out["equal"].values()), rank_out["equal"]
        assert rank_out["specs_kept"]
        assert set(rank_out["dtensor"]) == ({"Tensor"} if plain else {"DTensor"})
        assert rank_out["extras"] == _EXTRAS
        assert rank_out["rng_same"] and rank_out["count"] == 7


def test_load_without_template_gives_flat_full_values(saved_on_2):
    flat = ckpt.load(saved_on_2)
    torch.testing.assert_close(flat["params.layers.1.wq"], _full_tree()["params"]["layers"][1]["wq"],
                               rtol=0, atol=0)
    assert flat["data.order.2"] == 2 and flat["moments.count"].item() == 7 and flat["name"] == "run-a"
    md = ckpt.read_metadata(saved_on_2)
    assert tuple(md.state_dict_metadata["params.v"].size) == (4, 16)


# --- async save --------------------------------------------------------------------


def _async_body(path: str) -> dict:
    mesh = fs.make_mesh({"x": 2})
    full = _full_tree()["params"]
    params = fs.shard(full, P("x"), mesh)
    t0 = time.perf_counter()
    handle = ckpt.save(path, {"params": params, "step": 5}, blocking=False)
    returned_s = time.perf_counter() - t0
    for x in tree_util.leaves(params):  # the training goes on and overwrites its tensors
        x.to_local().mul_(0.0)
    handle.wait()
    ckpt.wait()
    back = ckpt.load(path, like={"params": params, "step": 0})
    same = all(torch.equal(a, b) for a, b in zip(tree_util.leaves(fs.gather(back["params"])),
                                                 tree_util.leaves(full)))
    # A failing background save reports through wait(), on every rank.
    real = dcp.FileSystemWriter.write_data

    def broken(self, plan, planner):
        raise OSError("disk full (injected)")

    dcp.FileSystemWriter.write_data = broken
    try:
        bad = ckpt.save(path, {"params": params, "step": 6}, blocking=False)
        try:
            bad.wait()
            failure = None
        except ckpt.CheckpointError as e:
            failure = str(e)
    finally:
        dcp.FileSystemWriter.write_data = real
    still = ckpt.load(path, like={"params": params, "step": 0})
    return {"same": same, "step": back["step"], "done": handle.done(), "returned_s": returned_s,
            "failure": failure, "still_step": still["step"]}


def test_async_save_stages_copies_and_reports_failures(tmp_path):
    for out in run_on_ranks(_async_body, str(tmp_path / "ck"), world_size=2):
        assert out["same"] and out["step"] == 5 and out["done"]
        assert "disk full (injected)" in out["failure"] and str(tmp_path / "ck") in out["failure"]
        assert out["still_step"] == 5  # the failed save left the committed checkpoint alone


# --- crash safety ------------------------------------------------------------------


def _fail_mid_write_body(path: str) -> dict:
    """Rank 1 raises after writing part of its file; the previous checkpoint must survive."""
    mesh = fs.make_mesh({"x": 2})
    v1 = fs.shard(_full_tree(seed=1)["params"], P("x"), mesh)
    ckpt.save(path, {"params": v1, "step": 1})
    v2 = fs.shard(_full_tree(seed=2)["params"], P("x"), mesh)
    import torch.distributed.checkpoint.filesystem as dfs

    real = dfs._write_item
    calls = []

    def dying(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 2:
            raise RuntimeError("rank 1 died mid-write (injected)")
        return result

    dfs._write_item = dying
    try:
        try:
            ckpt.save(path, {"params": v2, "step": 2})
            error = None
        except ckpt.CheckpointError as e:
            error = str(e)
    finally:
        dfs._write_item = real
    back = ckpt.load(path, like={"params": v1, "step": 0})
    full1 = _full_tree(seed=1)["params"]
    intact = all(torch.equal(a, b) for a, b in zip(tree_util.leaves(fs.gather(back["params"])),
                                                   tree_util.leaves(full1)))
    dist.barrier()
    return {"error": error, "intact": intact, "step": back["step"], "calls": len(calls),
            "siblings": sorted(os.listdir(os.path.dirname(path)))}


def test_exception_mid_write_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ck")
    for out in run_on_ranks(_fail_mid_write_body, path, world_size=2):
        assert out["error"] and "rank 1 died mid-write (injected)" in out["error"], out["error"]
        assert path in out["error"] and "unchanged" in out["error"]
        assert out["intact"] and out["step"] == 1
        assert out["siblings"] == ["ck"]  # the temporary directory was removed


def _killed_child(path: str, marker: str) -> None:
    """Saves v1, then starts saving v2 and stalls mid-write until the parent kills it."""
    import torch.distributed.checkpoint.filesystem as dfs

    ckpt.save(path, {"w": torch.full((64, 64), 1.0), "step": 1})
    real = dfs._write_item

    def stall(*args, **kwargs):
        result = real(*args, **kwargs)
        with open(marker, "w") as f:
            f.write("mid-write")
        time.sleep(120)
        return result

    dfs._write_item = stall
    ckpt.save(path, {"w": torch.full((64, 64), 2.0), "step": 2, "more": torch.zeros(1000)})


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    path, marker = str(tmp_path / "ck"), str(tmp_path / "marker")
    # A fresh process, forked from the rank pools' forkserver (torch and fshard imported
    # there once): spawn would spend seconds importing them again.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # the same forkserver as the pools'
    child = ctx.Process(target=_killed_child, args=(path, marker))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert child.is_alive() and time.monotonic() < deadline, "child did not reach the write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    finally:
        if child.is_alive():
            child.kill()
    assert child.exitcode == -signal.SIGKILL
    leftovers = [e for e in os.listdir(tmp_path) if e.startswith(".ck.tmp-")]
    assert len(leftovers) == 1  # the killed save got as far as its temporary directory
    partial = str(tmp_path / leftovers[0])
    assert not os.path.exists(os.path.join(partial, ".metadata"))
    flat = ckpt.load(path)  # the previous checkpoint is intact
    assert flat["step"] == 1 and torch.equal(flat["w"], torch.full((64, 64), 1.0))
    with pytest.raises(ckpt.CheckpointError, match=r"not a complete checkpoint.*'w'"):
        ckpt.load(partial, like={"w": torch.zeros(64, 64)})
    ckpt.save(path, {"w": torch.full((64, 64), 3.0), "step": 3})  # clears the leftover
    assert sorted(os.listdir(tmp_path)) == ["ck", "marker"]
    assert ckpt.load(path, like={"step": 0})["step"] == 3


def test_save_replaces_checkpoint_and_refuses_foreign_directories(tmp_path):
    path = str(tmp_path / "ck")
    ckpt.save(path, {"a": torch.ones(3), "step": 1})
    ckpt.save(path, {"a": torch.zeros(3), "step": 2})
    assert ckpt.load(path, like={"a": torch.ones(3), "step": 0})["step"] == 2
    assert os.listdir(tmp_path) == ["ck"]
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "train.txt").write_text("keep me")
    with pytest.raises(ckpt.CheckpointError, match=r"data'.*not part of a checkpoint"):
        ckpt.save(str(foreign), {"a": torch.ones(3)})
    assert (foreign / "train.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match=r"same key \['a.b'\]"):
        ckpt.save(str(tmp_path / "dup"), {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})


# --- errors on load ----------------------------------------------------------------


@pytest.fixture()
def small(tmp_path) -> tuple[str, dict]:
    path = str(tmp_path / "small")
    tree = {"params": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}, "step": 4}
    ckpt.save(path, tree)
    return path, tree


def test_load_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(ckpt.CheckpointNotFoundError, match=r"no checkpoint at '.*nowhere'.*'params.w'"):
        ckpt.load(str(tmp_path / "nowhere"), like={"params": {"w": torch.zeros(2)}})
    with pytest.raises(FileNotFoundError):
        ckpt.load(str(tmp_path / "nowhere"))


def test_load_partial_checkpoint_names_path_and_keys(small):
    path, tree = small
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(ckpt.CheckpointError, match=r"'.*small' is not a complete checkpoint.*'params.b'"):
        ckpt.load(path, like=tree)


def test_load_truncated_or_missing_data_names_keys(small):
    path, tree = small
    data = os.path.join(path, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(ckpt.CheckpointError, match=r"small' is incomplete or corrupt.*truncated"):
        ckpt.load(path, like=tree)
    os.remove(data)
    with pytest.raises(ckpt.CheckpointError, match=r"data of 3 keys is missing.*'params.w'.*missing"):
        ckpt.load(path, like=tree)


def test_load_corrupt_metadata_or_data(small, tmp_path):
    path, tree = small
    data = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:  # same size, garbage bytes: only reading can tell
        f.write(b"\xff" * size)
    with pytest.raises(ckpt.CheckpointError, match=r"reading the checkpoint '.*small' failed"):
        ckpt.load(path, like=tree)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(b"not a pickle")
    with pytest.raises(ckpt.CheckpointError, match=r"small' is corrupt: its .metadata cannot be read"):
        ckpt.load(path, like=tree)


def _flip_a_bit(path: str, key: str, value: torch.Tensor) -> str:
    """Flips one bit inside the stored bytes of the tensor ``value`` of ``key``; returns the file."""
    md = ckpt.read_metadata(path)
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        item = f.read(info.length)
        at = item.find(value.numpy().tobytes())  # the raw values inside torch.save's archive
        assert at >= 0
        f.seek(info.offset + at + value.numel() * value.element_size() // 2)
        f.write(bytes([item[at + value.numel() * value.element_size() // 2] ^ 0x01]))
    return info.relative_path


def _file_bytes(path: str) -> dict:
    return {e: open(os.path.join(path, e), "rb").read() for e in sorted(os.listdir(path))}


def test_load_flipped_bit_in_tensor_names_file_and_key_and_changes_nothing(small):
    path, tree = small
    data_file = _flip_a_bit(path, "params.w", tree["params"]["w"])  # DCP alone loads a wrong value
    before = _file_bytes(path)
    pattern = (rf"data file '{data_file}' of '.*small' is corrupt: the bytes of key 'params.w' "
               rf"\(offset \d+, \d+ bytes\) have CRC32 0x[0-9a-f]{{8}}, the save wrote 0x[0-9a-f]{{8}}")
    with pytest.raises(ckpt.CheckpointError, match=pattern):
        ckpt.load(path, like=tree)
    with pytest.raises(ckpt.CheckpointError, match=pattern):
        ckpt.load(path)
    part = ckpt.load(path, like={"params": {"b": torch.zeros(4)}})  # intact items still load
    assert torch.equal(part["params"]["b"], tree["params"]["b"])
    assert _file_bytes(path) == before
    checksums = os.path.join(path, ".fshard-checksums.json")
    with open(checksums, "w") as f:
        f.write("{not json")
    with pytest.raises(ckpt.CheckpointError, match=r"small' is corrupt: its .fshard-checksums.json cannot be read"):
        ckpt.load(path, like=tree)
    os.remove(checksums)  # the manifest says there were checksums: refused, naming the file (issue 36 row 11)
    with pytest.raises(ckpt.CheckpointError, match=r"small' is incomplete: its .fshard-checksums.json is missing"):
        ckpt.load(path, like=tree)
    # A checkpoint that never had checksums (plain DCP, or fshard before them) loads unchecked.
    os.remove(os.path.join(path, ".fshard-manifest.json"))
    md = dcp.FileSystemReader(path).read_metadata()
    del md.fshard_manifest  # what an older fshard wrote: no record of checksums
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    assert not torch.equal(ckpt.load(path, like=tree)["params"]["w"], tree["params"]["w"])


def _corrupt_rank_1_file_body(path: str) -> str:
    mesh = fs.make_mesh({"x": 2})
    ckpt.save(path, {"w": fs.shard(torch.arange(64.0).reshape(8, 8), P("x"), mesh)})
    if dist.get_rank() == 0:
        md = ckpt.read_metadata(path)
        assert {info.relative_path for info in md.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp"}
        info = next(v for v in md.storage_data.values() if v.relative_path == "__1_0.distcp")
        with open(os.path.join(path, info.relative_path), "r+b") as f:
            f.seek(info.offset + info.length - 8)  # inside the last element's bytes
            f.write(b"\x7f" * 4)
    dist.barrier()
    try:
        ckpt.load(path, like={"w": fs.shard(torch.zeros(8, 8), P("x"), mesh)})
    except ckpt.CheckpointError as e:
        return str(e)
    return "loaded"


def test_corrupt_file_of_one_rank_stops_every_rank_naming_it(tmp_path):
    for out in run_on_ranks(_corrupt_rank_1_file_body, str(tmp_path / "ck"), world_size=2, timeout_s=60):
        assert "data file '__1_0.distcp'" in out and "is corrupt: the bytes of key 'w'" in out, out


def test_load_missing_keys_names_them(small):
    path, tree = small
    like = {**tree, "opt": {"mu": torch.zeros(3)}, "rng": torch.zeros(2)}
    with pytest.raises(ckpt.CheckpointError, match=r"small' lacks 2 of the 5 keys.*\['opt.mu', 'rng'\]"):
        ckpt.load(path, like=like)
    part = ckpt.load(path, like={"params": {"w": torch.zeros(3, 4)}})  # a subset is fine
    assert torch.equal(part["params"]["w"], tree["params"]["w"])


def test_load_template_mismatch_names_path_and_both_shapes(small):
    path, tree = small
    like = {"params": {"w": torch.zeros(4, 3), "b": torch.zeros(4, dtype=DT)}, "step": torch.zeros(1)}
    with pytest.raises(ValueError) as info:
        ckpt.load(path, like=like)
    msg = str(info.value)
    assert "small'" in msg
    assert "'params.w': checkpoint shape (3, 4), template shape (4, 3)" in msg
    assert "'params.b': checkpoint dtype torch.float32, template dtype torch.float64" in msg
    assert "'step': the checkpoint holds a Python value, the template a tensor" in msg


def _one_rank_mismatch_body(path: str) -> str:
    mesh = fs.make_mesh({"x": 2})
    ckpt.save(path, {"w": fs.shard(torch.ones(4, 4), P("x"), mesh)})
    rows = 4 if dist.get_rank() == 0 else 8  # a bug on one rank only
    try:
        ckpt.load(path, like={"w": fs.shard(torch.zeros(rows, 4), P("x"), mesh)})
    except ValueError as e:
        return str(e) + "\n".join(getattr(e, "__notes__", []))
    return "loaded"


def test_error_on_one_rank_stops_every_rank(tmp_path):
    out = run_on_ranks(_one_rank_mismatch_body, str(tmp_path / "ck"), world_size=2, timeout_s=60)
    assert "template shape (8, 4)" in out[1]
    assert "template shape (8, 4)" in out[0] and "raised on rank 1" in out[0]


# --- interop -----------------------------------------------------------------------

_CFG = fs.models.TransformerConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, max_seq_len=8)


def _interop_body(path: str, pt_file: str) -> dict:
    mesh = fs.make_mesh({"x": 2})
    full = fs.models.transformer_init(_CFG, 0, dtype=DT)
    params = fs.shard(full, P("x"), mesh)
    exported = ckpt.export_state_dict(params)
    ckpt.save(path, {"params": params, "step": 1})
    module = fs.models.TransformerModule(_CFG, seed=5, dtype=DT)
    imported = ckpt.import_state_dict(module.state_dict(), like=params)
    same = all(torch.equal(a, b) for a, b in zip(tree_util.leaves(fs.gather(imported)),
                                                 tree_util.leaves(fs.models.transformer_init(_CFG, 5, dtype=DT))))
    if dist.get_rank() == 0:
        ckpt.to_torch_save(path, pt_file)
    errors = []
    for sd in ({k: v for k, v in module.state_dict().items() if k != "norm.bias"},
               {**module.state_dict(), "extra.weight": torch.zeros(1)},
               {**module.state_dict(), "norm.bias": torch.zeros(9, dtype=DT)}):
        try:
            ckpt.import_state_dict(sd, like=params)
        except ValueError as e:
            errors.append(str(e))
    return {"exported_names": list(exported), "module_names": list(module.state_dict()),
            "exported_equal": all(torch.equal(exported[k], v) for k, v in _module_state(full).items()),
            "imported_specs": fs.spec_of(imported) == fs.spec_of(params), "imported_equal": same,
            "errors": errors}


def _module_state(full: dict) -> dict:
    return fs.nn.to_state_dict(full)


def test_state_dict_interop(tmp_path):
    path, pt_file = str(tmp_path / "ck"), str(tmp_path / "model.pt")
    out = run_on_ranks(_interop_body, path, pt_file, world_size=2)[0]
    assert sorted(out["exported_names"]) == sorted(out["module_names"])
    assert out["exported_equal"] and out["imported_specs"] and out["imported_equal"]
    assert "missing 1 names of the template: ['norm.bias']" in out["errors"][0]
    assert "names the template lacks: ['extra.weight']" in out["errors"][1]
    assert "'norm.bias': state_dict shape (9,), template shape (8,)" in out["errors"][2]
    # The torch.save file loads into the nn.Module twin, strictly, and runs the same model.
    module = fs.models.TransformerModule(_CFG, seed=7, dtype=DT)
    module.load_state_dict(torch.load(pt_file), strict=True)
    tokens = torch.randint(0, 16, (2, 8))
    full = fs.models.transformer_init(_CFG, 0, dtype=DT)
    torch.testing.assert_close(module(tokens), fs.models.transformer_apply(full, tokens, _CFG), rtol=0, atol=0)
    # DCP's own converter reads the same checkpoint, with the full keys.
    dcp_to_torch_save(path, str(tmp_path / "dcp.pt"))
    raw = torch.load(str(tmp_path / "dcp.pt"), weights_only=False)
    assert raw["step"] == 1 and torch.equal(raw["params.norm.weight"], full["norm"]["weight"])
    with pytest.raises(ckpt.CheckpointError, match=r"no entries under 'model'; its top-level names are \['params', 'step'\]"):
        ckpt.to_torch_save(path, str(tmp_path / "x.pt"), prefix="model")


# --- pipeline stages: each stage holds its own layers, under their global indices ----


def _stage_tree(stage: int | None, mesh) -> dict:
    """Layers 0..3; a stage holds layers [2*stage, 2*stage+1] (None elsewhere); None: all."""
    full = [{"w": torch.arange(32.0).reshape(8, 4) + 100 * i} for i in range(4)]
    held = range(4) if stage is None else range(2 * stage, 2 * stage + 2)
    layers = [fs.shard(full[i], P("fsdp"), mesh) if i in held else None for i in range(4)]
    return {"layers": layers, "step": 9}


def _pp_save_body(path: str) -> list[str]:
    mesh = fs.make_mesh({"pp": 2, "fsdp": 2})
    stage_mesh = fs.Mesh(mesh.device_mesh["fsdp"], ("fsdp",))  # this stage's ranks
    ckpt.save(path, _stage_tree(mesh.axis_index("pp"), stage_mesh))
    return sorted(ckpt.read_metadata(path).state_dict_metadata)


def _pp_load_body(path: str, shape: dict) -> list[bool]:
    mesh = fs.make_mesh(shape)
    if "pp" in shape:
        stage = mesh.axis_index("pp")
        mesh = fs.Mesh(mesh.device_mesh["fsdp"], ("fsdp",))
    else:
        stage = None
    expect = _stage_tree(stage, mesh)
    like = tree_util.tree_map(lambda x: x * 0 if isinstance(x, torch.Tensor) else 0, expect)
    out = ckpt.load(path, like=like)
    return [out["step"] == 9] + [torch.equal(a, b) for a, b in
                                 zip(tree_util.leaves(fs.gather(out["layers"])), tree_util.leaves(fs.gather(expect["layers"])))]


def test_pipeline_stages_keep_global_layer_indices(tmp_path):
    path = str(tmp_path / "pp")
    keys = run_on_ranks(_pp_save_body, path, world_size=4)[0]
    assert keys == ["layers.0.w", "layers.1.w", "layers.2.w", "layers.3.w", "step"]
    for shape, n in [({"pp": 2, "fsdp": 2}, 4), ({"fsdp": 2}, 2)]:
        for checks in run_on_ranks(_pp_load_body, path, shape, world_size=n):
            assert len(checks) == (3 if "pp" in shape else 5) and all(checks), (shape, checks)


# --- seed scenario 33: 8 pipeline ranks, one chunk each, params and Adam state ---------


def _chunk_after_step(r: int) -> dict:
    """Layer r (an MLPModule(10): net1, net2) and its Adam(0.1) state after one step."""
    g = torch.Generator().manual_seed(1000 + r)
    layer = {name: {"weight": torch.randn(10, 10, generator=g, dtype=DT) * 0.3,
                    "bias": torch.randn(10, generator=g, dtype=DT) * 0.1} for name in ("net1", "net2")}
    params = {"layers": {str(r): layer}}  # the chunk keeps its global layer index
    x = torch.randn(4, 10, generator=g, dtype=DT)

    def loss(p):
        lp = p["layers"][str(r)]
        return (torch.relu(x @ lp["net1"]["weight"].T + lp["net1"]["bias"]) @ lp["net2"]["weight"].T
                + lp["net2"]["bias"]).pow(2).sum()

    opt = fs.optim.adam(0.1)
    state = opt.init(params)
    updates, state = opt.update(fs.grad(loss)(params), state, params)
    return {"model": fs.optim.apply_updates(params, updates), "optim": state}


def _pp_chunks_body(path: str) -> dict:
    r, n = dist.get_rank(), dist.get_world_size()
    mine, neighbour = _chunk_after_step(r), _chunk_after_step((r + 1) % n)
    ckpt.save(path, mine)
    keys = sorted(ckpt.read_metadata(path).state_dict_metadata)
    # Each rank reads back its own chunk and its neighbour's: a key written by the wrong
    # rank (or once for all, as if replicated) would give another layer's values.
    out = {}
    for name, want in (("own", mine), ("neighbour", neighbour)):
        got = ckpt.load(path, like=tree_util.tree_map(torch.zeros_like, want))
        a_paths, a_leaves, _ = tree_util.zip_with_path(got)
        b_paths, b_leaves, _ = tree_util.zip_with_path(want)
        out[name] = a_paths == b_paths and all(torch.equal(a, b) for a, b in zip(a_leaves, b_leaves))
    moved = not torch.equal(mine["optim"][1].mu["layers"][str(r)]["net1"]["weight"],
                            torch.zeros(10, 10, dtype=DT))
    return {"keys": keys, "local": sorted(tree_util.zip_with_path(mine)[0]), "moved": moved, **out}


def test_scenario33_eight_pipeline_chunks_keep_global_keys_with_adam_state(tmp_path):
    results = run_on_ranks(_pp_chunks_body, str(tmp_path / "pp8"), world_size=8)
    everything = sorted({k for res in results for k in res["local"]})
    for r, res in enumerate(results):
        assert res["own"] and res["neighbour"] and res["moved"], (r, res)
        # Every rank's model and optimizer keys are in the metadata under their global layer
        # index (mu and nu per leaf, the step count once), and nothing else is.
        assert f"model.layers.{r}.net2.bias" in res["local"] and f"optim.1.nu.layers.{r}.net1.weight" in res["local"]
        assert res["keys"] == everything
    assert len(everything) == 8 * 4 * 3 + 1  # 8 layers x 4 leaves x (param, mu, nu) + count


def test_portable_commit_and_recovery_without_atomic_exchange(tmp_path, monkeypatch):
    from fshard.checkpoint import _dirs

    monkeypatch.setattr(_dirs, "_exchange", lambda a, b: False)  # as on NFS
    path = str(tmp_path / "ck")
    ckpt.save(path, {"v": torch.ones(2), "step": 1})
    ckpt.save(path, {"v": torch.full((2,), 2.0), "step": 2})
    assert os.listdir(tmp_path) == ["ck"]
    # A crash between the two renames: the name is gone, the previous checkpoint is the backup.
    os.rename(path, str(tmp_path / ".ck.old-0123"))
    with pytest.warns(UserWarning, match=r"reading the previous checkpoint from '.*\.ck\.old-0123'"):
        assert ckpt.load(path, like={"step": 0})["step"] == 2
    ckpt.save(path, {"v": torch.zeros(2), "step": 3})
    assert os.listdir(tmp_path) == ["ck"] and ckpt.load(path, like={"step": 0})["step"] == 3


def _background_save_in_child(path):
    fs.checkpoint.save(path, {"x": torch.arange(4.0)}, blocking=False).wait(timeout=60)
    return fs.checkpoint.load(path)["x"].tolist()


def test_a_background_save_in_a_forked_child_of_a_process_that_saved_in_the_background(tmp_path):
    # The parent's save executor has a worker thread; a forked child has none of the parent's
    # threads, and used to queue its own background save on that executor forever.
    fs.checkpoint.save(tmp_path / "parent", {"x": torch.ones(2)}, blocking=False).wait(timeout=60)
    (got,) = fs.run_local(_background_save_in_child, str(tmp_path / "child"), world_size=1, timeout_s=120)
    assert got == [0.0, 1.0, 2.0, 3.0]
