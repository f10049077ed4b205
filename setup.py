"""megasparse: memory-efficient LLM pretraining on DeepSpeed (SMET sparse training, Spectron low-rank)."""
import runpy
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
# The tested torch and DeepSpeed ranges have one source, which the start-up warning reads too.
TESTED = runpy.run_path(str(HERE / "megasparse" / "versions.py"))["TESTED"]

setup(
    name="megasparse",
    version="0.1.0",
    description="Memory-efficient LLaMA pretraining on DeepSpeed: dynamic sparse (SMET) and native low-rank (Spectron) training",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The run configs have one source, the checkout's top-level configs/; an installed copy (a wheel, a plain
    # install) carries them as the data folder megasparse/configs/, and a source tree or an editable install
    # reads them where they are (megasparse.config.shipped_configs looks in both places).
    packages=[*find_packages(include=["megasparse", "megasparse.*"]), "megasparse.configs"],
    package_dir={"megasparse.configs": "configs"},
    package_data={"megasparse.configs": ["*.yaml", "studies/*.yaml"], "megasparse.launch": ["*.sbatch"]},
    install_requires=[
        *(f"{name}{spec}" for name, spec in TESTED.items()),
        "packaging",
        "sentencepiece>=0.2",
        "datasets>=2.19",
        "pyarrow",  # parquet corpora, read in row batches (datasets needs it too)
        "zstandard",  # .zst corpora (The Pile, RedPajama); the standard library reads .gz, .bz2 and .xz
        "numpy",
        "safetensors",
        "pyyaml",
        "tqdm",
    ],
    extras_require={
        "mpi": ["mpi4py"],
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        "bench": ["matplotlib"],
        "plot": ["matplotlib"],
        "hf": ["transformers"],  # megasparse generate
        "study": ["scipy", "matplotlib"],  # scaling-law fits (L-BFGS-B) and their figures
        # transformers, protobuf: HF export/import tests; wandb, tensorboard: their logging tests; matplotlib: megasparse
        # plot's; scipy: the scaling-law fits'
        "test": ["pytest", "mpi4py", "mpich", "transformers", "protobuf", "wandb", "matplotlib", "tensorboard", "scipy"],
    },
    entry_points={"console_scripts": ["megasparse=megasparse.cli:main"]},
)
