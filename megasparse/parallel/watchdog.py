"""The hang guard: a rank that dies or hangs makes the others fail, naming it, instead of waiting forever.

Every rank keeps a heartbeat: a background thread adds 1 to the counter
``megasparse/heartbeat/<rank>`` in the rendezvous store every ``parallel.heartbeat_seconds``. To
find who stopped, a rank reads all counters, waits three periods (beating on) and reads them
again: the ranks whose counters did not move are dead or hung (counters, not clock times, so clock
skew between nodes does not matter). If the store itself is unreachable, rank 0, which hosts it,
is the one gone. This runs in two cases:

- a collective raises (gloo sees a dead peer's closed connection at once; NCCL raises after the
  process group's timeout): the trainer turns the error into one line naming the silent rank;
- the training loop makes no progress for the stall timeout (a collective that never returns, as
  DeepSpeed's shared-memory CPU all-reduce or a stuck NCCL kernel can): the heartbeat thread itself
  reports the silent rank and ends the process with exit code 2. If every rank still beats (a slow
  step, a long checkpoint), it reports nothing and keeps waiting.

The stall timeout ends before the process group's (``parallel.timeout_minutes``): by the diagnosis's
three heartbeats and two more of margin (:func:`stall_timeout`). Under NCCL's asynchronous error
handling (torch's default) the NCCL watchdog ends the process when a collective passes the process
group's timeout, without raising in the training loop; with equal timeouts it would end a rank before
the diagnosis could name the dead or hung one.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as torch_dist

from megasparse.errors import UserError

DIAGNOSIS_PERIODS = 3  # heartbeats a rank waits to see whose counters stopped
MARGIN_PERIODS = 2  # heartbeats between the end of the diagnosis and the process group's timeout


def stall_timeout(process_group_timeout_s: float, period_s: float) -> float:
    """Seconds without a finished step after which the heartbeat looks for a silent rank: the process group's
    timeout less (DIAGNOSIS_PERIODS + MARGIN_PERIODS) heartbeats, so that the diagnosis ends first."""
    stall = process_group_timeout_s - (DIAGNOSIS_PERIODS + MARGIN_PERIODS) * period_s
    if stall <= 0:
        raise UserError(f"parallel.timeout_minutes: {process_group_timeout_s / 60:g} ({process_group_timeout_s:g} s) "
                        f"leaves no time to name a hung rank before collectives time out: it must exceed "
                        f"{DIAGNOSIS_PERIODS + MARGIN_PERIODS} x parallel.heartbeat_seconds = "
                        f"{(DIAGNOSIS_PERIODS + MARGIN_PERIODS) * period_s:g} s")
    return stall


class Heartbeat:
    def __init__(self, rank: int, world_size: int, period_s: float, process_group_timeout_s: float) -> None:
        self.rank, self.world_size, self.period_s = rank, world_size, period_s
        self.stall_timeout_s = stall_timeout(process_group_timeout_s, period_s)
        self.last_progress = time.monotonic()
        self.store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                         is_master=False, timeout=timedelta(seconds=max(10.0, 3 * period_s)),
                                         wait_for_workers=False)
        self._stop = threading.Event()
        self._waiting_on_rank_0 = False
        self._thread = threading.Thread(target=self._beat, name="megasparse-heartbeat", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        """The training loop completed a step."""
        self.last_progress = time.monotonic()

    @contextlib.contextmanager
    def waiting_on_rank_0(self) -> Iterator[None]:
        """A wait for rank 0 that no collective timeout bounds (its data preparation): inside it, a store that
        cannot be reached (rank 0, which hosts it, or its node is gone) ends this process with one line."""
        self._waiting_on_rank_0 = True
        try:
            yield
        finally:
            self._waiting_on_rank_0 = False

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self._key(self.rank), 1)
            except Exception:  # the store is gone (rank 0 died): the main thread's collective will say so
                if self._waiting_on_rank_0:  # unless it waits without a deadline
                    print(f"megasparse: error: rank {self.rank}: rank 0 (which hosts the rendezvous store) cannot be "
                          "reached while this rank waits for it: it or its node is gone", file=sys.stderr, flush=True)
                    os._exit(2)
                return
            if time.monotonic() - self.last_progress > self.stall_timeout_s:
                diagnosis = self.diagnosis()
                if diagnosis and not self._stop.is_set():
                    stalled = time.monotonic() - self.last_progress
                    print(f"megasparse: error: rank {self.rank}: no progress for {stalled:.0f} s "
                          f"(parallel.timeout_minutes less {DIAGNOSIS_PERIODS + MARGIN_PERIODS} heartbeats): "
                          f"{diagnosis}", file=sys.stderr, flush=True)
                    os._exit(2)
                self.last_progress = time.monotonic()  # everyone is alive: wait another timeout
            self._stop.wait(self.period_s)

    def _key(self, rank: int) -> str:
        return f"megasparse/heartbeat/{rank}"

    def _counters(self) -> list[int]:
        return [self.store.add(self._key(rank), 0) for rank in range(self.world_size)]

    def silent_ranks(self) -> list[int] | None:
        """The ranks whose heartbeat stopped (over DIAGNOSIS_PERIODS periods); None if the store is unreachable."""
        try:
            before = self._counters()
            for _ in range(DIAGNOSIS_PERIODS):
                time.sleep(self.period_s)
                self.store.add(self._key(self.rank), 1)  # this rank is alive while it judges the others
            after = self._counters()
        except Exception:
            return None
        return [rank for rank, (b, a) in enumerate(zip(before, after)) if a == b and rank != self.rank]

    def diagnosis(self) -> str | None:
        """Which rank stopped, in words; None if every other rank still beats (the error is not a lost peer)."""
        silent = self.silent_ranks()
        if silent is None:
            return "rank 0, which hosts the rendezvous store, is unreachable (dead, or its node is)"
        if not silent:
            return None
        names = ", ".join(map(str, silent))
        return f"rank {names} stopped responding (no heartbeat for {DIAGNOSIS_PERIODS * self.period_s:g} s: dead or hung)"

    def stop(self) -> None:
        """End the heartbeat and wait for its thread, so that no store request is in flight when the
        process group (and, on rank 0, the store) is torn down."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(10.0, 3 * self.period_s) + 1.0)
