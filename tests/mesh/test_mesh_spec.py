"""P: normalization, equality, hashing, repr round trip, bad entries."""

import pickle

import pytest

from fshard import P


def test_normalizes_tuples_and_compares():
    assert P(("dp",), None) == P("dp", None)
    assert P((), "tp") == P(None, "tp")
    assert P("dp") != P(None, "dp")
    assert len({P("a"), P(("a",)), P("a", None)}) == 2


@pytest.mark.parametrize("spec", [P(), P("dp"), P(None, "tp"), P(("dp", "tp"), None)])
def test_repr_round_trips_and_pickles(spec):
    assert eval(repr(spec)) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec


def test_axes_and_dim_axes():
    spec = P(("dp", "tp"), None, "pp")
    assert spec.axes() == ("dp", "tp", "pp")
    assert spec.dim_axes(0) == ("dp", "tp") and spec.dim_axes(1) == () and spec.dim_axes(5) == ()
    assert spec.padded(4) == P(("dp", "tp"), None, "pp", None)


def test_immutable_and_final():
    with pytest.raises(AttributeError):
        P("a")._entries = ()
    with pytest.raises(TypeError):
        type("Sub", (P,), {})


@pytest.mark.parametrize("bad", [3, 1.5, ("dp", 1), object()])
def test_bad_entries_raise_type_error(bad):
    with pytest.raises(TypeError, match="entry 0"):
        P(bad)
