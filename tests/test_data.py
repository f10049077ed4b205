"""Data pipeline: shard round trip, prepare-data, the embedded corpus, and the batch stream."""
import json

import numpy as np
import pytest

from megasparse.config import DataConfig
from megasparse.data.corpus import iter_documents, stdlib_dir, stdlib_files
from megasparse.data.loader import PretrainingBatches, evaluation_batches
from megasparse.data.permutation import FeistelPermutation
from megasparse.data.prepare import prepare_data
from megasparse.data.shards import ShardWriter, TokenWindows, open_prepared
from megasparse.data.tokenizer import file_sha256, load_tokenizer, training_sample, up_to_bytes
from megasparse.errors import UserError


def windows_of(tokens_per_shard, seq_len, tmp_path, dtype=np.uint16):
    """Write consecutive ids into shards of the given sizes; return the windows and the shards."""
    writer = ShardWriter(tmp_path, "train", np.dtype(dtype), shard_tokens=max(tokens_per_shard))
    start, shards = 0, []
    for n in tokens_per_shard:
        shards.append(np.arange(start, start + n) % 60000)
        start += n
        writer.write(shards[-1])
    entry = writer.close()
    return TokenWindows([tmp_path / s["file"] for s in entry["shards"]], [s["tokens"] for s in entry["shards"]],
                        np.dtype(dtype), seq_len), shards


def test_shard_round_trip_and_windows(tmp_path):
    windows, shards = windows_of([100, 100, 37], seq_len=8, tmp_path=tmp_path)
    assert len(windows) == 12 + 12 + 4  # (n - 1) // seq_len per shard
    np.testing.assert_array_equal(windows[0], shards[0][:9])
    np.testing.assert_array_equal(windows[11], shards[0][88:97])
    np.testing.assert_array_equal(windows[12], shards[1][:9])
    np.testing.assert_array_equal(windows[27], shards[2][24:33])
    assert windows[5].dtype == np.int64
    with pytest.raises(IndexError):
        windows[28]


def test_writer_splits_long_documents_across_shards(tmp_path):
    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint32), shard_tokens=10)
    writer.write(np.arange(25))
    writer.write(np.arange(3))
    entry = writer.close()
    assert [s["tokens"] for s in entry["shards"]] == [10, 10, 8] and entry["documents"] == 2
    data = np.concatenate([np.fromfile(tmp_path / s["file"], dtype=np.uint32) for s in entry["shards"]])
    np.testing.assert_array_equal(data, np.concatenate([np.arange(25), np.arange(3)]))


def test_prepared_dataset(dataset, corpus):
    data = open_prepared(dataset)
    index = json.loads((dataset / "index.json").read_text())
    assert index["tokenizer"]["sha256"] == file_sha256(dataset / "tokenizer.model")
    assert data.vocab_size == 400 and index["dtype"] == "uint16"
    train, val = index["splits"]["train"], index["splits"]["val"]
    assert train["tokens"] > 50_000 and val["tokens"] > 5_000
    assert val["documents"] == pytest.approx((train["documents"] + val["documents"]) / 10, abs=1)
    # the shards hold exactly the documents, tokenised, each followed by EOS
    sp = load_tokenizer(dataset / "tokenizer.model")
    docs = list(iter_documents(DataConfig(files=[str(corpus / "*.txt")])))
    expected = [t for i, d in enumerate(docs) if i % 10 != 9 for t in sp.encode(d) + [sp.eos_id()]]
    stored = np.concatenate([np.fromfile(dataset / s["file"], dtype=np.uint16) for s in train["shards"]])
    np.testing.assert_array_equal(stored, expected)
    assert sp.decode(sp.encode(docs[3])) == docs[3]  # no normalisation: code and whitespace survive


def test_prepare_with_an_existing_tokenizer_and_one_worker(dataset, corpus, tmp_path):
    out = tmp_path / "again"
    prepare_data(DataConfig(path=str(out), files=[str(corpus / "*.txt")], tokenizer=str(dataset / "tokenizer.model"),
                            val_fraction=0.1, workers=1), progress=False)
    for name in ("train-00000.bin", "val-00000.bin"):
        assert (out / name).read_bytes() == (dataset / name).read_bytes(), name
    trained = open_prepared(dataset).index
    del trained["tokenizer"]["trained_on"]  # what the tokenizer was trained on: only where it was trained
    assert open_prepared(out).index == trained


