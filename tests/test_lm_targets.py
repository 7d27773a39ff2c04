"""Language-model runs: the same corpus for every volunteer, and figures in language-model units."""

from __future__ import annotations

import gzip
import hashlib

import pytest

from swarm.data import BUNDLED_CORPUS, load_dataset, read_corpus
from swarm.runconfig import DataConfig, ModelConfig

LM = ModelConfig(kind="transformer", seq_len=16, vocab_size=256, d_model=8, n_heads=2, d_ff=8)
SHIPPED_SHA256 = "6155b058799c934cf48f7be0ce177a5062d2c91b22322e4450bf202eea99809f"


def test_the_default_corpus_is_the_one_shipped_whatever_the_python_version():
    corpus = read_corpus(None, 300_000)
    assert len(corpus) == 300_000 and hashlib.sha256(corpus).hexdigest() == SHIPPED_SHA256
    assert corpus.startswith(b"A. HISTORY OF THE SOFTWARE"), "CPython's licence travels with its text"
    pinned = load_dataset(DataConfig(source="text", max_text_bytes=300_000, sha256=SHIPPED_SHA256), LM)
    assert len(pinned.x_train) > 0 and len(pinned.x_val) > 0


def test_a_corpus_that_differs_from_the_pinned_one_is_refused_with_what_to_do(tmp_path):
    other = tmp_path / "other.txt.gz"
    with gzip.open(other, "wb") as handle:
        handle.write(b"not the run's corpus " * 500)
    assert read_corpus(str(other), 21) == b"not the run's corpus "
    with pytest.raises(ValueError, match=r"other.txt.gz.*pins data.sha256.*other data"):
        load_dataset(DataConfig(source="text", path=str(other), sha256=SHIPPED_SHA256), LM)
    with pytest.raises(ValueError):
        DataConfig(source="text", sha256="not-a-digest")
    assert BUNDLED_CORPUS.is_file()
