"""Crash-safe checkpoints: a checkpoint becomes visible only once all of it is on disk.

Every rank calls :func:`start_checkpoint`, then :func:`finish_checkpoint`:

1. DeepSpeed writes every rank's files into ``.step_N.partial/``, a name ``--resume`` never takes.
   Each file goes through :class:`RecordingCheckpointEngine`, which fsyncs it and records its size
   and SHA-256 (on the rank that wrote it, so hashing is spread like the writing), or the error
   (full disk, unwritable directory) that stopped it. A background save stages the files in host
   memory instead and a thread writes and records them (:mod:`megasparse.checkpoint.staging`) while
   training goes on; the ranks learn that every thread is done in a step's decision (train/guard.py), and
   the rest follows at that step's end.
2. The records of all ranks are gathered. If any rank failed, the partial directory is removed and
   every rank raises the same one-line error naming the file, the reason and the last complete
   checkpoint, which is untouched.
3. Rank 0 adds the tokenizer copy, ``manifest.json`` (size and SHA-256 of every file) and
   ``megasparse.json``, fsyncs them and the directory, renames it to ``step_N`` (atomic on POSIX file
   systems), fsyncs the parent, and only then moves the ``latest`` pointer (a temporary file, fsynced,
   renamed over the old one).
4. Older checkpoints are pruned: the newest ``checkpoint.keep_last`` stay, and every one whose step
   is a multiple of ``checkpoint.keep_every``.

A crash at any point leaves the previous checkpoints and at most a partial directory, which the
next run removes. :func:`verify_checkpoint` checks a checkpoint against its manifest; ``--resume
auto`` takes the newest checkpoint that passes and warns about every one it skips.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from megasparse import faults
from megasparse.checkpoint.staging import BackgroundWrite, HostStaging
from megasparse.errors import UserError

MANIFEST_FILE = "manifest.json"
LATEST_FILE = "latest"
PARTIAL_SUFFIX = ".partial"


def file_record(path: Path) -> dict[str, Any]:
    """fsync ``path`` and return its size and SHA-256."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        os.fsync(handle.fileno())
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


class RecordingCheckpointEngine:
    """DeepSpeed's checkpoint engine, with each saved file fsynced and recorded, and a write error kept
    (instead of raised between DeepSpeed's collectives, which would leave the other ranks waiting)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.staging = HostStaging()
        self.begin()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def begin(self, staged: bool = False) -> None:
        """A new checkpoint; ``staged``: DeepSpeed's files are copied to host memory (:attr:`staged`) for a
        background write, rather than written now."""
        self.records: dict[str, dict[str, Any]] = {}
        self.error: str | None = None
        self.staged: list[tuple[Any, Path]] | None = [] if staged else None
        if staged:
            self.staging.begin()

    def save(self, state_dict: dict, path: str) -> None:
        if self.staged is not None:
            self.staged.append((self.staging.stage(state_dict), Path(path)))
            return
        self.write(state_dict, path)

    def write(self, state_dict: dict, path: str | Path) -> None:
        """Write one file, fsync and record it (or keep the error)."""
        if self.error:
            return
        try:
            faults.before_checkpoint_file(path)
            self.inner.save(state_dict, str(path))
            self.records[Path(path).name] = file_record(Path(path))
        except (OSError, RuntimeError) as exc:  # torch.save reports some write failures as RuntimeError
            self.error = f"{Path(path).name}: {_write_failure(exc, Path(path).parent)}"
        faults.after_checkpoint_file(path)


def _write_failure(exc: Exception, directory: Path) -> str:
    """The reason a file could not be written, in words (torch's zip writer says only "unexpected pos")."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if free is not None and free < 1 << 16:
        return f"No space left on device ({free} bytes free)"
    return str(exc).strip().splitlines()[0][:200]


def partial_dir(directory: Path, tag: str) -> Path:
    return directory / f".{tag}{PARTIAL_SUFFIX}"


def remove_partials(directory: Path) -> None:
    """Remove what interrupted saves left (rank 0, at start-up)."""
    if directory.is_dir():
        for path in directory.glob(f".step_*{PARTIAL_SUFFIX}"):
            shutil.rmtree(path, ignore_errors=True)


@dataclass
class PendingCheckpoint:
    """A checkpoint whose files are being written (:func:`start_checkpoint`), to publish with
    :func:`finish_checkpoint`."""

    tag: str
    partial: Path
    final: Path
    extra_files: dict[str, bytes]
    last_complete: Path | None
    write: BackgroundWrite | None  # None: written already
    bytes: int = 0  # every rank's files, once published

    def writing(self) -> bool:
        """Whether this rank's files are still being written."""
        return self.write is not None and self.write.running()


def start_checkpoint(engine, directory: Path, tag: str, client_state: dict[str, Any], extra_files: dict[str, bytes],
                     last_complete: Path | None, background: bool) -> PendingCheckpoint:
    """Every rank: DeepSpeed's files of checkpoint ``tag`` into its partial directory, written now or, with
    ``background``, staged in host memory and written by a thread (:mod:`megasparse.checkpoint.staging`)."""
    partial, final = partial_dir(directory, tag), directory / tag
    error = None
    if dist.get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        except OSError as exc:
            error = f"cannot write checkpoints to {directory}: {exc.strerror or exc}"
    _raise_if_any([error])
    recorder: RecordingCheckpointEngine = engine.checkpoint_engine
    recorder.begin(staged=background)
    engine.save_checkpoint(str(directory), tag=partial.name, client_state=client_state, save_latest=False)
    write = None
    if background:
        recorder.staging.end()
        get_accelerator().synchronize()  # every staged copy complete before the thread reads it
        write = BackgroundWrite(recorder.staged, recorder.write)
    return PendingCheckpoint(tag, partial, final, extra_files, last_complete, write)


def finish_checkpoint(engine, pending: PendingCheckpoint) -> Path:
    """Every rank: wait for this rank's files, check every rank's, and publish the checkpoint (rank 0 writes
    ``extra_files``, ``megasparse.json`` among them last). Returns the published directory."""
    if pending.write is not None:
        pending.write.wait()
    recorder: RecordingCheckpointEngine = engine.checkpoint_engine
    tag, partial, last_complete = pending.tag, pending.partial, pending.last_complete
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (recorder.records, recorder.error))
    errors = [f"could not write checkpoint {tag} (rank {rank}, {err}); the last complete checkpoint, "
              f"{last_complete or 'none'}, is intact" for rank, (_, err) in enumerate(gathered) if err]
    if errors and dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    _raise_if_any(errors)
    records = {name: record for records, _ in gathered for name, record in records.items()}
    if dist.get_rank() == 0:
        error = None
        try:
            _publish(partial, pending.final, records, pending.extra_files)
        except OSError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            error = (f"could not write checkpoint {tag} ({exc.strerror or exc}); the last complete checkpoint, "
                     f"{last_complete or 'none'}, is intact")
        errors = [error]
    _raise_if_any(errors if dist.get_rank() == 0 else [None])
    pending.bytes = sum(record["bytes"] for record in records.values())
    return pending.final


