"""Checkpoint files and the tools on them: reading any layout whole (state.py), model weights in
portable forms (weights.py), Hugging Face export and import (hf.py), inspection (inspect.py) and
the ``megasparse convert`` / ``megasparse inspect`` commands (cli.py)."""
