"""webdataset's ``WebLoader``: a pipeline over a torch ``DataLoader``, taken over through the loader it holds.

``wds.WebLoader(dataset, batch_size=None, num_workers=...)``, as webdataset's docs write it, is not a ``DataLoader``: it
is a ``wds.DataPipeline`` whose first stage is one (``pipeline[0]``), and iterating it iterates that loader through its
further stages (``.unbatched().shuffle(n).batched(m)``, run in the main process) and its epoch options
(``with_epoch(n)``: epochs of ``n`` batches cut from the loader repeated; ``repeat(k)``). With no further stage,
iterating it is iterating the loader: the takeover prepares a copy of the loader as any other and gives Lightning a copy
of the ``WebLoader`` around it (:func:`around`; the user's objects are left as they are), and whatever looks for the
train loaders looks through that copy (``_lightning.prepared.unwrap``). Under ``with_epoch`` an epoch spans passes of
the loader (our passes of one epoch, counted as for a cycled loader), and the first epoch after a mid-epoch resume is
cut where the interrupted one was (webdataset counts ``n`` from each iterator's start). With stages, the batches
Lightning counts are not the loader's (a main-process shuffle buffer reads ahead of them), and ``repeat(k)`` would count
its repetitions from 0 in a resumed epoch: left as it is, and a ``NotExactWarning`` says why
(:func:`why_not_taken_over`).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_repro._lightning.prepared import PREPARED_INSIDE
from lightning_repro.data.streaming import PassSeeder
from lightning_repro.data.workerpos import loader_position

__all__ = ["around", "inner_loader", "why_not_taken_over"]


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
    if stages:
        names = ", ".join(getattr(stage, "__name__", type(stage).__name__) for stage in stages)
        return (
            f"its stages after the DataLoader ({names}) run in the main process on the loader's batches, so the"
            " batches training counts are not the loader's"
        )
    if getattr(obj, "repetitions", 1) not in (1, sys.maxsize):
        return "it repeats the loader a number of times (`repeat`), which a resumed epoch would count from 0"
    if _cut(obj) and not isinstance(obj.pipeline[0].dataset, IterableDataset):
        return "its epochs are cut (`with_epoch`) from a loader over a map-style dataset, not where a resume would be"
    return ""


def _cut(obj: Any) -> bool:
    """Whether ``obj``'s epochs are cut from its loader repeated (``with_epoch(n)``)."""
    return getattr(obj, "repetitions", 1) != 1 and getattr(obj, "nsamples", -1) > 0


def around(obj: Any, loader: DataLoader[Any], consumed: Callable[[], int] | None = None) -> Any:
    """A shallow copy of the pipeline ``obj`` that iterates ``loader`` (our prepared copy) instead of its own.

    ``consumed`` (a train loader's): the batches training consumed in the current epoch. With epochs cut from the
    repeated loader (``with_epoch(n)``), the copy's first epoch after a mid-epoch resume ends where the interrupted
    one would have: after ``n`` minus those batches (webdataset counts ``n`` from each iterator's start).
    """
    clone = copy.copy(obj)
    clone.pipeline = [loader, *obj.pipeline[1:]]
    vars(clone)[PREPARED_INSIDE] = loader  # what _lightning.prepared.unwrap finds
    if consumed is not None and _cut(obj):  # over an IterableDataset (see why_not_taken_over)
        cls = type(obj)
        if cls not in _CUT:
            _CUT[cls] = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__iter__": _cut_iter})
        clone.__class__ = _CUT[cls]
        vars(clone)[_CONSUMED] = consumed
    return clone


_CUT: dict[type, type] = {}  # a WebLoader class -> its subclass whose resumed epoch is cut short (_cut_iter)
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
    seeder = inner.batch_sampler if isinstance(inner.batch_sampler, PassSeeder) else inner.sampler
    if record is not None and not record.get("ended") and int(record["epoch"]) == int(seeder.counter()):
        done = vars(self)[_CONSUMED]()
        if done:
            return islice(self.iterator(), max(self.nsamples - done, 0))
    return iter(super(type(self), self).__iter__())
