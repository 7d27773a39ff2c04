"""Data sets, the train/validation/test split, data shards and the rarest-first shard choice.

Every volunteer of a run must see the same split and the same shards, so everything here is
deterministic given the run config: no downloads, no global RNG, files read in sorted order.

Sources:
- ``digits``: scikit-learn's bundled 8x8 digits (1797 images, 10 classes), pixels scaled to [0, 1].
- ``text``: a byte-level corpus (vocabulary 256) from ``data.path`` (a file, a gzipped file, or a
  folder of *.py and *.txt files) or, by default, the corpus shipped in ``swarm/run/corpus/`` (the same
  bytes for every volunteer, whatever its Python version). ``data.sha256`` pins the bytes read, so
  the run id identifies the data: a volunteer whose file differs is told so instead of training on
  other data.
- ``npz``: a user file with a float array ``X`` (N, ...) and integer labels ``y`` (N,).
- ``text`` with ``model.kind: llama``, ``tokens`` and ``text_files``: BPE tokens in windows addressed by sample
  id, memory-mapped from disk where they come from files (tokens.py, text_cache.py).

Splits: the test split (``data.test_fraction``) is what the run publishes; the validation split
(``data.validation_fraction`` of the whole set, carved out of what is left, never out of the test
split) is what copies are compared on when a peer decides whether to adopt another's copy
(swarm/averaging/validation.py). Neither is ever trained on: shards cut the train split only.
Classification sets split both stratified by class; text takes the test split from the tail of the
corpus and the validation split from just before it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from swarm.run.dataset import BUNDLED_CORPUS, Dataset, check_corpus, read_corpus  # noqa: F401 (re-exported)
from swarm.run.runconfig import DataConfig, ModelConfig

BYTE_VOCAB_SIZE = 256
DIGITS_PIXEL_MAX = 16.0


def load_dataset(data: DataConfig, model: ModelConfig) -> Dataset:
    """The run's data set, split into train and test, checked against the model's shapes."""
    if model.kind == "llama" or data.source in ("tokens", "text_files"):
        from swarm.run.tokens import token_dataset  # BPE tokens (swarm/run/tokens.py)

        return token_dataset(data, model)
    if data.source == "text":
        return _text_dataset(data, model)
    if data.source == "digits":
        x, y = _digits_arrays()
    else:
        x, y = _npz_arrays(data.path)
    _check_classifier_fits(x, y, model, data.source)
    train, test = stratified_split(y, data.test_fraction, data.split_seed)
    train, val = validation_split(y, train, data.validation_fraction, data.split_seed)
    return Dataset(
        x_train=torch.from_numpy(x[train]),
        y_train=torch.from_numpy(y[train]),
        x_test=torch.from_numpy(x[test]),
        y_test=torch.from_numpy(y[test]),
        num_classes=model.num_classes,
        kind="classification",
        x_val=torch.from_numpy(x[val]),
        y_val=torch.from_numpy(y[val]),
    )


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices with each class's share of test samples close to test_fraction."""
    rng = np.random.default_rng(seed)
    train: list[np.ndarray] = []
    test: list[np.ndarray] = []
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        n_test = int(round(test_fraction * len(members)))
        test.append(members[:n_test])
        train.append(members[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def validation_split(y: np.ndarray, train: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices: about ``fraction`` of each class's samples of the whole set move
    from ``train`` to the validation split (seeded apart from the test split, which stays as it was).
    A class keeps at least one training sample."""
    if fraction <= 0:
        return train, train[:0]
    rng = np.random.default_rng([seed, 1])
    kept: list[np.ndarray] = []
    held: list[np.ndarray] = []
    for label in np.unique(y[train]):
        members = rng.permutation(train[y[train] == label])
        n_val = min(int(round(fraction * np.count_nonzero(y == label))), len(members) - 1)
        held.append(members[:n_val])
        kept.append(members[n_val:])
    return np.sort(np.concatenate(kept)), np.sort(np.concatenate(held))


# ----- classification sources
def _digits_file() -> Path | None:
    """scikit-learn's bundled digits.csv.gz, found without importing scikit-learn (0.6 s of CPU at every
    volunteer's start)."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        file = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if file.is_file():
            return file
    return None


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    file = _digits_file()
    if file is not None:  # the same rows load_digits() reads: 64 pixels, then the label
        table = np.loadtxt(file, delimiter=",")
        data, target = table[:, :-1], table[:, -1]
    else:
        from sklearn.datasets import load_digits  # bundled with scikit-learn: never downloads

        digits = load_digits()
        data, target = digits.data, digits.target
    return (data / DIGITS_PIXEL_MAX).astype(np.float32), target.astype(np.int64)


def _npz_arrays(path: str | None) -> tuple[np.ndarray, np.ndarray]:
    if path is None:
        raise ValueError("data.source is 'npz' but data.path is not set: point it at an .npz file with arrays X and y")
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"data.path {str(file)!r} does not exist: create it with numpy.savez(path, X=..., y=...)")
    try:
        with np.load(file, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in ("X", "y") if name in archive.files}
            found = archive.files
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(file)!r} is not a readable .npz file ({error}): save it with numpy.savez") from error
    for name in ("X", "y"):
        if name not in arrays:
            raise ValueError(
                f"{str(file)!r} has no array {name!r} (it has {found}): save it with numpy.savez(path, X=..., y=...)"
            )
    x, y = arrays["X"], arrays["y"]
    if len(x) != len(y):
        raise ValueError(f"{str(file)!r}: X has {len(x)} rows but y has {len(y)} labels; they must match one to one")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{str(file)!r}: y must be a 1-D array of integer labels, got {y.dtype} of shape {y.shape}")
    return x.reshape(len(x), -1).astype(np.float32), y.astype(np.int64)


def _check_classifier_fits(x: np.ndarray, y: np.ndarray, model: ModelConfig, source: str) -> None:
    if model.kind != "mlp":
        raise ValueError(f"data.source {source!r} is a classification set; it needs model.kind 'mlp'")
    if x.shape[1] != model.input_dim:
        raise ValueError(f"data.source {source!r} has {x.shape[1]} features; set model.input_dim to {x.shape[1]}")
    if len(y) and (y.min() < 0 or y.max() >= model.num_classes):
        raise ValueError(
            f"data.source {source!r} has labels {y.min()}..{y.max()}; model.num_classes ({model.num_classes}) "
            f"must exceed the largest label"
        )


# ----- text source
def _text_dataset(data: DataConfig, model: ModelConfig) -> Dataset:
    if model.kind != "transformer":
        raise ValueError("data.source 'text' is a language-model corpus; it needs model.kind 'transformer'")
    if model.vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"model.vocab_size ({model.vocab_size}) must be at least {BYTE_VOCAB_SIZE} for byte text")
    corpus = read_corpus(data.path, data.max_text_bytes)
    check_corpus(corpus, data.sha256, data.path)
    span = model.seq_len + 1
    n_sequences = len(corpus) // span
    if n_sequences < 2:
        raise ValueError(
            f"the text corpus has {len(corpus)} bytes, fewer than two sequences of model.seq_len+1 ({span}) "
            f"bytes: use a bigger data.path or a smaller model.seq_len"
        )
    sequences = torch.frombuffer(bytearray(corpus[: n_sequences * span]), dtype=torch.uint8).long().view(-1, span)
    n_test = min(max(1, int(round(data.test_fraction * n_sequences))), n_sequences - 1)
    n_val = 0
    if data.validation_fraction > 0:
        n_val = min(max(1, int(round(data.validation_fraction * n_sequences))), n_sequences - n_test - 1)
    n_train = n_sequences - n_test - n_val
    if n_train < 1:
        raise ValueError(f"the text corpus has {n_sequences} sequences, too few for a test and a validation split: "
                         f"use a bigger data.path or a smaller data.test_fraction / data.validation_fraction")
    train, val, test = sequences[:n_train], sequences[n_train : n_train + n_val], sequences[n_train + n_val :]
    return Dataset(
        x_train=train[:, :-1].contiguous(),
        y_train=train[:, 1:].contiguous(),
        x_test=test[:, :-1].contiguous(),
        y_test=test[:, 1:].contiguous(),
        num_classes=model.vocab_size,
        kind="language_model",
        x_val=val[:, :-1].contiguous(),
        y_val=val[:, 1:].contiguous(),
    )


