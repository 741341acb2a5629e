"""webdataset's ``WebLoader``: a pipeline over a torch ``DataLoader``, taken over through the loader it holds.

``wds.WebLoader(dataset, batch_size=None, num_workers=...)``, as webdataset's docs write it, is not a ``DataLoader``: it
is a ``wds.DataPipeline`` whose first stage is one (``pipeline[0]``), and iterating it iterates that loader through its
further stages (``.unbatched().shuffle(n).batched(m)``, run in the main process) and its epoch options
(``with_epoch(n)``: epochs of ``n`` batches cut from the loader repeated; ``repeat(k)``). With no further stage,
iterating it is iterating the loader: the takeover prepares a copy of the loader as any other and gives Lightning a copy
of the ``WebLoader`` around it (:func:`around`; the user's objects are left as they are), and whatever looks for the
train loaders looks through that copy (``_lightning.prepared.unwrap``). Under ``with_epoch`` an epoch spans passes of
the loader (our passes of one epoch, counted as for a cycled loader), and the first epoch after a mid-epoch resume is
cut where the interrupted one was (webdataset counts ``n`` from each iterator's start).

With stages (over a loader of an ``IterableDataset``), the batches Lightning counts are not the loader's (a
main-process shuffle buffer reads ahead of them): each batch is pulled through the stages on streams of its own (what
they draw never moves training's), and a mid-epoch resume reads the epoch's pass again from its start through them
and drops the batches training consumed (the loader's workers are not fast-forwarded: ``StreamPosition.replay``;
the cost of reading them again is said in an INFO line). Under ``with_epoch(n)`` too: each epoch iterates
the pipeline afresh, its first pass read again. Left as it is, with a ``NotExactWarning`` saying why
(:func:`why_not_taken_over`): stages over a map-style dataset, a stage that seeds itself from
the clock (``.shuffle(n)`` without ``seed``) or draws from the user's generator across epochs (``rng=``), and
``repeat(k)``, which would count its repetitions from 0 in a resumed epoch.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_repro import streams
from lightning_repro._lightning.prepared import PREPARED_INSIDE
from lightning_repro.data.fastrng import capture_fast, restore_fast, seed_sample
from lightning_repro.data.passseeder import PassSeeder
from lightning_repro.data.wdsstages import shuffle_arguments, stage_epochs, unrepeatable_advice, unrepeatable_stages
from lightning_repro.data.workerpos import loader_position

__all__ = ["around", "inner_loader", "why_not_taken_over"]

log = logging.getLogger(__name__)


def inner_loader(obj: Any) -> DataLoader[Any] | None:
    """The ``DataLoader`` a webdataset pipeline starts with (``WebLoader``), or ``None``."""
    if not type(obj).__module__.startswith("webdataset"):
        return None
    pipeline = getattr(obj, "pipeline", None)
    if isinstance(pipeline, list) and pipeline and isinstance(pipeline[0], DataLoader):
        return pipeline[0]
    return None


def why_not_taken_over(obj: Any) -> str:
    """Why the loader ``obj`` holds cannot stand for it (empty: it can; see the module)."""
    stages = obj.pipeline[1:]
    if stages and not isinstance(obj.pipeline[0].dataset, IterableDataset):
        return (
            "its stages after the DataLoader run in the main process on a loader over a map-style dataset, whose"
            " resumed epoch starts at its consumed batches, not where the stages' does"
        )
    loader = obj.pipeline[0]
    persisted = not loader.num_workers or loader.persistent_workers  # the copies that iterate go on counting
    if stages and _cut(obj) and persisted and stage_epochs(loader.dataset) is not None:
        return (
            "its epochs are cut (`with_epoch`) across passes of a pipeline that counts its own passes (`detshuffle`,"
            " deterministic resampling) in copies that persist (the main process's, persistent workers'), and its"
            " stages after the DataLoader make a resumed epoch be read again from its first pass, whose counts the"
            " checkpoint does not hold (non-persistent workers, or no `with_epoch`, are exact)"
        )
    unrepeatable = unrepeatable_stages(obj)
    if unrepeatable:
        stage = unrepeatable[0]
        return f"its `{stage}` after the DataLoader seeds itself from the process id and the clock ({_advice(stage)})"
    for stage in stages:
        shuffle = shuffle_arguments(stage)
        if shuffle is not None and shuffle[1] is not None and shuffle[2] is None:  # rng=, no seed
            return (
                "its `.shuffle(n, rng=...)` after the DataLoader draws from a generator that goes on from epoch to"
                " epoch in the main process, which a resumed process starts afresh (give it `seed=...` instead)"
            )
    if getattr(obj, "repetitions", 1) not in (1, sys.maxsize):
        return "it repeats the loader a number of times (`repeat`), which a resumed epoch would count from 0"
    if _cut(obj) and not isinstance(obj.pipeline[0].dataset, IterableDataset):
        return "its epochs are cut (`with_epoch`) from a loader over a map-style dataset, not where a resume would be"
    return ""


def _advice(stage: str) -> str:
    return unrepeatable_advice(stage).replace("give it", "to repeat it, give it", 1)


def _cut(obj: Any) -> bool:
    """Whether ``obj``'s epochs are cut from its loader repeated (``with_epoch(n)``)."""
    return getattr(obj, "repetitions", 1) != 1 and getattr(obj, "nsamples", -1) > 0


