"""Train a Hugging Face model (GPT-2 or Llama) with fshard on any mesh; save it in HF format.

Bring your own ``nn.Module``: the model is ``transformers``' own class, built from a small
random config (no hub access needed), or from a local Hugging Face checkpoint directory
(``--pretrained DIR``: ``config.json`` and safetensors, e.g. what ``save_pretrained``
wrote), trained as a pure function of its parameters::

    python examples/finetune_hf.py --model gpt2                             # one process
    torchrun --nproc-per-node 4 examples/finetune_hf.py --model llama --mesh fsdp=4
    torchrun --nproc-per-node 4 examples/finetune_hf.py --model gpt2 --mesh dp=2,fsdp=2
    torchrun --nproc-per-node 4 examples/finetune_hf.py --model llama --mesh fsdp=2,tp=2
    torchrun --nproc-per-node 2 examples/finetune_hf.py --pretrained my-gpt2/ --mesh fsdp=2

With ``--pretrained``, the architecture is the directory's ``config.json`` (``model_type``
``gpt2`` or ``llama``; ``--dim``, ``--layers`` and ``--heads`` do not apply), and
``fs.checkpoint.load_hf`` reads the weights straight into the mesh's shards: each rank
reads only the slices it holds, on any mesh.

What runs: ``fs.recipes.ModuleModel`` and ``build_train_step`` on an ``fs.parallel.Layout``.
The recipe functionalizes the module (``fs.nn.functionalize``: ``apply`` and a parameter
tree), splits it by a plan (``HF_LLAMA_TP_PLAN``/``HF_GPT2_TP_PLAN``) over ``tp`` with
``fs.parallel.tp_apply``, and with ``fs.parallel.fsdp_apply`` gathers each block's shards
just before it runs over ``fsdp`` and all-reduces gradients over ``dp``. Tokens are bytes (vocabulary 256) of the
bundled text. At the end, ``fs.checkpoint.save_hf`` writes ``--out``, rank 0 reloads it with
``transformers.AutoModelForCausalLM.from_pretrained``, checks that its logits equal the
trained parameters', and generates a sample. The global batch of step ``s`` depends only on
``--seed`` and ``s``, so the loss curve is the same on every mesh (``--dtype float64``: to
rounding).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs

DATA = Path(__file__).resolve().parent / "data" / "kjv_shakespeare.txt"
AXES = ("dp", "fsdp", "tp")  # outermost first, whatever order --mesh names them in
DTYPES = {"float32": torch.float32, "float64": torch.float64}
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=sorted(BLOCKS), default=None,
                   help="a small random model of this kind; left out: gpt2, or with --pretrained the checkpoint's")
    p.add_argument("--pretrained", default=None, metavar="DIR",
                   help="a local HF checkpoint directory (config.json + *.safetensors) to start from, read "
                        "with fs.checkpoint.load_hf onto the mesh instead of a random init")
    p.add_argument("--mesh", default=None, help="axis=size,... over all ranks, axes dp, fsdp, tp "
                                                "(default: every rank on fsdp)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="global rows per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="HF checkpoint directory (default: a temporary one)")
    p.add_argument("--prompt", default="To be, or not")
    p.add_argument("--sample-tokens", type=int, default=60)
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def parse_mesh(text: str | None, world: int) -> dict[str, int]:
    """``"fsdp=2,tp=2"`` -> ``{"fsdp": 2, "tp": 2}`` in :data:`AXES` order; sizes multiply to ``world``."""
    if not text:
        return {"fsdp": world}
    sizes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if name not in AXES or not size.isdigit():
            raise SystemExit(f"--mesh {text!r}: each part is axis=size with axis one of {AXES}.")
        sizes[name] = int(size)
    if math.prod(sizes.values()) != world:
        raise SystemExit(f"--mesh {text!r} has {math.prod(sizes.values())} ranks, but this job has {world}.")
    return {a: sizes[a] for a in AXES if a in sizes}


def pretrained_config(args: argparse.Namespace) -> Any:
    """``--pretrained``'s ``config.json``, checked against what this script trains: sets ``args.model``.

    Raises:
      SystemExit: no ``config.json``, a ``model_type`` other than gpt2 or llama, a ``--model``
        that is not the checkpoint's, fewer than 256 tokens (the bytes), or fewer positions
        than ``--seq-len``.
    """
    from transformers import AutoConfig

    path = Path(args.pretrained)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--pretrained {args.pretrained}: no config.json there; pass the directory that "
                         "save_pretrained (or save_hf with config=) wrote.")
    cfg = AutoConfig.from_pretrained(path)
    if cfg.model_type not in BLOCKS:
        raise SystemExit(f"--pretrained {args.pretrained}: model_type {cfg.model_type!r}; this script trains "
                         f"{' and '.join(sorted(BLOCKS))} (their blocks and TP plans).")
    if args.model not in (None, cfg.model_type):
        raise SystemExit(f"--model {args.model} but --pretrained {args.pretrained} is a {cfg.model_type} "
                         f"checkpoint: leave --model out with --pretrained, or pass --model {cfg.model_type}.")
    if cfg.vocab_size < 256:
        raise SystemExit(f"--pretrained {args.pretrained}: vocab_size {cfg.vocab_size}, but the tokens are "
                         "bytes (0-255): the model needs at least 256.")
    if _positions(cfg) < args.seq_len:
        raise SystemExit(f"--seq-len {args.seq_len} is longer than --pretrained {args.pretrained}'s "
                         f"{_positions(cfg)} positions: pass --seq-len {_positions(cfg)} or less.")
    args.model = cfg.model_type
    return cfg


def _positions(cfg: Any) -> int:
    return cfg.n_positions if cfg.model_type == "gpt2" else cfg.max_position_embeddings


def build_model(args: argparse.Namespace, dtype: torch.dtype, config: Any = None):
    """A small random ``transformers`` causal LM over bytes (same values on every rank), or
    ``config``'s architecture (``--pretrained``'s; its values are loaded afterwards)."""
    torch.manual_seed(args.seed)
    if config is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config).to(dtype)
    positions = max(256, args.seq_len)  # room for the prompt and the sample
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=256, n_positions=positions, n_embd=args.dim, n_layer=args.layers,
                         n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg).to(dtype)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=args.dim, intermediate_size=3 * args.dim,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=positions,
                      bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg).to(dtype)


def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy, the mean over this rank's rows: ``out.logits`` is (b, T, 256)."""
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def batch(data: torch.Tensor, step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of bytes at random offsets, the same on every rank: inputs and next bytes (B, T)."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=g)
    rows = torch.stack([data[s:s + args.seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    config = pretrained_config(args) if args.pretrained else None  # sets --model
    args.model = args.model or "gpt2"
    fs.init()
    world = dist.get_world_size() if dist.is_initialized() else 1
    shape = parse_mesh(args.mesh, world)
    mesh = fs.make_mesh(shape)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    dtype = DTYPES[args.dtype]
    data = torch.frombuffer(bytearray(DATA.read_bytes()), dtype=torch.uint8).long()

    model = build_model(args, dtype, config)
    plan = fs.parallel.HF_GPT2_TP_PLAN if args.model == "gpt2" else fs.parallel.HF_LLAMA_TP_PLAN
    recipe = fs.recipes.ModuleModel(model, lm_loss, blocks=BLOCKS[args.model], tp_plan=plan, name=args.model)
    layout = fs.parallel.Layout(shape, batch=args.batch_size, dtype=args.dtype)
    optimizer = fs.optim.adamw(args.lr, weight_decay=0.01)
    init_state, step = fs.recipes.build_train_step(recipe, layout, optimizer, mesh=mesh)
    sharded, state = init_state(args.seed)  # the module's values, as shards
    if args.pretrained:  # the checkpoint's values into those shards: each rank reads its slices
        sharded = fs.checkpoint.load_hf(args.pretrained, like=sharded)
        state = optimizer.init(sharded)
        if rank0 and not args.quiet:
            n = sum(x.numel() for x in fs.tree.leaves(sharded))
            print(f"loaded {args.pretrained} ({args.model}, {n:,} parameters) onto mesh {shape}", flush=True)
    records = []
    for s in range(1, args.steps + 1):
        tokens, targets = batch(data, s, args)
        sharded, state, loss, _, _ = step(sharded, state, tokens, targets)
        records.append({"step": s, "loss": loss.item()})
        if rank0 and not args.quiet and (s == 1 or s % 10 == 0 or s == args.steps):
            print(f"step {s:4d}  loss {loss.item():.4f}", flush=True)

    out = args.out or os.path.join(tempfile.gettempdir(), f"fshard-finetune-{args.model}")
    fs.checkpoint.save_hf(out, sharded, config=model.config)
    fs.nn.load_state(model, fs.gather(sharded))  # collective; the trained values, for the check below
    result: dict[str, Any] = {"records": records, "out": out, "mesh": shape}
    if rank0:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
        tokens, _ = batch(data, 0, args)
        with torch.no_grad():
            result["reload_max_diff"] = (reloaded(tokens).logits - model(tokens).logits).abs().max().item()
            prompt = torch.tensor([list(args.prompt.encode())])
            room = _positions(model.config) - prompt.shape[1]
            ids = reloaded.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    max_new_tokens=min(args.sample_tokens, room), pad_token_id=0)
        # A pretrained vocabulary is larger than the bytes: its other tokens print as U+FFFD.
        text = b"".join(bytes([i]) if i < 256 else b"\xff" for i in ids[0].tolist())
        result["sample"] = text.decode("utf-8", errors="replace")
        if not args.quiet:
            print(f"saved {out}; reloaded with transformers (max logit difference "
                  f"{result['reload_max_diff']:.1e}); greedy sample:\n{result['sample']}")
    if dist.is_initialized():
        dist.barrier()
    return result


if __name__ == "__main__":
    fs.recipes.run_script(main, "finetune_hf.py")  # a layout that does not fit: one line, exit code 2
