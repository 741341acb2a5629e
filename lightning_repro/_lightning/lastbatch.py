"""A resume "on the last batch" of an epoch whose end Lightning counts: no batch is fetched after it.

A checkpoint written on an epoch's last batch resumes "on the last batch" (:func:`~lightning_repro._lightning.loops.
fix_loop_progress`: the epoch-end hooks run). Lightning's restarted epoch loop then runs ``advance`` once more
(``loops/training_epoch_loop.py``: ``done`` waits for ``_is_validation_done``, False while restarting), which returns
early only when a validation is due at that batch; otherwise it fetches. Where the data ran out with the epoch that
fetch ends it (``StopIteration``), as in the uninterrupted run. Where the epoch ends by count before its data does
(``limit_train_batches``, a loader beside a shorter one in ``min_size`` mode), the fetcher does not know: a sized
loader's fetcher compares its count with the length only in ``__next__`` (``loops/fetchers.py``: ``fetched`` is
raised by the loop's ``on_run_start`` after ``done`` was set), and a stream's has a batch prefetched. The resumed
epoch trained one batch more than the uninterrupted run (and the next epoch began elsewhere), said ``exact``.

A file written once the epoch was over (``trainer.save_checkpoint`` after ``fit``) is no restart at all: the resume
starts the next epoch (:func:`goes_on_in_epoch`).

What the checkpoint's ``on_train_batch_end`` left undone runs again on resume with the step that batch logged at
(:func:`step_of_saved_batch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl

__all__ = ["end_counted_epoch", "goes_on_in_epoch", "step_of_saved_batch"]


def end_counted_epoch(trainer: pl.Trainer) -> bool:
    """After a restart "on the last batch" of an epoch whose batches are all counted: the fetcher gives no more.

    Read from ``on_train_start`` (the restart stages are set by ``FitLoop.reset``; the fetcher's iterator exists).
    A prefetched batch is dropped, as the next epoch's ``iter()`` drops the uninterrupted run's. Returns whether it
    acted (a restart on the last batch with batches counted: ``num_training_batches`` known and all consumed).
    """
    loop = trainer.fit_loop
    epoch_loop = loop.epoch_loop
    if not (epoch_loop.restarting and getattr(epoch_loop, "restarted_on_last", False)):
        return False
    total = trainer.num_training_batches
    if total == float("inf") or epoch_loop.batch_progress.current.ready < total:
        return False
    fetcher: Any = loop._data_fetcher
    if fetcher is None:
        return False
    if isinstance(getattr(fetcher, "batches", None), list):
        fetcher.batches.clear()  # _PrefetchDataFetcher's
    fetcher.done = True
    return True


def goes_on_in_epoch(trainer: pl.Trainer) -> bool:
    """Whether a resumed run goes on in the checkpoint's epoch (read from ``on_train_start``, before the first batch).

    Lightning restarts in it when its end was not complete in the file (``loops/fit_loop.py``: the ``restarting``
    setter, "if the last epoch completely finished, we are not actually restarting"), and only then loads the train
    loaders' own states; otherwise the next epoch starts, whatever batches the file counts of the last one.
    """
    return bool(trainer.fit_loop.restarting)


@contextmanager
def step_of_saved_batch(trainer: pl.Trainer, pending: dict[str, Any] | None) -> Iterator[None]:
    """Inside: the logger's step (``_batches_that_stepped``) as the checkpoint's ``on_train_batch_end`` had it.

    A checkpoint written there on an epoch's last batch, with no validation due, is loaded with that batch's step
    counted already (:func:`~lightning_repro._lightning.loops.fix_loop_progress`, which counts the batch completed
    too): the uninterrupted run ran the rest of the hook and logged the batch's row before ``on_advance_end`` counted
    it, so on resume their replay (``checkpoint/remainder.py``, ``loops.run_pending``) runs with the step one lower.
    ``pending``: :func:`~lightning_repro._lightning.loops.pending_after_batch`'s, as the file holds it.
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    current: Any = epoch_loop.batch_progress.current
    last = current.ready >= 1 and current.completed == current.processed == current.ready
    counted = int(bool(pending) and not (pending or {}).get("validate") and last)
    epoch_loop._batches_that_stepped -= counted
    try:
        yield
    finally:
        epoch_loop._batches_that_stepped += counted
