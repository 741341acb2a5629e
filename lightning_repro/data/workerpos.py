"""Which worker produced each batch training consumed, and where each worker of a streaming loader stands.

A train loader over an ``IterableDataset`` reads each batch in one worker (or in the main process, ``num_workers=0``),
and torch takes batches from the workers in turn (``in_order=True``: the turn starts at worker 0 each pass; a worker
whose data ran out drops out of it). The keyed collate of :mod:`lightning_repro.data.streaming` returns every batch
as a :class:`~lightning_repro.data.stamps.WorkerStamp`: the batch, the worker that read it, that worker's item and
batch counts after it and, for a dataset with ``state_dict()``, the dataset's state taken in the worker right after
the batch. The loader's
iterator (:class:`StampedIterator`, installed by :func:`stream_loader`) takes the stamp off before Lightning sees
the batch and gives it to the loader's :class:`StreamPosition`.

Lightning fetches a batch ahead of training, and the workers ``prefetch_factor`` batches ahead of that, so the
position folds in only the batches training consumed (Lightning's count of the epoch's batches, read when a batch
arrives and when a checkpoint is written): :meth:`StreamPosition.describe` is what the checkpoint entry records,
per worker its consumed items and batches (and state), and whose turn the next batch is.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from lightning_repro.data.epochstart import EpochEndStart, check_read_epoch
from lightning_repro.data.libraries import shift_loader_counters
from lightning_repro.data.loaderstate import POSITION_ATTR, stamped_load_state_dict, stamped_state_dict
from lightning_repro.data.stamps import SkipTurn, WorkerStamp

__all__ = [
    "StampedIterator",
    "StreamPosition",
    "loader_position",
    "plain_loader_class",
    "stream_loader",
]

log = logging.getLogger(__name__)

POSITION_VERSION = 1
"""The version of :meth:`StreamPosition.describe`'s record."""


