"""The run's tokenizer: a byte-level BPE from the ``tokenizers`` library, pinned by its file's sha256.

Byte-level: every byte string has an encoding (no unknown token), and decoding gives back the bytes, so bits
per byte stay comparable with the byte-level charlm. One special token, ``<|endoftext|>`` (id 0), separates
documents. ``data.tokenizer`` names the file (default: the one shipped in corpus/, trained by
``volunteer tokenizer train`` from the shipped corpus), ``data.tokenizer_sha256`` pins it so that the run id
names the tokenizer as ``data.sha256`` names the corpus.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from swarm.run.runconfig import DataConfig

BUNDLED_TOKENIZER = Path(__file__).parent / "corpus" / "bpe-2048.json"
END_OF_TEXT = "<|endoftext|>"
MIN_VOCAB_SIZE = 256 + 1  # every byte, and the special token
TRAIN_CHUNK_CHARS = 1 << 16  # text handed to the trainer at a time (a gzipped corpus is one long "line")


class TokenizerError(ValueError):
    """The tokenizer file is missing, unreadable or not the one the run config pins."""


def tokenizer_path(data: DataConfig) -> Path:
    return Path(data.tokenizer).expanduser() if data.tokenizer is not None else BUNDLED_TOKENIZER


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer(data: DataConfig) -> Tokenizer:
    """The run's tokenizer, after checking the file is the one ``data.tokenizer_sha256`` names."""
    from tokenizers import Tokenizer

    path = tokenizer_path(data)
    if not path.is_file():
        raise TokenizerError(f"data.tokenizer {str(path)!r} does not exist: train one with `volunteer tokenizer "
                             "train --corpus FILES --out tokenizer.json`, or unset data.tokenizer for the shipped one")
    digest = file_sha256(path)
    if data.tokenizer_sha256 is not None and digest != data.tokenizer_sha256.lower():
        raise TokenizerError(f"the tokenizer {str(path)!r} has sha256 {digest}, but the run config pins "
                             f"data.tokenizer_sha256 {data.tokenizer_sha256}: this volunteer would read other tokens. "
                             "Get the run's tokenizer file, or set data.tokenizer_sha256 for a new run")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises its own Exception type for a malformed file
        raise TokenizerError(f"data.tokenizer {str(path)!r} is not a tokenizer.json ({exc})") from None


def end_of_text_id(tokenizer: Tokenizer) -> int | None:
    return tokenizer.token_to_id(END_OF_TEXT)


def text_chunks(paths: list[Path], on_read: Callable[[int], None] | None = None) -> Iterator[str]:
    """The files' text in bounded chunks (gzipped when they end in .gz; .jsonl: each line's ``text``);
    ``on_read`` hears the bytes on disk read so far."""
    done = 0
    for path in paths:
        with open(path, "rb") as raw:
            binary = gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw
            handle = io.TextIOWrapper(binary, encoding="utf-8", errors="replace")
            jsonl = path.name.endswith((".jsonl", ".jsonl.gz"))
            while True:
                if jsonl:
                    line = handle.readline()
                    if not line:
                        break
                    text = _jsonl_text(line)
                else:
                    text = _lines(handle, TRAIN_CHUNK_CHARS)
                    if not text:
                        break
                if on_read is not None:
                    on_read(done + raw.tell())
                if text:
                    yield text
            done += path.stat().st_size
    if on_read is not None:
        on_read(done)


def _lines(handle: io.TextIOBase, max_chars: int) -> str:
    """Whole lines up to about ``max_chars`` characters (a line longer than that is cut): chunks end at a line's
    end, so a word is rarely split between two chunks."""
    lines: list[str] = []
    size = 0
    while size < max_chars:
        line = handle.readline(max_chars)
        if not line:
            break
        lines.append(line)
        size += len(line)
    return "".join(lines)


def _jsonl_text(line: str) -> str | None:
    """A .jsonl line's ``text`` field, None for a blank or malformed line (skipped, as a bad record is)."""
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    text = record.get("text") if isinstance(record, dict) else None
    return text if isinstance(text, str) else None


def train_tokenizer(paths: list[Path], vocab_size: int, show_progress: bool = True,
                    on_read: Callable[[int], None] | None = None) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (the 256 bytes, ``<|endoftext|>``, and merges) learnt from
    the files; deterministic for the same files and size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least {MIN_VOCAB_SIZE} tokens")
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise ValueError(f"--corpus: no such file(s): {', '.join(missing)}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text_chunks(paths, on_read), trainer=trainer)
    return tokenizer


def hf_tokenizer_config(max_length: int) -> dict:
    """tokenizer_config.json beside tokenizer.json: what transformers' AutoTokenizer needs to load it."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, "bos_token": END_OF_TEXT,
            "eos_token": END_OF_TEXT, "unk_token": None, "add_prefix_space": False,
            "clean_up_tokenization_spaces": False}
