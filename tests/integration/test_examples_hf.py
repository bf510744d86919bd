"""examples/finetune_hf.py: a Hugging Face model trained on a mesh gives the one-process loss
curve, is saved in HF format, and transformers reloads it with the same logits and generates.

Short form: tiny GPT-2 on fsdp=2 and tiny Llama on tp=2, 3 steps in float64, each against
the same script on one process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fshard.testing import run_on_ranks

pytest.importorskip("transformers", reason="pip install fshard[hf]")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = ["--steps", "3", "--dtype", "float64", "--dim", "16", "--layers", "2", "--heads", "4", "--seq-len", "16",
        "--batch-size", "4", "--sample-tokens", "8", "--quiet"]


def _run(argv: list[str]) -> dict:
    from _harness._examples import example

    return example("finetune_hf").main(argv)


@pytest.mark.parametrize("model, mesh", [("gpt2", "fsdp=2"), ("llama", "tp=2")])
def test_finetune_hf_short(model, mesh, tmp_path):
    argv = TINY + ["--model", model]
    (one,) = run_on_ranks(_run, argv + ["--mesh", "fsdp=1", "--out", str(tmp_path / "one")], world_size=1)
    results = run_on_ranks(_run, argv + ["--mesh", mesh, "--out", str(tmp_path / "two")], world_size=2)
    want = [r["loss"] for r in one["records"]]
    for res in results:
        got = [r["loss"] for r in res["records"]]
        assert len(got) == 3 and all(abs(a - b) <= 1e-9 * abs(b) for a, b in zip(got, want)), (got, want)
    assert results[0]["reload_max_diff"] == 0.0  # transformers' reload has the trained values
    assert results[0]["sample"].startswith("To be, or not") and len(results[0]["sample"]) > len("To be, or not")
    assert "sample" not in results[1]  # only rank 0 reloads and generates
    files = os.listdir(tmp_path / "two")
    assert "model.safetensors" in files and "config.json" in files
