"""litdata loaders' pass counts, carried into the loaders a continued ``fit`` on the same Trainer makes again.

litdata's ``StreamingDataLoader`` counts its passes (``current_epoch``, one more at the start of each, given to its
dataset's ``set_epoch``, which seeds its shuffle). Training continued on the same Trainer (``fit_loop.max_epochs``
raised, or ``max_steps``, and ``fit`` called again) calls ``train_dataloader()`` again: a new loader counts from 0 and
reads epoch 0's order again (plain Lightning too), where the one longer fit's loader counts on. The count the last
``fit``'s loader reached is given to the new one, unless the longer fit would have made a new loader there too
(``reload_dataloaders_every_n_epochs`` due). A loader returned again (the same object) counts on by itself; a new
Trainer, or a ``fit`` that resumes a checkpoint (Lightning loads the loader's state), is not a continuation.

The other pipelines need nothing of this: their passes are keyed by the epoch (``torchdata.nodes``, our copy of an
``IterableDataset``), or their counts are given back per pass (webdataset's ``detshuffle``).
Part of ``data/``: imports :mod:`lightning_repro.data.libraries` only (its ``give_loader_its_epoch`` sets the count).
"""

from __future__ import annotations

import weakref
from typing import Any

from lightning_repro.data.libraries import give_loader_its_epoch, positioned_by_loader

__all__ = ["PassCounts"]


class PassCounts:
    """The train loaders of a ``fit`` whose passes litdata counts, and their counts when it ended (see the module)."""

    def __init__(self) -> None:
        self._loaders: dict[int, tuple[Any, int]] = {}  # loader index -> (the loader, the epoch it was made in)
        self._counts: dict[int, tuple[int, int]] = {}  # ... -> (its count, that epoch), as the last fit ended
        self._trainer: weakref.ReferenceType[Any] | None = None  # the Trainer of the fit they are from

    def __getstate__(self) -> dict[str, Any]:
        """A copy (a pickled callback, a deep copy of its Trainer) knows no Trainer: it continues no fit."""
        return {"_loaders": {}, "_counts": {}, "_trainer": None}

    def watch(self, trainer: Any, index: int, loader: Any) -> int | None:
        """A train loader of this fit (set up by Lightning); the count it was given, if it continues the last fit's."""
        if not positioned_by_loader(loader) or not isinstance(getattr(loader, "current_epoch", None), int):
            self._loaders.pop(index, None)
            return None
        made, given = int(trainer.current_epoch), None
        last = self._counts.pop(index, None) if self._continues(trainer) else None
        if last is not None and last[0] > 0 and loader.current_epoch == 0:
            count, last_made = last
            every = int(getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0)
            if not (every > 0 and made - last_made >= every):  # else the longer fit makes a new loader here too
                given, made = give_loader_its_epoch(loader, {"current_epoch": count}), last_made
        self._loaders[index] = (loader, made)
        return given

    def fit_ended(self, trainer: Any) -> None:
        """The fit ended (its teardown): keep each loader's count for a ``fit`` continuing on this Trainer."""
        self._counts = {index: (int(loader.current_epoch), made) for index, (loader, made) in self._loaders.items()}
        self._loaders = {}
        self._trainer = weakref.ref(trainer)

    def forget(self) -> None:
        """A fit that raised: what follows does not continue it."""
        self._loaders, self._counts, self._trainer = {}, {}, None

    def _continues(self, trainer: Any) -> bool:
        if self._trainer is None or self._trainer() is not trainer:
            return False
        return getattr(trainer, "ckpt_path", None) is None  # a checkpoint resumed: Lightning loads its loaders' state
