"""The keyed collate of a streaming loader: each batch collated on its stream, and stamped with its worker's position.

Installed by :func:`~lightning_repro.data.takeover.prepare_dataloader` over the user's ``collate_fn`` beside a
:class:`~lightning_repro.data.streaming.KeyedIterable` (see :mod:`lightning_repro.data.streaming`); the main process
takes the stamps off (:mod:`lightning_repro.data.workerpos`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from lightning_repro import streams
from lightning_repro.data.fastrng import seed_sample
from lightning_repro.data.stamps import SkipTurn, WorkerStamp
from lightning_repro.data.streaming import _SKIPPED, KeyedIterable

__all__ = ["StreamCollate"]


class StreamCollate:
    """Collates a worker's batch on its stream and stamps it with the worker's position."""

    def __init__(self, collate_fn: Callable[[Any], Any], dataset: KeyedIterable, *, seed_collate: bool) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset
        self.seed_collate = seed_collate  # False for torch's default collate and convert, which draw nothing

    def __call__(self, data: Any) -> Any:
        """Collate ``data`` (the items of one batch) and return it as a :class:`WorkerStamp`."""
        items = self.dataset._active
        if items is None:  # not an iterator of ours: the user's collate alone
            return self.collate_fn(data)
        if data is _SKIPPED or (type(data) is list and data and data[0] is _SKIPPED):
            return SkipTurn(items.worker)
        try:
            if self.dataset.keyed and self.seed_collate:
                items.hold()  # a pass's short last batch: its items' streams were put back when they ran out
                seed_sample(streams.collate_seed(items.seed, items.batches))
            batch = self.collate_fn(data)
        finally:
            items.put_back()  # main process: loading never shifts its streams
        items.batches += 1
        state = None
        if self.dataset._stateful:
            state = self.dataset.dataset.state_dict()
            if items.main:  # a worker's state is pickled on its way; the main process's must not move on
                state = copy.deepcopy(state)
        note, items.note = items.note, None
        stamp = WorkerStamp if not _litdata_wrapped(batch) else _inner_stamp
        return stamp(batch, items.worker, items.k, items.batches, state, note, items.epoch, items.epochs)


# litdata's CombinedStreamingDataset (and ParallelStreamingDataset) under its StreamingDataLoader yield each item as
# {"__SAMPLES__": item, "__NUM_SAMPLES_YIELDED__": [...], ...}; the loader reads the counts off the collated batch
# (its own state) and yields the samples: the stamp goes on the samples, so the loader still finds its counts
_LITDATA_SAMPLES, _LITDATA_COUNTS = "__SAMPLES__", "__NUM_SAMPLES_YIELDED__"


def _litdata_wrapped(batch: Any) -> bool:
    return type(batch) is dict and _LITDATA_SAMPLES in batch and _LITDATA_COUNTS in batch


def _inner_stamp(batch: dict[str, Any], *position: Any) -> dict[str, Any]:
    return {**batch, _LITDATA_SAMPLES: WorkerStamp(batch[_LITDATA_SAMPLES], *position)}

