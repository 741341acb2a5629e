"""webdataset's ``WebLoader``: a pipeline over a torch ``DataLoader``, taken over through the loader it holds.

``wds.WebLoader(dataset, batch_size=None, num_workers=...)``, as webdataset's docs write it, is not a ``DataLoader``: it
is a ``wds.DataPipeline`` whose first stage is one (``pipeline[0]``), and iterating it iterates that loader through its
further stages (``.unbatched().shuffle(n).batched(m)``, run in the main process) and its epoch options
(``with_epoch``/``repeat``: ``nsamples``, ``repetitions``). With no further stage and neither option, iterating it is
iterating the loader: the takeover prepares a copy of the loader as any other and gives Lightning a copy of the
``WebLoader`` around it (:func:`around`; the user's objects are left as they are), and whatever looks for the train
loaders looks through that copy (``_lightning.prepared.unwrap``). With stages or epoch options, the batches Lightning
counts are not the loader's (a main-process shuffle buffer reads ahead of them): it is left as it is, and a
``NotExactWarning`` says why (:func:`why_not_taken_over`).
"""

from __future__ import annotations

import copy
from typing import Any

from torch.utils.data import DataLoader

from lightning_repro._lightning.prepared import PREPARED_INSIDE

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
    if getattr(obj, "repetitions", 1) != 1 or getattr(obj, "nsamples", -1) > 0:
        return "its epochs are cut from a repeated loader (`with_epoch`/`repeat`), across the loader's passes"
    return ""


def around(obj: Any, loader: DataLoader[Any]) -> Any:
    """A shallow copy of the pipeline ``obj`` that iterates ``loader`` (our prepared copy) instead of its own."""
    clone = copy.copy(obj)
    clone.pipeline = [loader, *obj.pipeline[1:]]
    vars(clone)[PREPARED_INSIDE] = loader  # what _lightning.prepared.unwrap finds
    return clone
