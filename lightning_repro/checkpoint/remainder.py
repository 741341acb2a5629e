"""On resume: the rest of the hook the checkpoint was written in, run before the first resumed batch; a stop not saved.

``on_validation_end`` and ``on_train_epoch_end``: :func:`lightning_repro._lightning.hooks.replay_hook_remainder`.
``on_train_batch_end`` (:mod:`lightning_repro._lightning.batchend`): the callbacks after the writer and the
LightningModule's own hook get the batch's ``outputs`` as this rank saved them and the batch loaded again
(:func:`lightning_repro.data.takeover.fetch_again`), turned into what the hooks saw as Lightning turns a fetched batch
(the module's transfer hooks on this rank's device), the process streams put back afterwards: a transfer hook that
draws must not move the streams the resumed run continues from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lightning_repro._lightning import batchend as _batchend
from lightning_repro._lightning import hooks as _hooks
from lightning_repro._lightning.lastbatch import step_of_saved_batch
from lightning_repro.data.takeover import fetch_again
from lightning_repro.rng import capture_process_streams, restore_process_streams

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_repro.checkpoint.state import ReproState

__all__ = ["finish_hook_remainder", "stop_requested"]


def finish_hook_remainder(trainer: pl.Trainer, pending: ReproState) -> str | None:
    """Run the rest of the checkpoint's hook; return why what it did is not all in the resumed run (or ``None``)."""
    remainder = pending.remainder
    if not remainder:
        return None
    hook = remainder["hook"]
    if hook != "on_train_batch_end":
        missing = _hooks.replay_hook_remainder(trainer, remainder)
        return _missing(hook, missing) if missing else None
    batch = _batch_again(trainer, pending)
    # every rank runs the hooks, or none does: they may hold collectives (`self.log(..., sync_dist=True)`)
    here = batch[0] and "outputs" in (pending.batch_end or {})
    if not trainer.strategy.reduce_boolean_decision(here, all=True) and here:
        batch = (False, "another rank's batch or outputs cannot be given again")
    with step_of_saved_batch(trainer, pending.pending):  # the logger's step of the uninterrupted run's hooks
        skipped, absent, logged = _batchend.replay_batch_end(trainer, remainder, pending.batch_end, batch)
    row = (pending.pending or {}).get("log")
    if logged and row is not None:  # the batch's log row, written next (`run_pending`): with what the hooks logged
        row.update({key: value.detach().cpu().clone() for key, value in logged.items()})
    problems = [_missing(hook, absent)] if absent else []
    if skipped:
        kept = pending.batch_end or {}
        if not batch[0]:
            why, advice = batch[1], _SAVE_LATER
        else:
            why = f"its outputs ({kept.get('unstorable', 'not saved')}) are not in the file"
            advice = "For an exact resume, return tensors, numbers, strings, or lists and dicts of them from"
            advice += " training_step."
        problems.append(
            f"The checkpoint was written in `{hook}` before these ran that hook for its batch: {', '.join(skipped)}."
            f" They are not run again on resume ({why}): what they would have done then is missing from the resumed"
            f" run. {advice}"
        )
    return " ".join(problems) or None


_SAVE_LATER = (
    "For an exact resume, save where the batch is not needed again: at an epoch's end"
    " (`ModelCheckpoint(every_n_epochs=1, save_on_train_epoch_end=True)`) or in the next batch's"
    " `on_train_batch_start`."
)


def _missing(hook: str, missing: list[str]) -> str:
    return (
        f"The checkpoint was written in `{hook}` before these callbacks ran that hook ({', '.join(missing)}),"
        " and this Trainer does not have them: what they would have done then is missing from the resumed run."
    )


def _batch_again(trainer: pl.Trainer, pending: ReproState) -> tuple[bool, Any]:
    """The checkpoint's batch as the hooks saw it, or ``(False, why not)``.

    As the file keeps it (a batch the save knew could not be loaded again), else loaded again (one map-style loader,
    sample-keyed).
    """
    if pending.remap:
        return False, "the data is re-dealt to another number of ranks"
    kept, not_kept = _batchend.saved_batch(pending.batch_end, trainer)
    if kept:
        return True, not_kept
    loader = _batchend.single_train_loader(trainer)
    if loader is None:
        source = "the batch comes from several train loaders"
    elif isinstance(loader.dataset, torch.utils.data.IterableDataset):
        source = "its train data is an `IterableDataset`, whose batch is not loaded again"
    elif len(pending.data) != 1:
        source = "its train loader's order is not lightning-repro's (a batch sampler it does not take over)"
    else:
        saved = capture_process_streams()
        try:
            found, batch = fetch_again(loader, pending.data[0])
            if found:
                return True, _batchend.transfer(trainer, batch)
            source = batch
        finally:
            restore_process_streams(saved)
    return False, f"{source}, and {not_kept}"


def stop_requested(entry: Any) -> str | None:
    """What a resume from a checkpoint written once the run was asked to stop does not do (None: it was not).

    Lightning saves no ``trainer.should_stop``: resumed, the run trains on where the interrupted one had ended.
    """
    facts = entry.get("loops") if isinstance(entry, dict) else None
    if not (isinstance(facts, dict) and facts.get("stopping")):
        return None
    return (
        "The interrupted run had been asked to stop when this checkpoint was written (`trainer.should_stop`, set by"
        " EarlyStopping, a Timer or the module): it ended there, but Lightning saves no stop request, so the resumed"
        " run trains on (as it would without lightning-repro)."
    )
