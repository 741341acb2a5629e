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
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["end_counted_epoch", "goes_on_in_epoch"]


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