def test_jsonl_and_parquet_sources(tmp_path, dataset):
    import datasets

    rows = [{"text": f"document number {i} " * 20, "id": i} for i in range(30)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "b.parquet"))
    cfg = DataConfig(files=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")])
    assert list(iter_documents(cfg)) == [r["text"] for r in rows] * 2
    assert list(iter_documents(DataConfig(files=cfg.files, text_field="body"))) == []  # bad files: skipped
    with pytest.raises(UserError, match="no column 'body' \\(columns: text, id\\)"):
        list(iter_documents(DataConfig(files=[str(tmp_path / "b.parquet")], text_field="body", on_bad_file="error")))
    with pytest.raises(UserError, match="line 1 has no field 'body'"):
        list(iter_documents(DataConfig(files=[str(tmp_path / "a.jsonl")], text_field="body", on_bad_file="error")))


def test_embedded_corpus_is_the_standard_library():
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"argparse.py", "textwrap.py", "os.py"} <= names and len(files) > 300
    parts = {part for f in files for part in f.relative_to(stdlib_dir()).parts}
    assert not parts & {"test", "tests", "site-packages", "__pycache__"}
    first = next(iter_documents(DataConfig()))
    assert first == files[0].read_text()


BAD_DATA = [  # (file, content, refused with data.on_bad_file: error, the problem a skipped file is listed with)
    ("missing.txt", None, "'.*missing.txt' does not exist", None),
    ("*.nothing", None, "no file matches", None),
    ("empty.txt", b"", ": empty", "empty"),
    ("binary.txt", b"ab\x00\x01cd" * 10, "looks binary", "looks binary"),
    ("latin.txt", "caf\xe9 ".encode("latin-1") * 10, "not UTF-8 text", "not UTF-8 text"),
    ("table.csv", b"x,y", "unsupported type '.csv'", None),
    ("blank.txt", b"\n\n   \n", "no text found", None),
    ("broken.jsonl", b'{"text": "a"}\n{"text": \n', "line 2 is not JSON", None),
]


@pytest.mark.parametrize("on_bad_file,name,content,message", [
    ("error", name, content, message) for name, content, message, _ in BAD_DATA] + [
    # skipped: a corpus of only that file has no text (a bad row beside good ones: test_corpus_files.py)
    ("skip", name, content, f"no text found in .*{name} \\(1 bad file skipped, first .*{name}: {problem}" if problem
     else message) for name, content, message, problem in BAD_DATA if name != "broken.jsonl"])
def test_bad_data_files_fail_clearly_and_write_nothing(tmp_path, name, content, message, on_bad_file):
    """Refused in one line with data.on_bad_file: error; with skip, a corpus of one bad file has no text."""
    if content is not None:
        (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=message) as error:
        prepare_data(DataConfig(path=str(out), files=[str(tmp_path / name)], vocab_size=300, on_bad_file=on_bad_file),
                     progress=False)
    assert "\n" not in str(error.value)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging left behind


def test_existing_dataset_is_never_overwritten(dataset, corpus):
    before = (dataset / "index.json").read_bytes()
    with pytest.raises(UserError, match="already holds a prepared dataset"):
        prepare_data(DataConfig(path=str(dataset), files=[str(corpus / "*.txt")]), progress=False)
    assert (dataset / "index.json").read_bytes() == before


def test_vocabulary_too_large_for_the_data(tmp_path):
    (tmp_path / "small.txt").write_text("a few words only\n")
    with pytest.raises(UserError, match=r"tokenizer training failed \(data.vocab_size=5000\): Vocabulary size too high \(5000\)"):
        prepare_data(DataConfig(path=str(tmp_path / "out"), files=[str(tmp_path / "small.txt")], vocab_size=5000),
                     progress=False)


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "train-00000.bin").write_bytes((d / "train-00000.bin").read_bytes()[:-2]), "truncated or replaced"),
    (lambda d: (d / "val-00000.bin").unlink(), "is missing"),
    (lambda d: (d / "index.json").write_text("{not json"), "is not valid JSON"),
    (lambda d: (d / "tokenizer.model").unlink(), "missing its tokenizer"),
])
def test_damaged_datasets_are_refused(dataset, tmp_path, damage, message):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    damage(copy)
    with pytest.raises(UserError, match=message):
        open_prepared(copy)


def test_missing_dataset_says_how_to_make_one(tmp_path):
    with pytest.raises(UserError, match="run `megasparse prepare-data`"):
        open_prepared(tmp_path)


