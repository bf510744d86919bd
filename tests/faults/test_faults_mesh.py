"""Issue 36 row 16: ``make_mesh`` refuses bad axes with an error naming the axis and value.

Before: ``make_mesh({"dp": True})`` passed the check (``True`` is an ``int``), started a
process group and failed inside torch with an error about strides; a list of pairs with
a repeated name silently kept the last size.
"""

from __future__ import annotations

import numpy as np
import pytest

import fshard as fs
from fshard.mesh import mesh as mesh_mod
from fshard.runtime import process
from fshard.testing import run_on_ranks


@pytest.fixture()
def no_group(monkeypatch):
    """Bad axes must be refused before any process group is started."""
    def refuse(n):
        raise AssertionError(f"make_mesh started a process group for {n} rank(s) before checking its axes")

    monkeypatch.setattr(process, "ensure_initialized", refuse)


@pytest.mark.parametrize("axes, match", [
    ({"dp": True}, r"axis 'dp' has size True \(bool\); a size must be a positive int, e.g. \{'dp': 2\}"),
    ({"dp": False}, r"axis 'dp' has size False \(bool\)"),
    ({"dp": 2.0}, r"axis 'dp' has size 2.0 \(float\); a size must be a positive int"),
    ({"dp": "2"}, r"axis 'dp' has size '2' \(str\)"),
    ({"dp": None}, r"axis 'dp' has size None \(NoneType\)"),
    ({"dp": 0}, r"axis 'dp' has size 0; a size must be a positive int \(use \{'dp': 1\}"),
    ({"fsdp": 2, "tp": -2}, r"axis 'tp' has size -2; a size must be a positive int"),
    ({1: 2}, r"axis name 1 \(int\) must be an identifier string"),
    ({"my-axis": 2}, r"axis name 'my-axis' \(str\) must be an identifier string"),
    ([("dp", 2), ("dp", 2)], r"axis 'dp' is given twice"),
    ({}, r"make_mesh needs at least one axis"),
    ([2, 2], r"axes must be a dict \{name: size\} or \(name, size\) pairs, got list \[2, 2\]"),
    (["dp", "tp"], r"axes must be a dict \{name: size\} or \(name, size\) pairs, got list \['dp', 'tp'\]"),
    ("dp", r"axes must be a dict \{name: size\} or \(name, size\) pairs, got str 'dp'"),
    (4, r"axes must be a dict \{name: size\} or \(name, size\) pairs, got int 4"),
])
def test_bad_axes_are_refused_naming_the_axis_and_value(no_group, axes, match):
    with pytest.raises(ValueError, match=match):
        fs.make_mesh(axes)


def test_numpy_integer_sizes_and_pairs_are_accepted():
    assert mesh_mod._checked_axes({"dp": np.int64(2), "tp": 1}) == {"dp": 2, "tp": 1}
    assert type(mesh_mod._checked_axes({"dp": np.int64(2)})["dp"]) is int
    assert mesh_mod._checked_axes([("dp", 2), ("tp", 1)]) == {"dp": 2, "tp": 1}


def _mesh_of_wrong_size():
    fs.make_mesh({"dp": 2, "tp": 2})


def test_sizes_whose_product_is_not_the_world_size_name_both():
    with pytest.raises(ValueError, match=r"the mesh has dp=2 x tp=2 = 4 ranks but the world size is 2. "
                                         r"Choose axis sizes whose product is 2"):
        run_on_ranks(_mesh_of_wrong_size, world_size=2)
