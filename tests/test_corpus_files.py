"""Local corpora as clusters hold them: compressed JSON-lines, parquet and text shards read as streams, offline
(no connection attempted, no Hugging Face cache written), thousands of files over the workers, bad files and rows
skipped and counted (or refused with data.on_bad_file: error), one document per file for code, and a resume that
passes over the files it finished."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import zstandard
from helpers import CORPUS_MODULES

from megasparse.config import DataConfig
from megasparse.data.corpus import iter_documents
from megasparse.data.prepare import PROGRESS_FILE, prepare_data
from megasparse.data.shards import open_prepared
from megasparse.data.tokenizer import load_tokenizer
from megasparse.errors import UserError

COMPRESS = {".gz": gzip.compress, ".zst": lambda data: zstandard.ZstdCompressor(write_checksum=True).compress(data),
            ".bz2": bz2.compress, ".xz": lzma.compress, "": lambda data: data}


def documents_of(corpus: Path) -> list[str]:
    """The corpus fixture's paragraphs, as its .txt files give them."""
    return list(iter_documents(DataConfig(files=[str(corpus / "*.txt")])))


def write_rows(path: Path, rows: list[dict]) -> Path:
    """Rows as a shard named ``path``: JSON lines (compressed by the last suffix), or parquet."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
        return path
    compression = path.suffix if path.suffix in COMPRESS else ""
    path.write_bytes(COMPRESS[compression]("".join(json.dumps(row) + "\n" for row in rows).encode()))
    return path


def c4_rows(texts: list[str]) -> list[dict]:
    return [{"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{i}"}
            for i, text in enumerate(texts)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, corpus) -> tuple[Path, list[str]]:
    """The corpus as C4-style .json.gz, RedPajama-style .jsonl.zst and FineWeb-style parquet shards, and the
    documents they hold in order."""
    directory = tmp_path_factory.mktemp("shards")
    texts = documents_of(corpus)
    thirds = [texts[i * len(texts) // 3:(i + 1) * len(texts) // 3] for i in range(3)]
    write_rows(directory / "c4-train.00000-of-00003.json.gz", c4_rows(thirds[0]))
    write_rows(directory / "c4-train.00001-of-00003.jsonl.zst", c4_rows(thirds[1]))
    write_rows(directory / "c4-train.00002-of-00003.parquet", c4_rows(thirds[2]))
    return directory, texts


@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz", "a.jsonl.bz2", "a.jsonl.xz", "a.jsonl.zst", "a.json",
                                  "a.json.gz", "a.parquet"])
def test_every_format_gives_the_same_documents(tmp_path, corpus, name):
    texts = documents_of(corpus)[:40]
    path = tmp_path / name
    if name.startswith("a.txt"):
        path.write_bytes(COMPRESS[path.suffix if path.suffix != ".txt" else ""]("\n\n".join(texts).encode()))
    elif name == "a.json":  # one JSON array (datasets' json builder reads both forms)
        path.write_text(json.dumps(c4_rows(texts)))
    else:
        write_rows(path, c4_rows(texts))
    assert list(iter_documents(DataConfig(files=[str(path)]))) == texts


def test_text_paragraphs_split_as_before(tmp_path):
    """Paragraphs are the text split at every blank line (CRLF read as LF), across the reading blocks too."""
    import megasparse.data.readers as readers

    text = "one\r\n\r\ntwo\nlines\n\n\nthree\n\n" + "x" * 50 + "\n\nlast"
    (tmp_path / "a.txt").write_bytes(text.encode())
    expected = ["one", "two\nlines", "\nthree", "x" * 50, "last"]
    assert list(iter_documents(DataConfig(files=[str(tmp_path / "a.txt")]))) == expected
    chunk = readers._CHUNK
    try:
        for readers._CHUNK in (1, 2, 3, 7):
            assert list(iter_documents(DataConfig(files=[str(tmp_path / "a.txt")]))) == expected
    finally:
        readers._CHUNK = chunk


class SilentServer:
    """A TCP port that accepts connections and never answers (a firewall that lets packets in and nothing
    back), counting them."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.socket.close()
        for connection in self.accepted:
            connection.close()