class StreamPosition:
    """The per-worker position of one loader's current pass, folded from the batches training consumed.

    Args:
        num_workers: The loader's ``num_workers``.
        consumed: Returns how many batches of the current epoch training has consumed (``None``, an evaluation
            loader's: every batch that leaves the iterator counts as consumed, nothing is kept waiting).
    """

    def __init__(self, *, num_workers: int, consumed: Callable[[], int] | None = None) -> None:
        self.num_workers = int(num_workers)
        self.consumed = consumed
        self.counter: int | None = None  # of the current pass
        self.pass_ = 0
        self.dataset_epoch: int | None = None  # the dataset's epoch when the pass started
        self.workers_epoch: int | None = None  # the epoch of the dataset copies that read the pass (from the stamps)
        self.stage_epochs: list[int] | None = None  # the pipeline's own pass counts then, in the copies that iterate
        self.replay = False  # read a resumed pass from its start (webdataset's WebLoader with stages: webloader.py)
        self.resume = None  # a checkpoint's record, for the next pass of its epoch
        self.read_epoch: Callable[[], int | None] | None = None  # the user's dataset's epoch now (PassSeeder sets it)
        self.epoch_end: EpochEndStart | None = None  # the first pass after an epoch-end checkpoint (data/epochstart.py)
        self.loader_epoch: int | None = None  # then, the pass count given back to a loader that keeps one (litdata)
        # a checkpoint's record of another num_workers (on_topology_change="reseed"): the rest of its epoch is a new
        # pass, after the record's; and what the resume line says of it
        self.reseeded: dict[str, Any] | None = None
        self.reseed_note: str | None = None
        self.resumed: dict[str, Any] | None = None  # the record the current pass resumed from
        self._n = self._n_start = 0  # batches of the counter produced so far (every pass), and when the pass started
        self.ended = False  # the current pass's iterator ran out (a pass of its counter after it is a new one)
        self.previous: dict[str, Any] | None = None  # the record of the pass before, which ran out (begin_pass)
        self._pending: deque[tuple[int, WorkerStamp]] = deque()  # produced, not yet consumed
        self._workers: dict[int, dict[str, Any]] = {}  # consumed position of each worker in the pass
        self._batches = 0  # batches of the pass consumed
        self._turn = 0  # the worker whose turn the next batch of the pass is
        self._notes: dict[int, tuple[int, float]] = {}  # fast-forwards measured in the workers
        self.fast_forward: tuple[int, float] | None = None  # (items, seconds) of the last resume's fast-forward
        self.yielded: set[int] = set()  # the workers whose batches of the current pass left the iterator
        # a resumed pass's (epoch, pass) and the loader's own saved state, not loaded (data/loaderstate.py)
        self.unloaded: tuple[int, int, dict[str, Any]] | None = None
        self.loaded_own: dict[str, Any] | None = None  # the loader's own state it loaded (litdata's; loaderstate.py)
        # the loader's own state in the checkpoint, not loaded (ours resume it, or Lightning's epoch-end resume does not
        # load it): reported until a batch is read or another pass begins (data/loaderstate.py)
        self.unstarted: dict[str, Any] | None = None

    @property
    def resume(self) -> dict[str, Any] | None:
        """A checkpoint's record, for the next pass of its epoch; with :attr:`replay`, without worker positions."""
        return self._resume

    @resume.setter
    def resume(self, record: dict[str, Any] | None) -> None:  # with replay: every worker from the pass's start
        replay = record is not None and self.replay and not record.get("ended")
        self._resume = {**record, "pass": 0, "workers": [], "batches": 0, "turn": 0} if replay and record else record

    def reseed(self, record: dict[str, Any], how: str) -> None:
        """The checkpoint's ``record`` was written with another ``num_workers``: its epoch goes on in a new pass.

        ``how``: what becomes of the epoch's data, as the resume line says it (``the epoch's data starts over on``).
        """
        self.reseeded = record
        workers = f"{self.num_workers} workers" if self.num_workers else "the main process"
        self.reseed_note = f"{how} {workers} (on_topology_change='reseed')"

    def begin_pass(
        self,
        counter: int,
        pass_: int,
        *,
        dataset_epoch: int | None,
        start: dict[str, Any] | None,
        consumed: int = 0,
    ) -> None:
        """A pass of ``counter`` starts (``start``: the checkpoint's record it resumes from, or ``None``).

        ``consumed``: the batches of the epoch consumed before the pass (a reseeded epoch's, in another pass). The
        same pass again (its iterator was dropped before its end: Lightning re-creates the first iterator of a
        resumed epoch) counts its batches from the pass's start again, not from what the dropped iterator produced.
        """
        # the pass before, for a file written after fit once an iterator for a loader's state() began one (save.py)
        self.previous = self.describe(self._n, ended=True) if self.ended and counter != self.counter else None
        if start:
            self._n = 0 if self.replay else int(start["consumed"])  # a replayed pass is produced again from its start
        elif counter != self.counter:
            self._n = consumed
        elif pass_ == self.pass_ and not self.ended:
            self._n = self._n_start
        self._n_start = self._n
        self.ended = False
        self.counter, self.pass_, self.dataset_epoch = counter, pass_, dataset_epoch
        self.stage_epochs = start.get("stage_epochs") if start else None
        self.resumed = start
        self._pending.clear()
        self._notes = {}
        self.yielded = set()
        if self.unloaded is None or (counter, pass_) != self.unloaded[:2]:  # the loaded pass again: nothing read yet
            self.unstarted = None
        self._workers = {int(w["worker"]): dict(w) for w in start["workers"]} if start else {}
        self.workers_epoch = start.get("workers_epoch") if start else None
        self._batches = int(start["batches"]) if start else 0
        self._turn = int(start["turn"]) if start else 0

    def stale_epoch(self) -> int | None:
        """The dataset's epoch now, where it differs from the one the current pass began with (else ``None``).

        A resumed run's first iterator is made before ``on_train_epoch_start``, where users call ``set_epoch``
        (Lightning's ``FitLoop.setup_data``): its workers copied the dataset before it was given the epoch.
        """
        now = self.read_epoch() if self.read_epoch is not None else None
        return now if now is not None and self.counter is not None and now != self.dataset_epoch else None

    def read_any(self) -> bool:
        """Whether a batch of the current pass has left the loader's iterator (Lightning fetches one ahead)."""
        return self.counter is not None and self._n > self._n_start

    def produced(self, stamp: WorkerStamp) -> None:
        """A batch left the loader's iterator (Lightning may hold it a while before training consumes it)."""
        self._pending.append((self._n, stamp))
        self.yielded.add(stamp.worker)
        self.unstarted = None
        self._n += 1
        if stamp.note is not None:
            self._fast_forwarded(stamp.worker, stamp.note)
        self.fold(self.consumed() if self.consumed is not None else self._n)

    def fold(self, batches: int) -> None:
        """Count the batches of the epoch before ``batches`` as consumed."""
        workers = max(1, self.num_workers)
        while self._pending and self._pending[0][0] < batches:
            _, stamp = self._pending.popleft()
            self._workers[stamp.worker] = {
                "worker": stamp.worker,
                "items": stamp.items,
                "batches": stamp.batches,
                "state": stamp.state,
            }
            self._batches += 1
            self._turn = (stamp.worker + 1) % workers
            self.workers_epoch = stamp.epoch
            if stamp.epochs is not None:  # every copy of a pass counts alike: its workers start together
                self.stage_epochs = stamp.epochs

    def ahead(self) -> int | None:
        """The batches of the current pass that left the iterator and training did not consume yet.

        ``None`` when the pass's first batch is one of them (the consumed batches were all of the pass before).
        """
        if self.consumed is not None:
            self.fold(self.consumed())
        return None if self._pending and self._pending[0][0] <= self._n_start else len(self._pending)

    def describe(self, batches: int, *, ended: bool = False) -> dict[str, Any] | None:
        """The record a checkpoint stores once ``batches`` of the epoch are consumed (``None``: none of the pass).

        ``ended``: the epoch's batches are all consumed; the record then says ``"ended": True`` and is what the pass
        leaves to the next epoch's (the epoch of persistent workers' copies, the pipeline's own pass counts), never
        a position to resume the pass at.

        Keys: ``version``, ``epoch`` and ``pass`` (of the pass), ``batches`` (consumed in the pass), ``consumed`` (in
        the epoch), ``turn`` (the worker of the next batch), ``num_workers``, ``dataset_epoch`` (the dataset's epoch
        when the pass started, or None), ``workers_epoch`` (the epoch of the dataset copies that read the pass, or
        None: persistent workers keep the copy of their first pass, whose epoch a ``set_epoch`` in the main process
        does not reach), ``stage_epochs`` (the pass counts of its pipeline's stages then, as the copies that iterate
        had them, or None: :func:`~lightning_repro.data.libraries.stage_epochs`), ``workers``: per worker that
        consumed anything, ``worker``, ``items``, ``batches`` and ``state`` (its dataset's ``state_dict()`` in the
        worker, or None), and ``ended`` (only when ``ended``).
        """
        waiting = self.resume  # a checkpoint's record whose pass has not begun (litdata's starts at its first batch)
        if waiting is not None and int(waiting["consumed"]) == batches and bool(waiting.get("ended")) == ended:
            return dict(waiting)  # nothing consumed since: a file written now (the rest of a hook) holds it again
        if self.counter is None:
            return None
        self.fold(batches)
        if self._batches == 0 and not (batches and self.pass_ and not ended):  # else a new pass of the epoch, unread
            return None
        head = self._pending[0][1] if self._batches == 0 and self._pending else None  # that pass's first batch
        return {
            "version": POSITION_VERSION,
            "epoch": self.counter,
            "pass": self.pass_,
            "batches": self._batches,
            "consumed": int(batches),
            "turn": self._turn,
            "num_workers": self.num_workers,
            "dataset_epoch": self.dataset_epoch,
            "workers_epoch": head.epoch if head is not None else self.workers_epoch,
            "stage_epochs": head.epochs if head is not None else self.stage_epochs,
            "workers": [self._workers[w] for w in sorted(self._workers)],
            **({"ended": True} if ended else {}),
        }

    def _fast_forwarded(self, worker: int, note: Any) -> None:
        self._notes[worker] = (int(note[0]), float(note[1]))
        spec = self.resumed
        if spec is None:
            return
        expected = {int(w["worker"]) for w in spec["workers"] if w.get("state") is None and w["items"]}
        if expected and expected <= set(self._notes):
            items = sum(n for n, _ in self._notes.values())
            seconds = max(s for _, s in self._notes.values())
            rate = f"{items / seconds:,.0f} items/s" if seconds > 0 else "instant"
            log.info(
                f"lightning-repro: fast-forward of {items} items in {len(self._notes)} worker(s) to the resumed"
                f" position took {seconds:.3f} s ({rate}; read, not collated or sent)"
            )
            self.fast_forward = (items, seconds)
            self.resumed = None  # said once


