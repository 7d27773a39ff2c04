"""Token data of llama runs: windows addressed by sample id over memory-mapped files (nanoGPT's layout), a
folder of text tokenized once into a cache, the tokenizer pinned in the run id."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from swarm.run.data import MicroBatches, load_dataset, make_shards
from swarm.run.runconfig import RunConfig
from swarm.run.tokenizer import BUNDLED_TOKENIZER, TokenizerError, file_sha256
from swarm.run.tokens import TEST_WINDOWS_MAX, TokenWindows

SHIPPED_SHA = file_sha256(BUNDLED_TOKENIZER)
SEQ = 8


def _run(data: dict, **model) -> RunConfig:
    return RunConfig.model_validate({
        "name": "tok", "model": {"kind": "llama", "stages": 2, "d_model": 16, "n_heads": 2, "vocab_size": 2048,
                                 "seq_len": SEQ, **model},
        "data": {"source": "text", "tokenizer_sha256": SHIPPED_SHA, "shards": 2, **data},
    })


def _bins(folder, sizes: dict[str, int], dtype=np.uint16) -> None:
    for name, size in sizes.items():
        np.arange(size, dtype=dtype).__mod__(2000).astype(dtype).tofile(folder / name)


def test_windows_give_inputs_and_next_tokens_by_sample_id():
    tokens = np.arange(100, dtype=np.uint16)
    x, y = TokenWindows(tokens, SEQ, 2, 5, 0), TokenWindows(tokens, SEQ, 2, 5, 1)
    ids = torch.tensor([4, 0])
    assert x[ids].tolist() == [list(range(48, 56)), list(range(16, 24))]
    assert torch.equal(y[ids], x[ids] + 1), "the targets are the next tokens of the same window"
    assert x[1:3].shape == (2, SEQ) and x[ids].dtype == torch.int64 and len(x) == 5
    with pytest.raises(IndexError):
        x[torch.tensor([5])]


def test_token_files_are_memory_mapped_and_split_train_validation_test(tmp_path):
    _bins(tmp_path, {"train.bin": 801, "val.bin": 161})
    data = load_dataset(_run({"source": "tokens", "path": str(tmp_path), "validation_fraction": 0.1}).data,
                        _run({"source": "tokens", "path": str(tmp_path)}).model)
    assert isinstance(data.x_train.tokens, np.memmap), "a token file is never read whole"
    assert (len(data.x_train), len(data.x_val), len(data.x_test)) == (90, 10, 20)  # val.bin is the test split
    assert data.x_test.tokens is not data.x_train.tokens
    assert data.y_train[torch.tensor([89])][0, -1] == 90 * SEQ % 2000
    assert data.bytes_per_token > 1.0, "bits per byte need the bytes a token stands for"

    _bins(tmp_path, {"test.bin": 81})
    data = load_dataset(_run({"source": "tokens", "path": str(tmp_path)}).data, _run({}).model)
    assert (len(data.x_train), len(data.x_val), len(data.x_test)) == (100, 20, 10), "val.bin validates, test.bin tests"
    shards = make_shards(data.y_train, _run({}).data, data.num_classes)
    batch = MicroBatches(data.x_train, data.y_train, shards[1], 4).next_with_ids()
    assert batch[0].shape == (4, SEQ) and bool(np.isin(batch[1].numpy(), shards[1]).all())
    assert TEST_WINDOWS_MAX >= 1024


def test_token_file_problems_name_the_field_and_the_fix(tmp_path):
    _bins(tmp_path, {"train.bin": 801})
    with pytest.raises(ValueError, match="has no val.bin"):
        load_dataset(_run({"source": "tokens", "path": str(tmp_path)}).data, _run({}).model)
    (tmp_path / "val.bin").write_bytes(b"\0" * 33)
    with pytest.raises(ValueError, match="data.token_dtype"):
        load_dataset(_run({"source": "tokens", "path": str(tmp_path), "token_dtype": "uint32"}).data, _run({}).model)
    with pytest.raises(ValueError, match="data.path"):
        _run({"source": "tokens"})
    with pytest.raises(ValueError, match="model.vocab_size"):
        load_dataset(_run({"source": "text"}).data, _run({}, vocab_size=1000).model)


def test_a_text_folder_is_tokenized_once_into_a_cache_with_progress(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    records = [{"text": f"print({i} * {i})\n" * 5} for i in range(30)] + [{"no_text": 1}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\nnot json\n")
    run = _run({"source": "text_files", "path": str(tmp_path), "test_fraction": 0.1, "validation_fraction": 0.1})
    data = load_dataset(run.data, run.model)
    assert "tokenized" in capsys.readouterr().err
    (cache,) = (tmp_path / ".volunteer-tokens").glob("*.bin")
    assert isinstance(data.x_train.tokens, np.memmap) and len(data.x_test) >= 1 and len(data.x_val) >= 1
    assert 1.0 < data.bytes_per_token < 8.0
    stamp = cache.stat().st_mtime_ns
    again = load_dataset(run.data, run.model)
    assert cache.stat().st_mtime_ns == stamp and "tokenized" not in capsys.readouterr().err
    assert torch.equal(again.x_train[torch.arange(4)], data.x_train[torch.arange(4)])
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(BUNDLED_TOKENIZER)).decode(np.fromfile(cache, dtype=np.uint16).tolist(),
                                                                skip_special_tokens=False)
    assert text.count("<|endoftext|>") == 31, "each .txt file and each .jsonl record closes a document"
    (tmp_path / "a.txt").write_text("changed\n" * 200)
    load_dataset(run.data, run.model)
    assert len(list((tmp_path / ".volunteer-tokens").glob("*.bin"))) == 2, "a changed file makes a new cache"


def test_the_tokenizer_is_pinned_in_the_run_id(tmp_path):
    other = tmp_path / "tok.json"
    other.write_bytes(BUNDLED_TOKENIZER.read_bytes().replace(b'"version"', b'"version" ', 1))
    assert _run({"source": "text"}).run_id != _run({"source": "text", "tokenizer_sha256": "0" * 64}).run_id
    with pytest.raises(TokenizerError, match="pins data.tokenizer_sha256"):
        load_dataset(_run({"source": "text", "tokenizer": str(other)}).data, _run({}).model)
    with pytest.raises(ValueError, match="data.tokenizer_sha256"):
        RunConfig.model_validate({"name": "t", "model": {"kind": "llama"}, "data": {"source": "text"}})
    with pytest.raises(ValueError, match="model.kind llama"):
        RunConfig.model_validate({"name": "t", "data": {"source": "tokens", "path": "x"}})
