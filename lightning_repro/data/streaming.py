"""Item-keyed streams for an ``IterableDataset``, and each worker's resume at its own position.

An ``IterableDataset`` has no sample index, but each worker's items have a position: while worker ``w`` (0 in the
main process) produces its ``k``-th item of a pass, python, numpy and torch draw from the stream of
``(seed, rank, loader, epoch, pass, w, k)`` (:func:`~lightning_repro.streams.iterable_seed`,
:func:`~lightning_repro.streams.worker_items_seed`, :func:`~lightning_repro.streams.item_seed`), and the collate of
its ``b``-th batch from :func:`~lightning_repro.streams.collate_seed` ``(.., b)``. Draws inside a generator
``__iter__`` for item ``k`` happen during that ``next()``, so they are item ``k``'s. A worker's draws then depend on
neither timing, prefetch nor the main process, and a replay of its items draws what they drew. In the main process
the process streams are put back after each item and each collate, so loading never shifts them.

The pieces, installed on a private copy of the loader by :func:`~lightning_repro.data.takeover.prepare_dataloader`:

* :class:`~lightning_repro.data.passseeder.PassSeeder` replaces the loader's batch sampler (``batch_size``
  ``None``-lists, as torch makes them for an iterable): at every pass it derives the pass's seeds and gives each
  batch's indices as a :class:`Ticket` that carries the pass's key to the worker (persistent workers keep their first
  copy; no ``batch_size``: ``passkey``);
* :class:`KeyedIterable` wraps the dataset: its iterator (:class:`_Items`) seeds each item, and on a resumed pass
  gives the worker back its position: the dataset's own state taken in that worker when it has ``state_dict()``,
  else a fast-forward of its iterator from the pass's start by its consumed count (read, not collated or sent);
  a worker whose turn in torch's round-robin is not yet (torch starts every pass at worker 0) first answers one
  batch request with a :class:`~lightning_repro.data.stamps.SkipTurn`, so the turn continues with the right worker;
* :class:`~lightning_repro.data.streamcollate.StreamCollate` collates on the batch's stream and stamps the batch with
  the worker's position (:class:`~lightning_repro.data.stamps.WorkerStamp`), which the main process takes off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from lightning_repro import streams
from lightning_repro.data import generators as gens
from lightning_repro.data.fastrng import ItemSeeder, capture_fast, item_putters, restore_fast, seed_sample
from lightning_repro.data.keyed import DatasetWrapper
from lightning_repro.data.libraries import (
    dataset_epoch,
    give_evaluation_pass_its_epoch,
    own_state_exact,
    set_stage_epochs,
    stage_epochs,
    stateful_iterable,
)
from lightning_repro.data.litdatamix import forget_loaded_state, position_worker
from lightning_repro.data.passkey import SharedKey

__all__ = ["KeyedIterable", "Ticket"]

_TICKETS: dict[Any, tuple[int, int | None]] = {}  # in this process: loader owner -> the (key, count) being fetched
_SKIPPED = object()  # what an item request returns while a worker skips its turn


class Ticket(list):  # type: ignore[type-arg]
    """The indices of one batch of an iterable (``None`` each), carrying the pass's key into the worker.

    ``counter``: an evaluation pass's count of passes (its counter), which persistent workers' copies take at the pass's
    start (:class:`~lightning_repro.data.passseeder.PassSeeder`); ``None`` for a train pass.
    """

    __slots__ = ("counter", "key", "owner")

    def __init__(self, indices: Any, key: int, owner: Any, counter: int | None = None) -> None:
        super().__init__(indices)
        self.key, self.owner, self.counter = key, owner, counter

    def __iter__(self) -> Iterator[Any]:
        _TICKETS[self.owner] = (self.key, self.counter)  # torch's fetcher iterates the indices before it asks for items
        return list.__iter__(self)


class KeyedIterable(DatasetWrapper, IterableDataset):  # type: ignore[type-arg]
    """Wraps an ``IterableDataset``: each item on its own stream, each worker resumed at its position."""

    _WRAPPER = frozenset({"dataset", "owner", "keyed", "batch_size"})

    def __init__(self, dataset: Any, *, owner: Any, keyed: bool, batch_size: int | None) -> None:
        self.dataset = dataset
        self.owner = owner
        self.keyed = keyed
        self.batch_size = batch_size
        self._own: list[gens.OwnGenerator] = []  # generators the dataset holds: keyed per item too
        # its own state restores it exactly (not HF's with a shuffle buffer: data/libraries.py), else fast-forward
        self._stateful = stateful_iterable(dataset) and own_state_exact(dataset)
        self._positioned = False  # the loader restores the dataset's position itself (litdata): only key items
        self._key = 0  # the current pass's key (what a worker reads when no ticket brought one)
        # (pass key, per worker, turn, the epoch of the dataset copies that read the pass)
        self._resume: tuple[int, dict[int, dict[str, Any]], int, int | None] | None = None
        # (pass key, the epoch for persistent workers' copies, the pass counts for the copies that persist): what the
        # pass before an epoch-end checkpoint left to this one in the uninterrupted run (see passseeder.PassSeeder)
        self._carry: tuple[int, int | None, list[int] | None] | None = None
        self._active: _Items | None = None  # the iterator of the current pass in this process
        self._passes = 0  # passes this copy started in a worker (more than one: a persistent worker's)
        self._shared_key: SharedKey | None = None  # persistent workers without batch requests: the key (passkey)
        self._count: int | None = None  # an evaluation pass's count of passes (see Ticket), in this copy

    def begin_pass(
        self,
        key: int,
        record: dict[str, Any] | None,
        carry: tuple[int | None, list[int] | None] | None = None,
        count: int | None = None,
    ) -> None:
        """A pass starts with key ``key``.

        ``record``: the checkpoint's position it resumes at; ``carry``: the epoch and pass counts the copies that
        read it start with, after an epoch-end checkpoint; ``count``: an evaluation pass's count of passes, which the
        pipeline's copies read it with (see :class:`~lightning_repro.data.passseeder.PassSeeder`).
        """
        self._key, self._count = key, count
        if self._shared_key is not None:  # persistent workers that no batch request tells it
            self._shared_key.set(key, count)
        self._active = None
        self._resume = None
        self._carry = None if carry is None else (key, *carry)
        if record is not None:
            workers = {int(w["worker"]): w for w in record["workers"]}
            self._resume = (key, workers, int(record["turn"]), record.get("workers_epoch"))

    def __iter__(self) -> _Items:
        self._active = _Items(self)
        return self._active

    def _pass(self) -> tuple[int, int | None]:
        """The (key, count) of the current pass, where no batch request brought them: this copy's, else shared."""
        shared = self._shared_key
        return (self._key, self._count) if shared is None else (shared.get(), shared.count())


