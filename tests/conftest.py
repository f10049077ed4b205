"""Test setup: CPU/gloo DeepSpeed (unless ``DS_ACCELERATOR`` asks for another accelerator), a cached JIT-op
directory, and a small real dataset."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Before anything imports deepspeed: tests run on CPU ranks over gloo unless DS_ACCELERATOR=cuda asks for GPUs
# (NCCL, one GPU per rank: a test of more ranks than GPUs is skipped), and DeepSpeed's one JIT-compiled op
# (~20 s) is built once into a cache that later runs reuse.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
sys.path.insert(0, str(Path(__file__).parent))

from helpers import close_fork_server, fork_server, make_corpus, megasparse, tiny_config, write_config  # noqa: E402


# Tests that start no process group: they run first, while the fork server imports torch and DeepSpeed
# and builds DeepSpeed's JIT op (about 30 s on a fresh checkout), which every training process needs.
NO_PROCESS_GROUP = {"test_benchmark_reports", "test_config", "test_corpus_files", "test_data", "test_docs", "test_execution", "test_flops", "test_launch_env", "test_model", "test_progress", "test_study_fit", "test_study_plan",
                    "test_schedule", "test_smet", "test_spectron", "test_structure", "test_versions"}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.module.__name__ not in NO_PROCESS_GROUP)  # stable: file order kept
    if any(item.module.__name__ not in NO_PROCESS_GROUP for item in items):
        fork_server()  # its start-up runs beside the first tests


def pytest_sessionfinish(session):
    close_fork_server()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A directory of .txt files: a few standard-library modules, real text."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, corpus) -> Path:
    """The corpus prepared with a 400-piece tokenizer and a 10% validation split."""
    from megasparse.config import DataConfig
    from megasparse.data.prepare import prepare_data

    path = tmp_path_factory.mktemp("dataset") / "tokens"
    prepare_data(DataConfig(path=str(path), files=[str(corpus / "*.txt")], vocab_size=400, val_fraction=0.1,
                            workers=2), progress=False)
    return path


@pytest.fixture(scope="session")
def runs(tmp_path_factory, dataset):
    """Train the tiny config once per (ZeRO stage, processes, accumulation steps, precision, method,
    tensor-parallel degree, further ``training`` keys); cached for the session. Checkpoints at steps 4 and 8."""
    cache: dict[tuple, Path] = {}

    def run(zero: int, nproc: int, accumulation: int, precision: str = "fp32", method: str = "dense",
            tp: int = 1, **training) -> Path:
        key = (zero, nproc, accumulation, precision, method, tp, tuple(sorted(training.items())))
        if key not in cache:
            options = "".join(f"-{value}" for value in training.values())
            out = tmp_path_factory.mktemp(f"run-{method}-z{zero}-p{nproc}-t{tp}-a{accumulation}-{precision}{options}")
            micro = 8 * tp // (nproc * accumulation)  # tiny_config's global batch is 8
            cfg = tiny_config(dataset, out, method, parallel={"zero_stage": zero, "tensor_parallel": tp},
                              training={"micro_batch_size": micro, "precision": precision, **training})
            megasparse("train", str(write_config(out / "run.yaml", cfg)), nproc=nproc).check()
            cache[key] = out
        return cache[key]

    return run
