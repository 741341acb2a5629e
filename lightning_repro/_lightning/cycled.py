"""Which train loaders of a ``CombinedLoader`` in ``max_size_cycle`` mode ran out in the epoch: saved, given back.

Lightning's ``_MaxSizeCycle`` (``utilities/combined_loader.py``) restarts a loader that runs out, and ends the epoch
once every loader has run out at least once (its ``_consumed`` flags). That decides where the epoch ends when the
loaders have no length (streaming loaders: Lightning cannot count the epoch's batches). The flags are not in
Lightning's checkpoint: a resumed run starts them all ``False``, so a loader that had already run out in the epoch is
waited for again, and the longest one is started again at its end: the resumed epoch reads batches the
uninterrupted one did not. Our entry keeps them (``loops["ran_out"]``, a mask by loader index, written only when one
ran out) and gives them back to the iterator of the resumed epoch (:func:`give_back`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import combined_loader as _combined

__all__ = ["give_back", "new_epoch", "ran_out"]

_MODE = "max_size_cycle"
_EPOCH = "_lightning_repro_epoch"  # in the vars of an iterator started by give_back's class: the epoch it began in


def ran_out(trainer: pl.Trainer) -> int:
    """The train loaders that ran out in the current epoch, as a mask by loader index (0: none, or another mode)."""
    iterator = getattr(trainer.fit_loop._combined_loader, "_iterator", None)
    if not isinstance(iterator, _combined._MaxSizeCycle):
        return 0
    return sum(1 << index for index, flag in enumerate(iterator._consumed) if flag)


def give_back(entry: Any, trainer: pl.Trainer) -> list[Callable[[], None]]:
    """Until the undo, each ``_MaxSizeCycle`` started inside the resumed epoch marks the loaders that ran out so.

    ``entry``: our entry in the checkpoint being loaded; no undo (and nothing done) when none ran out. Lightning makes
    the resumed epoch's iterator in ``FitLoop.setup_data`` (and again where the loops' state came after the loaders:
    ``loops.restart_train_iterator``), after the checkpoint is loaded: install on loading it, undo at the resumed
    run's first batch. An iterator of a later epoch (after an epoch-end checkpoint, whose resumed epoch gives no
    batch) starts as Lightning starts it. Through the mode's entry in Lightning's table of
    modes (``_SUPPORTED_MODES``, which ``CombinedLoader.__iter__`` reads), put back by the undo.
    """
    facts = entry.get("loops") if isinstance(entry, dict) else None
    mask = int(facts.get("ran_out", 0)) if isinstance(facts, dict) else 0
    if not mask:
        return []
    modes: Any = _combined._SUPPORTED_MODES
    saved = modes[_MODE]
    base: Any = saved["iterator"]
    epochs: list[int] = []

    class Resumed(base):  # type: ignore[misc]
        def __iter__(self) -> Any:
            iterator = super().__iter__()
            epochs.append(trainer.current_epoch)  # the first is the resumed epoch's
            self.__dict__[_EPOCH] = epochs[-1]
            if epochs[-1] == epochs[0]:
                self._consumed = [bool(mask >> index & 1) for index in range(len(self.iterables))]
            return iterator

    modes[_MODE] = {**saved, "iterator": Resumed}

    def undo() -> None:
        modes[_MODE] = saved

    return [undo]


def new_epoch(trainer: pl.Trainer) -> None:
    """At an epoch's start (``on_train_epoch_start``): the resumed epoch's iterator, if still used, as a new one.

    After a resume from an epoch's last batch, Lightning iterates the same ``_MaxSizeCycle`` in the next epoch (it
    makes a new one only for an epoch it did not resume into: ``loops/training_epoch_loop.py: on_run_start``), whose
    flags still say every loader ran out: the uninterrupted run's next epoch starts with none run out (and with
    several loaders, that epoch would end at the first loader's end).
    """
    iterator = getattr(trainer.fit_loop._combined_loader, "_iterator", None)
    if not isinstance(iterator, _combined._MaxSizeCycle):
        return
    began = vars(iterator).get(_EPOCH)
    if began is not None and began != trainer.current_epoch:
        iterator._consumed = [False] * len(iterator._consumed)
