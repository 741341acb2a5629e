"""A warm fork server for the end-to-end tests: torch, numpy and Lightning imported once, one fork per run.

A fresh interpreter spends ~6 s of CPU importing torch and Lightning before a test's training starts; this
server imports them once (in a process started with the environment the runs expect) and forks a child per
run. The child becomes the run as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would: its own
session and process group, the requested argv, working directory and environment, stdin from /dev/null,
stdout and stderr into files, ``runpy`` with ``run_name="__main__"``, and the interpreter's normal exit (atexit
handlers, exit code from ``sys.exit``, 1 with a traceback on an exception, or whatever ``os._exit`` says).
A training still runs in its own process; only the imports are shared.

Rules that keep a child equal to a fresh interpreter:

* The server runs no torch op and starts no thread before forking (OpenMP and other thread pools do not
  survive ``fork``); ``serve`` checks that it is single-threaded before every fork.
* What an interpreter reads once at start (``PYTHONHASHSEED``, ``PYTHONPATH``, ``OMP_NUM_THREADS``) is the
  server's: ``tests/runner.py`` starts it with the values the runs use and runs a command whose environment
  differs in such a variable in a fresh interpreter instead.
* ``lightning_repro`` is not imported here, so the package's import-time reads of the environment are the
  run's.

Protocol: one JSON object a line on stdin, one answer a line on stdout.
``{"op": "spawn", "argv": [...], "cwd": ..., "env": {...}, "stdout": PATH, "stderr": PATH}`` -> ``{"pid": N}``
(``argv`` is ``[SCRIPT, *args]`` or ``["-m", MODULE, *args]``); ``{"op": "poll", "pid": N}`` -> ``{"code": C}``
with ``C`` ``null`` while the child runs, else its exit code as ``subprocess`` reports it (``-SIGNAL`` when a
signal ended it). End of input: the server kills the process groups of the children still running and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import sys
import threading
from typing import Any

PRELOAD = ("numpy", "torch", "torch.distributed", "torch.utils.data", "lightning.pytorch", "torchmetrics")


def _answer(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _threads() -> int:
    """The process's OS threads (Python's and native ones, such as an OpenMP pool)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux
        return threading.active_count()


def serve() -> dict[str, Any] | None:
    """Answer requests until the input ends; in a forked child, return its request (the child then runs it)."""
    children: set[int] = set()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        if request["op"] == "spawn":
            if _threads() != 1:  # a preloaded module started a thread: a forked child could inherit a held lock
                raise RuntimeError(f"the fork server has {_threads()} threads; it must fork with one")
            pid = os.fork()
            if pid == 0:
                return dict(request)
            children.add(pid)
            _answer({"pid": pid})
        elif request["op"] == "poll":
            pid = request["pid"]
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
            _answer({"code": os.waitstatus_to_exitcode(status) if done else None})
        else:
            raise ValueError(f"unknown request {request!r}")
    for pid in children:  # the tests went away: take their runs with them
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    return None


def become(request: dict[str, Any]) -> None:
    """In the forked child: turn into ``python ARGV`` with the request's directory, environment and files."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (fd 0 stays open for the process's lifetime)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = list(request["argv"])
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0], as ``python -m`` does
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    _answer({"ready": True, "pid": os.getpid()})
    request = serve()
    if request is not None:
        become(request)  # the child: exceptions, sys.exit and os._exit end it as they end a fresh interpreter


if __name__ == "__main__":
    main()
