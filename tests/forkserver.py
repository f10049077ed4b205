"""A fork server for the tests: ``megasparse`` processes without an interpreter start each.

Most of a tiny test run's time is Python importing torch and DeepSpeed (about 5 s of the 6 s of an
8-step run here). This server imports them once and forks a child per requested process. Every child
is a real, separate process -- its own memory, process group, DeepSpeed state, signals and exit
status -- that runs ``megasparse.cli.main`` as ``python -m megasparse`` would, with the environment,
working directory and standard output and error files the request names, and leaves as the
interpreter does (non-daemon threads joined, exit functions run). Only the interpreter's start-up is
shared, and with it what is read while importing: ``DS_ACCELERATOR`` and the like come from the
server's environment (``OMP_NUM_THREADS``, which the OpenMP runtime reads when it loads, is applied
again). What the shared start skips -- ``python -m megasparse`` itself, and the interpreter's
finalisation with the process group's destructors -- is run for real by the launcher tests and by
``helpers.megasparse(..., launcher="python")``.

Protocol, one JSON object per line: requests on standard input
``{"id", "argv", "env", "cwd", "stdout", "stderr"}``; replies on the file descriptor given as the
first argument, ``{"id", "pid"}`` when a child starts and ``{"id", "exit"}`` when it ends (the exit
status as ``subprocess`` reports it: negative for a signal). End of input kills the children still
running and ends the server.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import sys
import threading
import traceback

POLL_S = 0.01  # how often the children are reaped while some are running


def serve(replies: int) -> None:
    # The heavy imports, once; nothing here may start a thread or run a torch operation (the children
    # inherit the process as it is at the fork).
    import deepspeed  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (imported by the first torch.optim.Optimizer: 1.5 s)
    try:  # ZeRO's optimizer check imports it (1-2 s); a private module, so only if this release has it
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:
        pass

    import megasparse.cli  # noqa: F401
    import megasparse.convert.cli  # noqa: F401
    import megasparse.train.trainer  # noqa: F401
    from deepspeed.comm.torch import build_shm_op

    try:  # DeepSpeed's JIT-built CPU collective op (compiled on first use, ~20 s): built and loaded once, here
        build_shm_op()
    except Exception as exc:  # then each child meets the problem itself, and reports it
        print(f"forkserver: cannot build DeepSpeed's shared-memory op: {exc}", file=sys.stderr)

    requests = sys.stdin.fileno()
    running: dict[int, str] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], POLL_S if running else None)
        if ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, (requests, replies))
                running[pid] = request["id"]
                _reply(replies, {"id": request["id"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply(replies, {"id": running.pop(pid), "exit": os.waitstatus_to_exitcode(status)})
    for pid in running:
        os.kill(pid, signal.SIGKILL)
    for pid in running:
        os.waitpid(pid, 0)


def _reply(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _child(request: dict, server_fds: tuple[int, ...]) -> None:
    """Become ``python -m megasparse ARGV`` in the request's environment; never returns."""
    code = 1
    try:
        for fd in server_fds:
            os.close(fd)
        for target, path, flags in ((0, os.devnull, os.O_RDONLY),
                                    (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            fd = os.open(path, flags, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "OMP_NUM_THREADS" in os.environ:  # read by the OpenMP runtime when it loaded, in the server
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        sys.argv = [sys.executable, *request["argv"]]
        from megasparse.cli import main

        code = main(request["argv"])
    except SystemExit as exc:  # argparse, or a command that exits itself
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
    finally:
        try:  # the interpreter's own exit: wait for non-daemon threads, then the exit functions
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
