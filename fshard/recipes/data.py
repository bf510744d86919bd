"""Data for the recipes: token streams in a train and a validation split, batches that do not
depend on the mesh, and the tokenizers that make the streams.

:func:`load_corpus` reads what a command line's ``--data`` names (docs/data.md):

- a UTF-8 text file, tokenized whole (default tokenizer: its own characters);
- a directory of token shards: ``*.bin`` files of uint16 ids (nanoGPT's format), read
  through ``numpy.memmap``; ``train.bin`` and ``val.bin`` there are the two splits;
- a Hugging Face ``datasets`` dataset saved with ``save_to_disk`` (its ``text`` column).

A single stream (a text, shards other than train.bin/val.bin, a dataset without a
validation split) keeps its last ``val_fraction`` of tokens for validation. Batches are
drawn by :meth:`Corpus.batch` from ``(seed, step, split)`` alone, so every rank and every
mesh sees the same global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import attrs
import numpy as np
import torch

from fshard.mesh.mesh import Mesh
from fshard.mesh.sharding import make_dtensor
from fshard.mesh.spec import PartitionSpec
from fshard.parallel.layout import Layout
from fshard.recipes.roles import Roles

__all__ = [
    "ByteTokenizer",
    "CharCorpus",
    "CharTokenizer",
    "Corpus",
    "DataError",
    "HFTokenizer",
    "Tokenizer",
    "add_flags",
    "batches_from_args",
    "from_args",
    "load_corpus",
    "load_tokenizer",
    "padded_vocab",
    "rank_batches",
    "rank_rows",
]

DEFAULT_VAL_FRACTION = 0.1  # with --val-every and no --val-fraction
_VAL_SALT = 0x5EED_0000_0000  # val batches draw from their own generator, apart from train's
_SPLITS = ("train", "val")


class DataError(ValueError):
    """Data that cannot give what the run asks for (the message names the sizes)."""


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------


class Tokenizer(Protocol):
    """What the data and the sampler need of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@attrs.frozen
class CharTokenizer:
    """One id per character of ``chars`` (sorted, distinct): the text's own alphabet."""

    chars: str

    @classmethod
    def of_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        # Characters outside the alphabet are dropped rather than mapped to a fake id.
        lookup = {c: i for i, c in enumerate(self.chars)}
        return [lookup[c] for c in text if c in lookup]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids if 0 <= i < len(self.chars))


@attrs.frozen
class ByteTokenizer:
    """UTF-8 bytes: vocabulary 256, any text."""

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@attrs.frozen
class HFTokenizer:
    """A ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer, adding no special tokens:
    the text is one stream, where a BOS or EOS per encoded chunk would be noise."""

    tok: Any
    source: str

    @property
    def vocab_size(self) -> int:
        if hasattr(self.tok, "get_vocab_size"):  # tokenizers.Tokenizer
            return int(self.tok.get_vocab_size(with_added_tokens=True))
        return len(self.tok)  # transformers: the base vocabulary and the added tokens

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if hasattr(self.tok, "encode_batch"):
            return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]
        return [list(ids) for ids in self.tok(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids)))


def load_tokenizer(spec: str | os.PathLike | None) -> Tokenizer | None:
    """The tokenizer ``spec`` names; None for ``"char"`` (built from the text by the loader).

    Args:
      spec: ``"char"`` or None; ``"byte"``; a ``tokenizer.json`` file, or a directory holding
        one and no ``tokenizer_config.json`` (the ``tokenizers`` library); else a directory
        saved by a ``transformers`` tokenizer's ``save_pretrained``
        (``AutoTokenizer.from_pretrained(path, local_files_only=True)``: nothing is downloaded).

    Raises:
      DataError: the path does not exist, or the library cannot read it (its message kept).
    """
    if spec is None or str(spec) == "char":
        return None
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise DataError(
            f"--tokenizer {spec}: no such file or directory; give char, byte, a tokenizer.json file or a "
            f"directory saved with save_pretrained (local files only: nothing is downloaded)"
        )
    plain = path / "tokenizer.json"
    try:
        if path.is_file() or (plain.exists() and not (path / "tokenizer_config.json").exists()):
            import tokenizers

            return HFTokenizer(tokenizers.Tokenizer.from_file(str(path if path.is_file() else plain)), str(path))
        import transformers

        return HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True), str(path))
    except Exception as e:  # the libraries raise many kinds (OSError, ValueError, their own): keep the message
        raise DataError(f"--tokenizer {spec}: cannot read a tokenizer there: {type(e).__name__}: {e}") from e


