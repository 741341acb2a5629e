"""The first pass after an epoch-end checkpoint: the epoch its dataset is read with.

In an uninterrupted run the iterator of epoch ``e >= 1`` is made after ``on_train_epoch_start``, where users give
the dataset its epoch (``dataset.set_epoch(epoch)``), so its workers copy a dataset that shows ``e``. A run resumed
from a checkpoint written at the end of epoch ``e - 1`` makes its first iterator in ``FitLoop.setup_data``, before
that hook (and again at ``on_train_start`` when the loader was built early), and for a loader without ``__len__``
Lightning fetches a batch at once: that pass is read with whatever epoch the dataset shows then. So before the
iterator is made the dataset is given the epoch the uninterrupted run's hook gave it (:func:`start_after_epoch_end`),
where the checkpoint's record shows that the user gives each epoch its own (:func:`~lightning_repro.data.libraries.
epoch_evidence`): the recorded pass (of an epoch ``>= 1``) began with its own epoch, or the pipeline is HF's, whose
docs ask for it; a record of epoch 0 shows nothing (epoch 0's pass begins before the hook in every run): there the
user is predicted to give it.

Once the iterator exists (its workers copied the dataset, a loader without ``__len__`` read its first batch) and
before the hook runs, the dataset gets back the epoch it showed before (:meth:`EpochEndStart.settle`), as in the
uninterrupted run at that moment, so what the hook gives is checked at the first batches
(:class:`~lightning_repro.data.workerpos.StampedIterator`): the given epoch, exact; another one, the pass is made
again where none of it was read, else a ``NotExactWarning``. Not given back: HF's epoch, which its workers read from
shared memory when their pass starts (after the main process moved on), and an epoch whose hook Lightning will not
run (the restart of an iteration-based run at an epoch's end).

Part of ``data/``: imports :mod:`lightning_repro.data.libraries` only.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning_repro._warn import warn
from lightning_repro.data.libraries import dataset_epoch, epoch_evidence, epoch_shared_with_workers
from lightning_repro.exceptions import NotExactWarning

__all__ = ["EpochEndStart", "check_read_epoch", "start_after_epoch_end"]

_WHY = {  # why the epoch was given, as the resume line and the warning say it
    "each epoch": "as the interrupted run's hook gave each epoch its own",
    "docs": "as HF's docs ask of that hook",
    "predicted": "predicted for that hook (an epoch-0 checkpoint cannot show it)",
}


class EpochEndStart:
    """What the first pass of ``counter`` after an epoch-end checkpoint gave the user's ``dataset`` (see the module).

    ``epoch``: the epoch given with ``set_epoch`` before the pass was read (``None``: none given); ``before``: the
    one the dataset showed until then; ``evidence``: why (:func:`~lightning_repro.data.libraries.epoch_evidence`);
    ``checked``: it was given back before ``on_train_epoch_start``, so the hook's epoch is checked at the first batch.
    """

    __slots__ = ("before", "checked", "counter", "dataset", "epoch", "evidence", "settled")

    def __init__(self, dataset: Any, counter: int, epoch: int | None, before: int | None, evidence: str | None) -> None:
        self.dataset, self.counter, self.epoch, self.before, self.evidence = dataset, counter, epoch, before, evidence
        self.checked = False
        self.settled = False  # given back (or kept) once the resumed run's iterators exist

    def waiting(self) -> bool:
        """An epoch was given and the hook that gives it in the uninterrupted run has not run yet: nothing to check."""
        return self.epoch is not None and not self.settled

    def settle(self, *, hook_runs: bool) -> None:
        """Before ``on_train_epoch_start`` (``hook_runs``: Lightning runs it): give the dataset its own epoch back."""
        if self.settled:
            return
        self.settled = True
        if self.epoch is None or self.before is None or not hook_runs or epoch_shared_with_workers(self.dataset):
            return
        if dataset_epoch(self.dataset) != self.before:
            self.dataset.set_epoch(self.before)
        self.checked = True

    def text(self, *, read: bool, copies: bool) -> str:
        """What the resume line says of the epoch the pass is read with.

        ``read``: a batch of it left the iterator already (a loader without ``__len__``); ``copies``: its workers
        copied the dataset when the iterator was made (not persistent ones, which keep theirs).
        """
        why = f", {_WHY[self.evidence]}" if self.evidence is not None else ""
        checked = ", checked once that hook ran" if self.checked else ""
        if read and self.epoch is not None:
            return f", its first batch read before on_train_epoch_start with set_epoch({self.epoch}){why}{checked}"
        if read and self.before is not None:
            return f", its first batch read before on_train_epoch_start with epoch {self.before}, checked once it ran"
        if copies and self.epoch is not None:
            return f", its workers started with set_epoch({self.epoch}){why} (started again if the hook gives another)"
        return ""


def check_read_epoch(
    position: Any, *, first: bool, persistent: bool, remakable: bool
) -> Literal["same", "remake", "done"] | None:
    """At one of a pass's first batches: does the dataset still show the epoch its pass was read with?

    ``position``: the loader's :class:`~lightning_repro.data.workerpos.StreamPosition`; ``first``: no batch of the
    iterator came yet; ``persistent``: its workers persist; ``remakable``: the iterator can be made again (its
    workers copy the dataset when it is made). Returns ``None`` while an epoch given before ``on_train_epoch_start``
    waits for that hook (:meth:`EpochEndStart.waiting`: nothing checked), ``"same"``, ``"remake"`` (another epoch,
    before the first batch: the pass starts again, nothing of it was consumed) or ``"done"`` (no more checks).
    Another epoch once a batch came (a loader without ``__len__``: Lightning fetched one before the hook) is
    said once, in the first pass after an epoch-end checkpoint; persistent workers do not read the main process's
    epoch there (their copies get the record's): the record takes it.
    """
    start: EpochEndStart | None = position.epoch_end
    if start is not None and start.waiting():
        return None
    epoch = position.stale_epoch()
    if epoch is None:
        return "same"
    resumed = start is not None and start.counter == position.counter
    if resumed and persistent and start is not None and start.checked:
        position.dataset_epoch = epoch  # what the uninterrupted run's pass, made after the hook, began with
        return "done"
    if first:
        return "remake" if remakable else "same"
    if resumed and start is not None:
        given = f"; lightning-repro gave it set_epoch({start.epoch}), {_WHY[start.evidence]}" if start.evidence else ""
        warn(
            f"The IterableDataset shows epoch {epoch} after on_train_epoch_start, but this epoch's first batch was read"
            f" with epoch {position.dataset_epoch} (a resumed run makes its first iterator before that hook, and this"
            f" loader has no __len__, so Lightning fetched a batch then{given}): this epoch's data is NOT the"
            " uninterrupted run's. Give the loader a __len__, or resume from a mid-epoch checkpoint.",
            NotExactWarning,
        )
    return "done"


def start_after_epoch_end(
    dataset: Any, counter: int, record: dict[str, Any], known: EpochEndStart | None
) -> EpochEndStart:
    """Before the first pass of ``counter`` after the epoch-end ``record`` is read: give ``dataset`` its epoch.

    ``known``: what an earlier iterator of the same pass gave (Lightning's first iterator, dropped): given again
    until settled, never after (the hook then decides, and a pass made again reads what it gave).
    """
    if known is not None and known.counter == counter:
        if known.waiting() and dataset_epoch(dataset) != known.epoch:
            dataset.set_epoch(known.epoch)
        return known
    before = dataset_epoch(dataset)
    evidence = epoch_evidence(dataset, record)
    if evidence is None or before is None:
        return EpochEndStart(dataset, counter, None, before, None)
    if before != counter:
        dataset.set_epoch(counter)
    return EpochEndStart(dataset, counter, counter, before, evidence)