# ------------------------------------------------------------------ the batch stream


def stream(windows, dp_size, micro, global_batch=12, consumed=0, seed=3):
    return [PretrainingBatches(windows, global_batch, micro, r, dp_size, seed, consumed) for r in range(dp_size)]


def global_batch_rows(loaders):
    """The rows of one optimizer step over all ranks, as a set of token tuples."""
    return sorted(tuple(row.tolist()) for loader in loaders for x, y in loader.next_step()
                  for row in np.concatenate([x, y[:, -1:]], axis=1))


@pytest.mark.parametrize("dp_size,micro", [(2, 6), (2, 3), (3, 2), (4, 1), (1, 3)])
def test_global_batch_is_the_same_for_any_layout(tmp_path, dp_size, micro):
    windows, _ = windows_of([500, 300], seq_len=8, tmp_path=tmp_path)
    reference, other = stream(windows, 1, 12), stream(windows, dp_size, micro)
    for _ in range(10):  # 120 samples > 97 windows: crosses an epoch boundary
        assert global_batch_rows(other) == global_batch_rows(reference)


def test_ranks_get_disjoint_samples_and_an_epoch_sees_every_window(tmp_path):
    windows, _ = windows_of([400], seq_len=8, tmp_path=tmp_path)  # 49 windows
    loaders = stream(windows, 2, 2, global_batch=4)
    seen = []
    for _ in range(12):  # 48 samples: all but one window of epoch 0
        per_rank = [[tuple(r) for x, _ in loader.next_step() for r in x.tolist()] for loader in loaders]
        assert not set(per_rank[0]) & set(per_rank[1])
        seen += per_rank[0] + per_rank[1]
    assert len(set(seen)) == 48


def test_targets_are_inputs_shifted_by_one(tmp_path):
    windows, _ = windows_of([300], seq_len=8, tmp_path=tmp_path)
    (x, y), = stream(windows, 1, 4, global_batch=4)[0].next_step()
    assert x.shape == y.shape == (4, 8)
    np.testing.assert_array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())


def test_resume_continues_exactly_with_accumulation(tmp_path):
    windows, _ = windows_of([700], seq_len=8, tmp_path=tmp_path)
    uninterrupted = stream(windows, 2, 2)  # 3 micro-batches per rank and step
    expected = [[[x.numpy().copy() for x, _ in loader.next_step()] for loader in uninterrupted] for _ in range(9)]
    first = stream(windows, 2, 2)
    for _ in range(4):
        for loader in first:
            loader.next_step()
    resumed = stream(windows, 2, 2)
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    for step in range(4, 9):
        got = [[x.numpy() for x, _ in loader.next_step()] for loader in resumed]
        for rank in range(2):
            for a, b in zip(got[rank], expected[step][rank]):
                np.testing.assert_array_equal(a, b)


def test_different_seeds_shuffle_differently(tmp_path):
    windows, _ = windows_of([700], seq_len=8, tmp_path=tmp_path)
    a = stream(windows, 1, 12, seed=1)[0].next_step()[0][0]
    b = stream(windows, 1, 12, seed=2)[0].next_step()[0][0]
    assert not np.array_equal(a.numpy(), b.numpy())


def test_evaluation_split_covers_the_first_samples_once(tmp_path):
    windows, _ = windows_of([300], seq_len=8, tmp_path=tmp_path)  # 37 windows
    rows = [tuple(r) for rank in range(3) for x, _ in evaluation_batches(windows, 20, 4, rank, 3) for r in x.tolist()]
    assert sorted(rows) == sorted(tuple(windows[i][:-1].tolist()) for i in range(20))


def test_hub_dataset_path_streams(tmp_path):
    """data.hf_dataset goes through load_dataset(..., streaming=True); a local dataset folder
    takes the same path as a hub name, without network."""
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"content": f"row {i}"}) + "\n" for i in range(7)))
    cfg = DataConfig(hf_dataset=str(folder), text_field="content", max_documents=5)
    assert list(iter_documents(cfg)) == [f"row {i}" for i in range(5)]
    with pytest.raises(UserError, match="cannot read hub dataset .*no-such-dataset"):
        list(iter_documents(DataConfig(hf_dataset=str(tmp_path / "no-such-dataset"))))


