"""A preparation killed half-way (SIGKILL) continues where it stopped and ends byte for byte as an uninterrupted
one; other settings are refused, not overwritten; data.max_tokens stops at the first document boundary past it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from helpers import megasparse

from megasparse.config import DataConfig
from megasparse.data.prepare import PROGRESS_FILE, prepare_data
from megasparse.data.shards import open_prepared
from megasparse.errors import UserError


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory) -> Path:
    """About 10 MB of text (the standard library's top-level modules, three times over, in 12 files): some
    seconds of tokenising on one worker, so that a kill can fall between two of the preparation's records."""
    directory = tmp_path_factory.mktemp("big")
    modules = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = "\n\n".join(m.read_text(errors="replace") for m in modules)
    for part in range(12):
        (directory / f"part{part:02d}.txt").write_text(text[part * len(text) // 4:(part + 1) * len(text) // 4]
                                                         if part < 4 else text[(part % 4) * len(text) // 4:])
    return directory


def prepare_command(corpus: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megasparse", "prepare-data", "--files", str(corpus / "*.txt"), "--tokenizer",
            str(tokenizer), "--out", str(out), "--workers", "1", *extra]


def recorded_documents(staging: Path) -> int:
    try:
        return json.loads((staging / PROGRESS_FILE).read_text())["documents"]
    except (OSError, ValueError):
        return 0


def test_a_killed_preparation_resumes_to_the_same_bytes(big_corpus, dataset, tmp_path):
    tokenizer = dataset / "tokenizer.model"
    megasparse(*prepare_command(big_corpus, tokenizer, tmp_path / "whole")[3:]).check()
    killed = tmp_path / "killed"
    staging = tmp_path / ".killed.staging"
    process = subprocess.Popen(prepare_command(big_corpus, tokenizer, killed), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while recorded_documents(staging) == 0 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the preparation ended before its first record past the tokenizer"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    stopped_at = recorded_documents(staging)
    total = open_prepared(tmp_path / "whole").index["splits"]
    assert 0 < stopped_at < total["train"]["documents"] + total["val"]["documents"] and not killed.exists()
    megasparse(*prepare_command(big_corpus, tokenizer, killed)[3:]).check()
    assert not staging.exists()
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in killed.iterdir())
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (killed / name).read_bytes(), name


def test_an_interrupted_preparation_of_other_settings_is_refused(corpus, dataset, tmp_path, monkeypatch):
    """Interrupted (here: by an error after the first record), then run with another budget: refused in one line,
    the staging directory kept; with the first settings it completes."""
    cfg = DataConfig(path=str(tmp_path / "out"), files=[str(corpus / "*.txt")], tokenizer=str(dataset / "tokenizer.model"),
                     workers=1)
    import megasparse.data.prepare as prepare

    monkeypatch.setattr(prepare, "ShardWriter", _failing_after_commit(prepare.ShardWriter))
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, progress=False)
    monkeypatch.undo()
    staging = tmp_path / ".out.staging"
    assert (staging / PROGRESS_FILE).is_file()
    other = DataConfig(**{**cfg.__dict__, "max_tokens": 1000})
    with pytest.raises(UserError, match=r"holds an interrupted preparation with other settings \(max_tokens\)"):
        prepare_data(other, progress=False)
    assert (staging / PROGRESS_FILE).is_file()
    assert open_prepared(prepare_data(cfg, progress=False).directory).index["splits"]["train"]["tokens"] > 0


def _failing_after_commit(writer_class):
    """A ShardWriter whose 200th write is interrupted (after the record made at the start)."""
    class Writer(writer_class):
        writes = 0

        def write(self, tokens):
            Writer.writes += 1
            if Writer.writes == 200:
                raise KeyboardInterrupt
            super().write(tokens)

    return Writer


def test_max_tokens_stops_at_the_first_document_boundary_past_it(corpus, dataset, tmp_path):
    whole = prepare_data(DataConfig(path=str(tmp_path / "whole"), files=[str(corpus / "*.txt")], val_fraction=0,
                                    tokenizer=str(dataset / "tokenizer.model"), workers=1), progress=False)
    capped = prepare_data(DataConfig(path=str(tmp_path / "capped"), files=[str(corpus / "*.txt")], val_fraction=0,
                                     tokenizer=str(dataset / "tokenizer.model"), workers=1, max_tokens=5000),
                          progress=False)
    tokens = capped.index["splits"]["train"]["tokens"]
    assert tokens >= 5000 and tokens < whole.index["splits"]["train"]["tokens"]
    documents = capped.index["splits"]["train"]["documents"]
    prefix = (whole.directory / "train-00000.bin").read_bytes()[:2 * tokens]
    assert (capped.directory / "train-00000.bin").read_bytes() == prefix  # the same documents, cut at a boundary
    one_fewer = prepare_data(DataConfig(path=str(tmp_path / "fewer"), files=[str(corpus / "*.txt")], val_fraction=0,
                                        tokenizer=str(dataset / "tokenizer.model"), workers=1,
                                        max_documents=documents - 1), progress=False)
    assert one_fewer.index["splits"]["train"]["tokens"] < 5000  # the last document is the one that crossed it


def test_one_preparation_of_a_path_at_a_time_and_a_complete_staging_is_only_renamed(corpus, dataset, tmp_path):
    """A second preparation of the same path while one runs (holding the lock) is refused in one line; a staging
    directory that is complete (killed between its last record and the rename) is renamed, not rebuilt."""
    import fcntl
    import shutil

    cfg = DataConfig(path=str(tmp_path / "out"), files=[str(corpus / "*.txt")], tokenizer=str(dataset / "tokenizer.model"),
                     workers=1)
    with open(tmp_path / ".out.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError, match="another preparation of .* is running"):
            prepare_data(cfg, progress=False)
    staging = tmp_path / ".out.staging"
    shutil.copytree(dataset, staging)
    marker = staging / "train-00000.bin"
    marker.write_bytes(marker.read_bytes())  # the same bytes, a new inode: renamed, so still this file
    inode = marker.stat().st_ino
    assert prepare_data(cfg, progress=False).directory == tmp_path / "out"
    assert (tmp_path / "out" / "train-00000.bin").stat().st_ino == inode and not staging.exists()
