"""Token data for llama runs: samples are windows of a token array, addressed by sample id.

Sample ``i`` of a split is ``tokens[(first + i) * seq_len : ... + seq_len + 1]``: its input is the first
``seq_len`` tokens, its targets (the next tokens) the last ``seq_len``. Windows overlap by one token, so every
token but the first of a split is a target once. The array may be a ``np.memmap``: a batch reads only its
rows, so a file larger than memory is never read whole (``TokenWindows``).

Sources (``data.source``, with ``model.kind: llama``):
- ``text``: the byte corpus of the charlm run (or ``data.path``), tokenized in memory (``max_text_bytes``
  bounds it); the test split is its tail (at most TEST_WINDOWS_MAX windows), the validation split just before
  it, as for bytes.
- ``tokens``: nanoGPT's layout: ``train.bin``, ``val.bin`` and optionally ``test.bin`` in ``data.path``, flat
  arrays of ``data.token_dtype``. The test split is ``test.bin`` (else ``val.bin``), at most
  TEST_WINDOWS_MAX windows of it; the validation split is ``val.bin`` when ``test.bin`` exists, else the tail
  ``validation_fraction`` of ``train.bin``'s windows.
- ``text_files``: a folder of ``.txt`` / ``.jsonl`` files (each line's ``text``), tokenized once into a cache
  in the folder (text_cache.py), then split as ``text`` is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from swarm.run.dataset import Dataset, check_corpus, read_corpus
from swarm.run.runconfig import DataConfig, ModelConfig

TOKEN_FILES = ("train.bin", "val.bin", "test.bin")
TEST_WINDOWS_MAX = 2048  # an evaluation pass stays short whatever the size of test.bin
MAX_SCAN_TOKENS = 1 << 24  # max(): the tokens looked at, so a check never reads a large file whole
BYTES_PER_TOKEN_SAMPLE = 1 << 20  # tokens decoded to estimate the bytes a token stands for


class TokenWindows:
    """Rows of a token array as a read-only tensor-like: ``w[ids]`` (a LongTensor or array of sample ids),
    ``w[a:b]`` and ``len(w)`` give int64 tensors of shape (n, seq_len). ``shift`` 0: inputs, 1: targets."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int, count: int, shift: int):
        if count < 0 or (count and (first + count) * seq_len + 1 > len(tokens)):
            raise ValueError(f"{count} windows from {first} do not fit {len(tokens)} tokens")
        self.tokens, self.seq_len, self.first, self.count, self.shift = tokens, seq_len, first, count, shift
        self._offsets = np.arange(seq_len, dtype=np.int64)

    def __len__(self) -> int:
        return self.count

    @property
    def shape(self) -> tuple[int, int]:
        return (self.count, self.seq_len)

    def __getitem__(self, key) -> torch.Tensor:
        if isinstance(key, slice):
            ids = np.arange(self.count, dtype=np.int64)[key]
        else:
            ids = np.asarray(key.cpu() if isinstance(key, torch.Tensor) else key, dtype=np.int64)
        scalar = ids.ndim == 0
        ids = ids.reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.count):
            raise IndexError(f"sample ids outside 0..{self.count - 1}")
        starts = (self.first + ids) * self.seq_len + self.shift
        rows = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))
        return rows[0] if scalar else rows

    def max(self) -> int:
        """The largest token of the split's first MAX_SCAN_TOKENS tokens (a bounded check, not a full scan)."""
        if not self.count:
            return -1
        start = self.first * self.seq_len + self.shift
        stop = min(start + self.count * self.seq_len, start + MAX_SCAN_TOKENS)
        return int(np.asarray(self.tokens[start:stop]).max())


def windows(tokens: np.ndarray, seq_len: int, first: int, count: int) -> tuple[TokenWindows, TokenWindows]:
    return TokenWindows(tokens, seq_len, first, count, 0), TokenWindows(tokens, seq_len, first, count, 1)