def test_separate_validation_files(tmp_path, corpus):
    train = sorted(corpus.glob("*.txt"))
    out = tmp_path / "out"
    data = prepare_data(DataConfig(path=str(out), files=[str(p) for p in train[:3]], val_files=[str(train[3])],
                                   vocab_size=400), progress=False)
    val_docs = list(iter_documents(DataConfig(files=[str(train[3])])))
    train_docs = list(iter_documents(DataConfig(files=[str(p) for p in train[:3]])))
    assert data.index["splits"]["val"]["documents"] == len(val_docs)
    assert data.index["splits"]["train"]["documents"] == len(train_docs)
    assert data.index["sources"][-1] == f"val:{train[3]}"
    sp = load_tokenizer(out / "tokenizer.model")
    stored = np.fromfile(out / "val-00000.bin", dtype=np.uint16)
    np.testing.assert_array_equal(stored, [t for d in val_docs for t in sp.encode(d) + [sp.eos_id()]])
    with pytest.raises(UserError, match="missing.txt' does not exist"):
        prepare_data(DataConfig(path=str(tmp_path / "x"), files=[str(train[0])], val_files=[str(tmp_path / "missing.txt")]),
                     progress=False)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_the_permutation_is_a_bijection(size):
    """Every size, powers of 4 and their neighbours included (cycle-walking), for several seeds."""
    for seed in [(0, 0), (3, 1), (3, 2)]:
        image = FeistelPermutation(size, seed)(np.arange(size))
        assert sorted(image.tolist()) == list(range(size))


def test_the_permutation_looks_random_and_depends_on_seed_and_epoch():
    """For 10^4 elements: mean displacement |pi(i) - i| near N/3 (a uniform permutation's), near-zero
    correlation with the identity and between neighbours, few fixed points; other seeds and epochs differ."""
    n = 10_000
    i = np.arange(n)
    image = FeistelPermutation(n, (3, 0))(i)
    assert abs(np.abs(image - i).mean() / n - 1 / 3) < 0.02
    assert abs(np.corrcoef(image, i)[0, 1]) < 0.05 and abs(np.corrcoef(image[:-1], image[1:])[0, 1]) < 0.05
    assert (image == i).sum() < 10
    for other in [(4, 0), (3, 1)]:
        assert (FeistelPermutation(n, other)(i) == image).mean() < 0.01


class _Endless:
    """Windows of a corpus too large for any permutation held in memory (10^15): window i is [i, i + 1, i + 2]."""

    def __len__(self) -> int:
        return 10**15

    def __getitem__(self, i: int) -> np.ndarray:
        return np.arange(i, i + 3, dtype=np.int64)


def test_the_loader_needs_no_memory_per_window():
    """A loader over 10^15 windows gives its batches at once, in the first epoch and across the first boundary
    (a materialised permutation would need 8 PB); two layouts read the same global batch there."""
    windows = _Endless()
    loaders = stream(windows, 2, 3, consumed=10**15 - 6)  # the step's 12 samples: 6 of epoch 0, 6 of epoch 1
    other = stream(windows, 1, 12, consumed=10**15 - 6)
    rows = global_batch_rows(loaders)
    assert rows == global_batch_rows(other) and len(set(rows)) == 12


def test_the_tokenizer_sample_is_drawn_from_all_the_text():
    """1,000 lines kept from 4,000 lines of two sources read one after the other: both halves in about equal
    shares (the first lines alone would be all of the first), in reading order, the same every time; all lines
    when there are fewer; with a byte budget only the documents up to it."""
    documents = [f"first {i}\nfirst {i}b" for i in range(1000)] + [f"second {i}\nsecond {i}b" for i in range(1000)]
    sample = training_sample(documents, size=1000)
    second = sum(line.startswith("second") for line in sample.lines)
    assert len(sample.lines) == 1000 and 430 <= second <= 570
    assert (sample.of_lines, sample.of_documents) == (4000, 2000)
    order = [int(line.split()[1].rstrip("b")) + 1000 * line.startswith("second") for line in sample.lines]
    assert order == sorted(order) and training_sample(documents, size=1000) == sample
    assert training_sample(documents[:10], size=1000).lines == [line for d in documents[:10] for line in d.split("\n")]
    budget = training_sample(up_to_bytes(documents, 5000), size=1000)
    assert budget.of_bytes >= 5000 and budget.of_documents < 1000 and not any("second" in line for line in budget.lines)


def test_the_index_states_what_the_tokenizer_was_trained_on(dataset):
    trained = open_prepared(dataset).index["tokenizer"]["trained_on"]
    assert trained["lines"] == trained["of_lines"] > 1000 and trained["of_documents"] > 100