def around(obj: Any, loader: DataLoader[Any], consumed: Callable[[], int] | None = None) -> Any:
    """A shallow copy of the pipeline ``obj`` that iterates ``loader`` (our prepared copy) instead of its own.

    ``consumed`` (a train loader's): the batches training consumed in the current epoch. With epochs cut from the
    repeated loader (``with_epoch(n)``), the copy's first epoch after a mid-epoch resume ends where the interrupted
    one would have: after ``n`` minus those batches (webdataset counts ``n`` from each iterator's start). With stages
    after the loader, each batch is pulled through them on its own streams, and a resumed epoch is read again from
    its pass's start through them, its consumed batches dropped (:func:`_stages_iter`).
    """
    clone = copy.copy(obj)
    clone.pipeline = [loader, *obj.pipeline[1:]]
    vars(clone)[PREPARED_INSIDE] = loader  # what _lightning.prepared.unwrap finds
    staged = len(obj.pipeline) > 1
    if staged or (consumed is not None and _cut(obj)):  # _cut: over an IterableDataset (see why_not_taken_over)
        cls = type(obj)
        if (cls, staged) not in _CUT:
            body = _stages_iter if staged else _cut_iter
            _CUT[cls, staged] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__iter__": body})
        clone.__class__ = _CUT[cls, staged]
        vars(clone)[_CONSUMED] = consumed
        position = loader_position(loader)
        if staged and position is not None:
            position.replay = True  # a resumed pass is read from its start (the stages drop what was consumed)
    return clone


_CUT: dict[tuple[type, bool], type] = {}  # (a WebLoader class, with stages) -> its subclass (_stages_iter, _cut_iter)
_CONSUMED = "_lightning_repro_consumed"


def _cut_iter(self: Any) -> Iterator[Any]:
    """``__iter__`` of a copy whose epochs are cut from the repeated loader (``with_epoch``); see :func:`around`.

    The loader's position holds the checkpoint's record until the resumed pass begins: an iterator made while it
    holds a mid-epoch record of the current epoch, with batches of the epoch consumed, is the resumed epoch's (an
    epoch-end checkpoint's record is of the epoch before).
    """
    inner = vars(self)[PREPARED_INSIDE]
    position = loader_position(inner)
    record = position.resume if position is not None else None
    seeder = _seeder(inner)
    if record is not None and not record.get("ended") and int(record["epoch"]) == int(seeder.counter()):
        done = vars(self)[_CONSUMED]()
        if done:
            return islice(self.iterator(), max(self.nsamples - done, 0))
    return iter(super(type(self), self).__iter__())


def _seeder(inner: Any) -> Any:
    return inner.batch_sampler if isinstance(inner.batch_sampler, PassSeeder) else inner.sampler


def _stages_iter(self: Any) -> Iterator[Any]:
    """``__iter__`` of a copy with stages after its loader (see :func:`around`).

    Each batch is pulled through the stages (run in the main process) on its own streams, from
    :func:`~lightning_repro.streams.stages_seed` and its index in the pass, and the process streams are put back
    after it: what the stages draw never moves training's streams. The iterator of a resumed epoch (made while the
    loader's position holds the checkpoint's record of that epoch) reads the pass again from its start (the record
    holds no worker position: ``StreamPosition.replay``) and drops the batches training consumed. Under
    ``with_epoch(n)`` every epoch starts the loader's passes afresh (a new iterator of the pipeline), so the epoch's
    first pass is read again, and the epoch still ends after its ``n``-th batch.
    """
    inner = vars(self)[PREPARED_INSIDE]
    seeder = _seeder(inner)
    counter = int(seeder.counter())
    position = loader_position(inner)
    record = position.resume if position is not None else None
    consumed = vars(self)[_CONSUMED]
    skip = 0
    if consumed is not None and record is not None and not record.get("ended") and int(record["epoch"]) == counter:
        skip = int(consumed())
    base = streams.stages_seed(seeder.seed, seeder.rank, seeder.stream, counter)
    pulled = _pulled(self.iterator(), base, skip)
    return islice(pulled, max(self.nsamples - skip, 0)) if _cut(self) else pulled  # with_epoch: n batches an epoch


def _pulled(iterator: Iterator[Any], base: int, skip: int) -> Iterator[Any]:
    start = time.perf_counter()
    index = 0
    while True:
        saved = capture_fast()
        try:
            seed_sample(streams.item_seed(base, index))
            batch = next(iterator)
        except StopIteration:
            return
        finally:
            restore_fast(saved)
        index += 1
        if index <= skip:
            if index == skip:
                log.info(
                    f"lightning-repro: the WebLoader's stages run in the main process: the resumed epoch's first {skip}"
                    f" batches were read again through them and dropped ({time.perf_counter() - start:.3f} s)"
                )
            continue
        yield batch
