"""Each pass of a taken-over iterable seeded and keyed: the batch sampler :class:`PassSeeder`.

See :mod:`lightning_repro.data.streaming` for the item streams it keys, and
:mod:`lightning_repro.data.workerpos` for the positions it records and restores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightning_repro import streams
from lightning_repro.data.epochstart import start_after_epoch_end
from lightning_repro.data.libraries import (
    dataset_epoch,
    epoch_shared_with_workers,
    give_evaluation_pass_its_epoch,
    give_main_copy_its_epoch,
    set_stage_epochs,
)
from lightning_repro.data.streaming import _TICKETS, KeyedIterable, Ticket
from lightning_repro.data.workerpos import StreamPosition
from lightning_repro.streams import StreamKey

__all__ = ["PassSeeder"]


class PassSeeder:
    """The batch sampler of a taken-over iterable: seeds each pass and gives its batches as :class:`Ticket` values.

    At every pass it re-seeds the loader generator (the workers' base seed: ``streams.loader_seed``), derives the pass's
    item key, gives a resumed pass its position (and the dataset the epoch it had, see below), and tells the
    :class:`KeyedIterable` and the :class:`~lightning_repro.data.workerpos.StreamPosition`. A mid-epoch resume does not
    rerun ``on_train_epoch_start``, where users call ``dataset.set_epoch``: the epoch the dataset showed when the
    interrupted pass started (recorded in the checkpoint) is given back with ``set_epoch`` where it differs. A pipeline
    that counts its passes itself (webdataset's ``detshuffle``, counted in the copies that iterate: the workers',
    persistent ones included) gets the counts of then back, before the pass's workers copy it.

    A pass of the same counter starts anew only after the last one ran out (a cycled loader): an iterator dropped
    before its end (Lightning re-creates the first iterator of a resumed epoch) is restarted with the same key, as
    :class:`~lightning_repro.data.samplers.ReproBatchSampler` does. After an epoch-end checkpoint (its record says
    ``ended``, or is of the epoch before) the first pass gets what the uninterrupted run's copies had then: the
    dataset the epoch its ``on_train_epoch_start`` gave (:mod:`~lightning_repro.data.epochstart`), persistent
    workers the epoch of their copies (a ``set_epoch`` in the main process does not reach them, unless the dataset
    shares its epoch with them, as HF's does), and the copies that persist (persistent workers', the main
    process's with ``num_workers=0``) the pipeline's pass counts, one more than at the recorded pass's start.

    An evaluation pass of a pipeline that counts its passes (litdata's loader, webdataset's ``detshuffle``) is read
    with its counter as that count (``libraries.give_evaluation_pass_its_epoch``), not with the passes read in the
    process, which a sanity check or a resume moves: given in the main process before the workers copy the dataset,
    and carried with the pass's key (:class:`Ticket`, ``passkey``) to persistent workers, whose copies count their own.
    """

    def __init__(
        self,
        inner: Any,
        *,
        seed: int,
        rank: int,
        stream: StreamKey,
        counter: Callable[[], int],
        generator: torch.Generator,
        dataset: KeyedIterable,
        position: StreamPosition,
        batched: bool,
        persistent: bool = False,
    ) -> None:
        self.inner = inner
        self.seed, self.rank, self.stream, self.counter, self.generator = seed, rank, stream, counter, generator
        self.dataset, self.position, self.batched, self.persistent = dataset, position, batched, persistent
        position.read_epoch = lambda: dataset_epoch(dataset.dataset)  # see StampedIterator
        self._passes: dict[int, int] = {}
        self._ended: tuple[int, dict[str, Any]] | None = None  # (counter, the record of the pass before it)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # torch's multi-process iterator calls iter() twice and advances only the second: seed the loader generator
        # and the dataset now (the base seed is drawn after the first, workers start before the second), commit later
        counter = int(self.counter())
        position = self.position
        given = position.resume
        record = given if given is not None and given["epoch"] == counter and not given.get("ended") else None
        if given is not None and int(given["epoch"]) == counter - 1:  # an epoch-end checkpoint's
            self._ended, position.resume = (counter, given), None
        reseeded = position.reseeded
        if reseeded is not None and reseeded["epoch"] != counter:
            reseeded = None
        pass_ = self._next_pass(counter, record)
        if reseeded is not None:  # another num_workers: the rest of the epoch is a pass of its own, after the record's
            pass_ = max(pass_, int(reseeded["pass"]) + 1)
        where = (self.seed, self.rank, self.stream)
        self.generator.manual_seed(streams.loader_seed(*where, counter, pass_, persistent=self.persistent))
        key = streams.iterable_seed(*where, counter, pass_)
        user = self.dataset.dataset
        wanted = record.get("dataset_epoch") if record is not None else None
        if wanted is not None and dataset_epoch(user) != wanted:
            user.set_epoch(wanted)  # what on_train_epoch_start did in the interrupted run (see the class)
        if self.dataset._positioned:
            give_main_copy_its_epoch(user)  # litdata: the epoch its state records in the main process
        count = None if self.stream.stage == "train" else counter
        if count is not None:  # litdata's epoch, webdataset's stage counts: by the counter, not the passes read
            give_evaluation_pass_its_epoch(user, count)
        counts = record.get("stage_epochs") if record is not None else None
        if counts is not None:
            set_stage_epochs(user, counts)  # a resumed process counts its passes from 0 (see the class)
        ended = self._ended[1] if self._ended is not None and self._ended[0] == counter else None
        if ended is not None:  # the epoch the uninterrupted run's on_train_epoch_start gave, before the pass is read
            position.epoch_end = start_after_epoch_end(user, counter, ended, position.epoch_end)
        self.dataset.begin_pass(key, record, self._carry(counter, pass_), count)
        _TICKETS.pop(self.dataset.owner, None)  # no key of an earlier pass is read (workers fork this process)
        return self._pass(counter, pass_, key, record, reseeded, count)

    def _next_pass(self, counter: int, record: dict[str, Any] | None) -> int:
        if record is not None:
            return int(record["pass"])
        if counter in self._passes:  # a new pass only after the last one ran out, else the same one again
            return self._passes[counter] + int(self.position.ended)
        return 0

    def _carry(self, counter: int, pass_: int) -> tuple[int | None, list[int] | None] | None:
        """What the pass before an epoch-end checkpoint leaves to ``counter``'s first pass (see the class)."""
        if self._ended is None or self._ended[0] != counter or pass_ != 0:
            return None
        before = self._ended[1]
        user = self.dataset.dataset
        epoch = before.get("workers_epoch") if self.persistent and not epoch_shared_with_workers(user) else None
        counts = before.get("stage_epochs")
        persisted = self.persistent or self.position.num_workers == 0  # the copies that iterate, pass after pass
        stages = [int(c) + 1 for c in counts] if counts is not None and persisted else None
        return None if epoch is None and stages is None else (epoch, stages)

    def _pass(
        self,
        counter: int,
        pass_: int,
        key: int,
        record: dict[str, Any] | None,
        reseeded: dict[str, Any] | None,
        count: int | None,
    ) -> Iterator[Any]:
        self._passes = {counter: pass_}
        position = self.position
        if record is not None and position.resume is record:
            position.resume = None
        consumed = 0
        if reseeded is not None and position.reseeded is reseeded:
            position.reseeded, consumed = None, int(reseeded["consumed"])
        epoch = dataset_epoch(self.dataset.dataset)
        position.begin_pass(counter, pass_, dataset_epoch=epoch, start=record, consumed=consumed)
        if not self.batched:
            yield from self.inner
            return
        owner = self.dataset.owner
        yield from (Ticket(indices, key, owner, count) for indices in self.inner)