def _encode_all(tokenizer: Tokenizer, pieces: Sequence[str]) -> np.ndarray:
    """The pieces' ids, end to end (``encode_batch`` where the tokenizer has it: many at once)."""
    batch = getattr(tokenizer, "encode_batch", None)
    chunks = batch(pieces) if batch is not None else [tokenizer.encode(p) for p in pieces]
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int64
    return np.fromiter((i for c in chunks for i in c), dtype=dtype)


# ---------------------------------------------------------------------------
# The corpus and its batches
# ---------------------------------------------------------------------------


@attrs.frozen
class Corpus:
    """Token ids in two splits, each a tuple of 1-d integer arrays (a window never crosses
    from one array into the next), and the tokenizer that encodes and decodes them.

    Attributes:
      train, val: the splits' arrays (numpy, possibly memmaps); ``val`` may be empty.
      vocab_size: ids are below it (the model pads it: :func:`padded_vocab`).
      tokenizer: encodes prompts and decodes samples; None for shards with no known one.
      source: what the data was read from, and how it was split (for the run's first line).
    """

    train: tuple[np.ndarray, ...]
    val: tuple[np.ndarray, ...]
    vocab_size: int
    tokenizer: Tokenizer | None
    source: str

    def n_tokens(self, split: str = "train") -> int:
        return sum(len(a) for a in self._arrays(split))

    def encode(self, text: str) -> list[int]:
        return self._tok().encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok().decode(ids)

    def describe(self) -> str:
        val = f", {self.n_tokens('val'):,} validation" if self.val else ""
        return f"{self.source}: {self.n_tokens():,} train tokens{val}, vocabulary {self.vocab_size}"

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        seed: int,
        split: str = "train",
        rows: slice | Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step`` in ``split``: ``batch_size`` random windows of
        ``seq_len + 1`` tokens, as ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64.

        The windows' starts come from a generator seeded with ``(seed, step, split)`` alone,
        so every rank draws the same global batch on every mesh, and a resumed run goes on
        exactly where the interrupted one would have. ``rows`` (a slice or indices of the
        global batch) builds only those rows, of the same draw: what one data-parallel rank
        needs.

        Raises:
          DataError: the split is empty or too short for one window, or a window holds an
            id not below ``vocab_size``.
        """
        arrays = self._arrays(split)
        usable = np.array([max(len(a) - seq_len, 0) for a in arrays], dtype=np.int64)  # starts per array
        if usable.sum() == 0:
            n = self.n_tokens(split)
            what = "characters" if isinstance(self.tokenizer, CharTokenizer) else "tokens"
            raise DataError(
                f"the {split} split of {self.source} has {n} {what}; a sequence of {seq_len} needs more"
                + (" (hold some out with --val-fraction, e.g. 0.1)" if split == "val" and not n else "")
            )
        g = torch.Generator().manual_seed(seed * 1_000_003 + step + (_VAL_SALT if split == "val" else 0))
        starts = torch.randint(0, int(usable.sum()), (batch_size,), generator=g).numpy()
        if rows is not None:
            starts = starts[rows]
        ends = np.cumsum(usable)
        which = np.searchsorted(ends, starts, side="right")  # the array each start falls in
        offsets = starts - (ends - usable)[which]
        windows = np.stack([np.asarray(arrays[a][o : o + seq_len + 1]) for a, o in zip(which, offsets)])
        out = torch.from_numpy(windows.astype(np.int64))  # (rows, T + 1)
        if out.numel() and int(out.max()) >= self.vocab_size:
            raise DataError(
                f"{self.source} holds id {int(out.max())} but the vocabulary is {self.vocab_size}; give the "
                f"vocabulary with --vocab-size (or meta.json's vocab_size), or the tokenizer that made the data"
            )
        return out[:, :-1], out[:, 1:]

    def _arrays(self, split: str) -> tuple[np.ndarray, ...]:
        if split not in _SPLITS:
            raise DataError(f"split {split!r}: give one of {', '.join(_SPLITS)}")
        return self.train if split == "train" else self.val

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise DataError(
                f"{self.source} has no tokenizer to encode or decode text: give --tokenizer, or a meta.pkl "
                f"(nanoGPT's, with itos) beside the shards"
            )
        return self.tokenizer


@attrs.frozen
class CharCorpus(Corpus):
    """A text file as character ids: the vocabulary is its sorted characters (the default data)."""

    @classmethod
    def load(cls, path: str | os.PathLike, val_fraction: float = 0.0) -> "CharCorpus":
        text = _read_text(path)
        tok = CharTokenizer.of_text(text)
        ids = _encode_all(tok, [text])
        train, val = _hold_out((ids,), val_fraction)
        return cls(train, val, tok.vocab_size, tok, _described(Path(path).name, val_fraction))

    @property
    def chars(self) -> str:
        assert isinstance(self.tokenizer, CharTokenizer)
        return self.tokenizer.chars

    @property
    def ids(self) -> torch.Tensor:
        """The whole text's ids, train then validation."""
        return torch.from_numpy(np.concatenate(self.train + self.val).astype(np.int64))


