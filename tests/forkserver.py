"""A warm fork server for the end-to-end tests: torch, numpy and Lightning imported once, one fork per run.

A fresh interpreter spends ~6 s of CPU importing torch and Lightning before a test's training starts; this
server imports them once (in a process started with the environment the runs expect) and forks a child per
run. The child becomes the run as ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) would: its own
session and process group, the requested argv, working directory and environment, stdin from /dev/null,
stdout and stderr into files, ``runpy`` with ``run_name="__main__"``, and the interpreter's normal exit (atexit
handlers, exit code from ``sys.exit``, 1 with a traceback on an exception, or whatever ``os._exit`` says) up to
its finalization, which is skipped (:func:`finish`). A training still runs in its own process; only the imports
are shared.

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

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import threading
from typing import Any, NoReturn

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


def _exit_code(error: BaseException | None) -> int:
    """The exit code a fresh interpreter gives ``error`` escaping its script, the traceback or message printed."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        code = error.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)  # sys.exit("message"): printed, exit code 1
        return 1
    trace = error.__traceback__  # from the script's frames on, as a fresh interpreter prints it
    while trace is not None and trace.tb_frame.f_code.co_filename in (__file__, runpy.run_path.__code__.co_filename):
        trace = trace.tb_next
    error = error.with_traceback(trace or error.__traceback__)  # what the hook prints (not its argument)
    sys.excepthook(type(error), error, error.__traceback__)
    return 1


def finish(error: BaseException | None) -> NoReturn:
    """End the child as an interpreter ends, up to its finalization, which is skipped (as a multiprocessing child
    forked from its parent skips it).

    The order is ``Py_FinalizeEx``'s: the traceback or message, the non-daemon threads joined, the atexit handlers
    (``weakref.finalize`` and ``logging.shutdown`` among them), the standard streams flushed; then ``os._exit``.
    What it skips: tearing down the modules and collecting what is left, which takes a forked child 1.2-1.7 s on
    the 2-core CI VM (every object it inherited is written again: copy-on-write) and a fresh interpreter about 1.2
    s after importing torch and Lightning, for a run of 0.4 s. A file left open without a flush would lose its
    buffer here (a fresh interpreter flushes it while tearing down); the runs close theirs.
    """
    code = _exit_code(error)
    interrupted = isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls first: join non-daemon threads
    atexit._run_exitfuncs()  # errors are printed ("Exception ignored in atexit callback") and the rest still run
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:  # an unhandled KeyboardInterrupt ends the interpreter by SIGINT, as here
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    _answer({"ready": True, "pid": os.getpid()})
    request = serve()
    if request is None:
        return
    try:  # the child: exceptions, sys.exit and os._exit end it as they end a fresh interpreter
        become(request)
    except BaseException as error:  # what escapes the script: reported as the interpreter would
        finish(error)
    finish(None)


if __name__ == "__main__":
    main()
