"""Progress on standard error: a live tqdm bar on a terminal, plain lines at a low rate elsewhere.

When standard error is not a terminal (a Slurm job log, ``nohup``, CI), a bar would write every
refresh as a line of its own; there a :class:`Progress` writes one line when another tenth of a known
total is done or 30 s have passed since its last line, and one at the end, as DeepSpeed and torchtitan
log their steps::

    train: 400/1,000 step (40%), 2.1 step/s, loss=3.4120, tok_s=8,600, mem_gb=1.21
    tokenizing: 12,000 doc, 950.2 doc/s, tokens=3,100,000          (no total: every 30 s)
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

from tqdm import tqdm

LINE_INTERVAL_S = 30.0  # off a terminal: at most one line per this many seconds ...
LINE_PARTS = 10  # ... unless another tenth of the total is done


class Progress:
    """Counts units of work towards an optional ``total``; shows them as a bar on a terminal, as lines
    elsewhere (``stream`` defaults to standard error; ``clock`` is for tests)."""

    def __init__(self, desc: str, unit: str, total: int | None = None, initial: int = 0, enabled: bool = True,
                 stream: IO[str] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.desc, self.unit, self.total, self.n = desc, unit, total, initial
        self.enabled, self._stream, self._clock = enabled, stream or sys.stderr, clock
        self._postfix: dict[str, Any] = {}
        self._bar = tqdm(desc=desc, unit=unit, total=total, initial=initial, file=self._stream,
                         dynamic_ncols=True) if enabled and self._stream.isatty() else None
        self._start = self._last_line = clock()
        self._start_n = self._line_n = initial
        self._next_part = initial * LINE_PARTS // total + 1 if total else None

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and self._line_due():
            self._line()

    def set_postfix(self, **values: Any) -> None:
        """Values shown after the count (the bar's postfix; the next line's end)."""
        self._postfix = values
        if self._bar is not None:
            self._bar.set_postfix(values, refresh=False)

    def write(self, message: str) -> None:
        """A line of its own, which does not break the bar (written also when the progress is not shown)."""
        if self._bar is not None:
            self._bar.write(message, file=self._stream)
        else:
            print(message, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.n != self._line_n:
            self._line()

    def _line_due(self) -> bool:
        if self._next_part is not None and self.n * LINE_PARTS >= self._next_part * self.total:
            return True
        return self._clock() - self._last_line >= LINE_INTERVAL_S

    def _line(self) -> None:
        now = self._clock()
        count = f"{self.n:,}/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)" if self.total else \
            f"{self.n:,} {self.unit}"
        elapsed = now - self._start
        rate = f", {(self.n - self._start_n) / elapsed:,.1f} {self.unit}/s" if elapsed > 0 else ""
        postfix = "".join(f", {key}={value}" for key, value in self._postfix.items())
        print(f"{self.desc}: {count}{rate}{postfix}", file=self._stream, flush=True)
        self._last_line, self._line_n = now, self.n
        if self.total:
            self._next_part = self.n * LINE_PARTS // self.total + 1
