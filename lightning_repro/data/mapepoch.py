"""A map-style dataset given its epoch by the user (``set_epoch`` in ``on_train_epoch_start``), resumed mid-epoch.

Users give a dataset the epoch for epoch-dependent augmentation or a curriculum: ``def on_train_epoch_start(self):
self.train_set.set_epoch(self.current_epoch)``. A resume in the middle of an epoch does not run that hook, so the
rest of the epoch was read with what a fresh dataset shows (epoch 0) and the resume said exact. For a dataset with a
``set_epoch``, the checkpoint's data position records its plain attributes (``dataset_state``: the ints, floats and
bools of ``vars()``, :func:`dataset_state`); a mid-epoch resume whose dataset shows others calls ``set_epoch`` with
the checkpoint's epoch, where that gives a copy of the dataset the recorded attributes (:func:`give_epoch`), before
the resumed epoch's iterator is made (its workers copy the dataset then); where it does not, the resume is not exact
and says so (a ``NotExactWarning`` naming the attributes).

Not for a loader with persistent workers: its workers kept the copy they were started with, which never saw the
hook's epoch in the uninterrupted run either (and a resumed one starts from the fresh dataset, alike). IterableDatasets
have their own record (:mod:`lightning_repro.data.workerpos`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from lightning_repro._warn import warn
from lightning_repro.data.keyed import DatasetWrapper
from lightning_repro.exceptions import NotExactWarning

__all__ = ["dataset_state", "give_epoch"]

log = logging.getLogger(__name__)
_MAX_ATTRIBUTES = 64


def _users_dataset(loader: Any) -> Any:
    dataset = getattr(loader, "dataset", None)
    while isinstance(dataset, DatasetWrapper):
        dataset = dataset.dataset
    return dataset


def _plain_attributes(dataset: Any) -> dict[str, int | float | bool]:
    try:
        attributes = vars(dataset)
    except TypeError:
        return {}
    return {k: v for k, v in list(attributes.items())[:_MAX_ATTRIBUTES] if type(v) in (int, float, bool)}


def dataset_state(loader: Any) -> dict[str, int | float | bool] | None:
    """The plain attributes of the user's dataset behind a train loader; None without ``set_epoch`` or a copy read.

    A pass reads the main process's copy of the dataset unless the loader has persistent workers.

    Examples:
        >>> class Curriculum(list):
        ...     def set_epoch(self, epoch): self.difficulty = epoch
        >>> from torch.utils.data import DataLoader
        >>> data = Curriculum(range(4)); data.set_epoch(3)
        >>> dataset_state(DataLoader(data)), dataset_state(DataLoader(data, num_workers=2, persistent_workers=True))
        ({'difficulty': 3}, None)
    """
    dataset = _users_dataset(loader)
    if not callable(getattr(dataset, "set_epoch", None)):
        return None
    if int(getattr(loader, "num_workers", 0)) > 0 and bool(getattr(loader, "persistent_workers", False)):
        return None
    return _plain_attributes(dataset)


def give_epoch(loader: Any, position: dict[str, Any], index: int, cache: Any = None) -> int | None:
    """Give a mid-epoch resume's dataset its epoch back (``set_epoch``); the epoch given, or None.

    Only where the position is inside its pass, records a ``dataset_state`` and the dataset shows other attributes
    now: ``set_epoch(epoch)`` is called where it gives a shallow copy of the dataset the recorded attributes; else a
    ``NotExactWarning`` (through ``cache``, a ``WarningCache``, when given) names the attributes that differ.
    """
    saved = position.get("dataset_state")
    inside = 0 < int(position.get("offset", 0)) < int(position.get("length", 0))
    now = dataset_state(loader)
    if not isinstance(saved, dict) or not inside or now is None or now == saved:
        return None
    dataset, epoch = _users_dataset(loader), int(position["epoch"])
    probe = copy.copy(dataset)
    probe.set_epoch(epoch)
    if _plain_attributes(probe) == saved:
        dataset.set_epoch(epoch)
        log.info(
            f"gave train dataset {index} ({type(dataset).__qualname__}) its epoch {epoch} with set_epoch, as in the"
            " interrupted run (a mid-epoch resume skips the on_train_epoch_start that gave it)"
        )
        return epoch
    differ = ", ".join(
        f"{k}: {now.get(k)!r} now, {saved.get(k)!r} then"
        for k in sorted(set(now) | set(saved))
        if now.get(k) != saved.get(k)
    )
    message = (
        f"Train dataset {index} ({type(dataset).__qualname__}) shows other attributes than when the checkpoint was"
        f" written ({differ}), and its set_epoch({epoch}) does not give them back: the rest of the epoch is read with"
        " them (a mid-epoch resume skips on_train_epoch_start; a dataset whose set_epoch(epoch) sets them is given its"
        " epoch back by lightning-repro)."
    )
    if cache is not None:
        cache.warn(message, category=NotExactWarning)
    else:
        warn(message, NotExactWarning)
    return None
