"""A dataloader worker's start: its signal policy, the user's ``worker_init_fn``, then its streams seeded.

:class:`_WorkerInit` is the ``worker_init_fn`` :func:`lightning_repro.data.takeover.prepare_dataloader` installs.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from torch.utils.data import get_worker_info

from lightning_repro import streams
from lightning_repro._lightning.signals import ignored_in_workers
from lightning_repro.seeding import seed_process_streams
from lightning_repro.streams import StreamKey

__all__ = ["_WorkerInit"]


def _die_of_sigterm_only_from(manager_pid: int) -> None:
    """In a dataloader worker: end on SIGTERM only when the training process (or the worker's parent) sends it.

    A scheduler that preempts a job signals every process of it, the workers too. torch's worker dies of that
    signal, and the training process then fails wherever it is when it notices (torch's SIGCHLD handler raises
    ``RuntimeError: DataLoader worker ... is killed by signal`` at any line, or the next fetch finds the worker
    gone): the run stops mid-step, and under DDP each rank at another point, instead of at the batch end where
    Lightning stops on SIGTERM. So SIGTERM is blocked in the worker and a thread waits for it: from the process that
    started the loader (``DataLoader`` ending a worker that did not stop, ``multiprocessing`` at exit) or the
    worker's parent it ends the worker with status 0, as torch's own handler does; from anyone else it is ignored,
    and the worker goes on serving the batches the training process still fetches before it stops. SIGKILL still
    ends it, and it ends by itself once the training process is gone. POSIX only (``sigwaitinfo``).
    """
    if not (hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigwaitinfo")):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads started from here on inherit the mask

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid in (manager_pid, os.getppid()):
                os._exit(0)

    threading.Thread(target=wait, name="lightning-repro-worker-sigterm", daemon=True).start()


class _WorkerInit:
    """Sets a worker's signal policy, calls the user's ``worker_init_fn``, then seeds the worker streams.

    The policy (:func:`_die_of_sigterm_only_from`) keeps the worker alive through a SIGTERM meant for the whole job,
    and through SLURM's requeue signal (``_lightning/signals.py``: the training process handles it at a batch's end).
    """

    def __init__(self, user_fn: Callable[[int], None] | None, seed: int, rank: int, stream: StreamKey) -> None:
        self.user_fn, self.seed, self.rank, self.stream = user_fn, seed, rank, stream
        self.manager_pid = os.getpid()  # the process that takes the loader over iterates it and starts its workers
        self.ignored = ignored_in_workers()  # SLURM's requeue signal, while the training process defers it

    def __call__(self, worker_id: int) -> None:
        _die_of_sigterm_only_from(self.manager_pid)
        for signum in self.ignored:  # the training process writes the file and requeues the job, not the worker
            signal.signal(signum, signal.SIG_IGN)
        if self.user_fn is not None:
            self.user_fn(worker_id)
        info = get_worker_info()
        # info.seed = the iterator's base seed (drawn from our per-pass loader generator) + worker id
        base = info.seed if info is not None else 0
        seed_process_streams(streams.worker_seed(self.seed, self.rank, self.stream, base, worker_id))
