"""shard / gather / reshard / spec_of on real gloo ranks, against distribute_tensor; spec errors."""

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

import fshard as fs
from fshard import P
from fshard.mesh.sharding import _full_via_host
from fshard.testing import run_on_ranks

SPECS_1D = [P(), P("x"), P(None, "x")]
SPECS_2D = [P(), P("a"), P(None, "b"), P("a", "b"), P("b", "a"), P(("a", "b")), P(("b", "a")),
            P(None, ("a", "b")), P(None, ("b", "a"))]


def _round_trip(shape, specs):
    mesh = fs.make_mesh(shape)
    torch.manual_seed(0)
    x = torch.randn(8, 12, dtype=torch.float64)  # identical on every rank
    report = []
    for spec in specs:
        s = fs.shard(x, spec, mesh)
        ref = distribute_tensor(x, mesh.device_mesh, s.placements)
        report.append((
            repr(spec),
            isinstance(s, DTensor) and s.shape == x.shape,
            torch.equal(fs.gather(s), x),
            # the host path (ranks sharing a GPU through gloo), here on the CPU groups themselves
            torch.equal(_full_via_host(s), x),
            torch.equal(s.to_local(), ref.to_local()),
            fs.spec_of(s) == spec,
            tuple(s.to_local().shape) == fs.NamedSharding(mesh, spec).shard_shape(x.shape),
        ))
        for other in specs[:3]:  # reshard between layouts keeps values
            assert torch.equal(fs.gather(fs.reshard(s, other, mesh)), x)
    return report


@pytest.mark.parametrize("shape, specs", [({"x": 1}, SPECS_1D), ({"x": 2}, SPECS_1D),
                                          ({"x": 4}, SPECS_1D), ({"a": 2, "b": 2}, SPECS_2D)])
def test_shard_gather_round_trip_matches_distribute_tensor(shape, specs):
    for rank_report in run_on_ranks(_round_trip, shape, specs, world_size=math.prod(shape.values())):
        for spec, *checks in rank_report:
            assert all(checks), (spec, checks)


def _pytree_and_context():
    mesh = fs.make_mesh({"a": 2, "b": 2})
    params = {"layers": [{"w": torch.arange(16.0).reshape(4, 4), "b": torch.arange(4.0)}], "step": 3}
    with mesh:
        sharded = fs.shard(params, {"layers": [{"w": P("a", "b"), "b": P("b")}], "step": P()})
    specs = fs.spec_of(sharded)
    full = fs.gather(sharded)
    return (specs["layers"][0]["w"], specs["layers"][0]["b"], full["step"],
            torch.equal(full["layers"][0]["w"], params["layers"][0]["w"]),
            sharded["layers"][0]["w"].to_local().tolist())


def test_pytree_shard_with_current_mesh():
    out = run_on_ranks(_pytree_and_context, world_size=4)
    for rank, (w_spec, b_spec, step, same, local) in enumerate(out):
        assert (w_spec, b_spec, step, same) == (P("a", "b"), P("b"), 3, True)
        i, j = divmod(rank, 2)
        assert local == torch.arange(16.0).reshape(4, 4)[2 * i:2 * i + 2, 2 * j:2 * j + 2].tolist()


def _visualize():
    import contextlib
    import io

    mesh = fs.make_mesh({"a": 2, "b": 2})
    with contextlib.redirect_stdout(io.StringIO()) as out:
        text = fs.visualize_sharding(fs.shard(torch.zeros(4, 6), P("a"), mesh), use_color=False)
    return text, out.getvalue()


def test_visualize_sharding_names_blocks_and_ranks_and_prints_once():
    (text, printed), *others = run_on_ranks(_visualize, world_size=4)
    assert "[0:2, 0:6] ranks 0,1" in text and "[2:4, 0:6] ranks 2,3" in text
    assert "ranks 0,1" in printed  # rank 0 prints (the README's quick start: one table, not four)
    assert all(t == text and p == "" for t, p in others)


# --- bad input: every error names path, spec, shape, axis and sizes ------------------

def _spec_error(spec, shape):
    mesh = fs.make_mesh({"a": 2, "b": 2})
    try:
        fs.shard({"layers": [{"wq": torch.zeros(*shape)}]}, {"layers": [{"wq": spec}]}, mesh)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize(
    "spec, shape, fragments",
    [
        (P("a", None, "b"), (4, 4), ["layers.0.wq", "3 entries", "rank 2"]),
        (P("zz"), (4, 4), ["layers.0.wq", "'zz'", "['a', 'b']"]),
        (P("a", "a"), (4, 4), ["layers.0.wq", "'a' is used twice"]),
        (P(("a", "b")), (6, 4), ["layers.0.wq", "dim 0 of size 6", "a(2) x b(2) = 4", "not divisible by 4"]),
        (P(None, "b"), (4, 3), ["layers.0.wq", "P(None, 'b')", "(4, 3)", "dim 1 of size 3", "b(2)"]),
    ],
)
def test_spec_errors_name_path_spec_axis_and_sizes(spec, shape, fragments):
    kind, msg = run_on_ranks(_spec_error, spec, shape, world_size=4)[0]
    assert kind == "ValueError"
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_spec_of_wrong_kind_is_type_error():
    mesh = fs.make_mesh({"x": 1})
    with pytest.raises(TypeError, match=r"a leaf needs a single spec"):
        fs.shard({"w": torch.zeros(2)}, {"w": ("x",)}, mesh)


def test_spec_tree_not_a_prefix_names_path():
    mesh = fs.make_mesh({"x": 1})
    with pytest.raises(ValueError, match=r"first differ at 'layers'"):
        fs.shard({"layers": [torch.zeros(2), torch.zeros(2)]}, {"layers": [P()]}, mesh)


def test_mesh_size_must_equal_world():
    fs.make_mesh({"x": 1})  # starts the one-process group
    with pytest.raises(ValueError, match=r"a=2 x b=2 = 4 ranks but the world size is 1"):
        fs.make_mesh({"a": 2, "b": 2})


def test_mesh_rejects_bad_axes():
    with pytest.raises(ValueError, match="positive"):
        fs.make_mesh({"x": 0})
    with pytest.raises(ValueError, match="identifier"):
        fs.make_mesh({"a b": 1})


def test_mesh_context_and_axis_checks():
    mesh = fs.make_mesh({"x": 1})
    assert fs.current_mesh() is None
    with mesh:
        assert fs.current_mesh() is mesh
    assert fs.make_mesh({"x": 1}) is mesh
    with pytest.raises(ValueError, match=r"'q'.*mesh axes are \['x'\]"):
        mesh.axis_size("q")
    with pytest.raises(ValueError, match="needs a mesh"):
        fs.shard(torch.zeros(2), P())
