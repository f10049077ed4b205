"""The checkpoint tools: the ``megasparse inspect`` and ``megasparse convert`` commands (cli.py),
Hugging Face export and import (hf.py) and a checkpoint's description (inspect.py)."""