class StampedIterator:
    """Wraps a loader's iterator: takes the :class:`WorkerStamp` off each batch and skips :class:`SkipTurn` values.

    In a resumed pass, a loader iterator that counts its batches itself (torchdata's) is told, after its first batch,
    of the batches the interrupted pass had consumed, and of each skipped turn it yielded
    (:func:`~lightning_repro.data.libraries.shift_loader_counters`).
    """

    def __init__(
        self,
        iterator: Iterator[Any],
        position: StreamPosition,
        remake: Callable[[], Iterator[Any]] | None = None,
        *,
        persistent: bool = False,
    ) -> None:
        self.iterator, self.position, self.first = iterator, position, True
        # a loader whose workers copy the dataset when its iterator is made (not persistent ones: they keep theirs)
        self.remake = remake
        self.persistent = persistent
        self.checks = 2  # batches still checked for a dataset given its epoch after its pass was read

    def __iter__(self) -> StampedIterator:
        return self

    def __next__(self) -> Any:
        if self.checks:  # the dataset given another epoch than its pass was read with (data/epochstart.py)
            verdict = check_read_epoch(
                self.position, first=self.first, persistent=self.persistent, remakable=self.remake is not None
            )
            self.checks = 0 if verdict == "done" else self.checks - (verdict is not None)
            if verdict == "remake" and self.remake is not None:
                self.iterator = self.remake()  # the old iterator's workers end with it; nothing of it was consumed
        while True:
            try:
                data = next(self.iterator)
            except StopIteration:
                self.position.ended = True  # a pass of the counter after this one is a new pass
                raise
            if self.first:  # the pass has begun (its first batch request drew from the sampler): resumed or not
                self.first = False
                if self.position.resumed is not None:
                    shift_loader_counters(self.iterator, int(self.position.resumed["batches"]))
            kind = type(data)
            if kind is WorkerStamp:
                self.position.produced(data)
                return data.batch
            if kind is not SkipTurn:
                return data
            shift_loader_counters(self.iterator, -1)  # the uninterrupted pass had no such batch

    def __len__(self) -> int:
        return len(self.iterator)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "iterator" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["iterator"], name)


