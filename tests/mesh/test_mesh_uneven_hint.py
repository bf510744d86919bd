"""A dim its axes do not divide: fs.shard's error names ``uneven=True`` (issue 35, item 12), and
``uneven=True`` cuts it like ``torch.chunk``; the section the hint cites exists in docs/concepts.md."""

from pathlib import Path

import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

CONCEPTS = Path(__file__).resolve().parents[2] / "docs" / "concepts.md"


def _shard(shape, spec, uneven):
    mesh = fs.make_mesh({"fsdp": 2})
    try:
        x = fs.shard(
            {"w": torch.arange(float(torch.Size(shape).numel())).reshape(shape)}, {"w": spec}, mesh, uneven=uneven
        )["w"]
    except ValueError as e:
        return str(e)
    return tuple(x.to_local().shape), fs.gather(x).equal(torch.arange(float(x.numel())).reshape(shape))


def test_a_dim_the_axis_does_not_divide_names_uneven_true():
    msg = run_on_ranks(_shard, (5, 4), P("fsdp"), False, world_size=2)[0]
    assert "w: spec P('fsdp'), shape (5, 4): dim 0 of size 5" in msg and "not divisible by 2" in msg, msg
    assert "pass uneven=True" in msg and "pad the dim" in msg and '"Uneven shards"' in msg, msg


def test_uneven_true_cuts_like_torch_chunk_and_its_errors_do_not_suggest_it_again():
    assert run_on_ranks(_shard, (5, 4), P("fsdp"), True, world_size=2) == [((3, 4), True), ((2, 4), True)]
    msg = run_on_ranks(_shard, (5, 4), P("zz"), True, world_size=2)[0]
    assert "'zz' in dim 0 is not a mesh axis" in msg and "uneven=True" not in msg, msg


def test_the_section_the_hint_names_exists():
    text = CONCEPTS.read_text()
    assert "\n## Uneven shards: `uneven=True`\n" in text
    section = text.split("## Uneven shards")[1].split("\n## ")[0]
    for name in ("fs.shard", "fs.init_sharded", "fsdp_specs", "torch.chunk"):
        assert name in section, name
