"""Which train loaders of a ``CombinedLoader`` in ``max_size_cycle`` mode ran out in the epoch: saved, given back.

Lightning's ``_MaxSizeCycle`` (``utilities/combined_loader.py``) restarts a loader that runs out, and ends the epoch
once every loader has run out at least once (its ``_consumed`` flags). That decides where the epoch ends when the
loaders have no length (streaming loaders: Lightning cannot count the epoch's batches). The flags are not in
Lightning's checkpoint: a resumed run starts them all ``False``, so a loader that had already run out in the epoch is
waited for again, and the longest one is started again at its end: the resumed epoch reads batches the
uninterrupted one did not. Our entry keeps them, a mask by loader index: each rank's own in its part (``ran_out``,
written in every part of a cycling epoch of several loaders: under DDP the loaders of one rank can run out in
another order than another rank's), and rank 0's in ``loops["ran_out"]`` (written only when one ran out; files
written before the parts held theirs have only this one). :func:`give_back` gives this rank's mask back to the
iterator of the resumed epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import combined_loader as _combined

__all__ = ["cycling_mask", "give_back", "new_epoch", "ran_out"]

_MODE = "max_size_cycle"
_EPOCH = "_lightning_repro_epoch"  # in the vars of an iterator started by give_back's class: the epoch it began in


def cycling_mask(trainer: pl.Trainer) -> int | None:
    """The train loaders that ran out in the current epoch, as a mask by loader index.

    None outside a cycling epoch of several loaders (no ``_MaxSizeCycle`` iterator: another mode, or none started;
    or one loader, Lightning's default mode for it, whose running out ends the epoch).
    """
    iterator = getattr(trainer.fit_loop._combined_loader, "_iterator", None)
    several = isinstance(iterator, _combined._MaxSizeCycle) and len(iterator._consumed) > 1
    return ran_out(trainer) if several else None


def ran_out(trainer: pl.Trainer) -> int:
    """The train loaders that ran out in the current epoch, as a mask by loader index (0: none, or another mode)."""
    iterator = getattr(trainer.fit_loop._combined_loader, "_iterator", None)
    if not isinstance(iterator, _combined._MaxSizeCycle):
        return 0
    return sum(1 << index for index, flag in enumerate(iterator._consumed) if flag)


def _saved_mask(entry: Any, trainer: pl.Trainer) -> int:
    """This rank's mask in ``entry``.

    Its part's, where the parts are this run's ranks and hold one; else rank 0's (``loops``: a file written before
    the parts held theirs, or a world size re-dealt).
    """
    parts = entry.get("ranks") if isinstance(entry, dict) else None
    if isinstance(parts, list) and len(parts) == trainer.world_size and 0 <= trainer.global_rank < len(parts):
        part = parts[trainer.global_rank]
        if isinstance(part, dict) and "ran_out" in part:
            return int(part["ran_out"])
    facts = entry.get("loops") if isinstance(entry, dict) else None
    return int(facts.get("ran_out", 0)) if isinstance(facts, dict) else 0


def give_back(entry: Any, trainer: pl.Trainer) -> list[Callable[[], None]]:
    """Until the undo, each ``_MaxSizeCycle`` started inside the resumed epoch marks the loaders that ran out so.

    ``entry``: our entry in the checkpoint being loaded; no undo (and nothing done) when none of this rank's loaders
    ran out. Lightning makes the resumed epoch's iterator in ``FitLoop.setup_data`` (and again where the loops' state
    came after the loaders: ``loops.restart_train_iterator``), after the checkpoint is loaded: install on loading it,
    undo at the resumed run's first batch. An iterator of a later epoch (after an epoch-end checkpoint, whose resumed
    epoch gives no batch) starts as Lightning starts it. Through the mode's entry in Lightning's table of modes
    (``_SUPPORTED_MODES``, which ``CombinedLoader.__iter__`` reads), put back by the undo.
    """
    mask = _saved_mask(entry, trainer)
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
