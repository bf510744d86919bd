"""fs.plan's estimates are locked (issue 30): the validation table's layouts on the shipped
machines, the published runs with and without remat, and one search, each equal to
tests/plan/golden_estimates.json to a relative 1e-9. Regenerate with
``PYTHONPATH=. python tools/golden_estimates.py`` only for an intended change of the cost model."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("golden_estimates", ROOT / "tools" / "golden_estimates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_estimates_equal_the_golden_file():
    tool = _tool()
    golden = json.loads(tool.GOLDEN.read_text())
    now = tool.compute()
    assert len(golden) == 40
    assert tool.differences(now, golden) == []


def test_a_changed_number_is_reported():
    tool = _tool()
    golden = {"case": {"step_s": 1.0, "fits": True, "breakdown": {"compute": 0.5}}}
    now = {"case": {"step_s": 1.0 + 1e-6, "fits": True, "breakdown": {"compute": 0.5, "bubble": 0.0}}}
    assert tool.differences(now, golden) == [".case.breakdown.bubble: only in now", ".case.step_s: golden 1.0, now 1.000001"]
