"""Stopping the threads and worker processes of a ``torchdata.nodes`` pipeline's iterators, in an order that is safe.

torchdata's own stop (``_ParallelMapperIter._shutdown``) tells the reading thread, the sort thread and the worker
processes to stop at once: a worker may then exit while the sort thread is still unpickling a tensor it put (torch
passes tensor storage by file descriptor, fetched from the sending process), and that thread dies with an unhandled
``ConnectionResetError``. Here the threads that read from the workers are stopped and joined first, while the workers
still run; then the workers are told to stop, and joined. A worker that does not end in time (its output left in a
full pipe; or Lightning's SIGTERM handler, inherited by a worker forked during the fit, which only records the signal)
is killed: nothing reads what it makes any more.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["ENDED", "stop_threads"]

ENDED = "_lightning_repro_ended_workers"  # a stopped iterator's worker processes, ended (its own list is emptied)

_GRACE = 10.0  # seconds one mapper's threads and workers have to end; workers still running then are killed


def stop_threads(node: Any) -> None:
    """Stop the threads and worker processes the iterators of ``node`` and of the nodes under it started.

    Outer nodes first (a ``Prefetcher``'s thread pulls from the nodes under it: it ends before they do). Used for a
    ``Loader`` the user iterated before the fit (Lightning iterates our copy; without lightning-repro the user's
    would have been reset by its next ``iter()``) and for our copy at the run's end (a pass cut by ``max_steps``, or
    by ``limit_val_batches``, keeps its workers, and the process hung at exit joining them, as plain Lightning's does
    with the user's ``Loader``). An iterator stopped here starts again at the loader's next ``iter()``.
    """
    it = getattr(node, "_it", None)
    while it is not None:
        if hasattr(it, "_mp_stop") and hasattr(it, "_workers"):
            _stop_mapper(it)
        else:
            stop = getattr(it, "_shutdown", None)
            if callable(stop):
                stop()
        it = getattr(it, "_it", None)  # a ParallelMapper's _ParallelMapperImpl holds the iterator that has threads
    mixed = getattr(node, "source_nodes", None)  # a MultiNodeWeightedSampler's sources (one restarted mid-pass runs)
    for source in mixed.values() if isinstance(mixed, dict) else [getattr(node, "source", None)]:
        if source is not None:
            stop_threads(source)


def _stop_mapper(it: Any) -> None:
    """A ``_ParallelMapperIter``: its threads first, then its workers (see the module's docstring)."""
    deadline = time.monotonic() + _GRACE
    it._stop.set()  # the reading and sort threads (and thread workers) end at their next look
    for thread in (getattr(it, "_read_thread", None), getattr(it, "_sort_thread", None)):
        if thread is not None and thread.is_alive():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    it._mp_stop.set()  # process workers end once the items handed to them are done
    for worker in it._workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.is_alive() and hasattr(worker, "kill"):
            worker.kill()
            worker.join()
    # ended: kept aside, as torchdata's __del__ would join them again, also in a worker forked later that inherited
    # this iterator, where `is_alive` of another process's child raises "can only test a child process" (a traceback
    # printed by each such worker when it collects the iterator)
    vars(it)[ENDED], it._workers = it._workers, []
