"""fs.inspect and fs.visualize_sharding under fs.simulate and on real gloo ranks: the table
has every rank's block, its shape, its varying axes, the spec and the global shape; on real
ranks rank 0 gets it (the others None), and its rows are the simulation's, line for line."""

from __future__ import annotations

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks


def _program(n):
    """Every kind of leaf fs.inspect shows, inside and outside a body; the texts by name."""
    mesh = fs.make_mesh({"dp": 2, "tp": 2})
    w = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    x = fs.shard(w, P("dp", "tp"), mesh)
    big = fs.shard(torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4), P("dp"), mesh)
    texts = {
        "outside": fs.inspect(x, name="x", show=False),
        "tree": fs.inspect({"x": x, "big": big, "note": "a string", "idx": mesh.axis_index("dp")}, show=False),
        "uneven": fs.inspect(fs.shard(torch.arange(5.0), P(("dp", "tp")), mesh, uneven=True), show=False),
        "grid": fs.visualize_sharding(x, use_color=False),
    }
    closed = torch.full((2,), 7.0, dtype=torch.float64)

    def body(a):
        s = fs.lax.psum(a, "tp")
        texts["body"] = fs.inspect({"a": a, "s": s, "closed": closed}, show=False)
        return s

    fs.shard_map(body, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp"))(x)

    def unchecked(a):
        texts["unchecked"] = fs.inspect(a * 2, show=False)
        return a

    fs.shard_map(unchecked, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check=False)(x)

    def loss(a):
        texts["grad"] = fs.inspect(a, show=False)  # under value_and_grad: the primal's blocks
        return fs.lax.psum((a**2).sum(), ("dp", "tp"))

    fs.value_and_grad(fs.shard_map(loss, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P()))(x)
    return texts


def _rows(text):
    """The table without its title (which says simulated or real ranks)."""
    return None if text is None else text.splitlines()[1:]


def _table(text):
    """The table's rows as dicts, cut at the header's column starts."""
    lines = text.splitlines()
    head = lines[1]
    starts = [i for i, c in enumerate(head) if c != " " and (i == 0 or head[i - 1] == " ")]
    names = head.split()
    cut = [*starts[1:], None]
    return [{n: line[a:b].strip() for n, a, b in zip(names, starts, cut)} for line in lines[3:]]


def _simulated():
    with fs.simulate(4):
        return _program(4)


def test_simulated_table_has_every_rank_block_shape_vma_spec_and_global_shape():
    t = _simulated()
    out = t["outside"]
    assert out.splitlines()[0] == "fs.inspect(x): outside a body, on Mesh(dp=2, tp=2; cpu); 4 simulated ranks"
    assert out.splitlines()[1].split() == ["rank", "coord", "shape", "dtype", "vma", "spec", "global", "block"]
    blocks = ["[[0, 1], [4, 5]]", "[[2, 3], [6, 7]]", "[[8, 9], [12, 13]]", "[[10, 11], [14, 15]]"]
    assert _table(out) == [
        {"rank": str(r), "coord": f"dp={r // 2},tp={r % 2}", "shape": "(2, 2)", "dtype": "float64",
         "vma": "{dp, tp}", "spec": "P('dp', 'tp')", "global": "(4, 4)", "block": block}
        for r, block in enumerate(blocks)
    ]

    tree = _table(t["tree"])
    big = [row for row in tree if row["leaf"] == "big"]
    assert [row["rank"] for row in big] == ["0", "1", "2", "3"]
    assert all(row["shape"] == "(32, 4)" and row["vma"] == "{dp}" and row["global"] == "(64, 4)" for row in big)
    assert big[0]["block"].startswith("min 0 max 127 mean 63.5, crc32 ")
    assert big[0]["block"].endswith("first [0, 1, 2, 3, ...]")
    assert big[0]["block"] == big[1]["block"] and big[2]["block"].startswith("min 128 max 255")
    assert [(row["rank"], row["block"]) for row in tree if row["leaf"] == "note"] == [("all", "'a string'")]
    assert len([row for row in tree if row["leaf"] == "x"]) == 4
    # A per-rank int (a mesh coordinate): each rank's value.
    assert [(row["rank"], row["block"]) for row in tree if row["leaf"] == "idx"] == [
        ("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")
    ]

    # An uneven layout, cut like torch.chunk axis after axis: 5 -> 3, 2 over dp -> 2, 1, 1, 1.
    assert [row["shape"] for row in _table(t["uneven"])] == ["(2,)", "(1,)", "(1,)", "(1,)"]

    body = t["body"]
    assert body.splitlines()[0] == (
        "fs.inspect: inside a shard_map body on Mesh(dp=2, tp=2; cpu), checked; 4 simulated ranks"
    )
    rows = _table(body)
    a = [row for row in rows if row["leaf"] == "a"]
    s = [row for row in rows if row["leaf"] == "s"]
    assert [row["block"] for row in a] == blocks
    assert all(row["vma"] == "{dp, tp}" and row["spec"] == "P('dp', 'tp')" and row["global"] == "(4, 4)" for row in a)
    # psum over tp: varies over dp only, and is no body input (no spec, no global shape).
    assert all(row["vma"] == "{dp}" and row["spec"] == "-" and row["global"] == "-" for row in s)
    assert [row["block"] for row in s] == ["[[2, 4], [10, 12]]"] * 2 + ["[[18, 20], [26, 28]]"] * 2
    # A tensor closed over by the body is invariant: one row for every rank.
    assert [(row["rank"], row["vma"], row["block"]) for row in rows if row["leaf"] == "closed"] == [
        ("all", "{}", "[7, 7]")
    ]

    assert [row["block"] for row in _table(t["grad"])] == blocks
    assert all(row["vma"] == "{dp, tp}" for row in _table(t["grad"]))

    unchecked = t["unchecked"]
    assert "unchecked (vma not tracked)" in unchecked.splitlines()[0]
    assert [row["vma"] for row in _table(unchecked)] == ["?"] * 4


def test_visualize_sharding_under_simulation():
    grid = _simulated()["grid"]
    assert grid.splitlines()[0] == "shape (4, 4), P('dp', 'tp') on Mesh(dp=2, tp=2; cpu)"
    for r, rng in enumerate(["[0:2, 0:2]", "[0:2, 2:4]", "[2:4, 0:2]", "[2:4, 2:4]"]):
        assert f"{rng} rank {r}" in grid


def test_visualize_sharding_shows_an_uneven_layout_as_torch_chunk_does():
    with fs.simulate(4):
        mesh = fs.make_mesh({"fsdp": 4})
        grid = fs.visualize_sharding(fs.shard(torch.zeros(10, 3), P("fsdp"), mesh, uneven=True), use_color=False)
    for r, rng in enumerate(["[0:3, 0:3]", "[3:6, 0:3]", "[6:9, 0:3]", "[9:10, 0:3]"]):
        assert f"{rng} rank {r}" in grid


def test_real_ranks_gather_the_table_to_rank_0_with_the_simulation_rows():
    real = run_on_ranks(_program, 4, world_size=4)
    sim = _simulated()
    assert real[0]["outside"].splitlines()[0] == "fs.inspect(x): outside a body, on Mesh(dp=2, tp=2; cpu); 4 ranks"
    for name in ("outside", "tree", "uneven", "body", "unchecked", "grad"):
        assert all(r[name] is None for r in real[1:]), name  # rank 0 only
        assert _rows(real[0][name]) == _rows(sim[name]), name
    assert real[0]["grid"] == sim["grid"]


def test_printed_once_and_shown_as_text():
    with fs.simulate(2):
        mesh = fs.make_mesh({"d": 2})
        text = fs.inspect(fs.shard(torch.arange(4.0), P("d"), mesh))
    assert isinstance(text, str) and repr(text) == str(text) and text.shown
    assert not hasattr(text, "_repr_html_")


def test_outside_a_process_group_shows_this_process():
    text = fs.inspect({"w": torch.ones(2), "k": 3}, show=False)
    assert text.splitlines()[0] == "fs.inspect: outside a body; 1 rank"
    assert [(row["leaf"], row["rank"], row["block"]) for row in _table(text)] == [("k", "0", "3"), ("w", "0", "[1, 1]")]


def test_bad_max_values_names_the_parameter():
    with pytest.raises(ValueError, match=r"max_values=-1.*int >= 0"):
        fs.inspect(torch.ones(2), max_values=-1)


def test_an_empty_tree_says_so():
    assert fs.inspect({}, show=False).splitlines()[1:] == ["(no leaves)"]


def test_refused_inside_fs_jit_naming_the_fix():
    def step(x):
        fs.inspect(x)
        return x * 2

    with pytest.raises(fs.JitCaptureError, match="fs.inspect inside fs.jit.*outside the compiled step"):
        fs.jit(step)(torch.ones(3))
