"""Sampling from fshard's Transformer (whole, gathered parameters, one process)."""

from __future__ import annotations

from typing import Any

import torch

from fshard.models.transformer import TransformerConfig, transformer_apply

__all__ = ["generate"]


@torch.no_grad()
def generate(
    params: Any,
    cfg: TransformerConfig,
    prompt: list[int],
    n_new: int,
    *,
    seed: int,
    n_real: int | None = None,
    temperature: float = 0.8,
) -> list[int]:
    """``prompt`` followed by ``n_new`` ids drawn one at a time at ``temperature``.

    Args:
      params: the Transformer's whole parameters (``fs.recipes.pipeline.gather_full``).
      cfg: its config; the context is the last ``cfg.max_seq_len`` ids.
      prompt: the first ids (empty: starts from id 0).
      n_new: how many ids to draw.
      seed: seeds the draws.
      n_real: only ids below this are drawn (a padded vocabulary's padding never is);
        default the whole vocabulary.
      temperature: the logits' divisor.
    """
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt) or [0]
    n_real = cfg.vocab_size if n_real is None else n_real
    for _ in range(n_new):
        context = torch.tensor([ids[-cfg.max_seq_len :]])  # (1, t)
        logits = transformer_apply(params, context, cfg)[0, -1, :n_real].float()  # (n_real,)
        probs = torch.softmax(logits / temperature, dim=-1)
        ids.append(int(torch.multinomial(probs, 1, generator=g)))
    return ids
