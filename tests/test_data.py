"""Data sets, splits and shards: deterministic, checked, and clear when the input is wrong."""

import numpy as np
import pytest
import torch

from swarm.run.data import MicroBatches, choose_shard, load_dataset, make_shards, read_corpus
from swarm.run.runconfig import DataConfig, ModelConfig

DIGITS = DataConfig(source="digits")
MLP = ModelConfig()
LM = ModelConfig(kind="transformer", seq_len=8)


@pytest.fixture(scope="module")
def digits():
    return load_dataset(DIGITS, MLP)


def test_digits_split_is_stratified_scaled_and_the_same_every_time(digits):
    again = load_dataset(DIGITS, MLP)
    assert torch.equal(digits.x_train, again.x_train) and torch.equal(digits.y_test, again.y_test)
    assert len(digits.x_train) + len(digits.x_val) + len(digits.x_test) == 1797
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() <= 1.0
    test_share = np.bincount(digits.y_test, minlength=10) / np.bincount(
        np.concatenate([digits.y_train, digits.y_val, digits.y_test]), minlength=10
    )
    assert np.all(np.abs(test_share - DIGITS.test_fraction) < 0.01)


def test_iid_shards_partition_the_train_set(digits):
    shards = make_shards(digits.y_train, DIGITS, 10)
    sizes = [len(shard) for shard in shards]
    assert len(shards) == DIGITS.shards and max(sizes) - min(sizes) <= 1
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(len(digits.y_train)))


def test_label_skewed_shards_hold_exactly_k_classes_and_cover_all(digits):
    data = DataConfig(partition="label_skewed", shards=8, classes_per_shard=8)
    shards = make_shards(digits.y_train, data, 10)
    labels = digits.y_train.numpy()
    assert all(len(np.unique(labels[shard])) == 8 for shard in shards)
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(len(labels)))
    assert set(np.concatenate([labels[s] for s in shards])) == set(range(10))


def test_label_skewed_is_refused_for_a_language_model():
    data = DataConfig(partition="label_skewed", shards=2)
    with pytest.raises(ValueError, match="iid"):
        make_shards(torch.zeros(10, 8, dtype=torch.int64), data, 256)


def test_choose_shard_takes_the_rarest_with_ties_to_the_lowest_and_ignores_junk():
    assert choose_shard(4, []) == 0
    assert choose_shard(4, [0, 0, 1, 2, 3, 3]) == 1
    assert choose_shard(4, [0, 1, 2, 3, 2]) == 0
    assert choose_shard(3, [0, 1, -1, 7, 99, "2", None]) == 2


def test_simultaneous_joiners_spread_over_the_rarest_shards_by_peer_id():
    picks = [choose_shard(8, [], tiebreak=f"peer{i}") for i in range(40)]
    assert len(set(picks)) >= 6  # not all on shard 0
    assert picks == [choose_shard(8, [], tiebreak=f"peer{i}") for i in range(40)]  # deterministic per peer
    assert all(choose_shard(4, [0, 1, 3], tiebreak=f"peer{i}") == 2 for i in range(10))  # rarest still wins


def test_npz_errors_name_the_file_and_what_is_missing(tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(ValueError, match="nope.npz.*does not exist"):
        load_dataset(DataConfig(source="npz", path=str(missing)), MLP)
    no_y = tmp_path / "no_y.npz"
    np.savez(no_y, X=np.zeros((4, 64)))
    with pytest.raises(ValueError, match=r"no_y.npz.*no array 'y'"):
        load_dataset(DataConfig(source="npz", path=str(no_y)), MLP)
    uneven = tmp_path / "uneven.npz"
    np.savez(uneven, X=np.zeros((4, 64)), y=np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="uneven.npz.*4 rows.*3 labels"):
        load_dataset(DataConfig(source="npz", path=str(uneven)), MLP)


def test_a_valid_npz_file_loads_with_a_stratified_split(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, X=np.random.default_rng(0).random((100, 2, 3)), y=np.arange(100) % 4)
    data = load_dataset(DataConfig(source="npz", path=str(good)), ModelConfig(input_dim=6, num_classes=4))
    assert data.x_train.shape == (72, 6) and data.x_train.dtype == torch.float32  # 20 test, 8 validation
    assert np.bincount(data.y_test, minlength=4).tolist() == [5, 5, 5, 5]


def test_text_corpus_loads_deterministically_as_next_byte_pairs(tmp_path):
    corpus = bytes(range(256)) * 4
    (tmp_path / "a.txt").write_bytes(corpus)
    data = DataConfig(source="text", path=str(tmp_path / "a.txt"), test_fraction=0.25)
    first, second = load_dataset(data, LM), load_dataset(data, LM)
    assert torch.equal(first.x_train, second.x_train) and torch.equal(first.y_test, second.y_test)
    n_sequences = len(corpus) // 9
    assert len(first.x_train) + len(first.x_val) + len(first.x_test) == n_sequences
    assert first.x_train.shape[1] == 8 and first.x_train.dtype == torch.int64
    assert torch.equal(first.x_train[0], torch.arange(8)) and torch.equal(first.y_train[0], torch.arange(1, 9))
    assert first.x_test[-1, 0].item() == corpus[(n_sequences - 1) * 9]  # the test split is the tail


def test_a_folder_corpus_reads_sorted_py_and_txt_files_up_to_the_cap(tmp_path):
    (tmp_path / "b.py").write_bytes(b"B" * 10)
    (tmp_path / "a.txt").write_bytes(b"A" * 10)
    (tmp_path / "c.bin").write_bytes(b"C" * 10)
    assert read_corpus(str(tmp_path), 15) == b"A" * 10 + b"B" * 5
    assert len(read_corpus(None, 2048)) == 2048  # the corpus shipped with the client


def test_micro_batches_have_a_fixed_size_cover_each_epoch_and_follow_the_seed():
    x, y = torch.arange(10).float(), torch.arange(10)
    batches = MicroBatches(x, y, np.arange(10), batch_size=5, seed=3)
    epoch = [next(batches) for _ in range(2)]
    assert all(len(bx) == 5 for bx, _ in epoch)
    assert sorted(torch.cat([by for _, by in epoch]).tolist()) == list(range(10))
    replay = MicroBatches(x, y, np.arange(10), batch_size=5, seed=3)
    assert all(torch.equal(next(replay)[1], by) for _, by in epoch)


def test_a_shared_shard_is_left_for_an_unheld_one_by_the_larger_peer_id():
    from swarm.run.data import rebalance_shard

    # b shares shard 2 with a (smaller id) while shards 0, 1 and 3 are free: b moves to one of them
    moved = rebalance_shard(4, 2, "b", {"a": 2})
    assert moved in (0, 1, 3)
    assert rebalance_shard(4, 2, "a", {"b": 2}) is None  # the smallest id keeps its shard
    assert rebalance_shard(2, 1, "b", {"a": 1, "c": 0}) is None  # every shard is held: keep sharing
    assert rebalance_shard(4, 2, "b", {"a": 1}) is None  # nobody else holds ours
    # two peers on one shard of two spread out in one step, whatever their ids
    for i in range(20):
        me, other = f"peer{i}b", f"peer{i}a"
        assert rebalance_shard(2, 0, me, {other: 0}) == 1


def test_digits_are_read_without_importing_scikit_learn_and_match_load_digits():
    from sklearn.datasets import load_digits

    from swarm.run import data as data_module

    x, y = data_module._digits_arrays()
    reference = load_digits()
    assert data_module._digits_file() is not None
    assert np.array_equal(y, reference.target) and np.allclose(x * data_module.DIGITS_PIXEL_MAX, reference.data)
