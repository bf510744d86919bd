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


def _save_tiny(model: str, path: Path):
    """A tiny random GPT-2 or Llama over bytes, saved with ``save_pretrained`` (float64, no
    dropout); seeded apart from the script's own random init, so a run that did not load it
    starts elsewhere."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    if model == "gpt2":
        cfg = GPT2Config(vocab_size=256, n_positions=256, n_embd=16, n_layer=2, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        hf = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          bos_token_id=0, eos_token_id=0)
        hf = LlamaForCausalLM(cfg)
    hf = hf.to(torch.float64).eval()
    hf.save_pretrained(path)
    return hf


def _run_each(argvs: list[list[str]]) -> list[dict]:
    return [_run(argv) for argv in argvs]


@pytest.mark.parametrize("model, mesh", [("gpt2", "fsdp=2"), ("llama", "tp=2")])
def test_finetune_hf_pretrained_loads_the_checkpoint_onto_the_mesh(model, mesh, tmp_path):
    """--pretrained DIR: the saved model's values on the mesh (written back unchanged after 0
    steps) and its loss on the first batch (the HF model's, computed here)."""
    import torch
    import torch.nn.functional as F
    from _harness._examples import example
    from safetensors.torch import load_file

    hf = _save_tiny(model, tmp_path / "pretrained")
    base = ["--pretrained", str(tmp_path / "pretrained"), "--mesh", mesh, "--dtype", "float64", "--seq-len", "16",
            "--batch-size", "4", "--sample-tokens", "8", "--quiet"]
    loaded, trained = run_on_ranks(_run_each, [base + ["--steps", "0", "--out", str(tmp_path / "loaded")],
                                               base + ["--steps", "2", "--out", str(tmp_path / "trained")]],
                                   world_size=2)[0]
    saved = load_file(tmp_path / "pretrained" / "model.safetensors")
    written = load_file(tmp_path / "loaded" / "model.safetensors")
    assert sorted(written) == sorted(saved)
    for name, value in saved.items():
        assert torch.equal(written[name], value), name
    assert loaded["records"] == [] and loaded["reload_max_diff"] == 0.0

    script = example("finetune_hf")
    data = torch.frombuffer(bytearray(script.DATA.read_bytes()), dtype=torch.uint8).long()
    tokens, targets = script.batch(data, 1, script.parse_args(base))
    with torch.no_grad():
        want = F.cross_entropy(hf(tokens).logits.flatten(0, 1), targets.flatten()).item()
    got = [r["loss"] for r in trained["records"]]
    assert len(got) == 2 and abs(got[0] - want) <= 1e-9 * want, (got, want)


def test_finetune_hf_pretrained_refusals(tmp_path):
    from _harness._examples import example
    from transformers import BertConfig, GPT2Config

    script = example("finetune_hf")
    with pytest.raises(SystemExit, match="no config.json there"):
        script.main(["--pretrained", str(tmp_path)])
    BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path / "bert")
    with pytest.raises(SystemExit, match="model_type 'bert'; this script trains gpt2 and llama"):
        script.main(["--pretrained", str(tmp_path / "bert")])
    GPT2Config(vocab_size=256, n_positions=32).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(SystemExit, match="--model llama but --pretrained .* is a gpt2 checkpoint"):
        script.main(["--pretrained", str(tmp_path / "gpt2"), "--model", "llama"])
    with pytest.raises(SystemExit, match="--seq-len 64 is longer than .* 32 positions"):
        script.main(["--pretrained", str(tmp_path / "gpt2"), "--seq-len", "64"])
