"""Issue 36 row 7 and row 14: dtype rules of the reducing collectives, and 0-d inputs to
tiled ones, held to what JAX 0.10.2 does.

``jax_dtype_table.json`` is the output of ``faults_jax_dtype_table.py`` (JAX on 2 CPU
devices, x64): for each op and dtype, the result's dtype and values, or the error JAX
raises. fshard on 2 gloo ranks must give the same dtype and values, or refuse with the
same exception type. Before the fix: pmean of all-True bools gave 0.5, psum of bools was
a logical OR (bool result), psum_scatter of bools gave int64 counts and of int8 int64
sums, and a tiled all_gather / psum_scatter of a 0-d value raised ZeroDivisionError.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fshard as fs
from fshard import P
from fshard.testing import run_on_ranks

HERE = Path(__file__).parent
TABLE = json.loads((HERE / "jax_dtype_table.json").read_text())


def _body(op, dtype_name):
    """Runs ``op`` on every dtype's input (rank r holds TABLE['ranks'][r]); returns what
    the table records: the result dtype and values (every rank's, concatenated), or the
    exception type and message."""
    mesh = fs.make_mesh({"x": 2})
    dtype = getattr(torch, dtype_name)
    x = torch.tensor(TABLE["ranks"][0] + TABLE["ranks"][1]).to(dtype)
    fn = {
        "psum": lambda a: fs.lax.psum(a, "x"),
        "pmean": lambda a: fs.lax.pmean(a, "x"),
        "pmax": lambda a: fs.lax.pmax(a, "x"),
        "pmin": lambda a: fs.lax.pmin(a, "x"),
        "psum_scatter": lambda a: fs.lax.psum_scatter(a, "x", tiled=True),
        "all_gather": lambda a: fs.lax.all_gather(a, "x", tiled=True),
    }[op]
    f = fs.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check=False)
    try:
        y = f(x).to_local()  # (not full_tensor: DTensor's own gather has no int16 on gloo)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return {"error": type(e).__name__, "message": str(e)}
    return {"dtype": str(y.dtype).removeprefix("torch."), "values": y.double().tolist()}


def _both(op, dtype_name):
    """``_body`` on 2 ranks, the ranks' values concatenated (as JAX's out_specs P('x'))."""
    ranks = run_on_ranks(_body, op, dtype_name, world_size=2)
    if "error" in ranks[0]:
        return ranks[0]
    return {"dtype": ranks[0]["dtype"], "values": ranks[0]["values"] + ranks[1]["values"]}


@pytest.mark.parametrize("op", sorted(TABLE["ops"]))
def test_collective_dtypes_follow_jax(op):
    got = {name: _both(op, name) for name in TABLE["ops"][op]}
    wrong = {}
    for name, want in TABLE["ops"][op].items():
        have = got[name]
        if "error" in want:
            ok = have.get("error") == want["error"]
        else:
            ok = have.get("dtype") == want["dtype"] and have.get("values") == want["values"]
        if not ok:
            wrong[name] = {"fshard": have, "jax": want}
    assert not wrong, f"{op}: fshard differs from JAX 0.10.2: {wrong}"


def test_pmean_of_all_true_bools_is_one():
    """The finding itself: pmean of an all-True bool tensor gave 0.5."""
    assert run_on_ranks(_module_body, "pmean_true", world_size=2) == [(torch.float32, [1.0, 1.0])] * 2


def _module_body(what):
    mesh = fs.make_mesh({"x": 2})
    if what == "pmean_true":
        f = fs.shard_map(lambda a: fs.lax.pmean(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P(), check=False)
        y = f(torch.ones(4, dtype=torch.bool)).to_local()
        return y.dtype, y.tolist()
    raise AssertionError(what)


def _zero_d(op, tiled):
    mesh = fs.make_mesh({"x": 2})
    fn = {"all_gather": lambda a: fs.lax.all_gather(a.sum(), "x", tiled=tiled),
          "psum_scatter": lambda a: fs.lax.psum_scatter(a.sum(), "x", tiled=tiled),
          "all_to_all": lambda a: fs.lax.all_to_all(a.sum(), "x", 0, 0, tiled=tiled)}[op]
    f = fs.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P(), check=False)
    try:
        f(torch.ones(4))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("op, tiled", [("all_gather", True), ("psum_scatter", True), ("psum_scatter", False),
                                       ("all_to_all", True)])
def test_zero_d_input_to_tiled_ops_is_a_clear_error(op, tiled):
    """Row 14: JAX 0.10.2 refuses these too (ValueError "axis 0 is out of bounds for array
    of dimension 0" for all_gather, IndexError for psum_scatter / all_to_all); fshard
    raised ZeroDivisionError. The message names the op, the axis and the shape."""
    for got in run_on_ranks(_zero_d, op, tiled, world_size=2):
        assert got is not None and got[0] == "ValueError", got
        assert f"fs.lax.{op} over 'x'" in got[1] and "shape ()" in got[1] and "0-d" in got[1], got[1]


def test_untiled_all_gather_of_zero_d_still_works():
    assert run_on_ranks(_zero_d_untiled, world_size=2) == [None, None]


def _zero_d_untiled():
    mesh = fs.make_mesh({"x": 2})
    f = fs.shard_map(lambda a: fs.lax.all_gather(a.sum(), "x"), mesh=mesh, in_specs=P("x"), out_specs=P(), check=False)
    y = f(torch.arange(4.0)).to_local()
    assert y.tolist() == [1.0, 5.0], y
    return None


@pytest.mark.skipif(subprocess.run([sys.executable, "-c", "import jax"], capture_output=True).returncode != 0,
                    reason="jax not installed")
def test_recorded_table_is_what_jax_does():
    """The record is regenerated by running JAX (in a subprocess: the pytest process does
    not import jax) and must be unchanged."""
    out = subprocess.run([sys.executable, str(HERE / "faults_jax_dtype_table.py")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == TABLE