def _raise_if_any(errors: list[str | None]) -> None:
    """Raise the first error any rank has (every rank passes its own list), on every rank alike."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, next((e for e in errors if e), None))
    first = next((e for e in gathered if e), None)
    if first:
        raise UserError(first)


def _publish(partial: Path, final: Path, records: dict[str, dict[str, Any]], extra_files: dict[str, bytes]) -> None:
    for name, contents in extra_files.items():
        (partial / name).write_bytes(contents)
        records[name] = file_record(partial / name)
    _write_json_synced(partial / MANIFEST_FILE, {"files": records})
    _fsync_dir(partial)
    faults.before_publish(final)
    replaced = final.with_name(f".{final.name}.replaced")
    if final.exists():  # a damaged checkpoint of this step that the run resumed past: set it aside first
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    latest = final.parent / f".{LATEST_FILE}.tmp"
    latest.write_text(final.name)
    file_record(latest)
    os.replace(latest, final.parent / LATEST_FILE)
    _fsync_dir(final.parent)


def write_manifest(tag_dir: Path) -> None:
    """A manifest of every file in ``tag_dir`` (for checkpoints written in one process, such as universal ones)."""
    records = {path.name: file_record(path) for path in sorted(tag_dir.iterdir()) if path.is_file()}
    _write_json_synced(tag_dir / MANIFEST_FILE, {"files": records})


def _write_json_synced(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
    file_record(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(complete: list[Path], newest: Path, keep_last: int, keep_every: int, kept_steps: set[int] = frozenset()
          ) -> list[Path]:
    """Delete complete checkpoints older than ``newest`` (the one just written) beyond the newest
    ``keep_last`` except multiples of ``keep_every`` and the steps ``kept_steps`` (``keep_last`` 0 keeps all);
    returns what was removed. Checkpoints of higher steps (a run resumed from an earlier one) are left alone, and
    so is ``newest``."""
    if keep_last <= 0:
        return []
    removed = []
    older = [tag_dir for tag_dir in complete if tag_dir.name < newest.name]
    for tag_dir in older[:max(0, len(older) - (keep_last - 1))]:
        step = int(tag_dir.name.split("_")[1])
        if (keep_every <= 0 or step % keep_every) and step not in kept_steps:
            shutil.rmtree(tag_dir, ignore_errors=True)
            removed.append(tag_dir)
    return removed


def keep_recovery_script_errors(engine, recorder: "RecordingCheckpointEngine") -> None:
    """DeepSpeed's save also copies its recovery scripts (zero_to_fp32.py) on one rank, outside the
    checkpoint engine; record a failure there too instead of raising between collectives."""
    copy = engine._copy_recovery_script

    def guarded(save_path):
        try:
            copy(save_path)
        except OSError as exc:
            recorder.error = recorder.error or f"recovery script: {exc.strerror or exc}"

    engine._copy_recovery_script = guarded


def verify_checkpoint(tag_dir: Path, share: tuple[int, int] = (0, 1)) -> str | None:
    """What is wrong with ``tag_dir`` by its manifest (missing, truncated or altered files), or None (also
    for a checkpoint without a manifest, from before manifests existed);
    ``share`` = (i, n) checks every n-th file from the i-th, so that n ranks split the reading."""
    try:
        files = json.loads((tag_dir / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:  # written before manifests existed: nothing to check it against
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {MANIFEST_FILE} is unreadable"
    index, count = share
    for name in sorted(files)[index::count]:
        path, expected = tag_dir / name, files[name]
        if not path.is_file():
            return f"'{name}' is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"'{name}' has {path.stat().st_size} bytes, its manifest says {expected['bytes']}"
        if file_record(path)["sha256"] != expected["sha256"]:
            return f"'{name}' does not match its checksum"
    return None


def verify_on_all_ranks(tag_dir: Path) -> str | None:
    """:func:`verify_checkpoint` with the files split over the ranks; every rank gets the same answer."""
    problem = verify_checkpoint(tag_dir, (dist.get_rank(), dist.get_world_size()))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problem)
    return next((p for p in gathered if p), None)