def window_count(n_tokens: int, seq_len: int) -> int:
    return max(0, (n_tokens - 1) // seq_len)


def token_dataset(data: DataConfig, model: ModelConfig) -> Dataset:
    """The llama run's data set from ``data.source`` (text, tokens, text_files)."""
    from swarm.run.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(data)
    if model.vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"model.vocab_size ({model.vocab_size}) is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.get_vocab_size()}): set model.vocab_size to at least "
                         f"{tokenizer.get_vocab_size()}")
    if data.source == "tokens":
        return _token_files_dataset(data, model, tokenizer)
    if data.source == "text_files":
        from swarm.run.text_cache import cached_tokens

        tokens, n_bytes = cached_tokens(Path(data.path).expanduser(), tokenizer, data.tokenizer_sha256 or "")
    else:
        corpus = read_corpus(data.path, data.max_text_bytes)
        check_corpus(corpus, data.sha256, data.path)
        tokens = np.asarray(tokenizer.encode(corpus.decode("utf-8", errors="replace")).ids, dtype=np.uint32)
        n_bytes = len(corpus)
    return _tail_split(tokens, data, model, n_bytes / max(len(tokens), 1))


def _tail_split(tokens: np.ndarray, data: DataConfig, model: ModelConfig, bytes_per_token: float) -> Dataset:
    """Train, validation and test windows of one array: the test split is its tail, validation just before."""
    total = window_count(len(tokens), model.seq_len)
    n_test = min(max(1, int(round(data.test_fraction * total))), total - 1, TEST_WINDOWS_MAX)
    n_val = min(max(1, int(round(data.validation_fraction * total))), total - n_test - 1) \
        if data.validation_fraction > 0 else 0
    n_train = total - n_test - n_val
    if n_train < 1:
        raise ValueError(f"the text gives {len(tokens)} tokens, {total} windows of model.seq_len+1 "
                         f"({model.seq_len + 1}) tokens: too few for a train, validation and test split. Use more "
                         f"text (data.path, data.max_text_bytes) or a smaller model.seq_len")
    train, val, test = (windows(tokens, model.seq_len, first, count)
                        for first, count in ((0, n_train), (n_train, n_val), (n_train + n_val, n_test)))
    return _dataset(train, val, test, model, bytes_per_token)


def _token_files_dataset(data: DataConfig, model: ModelConfig, tokenizer) -> Dataset:
    folder = Path(data.path).expanduser()
    arrays = {name: _memmap(folder / name, data.token_dtype) for name in TOKEN_FILES if (folder / name).is_file()}
    for name in TOKEN_FILES[:2]:
        if name not in arrays:
            raise ValueError(f"data.path {str(folder)!r} has no {name}: data.source tokens reads nanoGPT's layout, "
                             "train.bin and val.bin (test.bin optional), flat arrays of data.token_dtype")
    seq = model.seq_len
    counts = {name: window_count(len(array), seq) for name, array in arrays.items()}
    for name, count in counts.items():
        if count < 1:
            raise ValueError(f"{folder / name} holds {len(arrays[name])} tokens, not one window of model.seq_len+1 "
                             f"({seq + 1}): add tokens or lower model.seq_len")
    test_name = "test.bin" if "test.bin" in arrays else "val.bin"
    test = windows(arrays[test_name], seq, 0, min(counts[test_name], TEST_WINDOWS_MAX))
    n_train = counts["train.bin"]
    if "test.bin" in arrays:
        val = windows(arrays["val.bin"], seq, 0, counts["val.bin"])
    else:  # val.bin is the test split: validation is carved from train.bin's tail
        n_val = min(int(round(data.validation_fraction * n_train)), n_train - 1)
        n_train -= n_val
        val = windows(arrays["train.bin"], seq, n_train, n_val)
    train = windows(arrays["train.bin"], seq, 0, n_train)
    return _dataset(train, val, test, model, _bytes_per_token(arrays[test_name], tokenizer))


def _memmap(path: Path, dtype: str) -> np.ndarray:
    size = path.stat().st_size
    item = np.dtype(dtype).itemsize
    if size % item:
        raise ValueError(f"{path} has {size} bytes, not a whole number of {dtype} tokens: set data.token_dtype to "
                         "the dtype the file was written with")
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)


def _bytes_per_token(tokens: np.ndarray, tokenizer) -> float:
    """The UTF-8 bytes a token stands for, on average over (the start of) a split: converts nats per token
    into bits per byte."""
    sample = np.asarray(tokens[:BYTES_PER_TOKEN_SAMPLE]).tolist()
    if not sample:
        return 1.0
    return max(len(tokenizer.decode(sample, skip_special_tokens=False).encode("utf-8")), 1) / len(sample)


def _dataset(train, val, test, model: ModelConfig, bytes_per_token: float) -> Dataset:
    return Dataset(x_train=train[0], y_train=train[1], x_test=test[0], y_test=test[1], num_classes=model.vocab_size,
                   kind="language_model", x_val=val[0], y_val=val[1], bytes_per_token=bytes_per_token)