# ----- shards
def make_shards(y_train: torch.Tensor | np.ndarray, data: DataConfig, num_classes: int) -> list[np.ndarray]:
    """``data.shards`` arrays of train indices: an IID split, or label-skewed with k classes per shard."""
    if data.shards > len(y_train):
        raise ValueError(f"data.shards ({data.shards}) exceeds the {len(y_train)} training samples: use fewer shards")
    rng = np.random.default_rng(data.split_seed)
    if data.partition == "iid":  # by sample id alone: token windows are never read here
        return [np.sort(part) for part in np.array_split(rng.permutation(len(y_train)), data.shards)]
    labels = np.asarray(y_train)
    if labels.ndim != 1:
        raise ValueError(
            "data.partition 'label_skewed' needs one class label per sample; a language model's targets are "
            "sequences, so use data.partition 'iid'"
        )
    return _label_skewed_shards(labels, data.shards, data.classes_per_shard, num_classes, rng)


def shard_classes(num_shards: int, classes_per_shard: int, num_classes: int) -> list[list[int]]:
    """The classes each shard holds: runs of k consecutive classes (mod C) from evenly spread starts.

    Starts ``floor(s * C / S)`` are at most ``ceil(C / S)`` apart, so when ``S * k >= C`` every class
    is held by at least one shard and the holders of each class are balanced.
    """
    if not 1 <= classes_per_shard <= num_classes:
        raise ValueError(f"data.classes_per_shard ({classes_per_shard}) must be within 1..{num_classes}")
    if num_shards * classes_per_shard < num_classes:
        raise ValueError(
            f"data.shards ({num_shards}) x data.classes_per_shard ({classes_per_shard}) cannot cover "
            f"{num_classes} classes: raise either"
        )
    starts = [s * num_classes // num_shards for s in range(num_shards)]
    return [sorted((start + j) % num_classes for j in range(classes_per_shard)) for start in starts]


def _label_skewed_shards(
    labels: np.ndarray, num_shards: int, classes_per_shard: int, num_classes: int, rng: np.random.Generator
) -> list[np.ndarray]:
    classes = shard_classes(num_shards, classes_per_shard, num_classes)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
    for label in range(num_classes):
        holders = [s for s, held in enumerate(classes) if label in held]
        members = rng.permutation(np.flatnonzero(labels == label))
        if len(members) < len(holders):
            raise ValueError(
                f"class {label} has {len(members)} training samples but {len(holders)} shards hold it: "
                f"lower data.shards or data.classes_per_shard"
            )
        for shard, chunk in zip(holders, np.array_split(members, len(holders))):
            parts[shard].append(chunk)
    return [np.sort(np.concatenate(chunks)) for chunks in parts]


def choose_shard(num_shards: int, held: list[int], tiebreak: str = "") -> int:
    """Rarest first: a shard held by the fewest online layer0 peers.

    Ties go to the lowest index when ``tiebreak`` is empty; otherwise to the candidate a hash of
    ``tiebreak`` (the peer id) picks, so peers that join at the same moment, each seeing no holder
    yet, spread over the shards instead of all taking shard 0.
    ``held`` comes from DHT records of other peers, so ids that are not ints in range are ignored.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    counts = [0] * num_shards
    for shard in held:
        if isinstance(shard, int) and not isinstance(shard, bool) and 0 <= shard < num_shards:
            counts[shard] += 1
    rarest = [i for i, count in enumerate(counts) if count == min(counts)]
    if not tiebreak:
        return rarest[0]
    digest = hashlib.sha256(tiebreak.encode()).digest()
    return rarest[int.from_bytes(digest[:8], "big") % len(rarest)]


def rebalance_shard(num_shards: int, mine: int, me: str, others: dict[str, int]) -> int | None:
    """A new shard for us, or None to keep ours. ``others``: the shard of every other online layer0 peer.

    When a peer with a smaller id holds our shard while some shard is held by nobody, we move to one of
    those (the same hash tie-break as ``choose_shard``); the smallest id keeps its shard, so peers that
    picked the same shard at the same moment spread out within a heartbeat or two.
    """
    if not any(shard == mine and peer < me for peer, shard in others.items()):
        return None
    held = [shard for shard in others.values()]
    if all(any(shard == k for shard in held) for k in range(num_shards)):
        return None  # every shard is held: sharing ours is the best there is
    return choose_shard(num_shards, held, tiebreak=me)


# ----- micro-batches
class MicroBatches(Iterator[tuple[torch.Tensor, torch.Tensor]]):
    """Endless (x, y) micro-batches over ``indices``, reshuffled every epoch from a seeded generator
    (``next_with_ids``: (x, sample ids), what the pipeline driver sends).

    Every batch has exactly ``batch_size`` samples (the last partial batch of an epoch is dropped; the
    next shuffle covers it) so a stage server can expect a fixed shape; with fewer samples than
    ``batch_size`` each batch is the whole (shuffled) set.
    """

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, indices: np.ndarray | torch.Tensor, batch_size: int, seed: int = 0
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.x, self.y = x, y
        self.indices = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        if len(self.indices) == 0:
            raise ValueError("MicroBatches needs at least one index: the shard is empty")
        self.batch_size = min(batch_size, len(self.indices))
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = -1
        self._order = self.indices[:0]
        self._position = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.next_ids()
        return self.x[batch], self.y[batch]

    def next_with_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch as (x, sample ids): int64 row indices into ``x``/``y`` (the train split).
        The driver sends ids, never targets: the last stage looks the labels up in its own copy of the data."""
        batch = self.next_ids()
        return self.x[batch], batch.clone()

    def next_ids(self) -> torch.Tensor:
        if self._position + self.batch_size > len(self._order):
            self._order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
            self._position = 0
            self.epoch += 1
        batch = self._order[self._position : self._position + self.batch_size]
        self._position += self.batch_size
        return batch
