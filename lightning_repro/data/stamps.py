"""What a worker's keyed collate returns in place of a bare batch: the batch and the worker's position after it.

:mod:`lightning_repro.data.streamcollate` makes them in the workers; :mod:`lightning_repro.data.workerpos` takes them
off in the main process before Lightning sees the batch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SkipTurn", "WorkerStamp"]


class WorkerStamp:
    """A batch as a worker's keyed collate returns it: the batch and the worker's position after it.

    ``epoch``: the epoch the worker's dataset copy showed when it began the pass (``None``: it shows none);
    ``epochs``: the pass counts its dataset copy's stages had when the pass started (webdataset's ``detshuffle``,
    :func:`~lightning_repro.data.libraries.stage_epochs`), or ``None``.
    """

    __slots__ = ("batch", "batches", "epoch", "epochs", "items", "note", "state", "worker")

    def __init__(
        self,
        batch: Any,
        worker: int,
        items: int,
        batches: int,
        state: Any = None,
        note: Any = None,
        epoch: int | None = None,
        epochs: list[int] | None = None,
    ) -> None:
        self.batch, self.worker, self.items, self.batches = batch, worker, items, batches
        self.state, self.note, self.epoch, self.epochs = state, note, epoch, epochs

    def pin_memory(self, device: Any = None) -> WorkerStamp:
        """The stamp with its batch pinned (torch's pin-memory thread calls this; the stamp itself is not pinned)."""
        from torch.utils.data._utils.pin_memory import pin_memory  # torch's own walk over a batch

        batch = pin_memory(self.batch, device)  # type: ignore[no-untyped-call]
        return WorkerStamp(batch, self.worker, self.items, self.batches, self.state, self.note, self.epoch, self.epochs)


class SkipTurn:
    """What a worker returns instead of a batch when it is not its turn yet (a resumed pass, see ``streaming``)."""

    __slots__ = ("worker",)

    def __init__(self, worker: int) -> None:
        self.worker = worker

    def pin_memory(self, device: Any = None) -> SkipTurn:
        """Nothing to pin."""
        return self
