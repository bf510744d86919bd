"""fs.recipes.data and .progress: mesh-independent batches, their errors, the atomic log."""

from __future__ import annotations

import json

import pytest
import torch

from fshard.recipes.data import CharCorpus, DataError, padded_vocab
from fshard.recipes.progress import Progress, write_log


def test_char_corpus_batches_depend_only_on_seed_and_step(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("abcabcabd" * 20, encoding="utf-8")
    corpus = CharCorpus.load(path)
    assert corpus.chars == "abcd" and corpus.vocab_size == 4 and padded_vocab(4) == 64
    assert corpus.decode(corpus.encode("dab?")) == "dab"  # unknown characters are dropped
    x, y = corpus.batch(3, 5, 8, seed=1)
    assert x.shape == y.shape == (5, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(corpus.batch(3, 5, 8, seed=1)[0], x) and not torch.equal(corpus.batch(4, 5, 8, seed=1)[0], x)
    with pytest.raises(DataError, match="the corpus has 180 characters; a sequence of 180 needs more"):
        corpus.batch(0, 1, 180, seed=0)


def test_progress_lines_and_the_log_file(tmp_path, capsys):
    progress = Progress(0, 4, True, every=2)
    progress.bar = None  # the line printer (tqdm may be installed)
    for step in range(1, 5):
        progress.update({"step": step, "loss": 1.0 / step, "tokens_per_s": 100.0, "lr": 1e-3})
    progress.close()
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out] == ["2/4", "4/4"]
    write_log(str(tmp_path / "logs" / "run.json"), [{"step": 1}])
    assert json.loads((tmp_path / "logs" / "run.json").read_text()) == [{"step": 1}]
    assert not (tmp_path / "logs" / "run.json.tmp").exists()