def rank_rows(batch_size: int, microbatches: int, n_data: int, data_index: int) -> list[int]:
    """The rows of the global batch that data rank ``data_index`` of ``n_data`` computes on,
    in the order the eager step takes them: microbatch by microbatch (the step cuts the
    global batch into ``microbatches`` slices, and each slice over the data ranks)."""
    per_mb = batch_size // microbatches
    b = per_mb // n_data
    return [k * per_mb + data_index * b + j for k in range(microbatches) for j in range(b)]


def rank_batches(
    corpus: Corpus, batch_size: int, seq_len: int, seed: int, mesh: Mesh, data_axes: Sequence[str], microbatches: int
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``step -> (inputs, targets)``: this rank's rows of the global batch of ``step`` only, as
    DTensors of the global shape laid out ``P(data_axes)``, for the eager step
    (``fs.recipes.step.make_train_step``; a pipeline's with ``microbatches=1``: it cuts
    each data rank's block itself) and for its ``fs.jit`` graph, traced on such a batch.

    The step's ``shard_map`` takes a DTensor in its spec's layout as it is, so each rank
    computes on exactly the rows it would have cut from the global batch, and the losses
    are those of the global batch, bit for bit. With ``microbatches > 1`` a rank's block
    holds its rows of microbatch 0, then 1, ...: the step cuts it locally
    (``fs.recipes.step.split_rows``); its global view is then the batch's rows in another
    order. Ranks that share rows (tp, pp) read the same ones.
    """
    axes = tuple(data_axes)
    n_data = mesh.axis_size(axes) if axes else 1
    rows = rank_rows(batch_size, microbatches, n_data, mesh.axis_index(axes) if axes else 0)
    spec = PartitionSpec(axes) if axes else PartitionSpec()

    def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = corpus.batch(step, batch_size, seq_len, seed, rows=rows)
        return make_dtensor(x, spec, mesh, (batch_size, seq_len)), make_dtensor(y, spec, mesh, (batch_size, seq_len))

    return batch_at


def padded_vocab(n_chars: int, multiple: int = 64) -> int:
    """The model's vocabulary: the data's, rounded up to a multiple of 64.

    The padding ids never occur in the data. Padding makes the embedding and output
    tables split evenly over any tp x fsdp grid up to 64 ranks, and it is the same on
    every mesh, so the model (and its loss) does not depend on the layout.
    """
    return -(-n_chars // multiple) * multiple


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def load_corpus(
    path: str | os.PathLike,
    tokenizer: str | os.PathLike | Tokenizer | None = None,
    val_fraction: float = 0.0,
    vocab_size: int | None = None,
) -> Corpus:
    """The corpus at ``path`` (a text file, a directory of token shards, or a saved dataset).

    Args:
      path: see the module docstring.
      tokenizer: for text (a file or a dataset's): a :class:`Tokenizer`, or what
        :func:`load_tokenizer` reads (None or ``"char"``: the text's characters). Token
        shards are already ids: a tokenizer there only decodes samples and gives the vocabulary.
      val_fraction: the last fraction of a single stream held out for validation, in
        ``[0, 1)``; not used where the data has its own split (``val.bin``, a dataset's
        ``validation`` or ``test``).
      vocab_size: the shards' vocabulary (default: ``meta.json``'s ``vocab_size``, then
        nanoGPT's ``meta.pkl``, then the tokenizer's).

    Raises:
      DataError: no such path, an empty or unreadable source, no vocabulary for shards,
        ``datasets`` missing for a saved dataset, or ``val_fraction`` out of range.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction}: give a fraction in [0, 1), e.g. 0.1")
    p = Path(path)
    tok = load_tokenizer(tokenizer) if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    if not p.exists():
        raise DataError(f"--data {path}: no such file or directory")
    if p.is_file():
        if tok is None:
            return CharCorpus.load(p, val_fraction)
        return _text_corpus([_read_text(p)], tok, val_fraction, p.name)
    if any((p / f).exists() for f in ("dataset_dict.json", "dataset_info.json", "state.json")):
        return _dataset_corpus(p, tok, val_fraction)
    return _shard_corpus(p, tok, val_fraction, vocab_size)


def _read_text(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"--data {path}: not UTF-8 text ({e.reason} at byte {e.start}); token shards go in a directory"
        ) from None


def _described(name: str, val_fraction: float, split: str | None = None) -> str:
    if split is not None:
        return f"{name} (validation: {split})"
    return f"{name} (validation: its last {val_fraction:g})" if val_fraction else name


def _hold_out(
    arrays: tuple[np.ndarray, ...], val_fraction: float
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """The streams end to end, cut before the last ``val_fraction`` of their tokens."""
    total = sum(len(a) for a in arrays)
    cut = total - int(total * val_fraction)
    train, val, seen = [], [], 0
    for a in arrays:
        k = min(max(cut - seen, 0), len(a))
        train.append(a[:k])
        val.append(a[k:])
        seen += len(a)
    return tuple(a for a in train if len(a)), tuple(a for a in val if len(a))


def _text_corpus(texts: Sequence[str], tok: Tokenizer | None, val_fraction: float, name: str) -> Corpus:
    tok = tok or CharTokenizer.of_text("".join(texts))
    # Lines (ends kept) in groups: a batch of calls is much faster than one huge string.
    pieces = [line for t in texts for line in _groups(t.splitlines(keepends=True), 256)]
    ids = _encode_all(tok, pieces)
    if not len(ids):
        raise DataError(f"--data {name}: the text is empty")
    train, val = _hold_out((ids,), val_fraction)
    return Corpus(train, val, tok.vocab_size, tok, _described(name, val_fraction))


def _groups(lines: Sequence[str], n: int) -> Iterable[str]:
    return ("".join(lines[i : i + n]) for i in range(0, len(lines), n))


def _shard_corpus(p: Path, tok: Tokenizer | None, val_fraction: float, vocab_size: int | None) -> Corpus:
    meta = _shard_meta(p)
    dtype = np.dtype(meta.get("dtype", "uint16"))
    split = (p / "train.bin").exists() and (p / "val.bin").exists()
    files = [p / "train.bin", p / "val.bin"] if split else sorted(p.glob("*.bin"))
    if not files:
        raise DataError(
            f"--data {p}: a directory needs *.bin token shards ({dtype.name}), or a dataset saved with "
            f"save_to_disk; a text corpus is a file"
        )
    vocab = vocab_size or meta.get("vocab_size") or (tok.vocab_size if tok is not None else None)
    if vocab is None:
        raise DataError(
            f"--data {p}: the shards' vocabulary is unknown; give --vocab-size N, a meta.json with "
            f'{{"vocab_size": N}} beside them, or --tokenizer'
        )
    if tok is None and "itos" in meta:  # nanoGPT's char-level meta.pkl
        itos = meta["itos"]
        tok = CharTokenizer("".join(itos[i] for i in range(len(itos))))
    arrays = tuple(_memmap(f, dtype) for f in files)
    if split:
        return Corpus(arrays[:1], arrays[1:], int(vocab), tok, _described(p.name, 0.0, "val.bin"))
    train, val = _hold_out(arrays, val_fraction)
    return Corpus(train, val, int(vocab), tok, _described(f"{p.name} ({len(files)} shards)", val_fraction))


def _memmap(f: Path, dtype: np.dtype) -> np.ndarray:
    size = f.stat().st_size
    if size % dtype.itemsize:
        raise DataError(
            f"--data {f}: {size} bytes is not a whole number of {dtype.name} ids; give meta.json's dtype if "
            f"the shards are not {dtype.name}"
        )
    return np.memmap(f, dtype=dtype, mode="r") if size else np.zeros(0, dtype)  # mmap refuses an empty file


def _shard_meta(p: Path) -> dict[str, Any]:
    """``meta.json``, else nanoGPT's ``meta.pkl`` (read with pickle, as nanoGPT does: data you trust)."""
    if (p / "meta.json").exists():
        return dict(json.loads((p / "meta.json").read_text()))
    if (p / "meta.pkl").exists():
        with open(p / "meta.pkl", "rb") as f:
            return dict(pickle.load(f))
    return {}


def _dataset_corpus(p: Path, tok: Tokenizer | None, val_fraction: float) -> Corpus:
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"--data {p} is a Hugging Face dataset saved with save_to_disk; reading it needs the datasets "
            f"library: pip install datasets"
        ) from None
    loaded = datasets.load_from_disk(str(p))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"--data {p}: the dataset has splits {list(loaded)}; it needs a 'train' split")
        held = next((s for s in ("validation", "val", "test") if s in loaded), None)
        train_texts = _texts(loaded["train"], p)
        if held is not None:
            val_texts = _texts(loaded[held], p)
            tok = tok or CharTokenizer.of_text("".join(train_texts + val_texts))
            train = _text_corpus(train_texts, tok, 0.0, p.name)
            val = _text_corpus(val_texts, tok, 0.0, p.name)
            return attrs.evolve(train, val=val.train, source=_described(p.name, 0.0, f"its {held!r} split"))
        return _text_corpus(train_texts, tok, val_fraction, p.name)
    return _text_corpus(_texts(loaded, p), tok, val_fraction, p.name)


def _texts(ds: Any, p: Path) -> list[str]:
    strings = [name for name, f in ds.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    column = "text" if "text" in ds.column_names else (strings[0] if len(strings) == 1 else None)
    if column is None:
        raise DataError(f"--data {p}: the dataset's columns are {ds.column_names}; it needs a 'text' column")
    # Documents end to end, each ending its line: the stream's separator.
    return [t if t.endswith("\n") else t + "\n" for t in ds[column]]


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def add_flags(p: argparse.ArgumentParser, default: str | os.PathLike) -> None:
    """The data flags, in a group "data": ``--data``, ``--tokenizer``, ``--val-fraction``, ``--vocab-size``."""
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        default=str(default),
        metavar="PATH",
        help="a UTF-8 text file; a directory of uint16 token shards (*.bin; train.bin and val.bin are "
        "the splits); or a datasets dataset saved with save_to_disk (default: %(default)s)",
    )
    g.add_argument(
        "--tokenizer",
        default="char",
        metavar="PATH",
        help="for text: char (its characters), byte, a tokenizer.json, or a directory saved with "
        "save_pretrained (read locally; default: char)",
    )
    g.add_argument(
        "--val-fraction",
        type=float,
        default=None,
        metavar="F",
        help=f"hold out the last F of a single stream for validation (default: {DEFAULT_VAL_FRACTION} "
        f"with --val-every, else 0: training sees all of it)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="the token shards' vocabulary (default: meta.json, nanoGPT's meta.pkl, or --tokenizer's)",
    )


def batches_from_args(
    corpus: Corpus, args: argparse.Namespace, layout: Layout, mesh: Mesh
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """The train batches of ``step`` for a training script: each rank's own rows
    (:func:`rank_batches`; ``--jit``'s graph takes them as the eager step does), or the
    global batch under ``--simulate`` (one process holds every rank: docs/data.md). A
    pipeline (``fs.sched.pipeline_step``) cuts each data rank's block into microbatches,
    where the eager step cuts each microbatch over the data ranks: its rows are the block."""
    if getattr(args, "simulate", None):
        return lambda step: corpus.batch(step, args.batch_size, args.seq_len, args.seed)
    data_axes = Roles.of(layout, mesh).data_axes
    microbatches = 1 if "pp" in mesh.axis_names else layout.microbatches
    return rank_batches(corpus, args.batch_size, args.seq_len, args.seed, mesh, data_axes, microbatches)


def from_args(args: argparse.Namespace) -> Corpus:
    """The corpus :func:`add_flags`' flags name; ``--val-fraction`` defaults to
    :data:`DEFAULT_VAL_FRACTION` when the run validates (``--val-every``), else to 0, so a run
    that does not validate trains on the whole stream."""
    fraction = args.val_fraction
    if fraction is None:
        fraction = DEFAULT_VAL_FRACTION if getattr(args, "val_every", 0) else 0.0
    return load_corpus(args.data, args.tokenizer, fraction, args.vocab_size)
