"""Language-model runs: the same corpus for every volunteer, and figures in language-model units."""

from __future__ import annotations

import gzip
import hashlib

import pytest

from swarm.run.data import BUNDLED_CORPUS, load_dataset, read_corpus
from swarm.run.runconfig import DataConfig, ModelConfig

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


def test_a_language_model_demo_stops_on_bits_per_byte_and_a_classifier_on_accuracy():
    from swarm.run.runconfig import RunConfig
    from volunteer_cli.commands.demo import demo_target, latest_evaluation, target_reached

    charlm = RunConfig(name="lm", model={"kind": "transformer"}, data={"source": "text"})
    digits = RunConfig(name="digits")
    bits = demo_target(charlm, accuracy=0.95, bits=None)
    assert (bits.kind, bits.value, str(bits)) == ("bits", 2.5, "2.50 bits/byte"), "an accuracy flag is no LM target"
    assert demo_target(charlm, None, 1.8).value == 1.8
    assert target_reached(bits, None, 2.4 * 0.6931) and not target_reached(bits, None, 2.6 * 0.6931)
    assert not target_reached(bits, None, None)
    accuracy = demo_target(digits, None, 2.0)
    assert (accuracy.kind, accuracy.value, str(accuracy)) == ("accuracy", 0.95, "95% test accuracy")
    assert target_reached(accuracy, 0.96, 0.1) and not target_reached(accuracy, None, 0.01)

    class Record:  # a layer0 record's evaluation fields (-1: none)
        def __init__(self, accuracy: float, loss: float, samples: int):
            self.test_accuracy, self.test_loss, self.eval_samples = accuracy, loss, samples

    assert latest_evaluation([Record(-1, 1.9, 100), Record(-1, 1.5, 900), Record(-1, -1, 2000)]) == (None, 1.5)
    assert latest_evaluation([Record(0.9, 0.3, 10)]) == (0.9, 0.3)
    assert latest_evaluation([Record(-1, -1, 10)]) == (None, None)


def test_status_reports_a_language_model_in_bits_per_byte():
    from volunteer_cli.commands.status import render_report

    report = {"run_id": "lm-1", "swarms": {}, "summary": {},
              "evaluation": {"test_accuracy": None, "test_loss": 1.3863, "test_bits_per_byte": 2.0, "samples": 640,
                             "by": "12D3KooWabcdefgh", "age_s": 3.0, "eval_every_s": 30.0}}
    line = render_report(report).splitlines()[1]
    assert "test 2.00 bits/byte (loss 1.386 nats/byte)" in line and "after 640 samples" in line
