"""Progress: a live bar on a terminal, a few plain lines in a log file (a Slurm job log, nohup, CI)."""
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from megasparse.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_log_gets_a_line_per_tenth_and_at_the_end():
    out, clock = io.StringIO(), Clock()
    progress = Progress("train", "step", total=1000, stream=out, clock=clock)
    for _ in range(1000):
        clock.now += 0.01  # 10 s in all: the time rule never fires
        progress.set_postfix(loss="3.1")
        progress.update()
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[1].split("%")[0] for line in lines] == [str(p) for p in range(10, 101, 10)]
    assert lines[0] == "train: 100/1,000 step (10%), 100.0 step/s, loss=3.1"
    assert "\r" not in out.getvalue()


def test_a_log_without_a_total_gets_a_line_every_30_s():
    out, clock = io.StringIO(), Clock()
    progress = Progress("tokenizing", "doc", stream=out, clock=clock)
    for _ in range(100):
        clock.now += 1.0
        progress.update(10)
    progress.close()
    assert [line.split(":")[1].split(" doc")[0].strip() for line in out.getvalue().splitlines()] == [
        "300", "600", "900", "1,000"]


def test_a_resumed_run_counts_from_its_step():
    out, clock = io.StringIO(), Clock()
    progress = Progress("train", "step", total=100, initial=45, stream=out, clock=clock)
    for _ in range(10):
        clock.now += 1.0
        progress.update()
    progress.close()
    assert out.getvalue().splitlines() == ["train: 50/100 step (50%), 1.0 step/s", "train: 55/100 step (55%), 1.0 step/s"]


def test_disabled_progress_writes_only_messages():
    out = io.StringIO()
    progress = Progress("train", "step", total=10, enabled=False, stream=out)
    progress.update(10)
    progress.write("step 10: val_loss 3.0")
    progress.close()
    assert out.getvalue() == "step 10: val_loss 3.0\n"


PREPARE = ["-m", "megasparse", "prepare-data", "--vocab-size", "400"]


def test_prepare_data_in_a_log_file_and_on_a_terminal(corpus, tmp_path):
    """The same preparation with standard error in a file (a few lines) and on a terminal (tqdm's bar,
    redrawn in place)."""
    log = tmp_path / "log.txt"
    with log.open("w") as handle:
        subprocess.run([sys.executable, *PREPARE, "--files", str(corpus / "*.txt"), "--out", str(tmp_path / "a")],
                       stderr=handle, stdout=subprocess.DEVNULL, check=True, timeout=300)
    lines = [line for line in log.read_text().splitlines() if line.startswith("tokenizing")]
    assert len(lines) == 1 and "\r" not in log.read_text(), log.read_text()[-2000:]
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal 120 wide
    proc = subprocess.Popen([sys.executable, *PREPARE, "--files", str(corpus / "*.txt"), "--out", str(tmp_path / "b")],
                            stderr=terminal, stdout=subprocess.DEVNULL)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(controller, 1 << 16)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        shown += chunk
    assert proc.wait(timeout=300) == 0
    assert b"tokenizing" in shown and re.search(rb"\r(?!\n)", shown)  # the live bar, redrawn (not a pty's \r\n)