def offline_environment(tmp_path: Path, port: int) -> dict[str, str]:
    """Every way a Hugging Face library or an HTTP client would reach out goes to ``port``; caches in
    ``tmp_path/hf``."""
    address = f"http://127.0.0.1:{port}"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE"))}
    env.update({"HF_ENDPOINT": address, "HTTP_PROXY": address, "HTTPS_PROXY": address, "ALL_PROXY": address,
                "http_proxy": address, "https_proxy": address, "NO_PROXY": "", "no_proxy": "",
                "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"),
                "XDG_CACHE_HOME": str(tmp_path / "hf" / "xdg")})
    (tmp_path / "hf" / "datasets").mkdir(parents=True)
    return env


def prepare_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "megasparse", "prepare-data", *args]


def test_compressed_and_parquet_shards_prepare_offline(shards, dataset, tmp_path):
    """C4-style .json.gz, .jsonl.zst and parquet shards: prepared with no connection attempted and nothing in the
    Hugging Face cache, the shards holding exactly the documents, tokenised, each followed by EOS. Then 300 small
    files the same way: still no connection, and no wait per file (3 s each, as datasets' request to its bucket
    waits on a silent network, would take 15 minutes)."""
    directory, texts = shards
    server = SilentServer()
    try:
        env = offline_environment(tmp_path, server.port)
        out = tmp_path / "data"
        result = subprocess.run(prepare_command("--files", str(directory / "c4-*"), "--tokenizer",
                                                str(dataset / "tokenizer.model"), "--out", str(out), "--workers", "2",
                                                "--set", "data.val_fraction=0"),
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        sp = load_tokenizer(out / "tokenizer.model")
        stored = np.fromfile(out / "train-00000.bin", dtype=np.uint16)
        np.testing.assert_array_equal(stored, [t for text in texts for t in sp.encode(text) + [sp.eos_id()]])
        many = tmp_path / "many"
        many.mkdir()
        for number in range(300):
            write_rows(many / f"part-{number:05d}.jsonl.gz", c4_rows([texts[number % len(texts)]]))
        result = subprocess.run(prepare_command("--files", str(many / "*.jsonl.gz"), "--tokenizer",
                                                str(dataset / "tokenizer.model"), "--out", str(tmp_path / "many-data"),
                                                "--workers", "2"),
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert open_prepared(tmp_path / "many-data").index["splits"]["train"]["documents"] == 297
        assert server.accepted == [], "a connection was attempted"
        assert [p for p in (tmp_path / "hf").rglob("*") if p.is_file()] == [], "the Hugging Face cache was written"
    finally:
        server.close()


def bad_corpus(directory: Path, texts: list[str]) -> dict[str, str]:
    """Good shards among bad ones; the problem each bad file shows."""
    directory.mkdir()
    write_rows(directory / "00-good.jsonl.gz", c4_rows(texts[:10]))
    (directory / "01-empty.jsonl").write_bytes(b"")
    (directory / "02-__init__.txt").write_bytes(b"")
    write_rows(directory / "03-no-text-field.jsonl", [{"content": text} for text in texts[:3]])
    lines = [json.dumps({"text": texts[10]}), '{"text": "cut off', json.dumps({"text": 7}), json.dumps({"text": texts[11]})]
    (directory / "04-broken-lines.jsonl").write_text("\n".join(lines) + "\n")
    whole = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts[12:40]).encode())
    (directory / "05-truncated.json.gz").write_bytes(whole[:len(whole) // 2])
    whole = COMPRESS[".zst"]("".join(json.dumps({"text": t}) + "\n" for t in texts[12:40]).encode())
    (directory / "06-truncated.jsonl.zst").write_bytes(whole[:len(whole) // 2])
    (directory / "07-binary.txt").write_bytes(b"\x89PNG\x00\x00" * 100)
    (directory / "08-latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)
    write_rows(directory / "09-good.parquet", c4_rows(texts[40:50]))
    corrupt = bytearray(whole)  # a byte of the middle changed: zstd's checksum tells
    corrupt[len(corrupt) // 2] ^= 0x55
    (directory / "10-corrupt.jsonl.zst").write_bytes(bytes(corrupt))
    return {"01-empty.jsonl": "empty", "02-__init__.txt": "empty", "03-no-text-field.jsonl": "no row has text in 'text'",
            "05-truncated.json.gz": "cut short", "06-truncated.jsonl.zst": "cut short",
            "07-binary.txt": "looks binary", "08-latin1.txt": "not UTF-8",
            "10-corrupt.jsonl.zst": "cannot be read (corrupt zstd stream"}


def test_bad_files_and_rows_are_skipped_counted_and_listed(tmp_path, corpus, dataset):
    texts = documents_of(corpus)
    problems = bad_corpus(tmp_path / "corpus", texts)
    out = tmp_path / "data"
    result = subprocess.run(prepare_command("--files", str(tmp_path / "corpus" / "*"), "--tokenizer",
                                            str(dataset / "tokenizer.model"), "--out", str(out), "--workers", "2",
                                            "--set", "data.val_fraction=0"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: skipped")]
    assert len(warnings) == 1 and "skipped 8 bad files and 2 bad rows in 1 other file" in warnings[0], result.stderr
    assert "01-empty.jsonl: empty" in warnings[0]
    skipped = open_prepared(out).index["skipped"]
    assert (skipped["files"], skipped["rows"]) == (8, 2)
    listed = {Path(entry["file"]).name: entry for entry in skipped["by_file"]}
    assert set(listed) == set(problems) | {"04-broken-lines.jsonl"}
    for name, problem in problems.items():
        assert problem in listed[name]["problem"], listed[name]
    assert listed["04-broken-lines.jsonl"]["rows"] == 2 and listed["04-broken-lines.jsonl"]["problem"] == ""
    # the good documents, in order: the truncated streams give what they held before the cut
    documents = open_prepared(out).index["splits"]["train"]["documents"]
    truncated = [len(list(iter_documents(DataConfig(files=[str(tmp_path / "corpus" / name)]))))
                 for name in ("05-truncated.json.gz", "06-truncated.jsonl.zst")]
    assert truncated[0] < 28 and truncated[1] < 28  # (what was read in whole blocks before the cut)
    corrupt = len(list(iter_documents(DataConfig(files=[str(tmp_path / "corpus" / "10-corrupt.jsonl.zst")]))))
    assert documents == 10 + 2 + sum(truncated) + 10 + corrupt


@pytest.mark.parametrize("name,problem", [
    ("01-empty.jsonl", "empty"), ("03-no-text-field.jsonl", "line 1 has no field 'text'"),
    ("04-broken-lines.jsonl", "line 2 is not JSON"), ("05-truncated.json.gz", "cut short"),
    ("06-truncated.jsonl.zst", "zstd stream ends inside a frame"), ("07-binary.txt", "looks binary"),
    ("08-latin1.txt", "not UTF-8"), ("10-corrupt.jsonl.zst", "corrupt zstd stream"),
])
def test_strict_mode_refuses_each_bad_file_in_one_line(tmp_path, corpus, dataset, name, problem):
    bad_corpus(tmp_path / "corpus", documents_of(corpus))
    out = tmp_path / "data"
    cfg = DataConfig(path=str(out), files=[str(tmp_path / "corpus" / "00-good.jsonl.gz"), str(tmp_path / "corpus" / name)],
                     tokenizer=str(dataset / "tokenizer.model"), workers=2, on_bad_file="error")
    with pytest.raises(UserError, match=f"data file '.*{name}': .*{problem}.*data.on_bad_file: error") as error:
        prepare_data(cfg, progress=False)
    assert "\n" not in str(error.value)
    assert not out.exists() and not (tmp_path / ".data.staging").exists()


def test_a_corpus_of_only_bad_files_names_them(tmp_path, corpus):
    bad_corpus(tmp_path / "corpus", documents_of(corpus))
    files = [str(tmp_path / "corpus" / name) for name in ("01-empty.jsonl", "07-binary.txt")]
    with pytest.raises(UserError, match="no text found in .*01-empty.jsonl.* \\(2 bad files skipped, first "
                                        ".*01-empty.jsonl: empty\\)"):
        prepare_data(DataConfig(path=str(tmp_path / "out"), files=files), progress=False)


def test_code_files_are_one_document_each_under_document_file(tmp_path):
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = tmp_path / "repo"
    code.mkdir()
    for name in CORPUS_MODULES[:4]:
        (code / Path(name).name).write_text((stdlib / name).read_text())
    (code / "README.md").write_text("# A repository\n\nIts readme, in two paragraphs.\n")
    files = sorted(code.iterdir())
    whole = list(iter_documents(DataConfig(files=[str(code / "*")], document="file")))
    assert whole == [path.read_text() for path in files]
    with pytest.raises(UserError, match=r"data.files: '.*\.md' is a \.md file, read only as one document per file: "
                                        "set data.document: file"):
        list(iter_documents(DataConfig(files=[str(code / "*")])))
    (tmp_path / "notes.txt").write_text("first\n\nsecond\n")
    assert list(iter_documents(DataConfig(files=[str(tmp_path / "notes.txt")], document="file"))) == ["first\n\nsecond\n"]
    (tmp_path / "x.parquet.gz").write_bytes(b"x")
    with pytest.raises(UserError, match="parquet compresses its columns itself"):
        list(iter_documents(DataConfig(files=[str(tmp_path / "x.parquet.gz")])))


@pytest.mark.parametrize("read_by", ["workers", "main process"])
def test_an_interrupted_preparation_of_many_files_passes_over_the_files_it_finished(tmp_path, corpus, dataset,
                                                                                     monkeypatch, read_by):
    """Interrupted part-way through 400 files (recording after every piece), then the files its record finished
    replaced by other text of the same size and time: the resumed run does not open them (it ends with the bytes
    of an uninterrupted run, which a run re-reading them to skip their documents would not). Files read whole by
    the workers are recorded between files; files streamed by the main process (as a large one is) also within
    one, whose recorded documents the resumed run skips. A kill is tested in test_prepare_resume.py."""
    import megasparse.data.encoding as encoding
    import megasparse.data.prepare as prepare

    if read_by == "main process":  # every file streamed, 8 documents a piece
        monkeypatch.setattr(encoding, "FILE_TASK_TEXT_BYTES", 0)
        monkeypatch.setattr(encoding, "DOCUMENTS_PER_TASK", 8)

    texts = documents_of(corpus)
    files = tmp_path / "files"
    files.mkdir()
    for number in range(400):
        (files / f"doc-{number:05d}.txt").write_text("\n\n".join(texts[(number * 7 + k) % len(texts)] for k in range(20)))
    cfg = DataConfig(path=str(tmp_path / "whole"), files=[str(files / "*.txt")], tokenizer=str(dataset / "tokenizer.model"),
                     workers=2)
    whole = prepare_data(cfg, progress=False).directory
    cfg.path = str(tmp_path / "interrupted")
    monkeypatch.setattr(prepare, "COMMIT_SECONDS", 0.0)
    monkeypatch.setattr(prepare, "ShardWriter", _interrupted_at_write(prepare.ShardWriter, 20 * 150 + 10))
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, progress=False)
    monkeypatch.setattr(prepare, "ShardWriter", prepare.ShardWriter.__mro__[1])
    finished, within = json.loads((tmp_path / ".interrupted.staging" / PROGRESS_FILE).read_text())["input"]
    assert 100 <= finished < 200 and (within > 0) == (read_by == "main process"), (finished, within)
    for path in sorted(files.iterdir())[:finished]:  # other paragraphs, the same size and time
        stat = path.stat()
        path.write_text(("z\n\n" * stat.st_size)[:stat.st_size])
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    resumed = prepare_data(cfg, progress=False).directory
    for name in ("train-00000.bin", "val-00000.bin", "index.json"):
        assert (resumed / name).read_bytes() == (whole / name).read_bytes(), name


def _interrupted_at_write(writer_class, writes: int):
    """A ShardWriter whose ``writes``-th write is interrupted."""
    class Writer(writer_class):
        count = 0

        def write(self, tokens):
            Writer.count += 1
            if Writer.count == writes:
                raise KeyboardInterrupt
            super().write(tokens)

    return Writer


@pytest.mark.parametrize("read_by", ["workers, a file a task", "main process"])
def test_a_budget_ends_the_training_text_the_same_way_on_any_number_of_workers(tmp_path, corpus, dataset, monkeypatch,
                                                                               read_by):
    """data.max_tokens reached in the second of four files: the validation files are still read whole, and the
    bad files after the budget are neither read for their documents nor listed, so index.json (and every shard)
    is the same on 1 and 2 workers, however far the workers read ahead."""
    import megasparse.data.encoding as encoding

    if read_by == "main process":
        monkeypatch.setattr(encoding, "FILE_TASK_TEXT_BYTES", 0)
    else:
        monkeypatch.setattr(encoding, "TASK_TEXT_BYTES", 0)
    texts = documents_of(corpus)
    files = tmp_path / "files"
    files.mkdir()
    for number in range(4):
        (files / f"{number}-good.txt").write_text("\n\n".join(texts[number * 100:(number + 1) * 100]))
    (files / "5-empty.txt").write_bytes(b"")
    (files / "6-binary.txt").write_bytes(b"\x00" * 10)
    validation = tmp_path / "validation.txt"
    validation.write_text("\n\n".join(texts[400:450]))
    first = len(list(iter_documents(DataConfig(files=[str(files / "0-good.txt")]))))
    tokens = sum(len(load_tokenizer(dataset / "tokenizer.model").encode(text)) + 1 for text in texts[:first])
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"data-{workers}"
        data = prepare_data(DataConfig(path=str(out), files=[str(files / "*")], val_files=[str(validation)],
                                       tokenizer=str(dataset / "tokenizer.model"), workers=workers,
                                       max_tokens=tokens + 50), progress=False)
        splits = data.index["splits"]
        assert first < splits["train"]["documents"] < 2 * first + 10 and splits["val"]["documents"] == 50
        assert data.index["skipped"] == {"files": 0, "rows": 0, "by_file": []}
        outputs.append({name: (out / name).read_bytes() for name in ("index.json", "train-00000.bin", "val-00000.bin")})
    assert outputs[0] == outputs[1]


def test_a_hub_stream_that_breaks_is_fatal_not_a_bad_file(monkeypatch):
    """A network error or a broken remote shard in the middle of a hub dataset stops the preparation in one line;
    the rest of the stream is never skipped as a bad file's would be."""
    import datasets

    class Stream:
        column_names = ["text"]

        def __iter__(self):
            yield {"text": "one"}
            yield {"text": "two"}
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")

    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: Stream())
    with pytest.raises(UserError, match="cannot read hub dataset 'hf:some/corpus:train': EOFError: Compressed file"):
        list(iter_documents(DataConfig(hf_dataset="some/corpus")))


def test_a_hub_dataset_without_text_is_refused_naming_it(tmp_path, monkeypatch):
    import datasets

    class Stream:
        column_names = ["text"]

        def __iter__(self):
            yield from ({"text": None} for _ in range(3))

    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: Stream())
    with pytest.raises(UserError, match="no text found in hf:some/corpus:train \\(1 bad file skipped, first "
                                        "hf:some/corpus:train: no row has text in 'text'"):
        prepare_data(DataConfig(path=str(tmp_path / "out"), hf_dataset="some/corpus"), progress=False)
    assert not (tmp_path / "out").exists()
