"""What a run's data set is (``Dataset``) and how a text corpus is read and pinned: below both the data sources
(data.py) and the BPE tokens (tokens.py), which data.py dispatches to (no import circle between them)."""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

TEXT_SUFFIXES = (".py", ".txt")
BUNDLED_CORPUS = Path(__file__).parent / "corpus" / "python311-stdlib-300k.txt.gz"


@dataclass(frozen=True)
class Dataset:
    """Train and test tensors; ``kind`` says how targets are read: class ids or next-byte ids."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    kind: Literal["classification", "language_model"]
    x_val: torch.Tensor  # the validation split: empty when data.validation_fraction is 0
    y_val: torch.Tensor
    bytes_per_token: float = 1.0  # language models: the text bytes one token stands for (1 for bytes)

    def largest_label(self) -> int:
        """The largest target id of the train and test splits (token windows look at a bounded part)."""
        parts = [int(y.max()) for y in (self.y_train, self.y_test) if len(y)]
        return max(parts) if parts else -1


def check_corpus(corpus: bytes, sha256: str | None, path: str | None) -> None:
    """A pinned corpus must be the bytes the run config names (``data.sha256``)."""
    if sha256 is None:
        return
    digest = hashlib.sha256(corpus).hexdigest()
    if digest != sha256.lower():
        where = path or str(BUNDLED_CORPUS)
        raise ValueError(f"the text corpus read from {where!r} has sha256 {digest}, but the run config pins "
                         f"data.sha256 {sha256}: this volunteer would train on other data. Get the run's corpus "
                         f"file (data.path) or a client version that ships it")


def read_corpus(path: str | None, max_bytes: int) -> bytes:
    """Up to ``max_bytes`` bytes of a file (gzipped when it ends in .gz), or of a folder's *.py/*.txt
    files (top level, sorted); without a path, the corpus shipped with the client."""
    root = Path(path).expanduser() if path is not None else BUNDLED_CORPUS
    if root.is_file() and root.suffix == ".gz":
        with gzip.open(root, "rb") as handle:
            return handle.read(max_bytes)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        files = sorted(f for f in root.iterdir() if f.suffix in TEXT_SUFFIXES and f.is_file())
    else:
        raise ValueError(f"data.path {str(root)!r} does not exist: give a text file or a folder of *.py / *.txt files")
    chunks: list[bytes] = []
    remaining = max_bytes
    for file in files:
        if remaining <= 0:
            break
        with open(file, "rb") as handle:
            chunk = handle.read(remaining)
        chunks.append(chunk)
        remaining -= len(chunk)
    if not chunks:
        raise ValueError(f"data.path {str(root)!r} holds no *.py or *.txt files")
    return b"".join(chunks)
