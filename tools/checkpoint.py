#!/usr/bin/env python3
"""The checkpoint tools as a script, for checkouts without the ``megasparse`` entry point:

    python tools/checkpoint.py inspect CHECKPOINT
    python tools/checkpoint.py {consolidate,reshard,export-hf,import-hf} ARGS...

is ``megasparse inspect ...`` / ``megasparse convert ...`` (``--help`` on each lists the options).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megasparse.cli import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args if args[:1] == ["inspect"] else ["convert", *args]))
