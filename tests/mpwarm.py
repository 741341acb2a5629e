"""A warm ``multiprocessing`` fork server for a test run's dataloader workers: forked, not a fresh interpreter.

A DDP rank of the tests starts its dataloader workers from a fork server (``multiprocessing_context="forkserver"``:
forking them from the rank itself, once its gloo threads run, hung once in ~20 runs). ``multiprocessing`` starts
that server as a fresh interpreter, which imports torch, Lightning and lightning-repro again: ~6 s of CPU per rank
and job on the 2-core CI VM, three jobs a test. :func:`start` forks the server from the run instead, at the start
of its script, while the run is still single-threaded (nothing has run a torch op, no process group, no thread):
the server then has the run's imports already, and runs ``multiprocessing.forkserver.main`` as the spawned one does
(same listener, same "alive" pipe, same preload). The workers are still forked by that server, in the rank's
process group, from a process that never ran a training step.

What differs from a spawned server: its ``__main__`` is the run's script (a spawned one's workers import it again
as ``__mp_main__``; its module-level state is the same at both points), and its hash seed is the rank's. A run whose
process is not single-threaded at that point gets the spawned server, as does a run with ``warm_forkserver``
off (one DDP test keeps the spawned path).
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
from multiprocessing import connection, forkserver, resource_tracker, util


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: leave it to multiprocessing
        return 0


def _known() -> bool:
    """This Python's server takes what :func:`start` gives it (3.11, 3.12; 3.13 added an authentication key)."""
    return list(inspect.signature(forkserver.main).parameters) == [
        "listener_fd",
        "alive_r",
        "preload",
        "main_path",
        "sys_path",
    ]


def start(preload: list[str]) -> bool:
    """Fork this process's ``multiprocessing`` fork server now (with ``preload`` imported in it); ``False`` (and
    nothing done) when the process is not single-threaded or a server already runs."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    if _threads() != 1 or server._forkserver_pid is not None or not _known():
        return False
    with server._lock:
        resource_tracker.ensure_running()  # as ensure_running does: the workers get its fd from the rank
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # what the run printed is not printed again by a worker
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the server: it ends when every process holding alive_w has ended
            code = 1
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, preload)
            except SystemExit:
                code = 0
            finally:
                os._exit(code)  # never the run's atexit handlers
        os.close(alive_r)
        listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True
