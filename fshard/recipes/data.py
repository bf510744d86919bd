"""Data for the recipes: a character corpus whose batches do not depend on the mesh."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import attrs
import torch

__all__ = ["CharCorpus", "DataError", "padded_vocab"]


class DataError(ValueError):
    """Data that cannot give what the run asks for (the message names the sizes)."""


@attrs.frozen
class CharCorpus:
    """A text as a 1-d tensor of character ids; the vocabulary is its sorted characters."""

    ids: torch.Tensor
    chars: str

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharCorpus":
        text = Path(path).read_text(encoding="utf-8")
        chars = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(chars)}
        return cls(torch.tensor([lookup[c] for c in text], dtype=torch.int64), chars)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        # Characters the corpus lacks are dropped rather than mapped to a fake id.
        return [self.chars.index(c) for c in text if c in self.chars]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``batch_size`` random windows and their next characters.

        The windows come from a generator seeded with ``(seed, step)`` alone, so every rank
        draws the same global batch on every mesh, and a resumed run continues exactly
        where the interrupted one would have gone. shard_map then gives each data-parallel
        rank its rows.
        """
        if len(self.ids) <= seq_len:
            raise DataError(f"the corpus has {len(self.ids)} characters; a sequence of {seq_len} needs more")
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.ids) - seq_len, (batch_size,), generator=g)
        windows = torch.stack([self.ids[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]


def padded_vocab(n_chars: int, multiple: int = 64) -> int:
    """The model's vocabulary: the characters, rounded up to a multiple of 64.

    The padding ids never occur in the data. Padding makes the embedding and output
    tables split evenly over any tp x fsdp grid up to 64 ranks, and it is the same on
    every mesh, so the model (and its loss) does not depend on the layout.
    """
    return -(-n_chars // multiple) * multiple
