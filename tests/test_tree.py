"""Pytree helpers: key paths and the prefix rule with its errors."""

import pytest
import torch

from fshard import P, tree
from fshard.mesh.spec import is_spec


def test_keystr_paths():
    t = {"layers": [{"wq": torch.ones(1), "wk": torch.ones(1)}], "out": torch.ones(1)}
    assert [p for p, _ in tree.leaves_with_path(t)] == ["layers.0.wk", "layers.0.wq", "out"]
    assert tree.keystr(()) == "<root>"


def test_prefix_leaf_applies_to_subtree():
    values = {"a": {"x": 1, "y": 2}, "b": [3, 4], "c": None}
    specs = {"a": P("dp"), "b": [P(), P("tp")], "c": None}
    assert tree.broadcast_prefix(specs, values, is_prefix_leaf=is_spec) == [P("dp"), P("dp"), P(), P("tp")]
    assert tree.broadcast_prefix(P(), values, is_prefix_leaf=is_spec) == [P()] * 4


@pytest.mark.parametrize(
    "specs, where, why",
    [
        ({"a": P(), "b": [P()]}, "'b'", "keys differ"),
        ({"a": P(), "z": P()}, "'<root>'", "keys differ"),
        ({"a": {"x": P(), "y": {"q": P()}}, "b": P()}, "'a.y'", "leaf"),
        ({"a": "oops", "b": P()}, "'a'", "non-spec leaf"),
    ],
)
def test_prefix_mismatch_names_path_and_both_structures(specs, where, why):
    values = {"a": {"x": 1, "y": 2}, "b": [3, 4]}
    with pytest.raises((ValueError, TypeError)) as info:
        tree.broadcast_prefix(specs, values, is_prefix_leaf=is_spec, name="in_specs[0]")
    msg = str(info.value)
    assert where in msg and why in msg and "in_specs[0] at" in msg and "values at" in msg


def test_list_spec_for_tuple_value_is_fine():
    assert tree.broadcast_prefix([P("a"), P()], (1, 2), is_prefix_leaf=is_spec) == [P("a"), P()]