class _Items:
    """One process's iterator over a :class:`KeyedIterable` for one pass (see the module)."""

    def __init__(self, owner: KeyedIterable) -> None:
        self.owner = owner
        self.inner: Iterator[Any] | None = None
        self.main = True
        self.worker = 0
        self.seed = 0  # the worker's items seed in this pass
        self.seeder = ItemSeeder(0)  # its items' streams (streams.item_seed(seed, k)), a block at a time
        self.k = 0  # items produced (fast-forwarded ones included)
        self.batches = 0  # batches collated
        self.skip = 0  # item requests still to answer with _SKIPPED (not this worker's turn yet)
        self.ended = False
        self.note: tuple[int, float] | None = None  # a fast-forward's (items, seconds), sent with the next batch
        self.epoch: int | None = None  # the epoch the dataset copy shows in this pass (``dataset_epoch``)
        self.epochs: list[int] | None = None  # the dataset's own pass counts at the pass's start (detshuffle)
        self.pending: Any = None  # main process: its streams before the current batch's first item
        self.own = owner._own  # with the generators the pass's iterator holds: keyed per item
        self.fast = False  # __next__'s short path (_fast_allowed): ItemSeeder.seed inlined
        _, self._py, self._set_torch = item_putters()

    def hold(self) -> None:
        """Main process: keep the process streams now, for :meth:`put_back`, unless the current batch's are kept.

        The collate of a pass's short last batch comes after its items ran out, which put their streams back
        already: its own draws are put back too (they once moved the training's streams with ``num_workers=0``).
        """
        if self.main and self.pending is None:
            self.pending = capture_fast()

    def put_back(self) -> None:
        """Main process: put back the process streams the current batch's items moved."""
        if self.pending is not None:
            saved, self.pending = self.pending, None
            restore_fast(saved)

    def __iter__(self) -> _Items:
        return self

    def _start(self) -> None:
        owner = self.owner
        info = get_worker_info()
        self.main = info is None
        self.worker = 0 if info is None else int(info.id)
        key, count = _TICKETS.get(owner.owner) or owner._pass()
        if count is not None and not self.main:  # persistent workers' copies count their passes on from their first
            give_evaluation_pass_its_epoch(owner.dataset, count)
        self.seed = streams.worker_items_seed(key, self.worker)
        self.seeder = ItemSeeder(self.seed)
        resume = owner._resume if owner._resume is not None and owner._resume[0] == key else None
        spec = resume[1].get(self.worker) if resume is not None else None
        wanted = resume[3] if resume is not None and not self.main else None
        if wanted is not None and dataset_epoch(owner.dataset) != wanted:
            # what this worker's copy showed in the interrupted pass: persistent workers keep the copy of their
            # first pass, which the main process's set_epoch does not reach, while this worker started now
            owner.dataset.set_epoch(wanted)
        carry = owner._carry if owner._carry is not None and owner._carry[0] == key else None
        if carry is not None:  # the first pass after an epoch-end checkpoint, in the copies that persist
            if not self.main and carry[1] is not None and dataset_epoch(owner.dataset) != carry[1]:
                owner.dataset.set_epoch(carry[1])
            if carry[2] is not None:  # also undoes what a dropped iterator of the same pass counted
                set_stage_epochs(owner.dataset, carry[2])
        if not self.main:
            if owner._passes:  # a persistent worker's copy: what was loaded before its first pass is stale
                forget_loaded_state(owner.dataset)
            owner._passes += 1
        self.epoch = dataset_epoch(owner.dataset)
        saved = capture_fast() if self.main else None
        own_saved = gens.capture_generators(owner._own) if self.main and owner._own else None
        try:
            restored = False
            if spec is not None:
                self.batches = int(spec["batches"])
                if owner._positioned:  # the dataset resumes at its consumed items by the loader's own state
                    self.k, restored = int(spec["items"]), True
                    if not self.main:  # litdata's mix: each dataset at this worker's own items of it
                        position_worker(owner.dataset, self.worker)
                if owner._stateful and spec.get("state") is not None:
                    owner.dataset.load_state_dict(spec["state"])  # before iter(), as torchdata does
                    self.k, restored = int(spec["items"]), True
            if owner.keyed:
                z = streams.iter_seed(self.seed)
                seed_sample(z)
                if owner._own:
                    gens.reseed_generators(owner._own, z)
            self.epochs = stage_epochs(owner.dataset)  # before iterating: webdataset counts at the first item
            self.inner = iter(owner.dataset)
            if owner.keyed:
                self.own = owner._own + gens.iterator_generators(self.inner, owner._own)
            if spec is not None and not restored and int(spec["items"]):
                self._fast_forward(int(spec["items"]))
        finally:
            if saved is not None:
                restore_fast(saved)
            if own_saved is not None:
                gens.restore_generators(owner._own, own_saved)
        if resume is not None and not self.main and self.worker < resume[2] and not owner._positioned:
            self.skip = owner.batch_size or 1  # one batch request of this pass comes before this worker's turn
        self.fast = self._fast_allowed()

    def _fast_allowed(self) -> bool:
        """A worker's keyed items, with no streams to put back, own generators or turn to skip: the short path."""
        return self.owner.keyed and not self.main and not self.own and not self.skip and not self.ended

    def _fast_forward(self, items: int) -> None:
        """Read this worker's first ``items`` items of the pass again, on their streams, and drop them."""
        start = time.perf_counter()
        owner, inner = self.owner, self.inner
        assert inner is not None
        for k in range(items):
            if owner.keyed:
                z = self.seeder.seed(k)
                if self.own:
                    gens.reseed_generators(self.own, z)
            try:
                next(inner)
            except StopIteration:
                self.ended = True
                break
            self.k = k + 1
        self.note = (self.k, time.perf_counter() - start)

    def __next__(self) -> Any:
        if self.fast:  # the same states put in place as by ItemSeeder.seed, ~0.4 us an item less
            seeder, k = self.seeder, self.k
            if seeder.whole and seeder.start <= k < seeder.end:
                seeder.put(seeder.states, k - seeder.start)  # torch's too where the kernel writes it (TORCH_RAW)
                self._py.gauss_next = None  # random.seed() clears it too
                if seeder.tensors:
                    self._set_torch(seeder.tensors[k - seeder.start])
            else:
                seeder.seed(k)
            try:
                item = next(self.inner)  # type: ignore[arg-type]
            except StopIteration:
                self.ended, self.fast = True, False
                raise
            self.k = k + 1
            return item
        if self.inner is None:
            self._start()
        if self.skip:
            self.skip -= 1
            if not self.skip:
                self.fast = self._fast_allowed()
            return _SKIPPED
        if self.ended:
            raise StopIteration
        owner, inner = self.owner, self.inner
        assert inner is not None
        if not owner.keyed:
            item = next(inner)
            self.k += 1
            return item
        if self.main and self.pending is None:
            self.pending = capture_fast()  # put back by the collate of the batch (or when the items end)
        own_saved = gens.capture_generators(self.own) if self.main and self.own else None
        try:
            z = self.seeder.seed(self.k)
            if self.own:
                gens.reseed_generators(self.own, z)
            item = next(inner)
        except BaseException as error:
            if isinstance(error, StopIteration):
                self.ended = True
            self.put_back()
            raise
        finally:
            if own_saved is not None:
                gens.restore_generators(self.own, own_saved)
        self.k += 1
        return item
