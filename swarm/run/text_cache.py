"""``data.source: text_files``: a folder of .txt / .jsonl files tokenized once into a cache beside them.

The cache is ``<folder>/.volunteer-tokens/<key>.bin`` (flat uint16 or uint32 tokens) and ``<key>.json`` (its
token and byte counts), where the key hashes the tokenizer's sha256 and every file's name, size and
modification time: a changed file or tokenizer makes a new cache, an unchanged folder is never tokenized
again. The files are read in sorted order, streamed in chunks that end at a line's end; each document (a .txt
file, a .jsonl line's ``text``) ends with ``<|endoftext|>``. Written to a temporary name and renamed, so an
interrupted run leaves no half cache. Progress goes to stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

TEXT_FILE_SUFFIXES = (".txt", ".jsonl")
CACHE_DIR = ".volunteer-tokens"
ENCODE_BATCH = 256  # texts handed to the tokenizer at once (it encodes a batch on all cores)
PROGRESS_EVERY_S = 2.0
UINT16_VOCAB_MAX = 1 << 16


def text_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise ValueError(f"data.path {str(folder)!r} is not a folder: data.source text_files reads a folder of "
                         ".txt / .jsonl files")
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in TEXT_FILE_SUFFIXES)
    if not files:
        raise ValueError(f"data.path {str(folder)!r} holds no .txt or .jsonl files")
    return files


def cache_key(files: list[Path], tokenizer_sha256: str) -> str:
    digest = hashlib.sha256(tokenizer_sha256.encode())
    for file in files:
        stat = file.stat()
        digest.update(f"\0{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def cached_tokens(folder: Path, tokenizer, tokenizer_sha256: str) -> tuple[np.ndarray, int]:
    """(the folder's tokens as a read-only memmap, the UTF-8 bytes of text they encode); tokenizes on a miss."""
    files = text_files(folder)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= UINT16_VOCAB_MAX else np.uint32
    key = cache_key(files, tokenizer_sha256)
    data_file, meta_file = folder / CACHE_DIR / f"{key}.bin", folder / CACHE_DIR / f"{key}.json"
    if not (data_file.is_file() and meta_file.is_file()):
        _tokenize(files, tokenizer, dtype, data_file, meta_file)
    meta = json.loads(meta_file.read_text())
    return np.memmap(data_file, dtype=meta["dtype"], mode="r", shape=(meta["tokens"],)), int(meta["bytes"])


def _tokenize(files: list[Path], tokenizer, dtype: type, data_file: Path, meta_file: Path) -> None:
    from swarm.run.tokenizer import END_OF_TEXT, text_chunks

    data_file.parent.mkdir(exist_ok=True)
    end = tokenizer.token_to_id(END_OF_TEXT)
    partial = data_file.with_suffix(f".{os.getpid()}.tmp")
    counts = {"tokens": 0, "bytes": 0}
    progress = _Progress(data_file.parent.parent, sum(f.stat().st_size for f in files))
    try:
        with open(partial, "wb") as out:
            for file in files:
                jsonl = file.suffix == ".jsonl"  # one document per line; a .txt file is one document
                batch: list[str] = []
                for text in text_chunks([file], on_read=progress.reading):
                    batch.append(text)
                    if len(batch) >= ENCODE_BATCH:
                        _write(out, tokenizer, batch, dtype, counts, end if jsonl else None)
                        batch = []
                _write(out, tokenizer, batch, dtype, counts, end if jsonl else None)
                if not jsonl and end is not None:
                    np.asarray([end], dtype=dtype).tofile(out)
                    counts["tokens"] += 1
                progress.file_done(file)
        os.replace(partial, data_file)
    finally:
        partial.unlink(missing_ok=True)
    meta_file.write_text(json.dumps({"tokens": counts["tokens"], "bytes": counts["bytes"],
                                     "dtype": np.dtype(dtype).name, "files": [f.name for f in files]}))
    print(f"tokenized {data_file.parent.parent}: {counts['tokens']} tokens from {counts['bytes'] / 1e6:.1f} MB "
          f"of text (cache {data_file})", file=sys.stderr, flush=True)


def _write(out, tokenizer, texts: list[str], dtype: type, counts: dict, end_each: int | None) -> None:
    """Encode ``texts`` and append them; ``end_each``: the id closing each text (a .jsonl record)."""
    if not texts:
        return
    for encoding, text in zip(tokenizer.encode_batch(texts, add_special_tokens=False), texts):
        ids = encoding.ids + ([end_each] if end_each is not None else [])
        np.asarray(ids, dtype=dtype).tofile(out)
        counts["tokens"] += len(ids)
        counts["bytes"] += len(text.encode("utf-8"))


class _Progress:
    """The bytes on disk read so far, on stderr at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, folder: Path, total: int):
        self.folder, self.total, self.done_before = folder, max(total, 1), 0
        self.last = time.monotonic()

    def reading(self, done_in_file: int) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            done = self.done_before + done_in_file
            print(f"tokenizing {self.folder}: {done / 1e6:.1f} of {self.total / 1e6:.1f} MB "
                  f"({done / self.total:.0%})", file=sys.stderr, flush=True)

    def file_done(self, file: Path) -> None:
        self.done_before += file.stat().st_size
