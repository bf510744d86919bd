"""fs.checkpoint.load_hf / save_hf: Hugging Face safetensors checkpoints of GPT-2 and Llama.

On 2 ranks: a checkpoint written by transformers' own ``save_pretrained`` is read into
FSDP shards (each rank reads only its blocks), written back with ``save_hf`` in several
files, read again into TP shards, and ``AutoModelForCausalLM.from_pretrained`` of the
result gives the original model's logits exactly. Bad checkpoints name the first keys.
"""

import os

import pytest
import torch
import torch.distributed as dist
from _harness import hf_models  # noqa: E402
from _harness.optional import requires

import fshard as fs
from fshard.checkpoint import CheckpointError, CheckpointNotFoundError
from fshard.testing import run_on_ranks

pytestmark = requires("transformers", "safetensors")  # every test here reads or writes an HF checkpoint
PLANS = {"gpt2": fs.parallel.HF_GPT2_TP_PLAN, "llama": fs.parallel.HF_LLAMA_TP_PLAN}


def _roundtrip(kind, root):
    from transformers import AutoModelForCausalLM

    from fshard.checkpoint import _hf

    mesh = fs.make_mesh({"x": 2})
    model = hf_models.MODELS[kind]()
    native, ours = os.path.join(root, f"{kind}-native"), os.path.join(root, f"{kind}-ours")
    if dist.get_rank() == 0:
        model.save_pretrained(native)
        if kind == "gpt2":  # a base-model checkpoint too, named as GPT-2's on the hub (no "transformer.")
            model.transformer.save_pretrained(native + "-base")
    dist.barrier()
    _, params, _ = fs.nn.functionalize(model)
    _, other, _ = fs.nn.functionalize(hf_models.MODELS[kind](seed=1))  # the template's values must not leak
    read = []
    original = _hf._Source.read

    def spy(self, key, index):
        out = original(self, key, index)
        read.append(out.numel())
        return out

    _hf._Source.read = spy
    try:
        fsdp = fs.parallel.fsdp_specs(other, "x")
        template = fs.shard(other, fsdp, mesh, uneven=True)
        loaded = fs.checkpoint.load_hf(native, like=template)
        local = sum(x.to_local().numel() for x in fs.tree.leaves(loaded))
        read_fsdp, read[:] = sum(read), []
        fs.checkpoint.save_hf(ours, loaded, config=model.config, max_shard_size=4096)
        tp = fs.parallel.tp_specs(other, PLANS[kind], "x")
        tp_template = fs.shard(other, tp, mesh)
        again = fs.checkpoint.load_hf(ours, like=tp_template)
        base_ok = True
        if kind == "gpt2":
            base = fs.checkpoint.load_hf(native + "-base", like=template)
            base_ok = all(torch.equal(a, b) for a, b in zip(fs.tree.leaves(fs.gather(base)), fs.tree.leaves(params)))
    finally:
        _hf._Source.read = original
    exact = [torch.equal(a, b) for t in (loaded, again)
             for a, b in zip(fs.tree.leaves(fs.gather(t)), fs.tree.leaves(params))]
    specs_kept = all(a.placements == b.placements and a.to_local().shape == b.to_local().shape
                     for t, like in ((loaded, template), (again, tp_template))
                     for a, b in zip(fs.tree.leaves(t), fs.tree.leaves(like)))
    files = sorted(os.listdir(ours))
    same_logits = None
    if dist.get_rank() == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float64)
        tok, _ = hf_models.batch(0, 2)
        same_logits = type(reloaded) is type(model) and torch.equal(reloaded(tok).logits, model(tok).logits)
    dist.barrier()
    return all(exact), specs_kept, base_ok, read_fsdp, local, files, same_logits


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_checkpoint_roundtrip_through_shards(kind, tmp_path):
    results = run_on_ranks(_roundtrip, kind, str(tmp_path), world_size=2)
    for rank, (exact, specs_kept, base_ok, read_fsdp, local, files, same_logits) in enumerate(results):
        assert exact and specs_kept and base_ok
        assert read_fsdp == local  # each rank read exactly the elements of its own blocks
        assert "model.safetensors.index.json" in files and "config.json" in files
        assert sum(f.endswith(".safetensors") for f in files) > 1
        assert same_logits is (True if rank == 0 else None)


def _state():
    _, params, _ = fs.nn.functionalize(hf_models.llama())
    return params, dict(fs.nn.to_state_dict(params))


def test_missing_keys_are_named():
    params, sd = _state()
    for k in ("model.norm.weight", "lm_head.weight"):
        del sd[k]
    with pytest.raises(CheckpointError, match=r"the template's lm_head.weight, model.norm.weight are missing "
                                              r"\(2 of 21\)"):
        fs.checkpoint.load_hf(sd, like=params)


def test_extra_keys_are_named_unless_not_strict():
    params, sd = _state()
    sd["model.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(4)
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.rotary.inv_freq is not in the template "
                                              r"\(1 names; pass strict=False"):
        fs.checkpoint.load_hf(sd, like=params)
    out = fs.checkpoint.load_hf(sd, like=params, strict=False)
    assert all(torch.equal(a, b) for a, b in zip(fs.tree.leaves(out), fs.tree.leaves(params)))


def test_wrong_shapes_are_named(tmp_path):
    params, sd = _state()
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(24, 8, dtype=torch.float64)
    sd["model.embed_tokens.weight"] = torch.zeros(65, 16, dtype=torch.float64)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(CheckpointError, match=r"shapes in the checkpoint '.*bad.safetensors' differ from the "
                                              r"template's: 'model.embed_tokens.weight': checkpoint \(65, 16\), "
                                              r"template \(64, 16\), 'model.layers.1.mlp.up_proj.weight': "
                                              r"checkpoint \(24, 8\), template \(24, 16\)"):
        fs.checkpoint.load_hf(str(tmp_path / "bad.safetensors"), like=params)
    with pytest.raises(CheckpointNotFoundError, match="no safetensors file or directory"):
        fs.checkpoint.load_hf(str(tmp_path / "nowhere"), like=params)