_POSITION = POSITION_ATTR  # the loader attribute holding its StreamPosition


def loader_position(loader: Any) -> StreamPosition | None:
    """The :class:`StreamPosition` of a loader :func:`stream_loader` took over, else ``None``."""
    position = getattr(loader, "__dict__", {}).get(_POSITION)
    return position if isinstance(position, StreamPosition) else None


def _stamped_iter(self: Any) -> Any:
    """``__iter__`` of a stamped loader's class (see :func:`stream_loader`)."""
    base: Any = _CLASSES[type(self)]
    position = loader_position(self)
    iterator = base.__iter__(self)  # the user's class's own
    if position is None:
        return iterator
    fresh = self.num_workers > 0 and not self.persistent_workers
    remake = (lambda: base.__iter__(self)) if fresh else None
    return StampedIterator(iterator, position, remake, persistent=self.num_workers > 0 and self.persistent_workers)


_CLASSES: dict[type, type] = {}  # stamped class -> the user's class it derives from
_STAMPED: dict[type, type] = {}  # the user's class -> its stamped class


def stream_loader(loader: Any, position: StreamPosition) -> None:
    """Make ``loader`` (a private copy) unwrap the stamps of its batches into ``position``.

    Its class becomes a subclass of its own class of the same name (``StatefulDataLoader`` stays one), whose
    ``__iter__`` wraps the iterator in a :class:`StampedIterator`. A loader Lightning re-instantiates from it has
    no position and iterates as its base class does.
    """
    cls = type(loader)
    if cls not in _CLASSES:
        if cls not in _STAMPED:
            namespace: dict[str, Any] = {"__module__": cls.__module__, "__slots__": (), "__iter__": _stamped_iter}
            if callable(getattr(cls, "load_state_dict", None)):
                namespace["load_state_dict"] = stamped_load_state_dict
            if callable(getattr(cls, "state_dict", None)):
                namespace["state_dict"] = stamped_state_dict
            _STAMPED[cls] = type(cls.__name__, (cls,), namespace)  # the same layout: a copy's class can be swapped
            _CLASSES[_STAMPED[cls]] = cls
        object.__setattr__(loader, "__class__", _STAMPED[cls])
    object.__setattr__(loader, _POSITION, position)


def plain_loader_class(loader: Any) -> None:
    """Give a copy of a stamped loader its user's class back (Lightning re-instantiated or copied it)."""
    base = _CLASSES.get(type(loader))
    if base is not None:
        object.__setattr__(loader, "__class__", base)
    loader.__dict__.pop(_POSITION, None)
