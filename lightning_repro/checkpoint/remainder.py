"""On resume: the rest of the hook the checkpoint was written in, run before the first resumed batch.

``on_validation_end`` and ``on_train_epoch_end``: :func:`lightning_repro._lightning.hooks.replay_hook_remainder`.
``on_train_batch_end`` (:mod:`lightning_repro._lightning.batchend`): the callbacks after the writer and the
LightningModule's own hook get the batch's ``outputs`` as this rank saved them and the batch loaded again
(:func:`lightning_repro.data.takeover.fetch_again`), turned into what the hooks saw as Lightning turns a fetched batch
(the module's transfer hooks on this rank's device), the process streams put back afterwards: a transfer hook that
draws must not move the streams the resumed run continues from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_repro._lightning import batchend as _batchend
from lightning_repro._lightning import hooks as _hooks
from lightning_repro.data.takeover import fetch_again
from lightning_repro.rng import capture_process_streams, restore_process_streams

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_repro.checkpoint.state import ReproState

__all__ = ["finish_hook_remainder"]


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
    missing, logged = _batchend.replay_batch_end(trainer, remainder, pending.batch_end, batch)
    row = (pending.pending or {}).get("log")
    if logged and row is not None:  # the batch's log row, written next (`run_pending`): with what the hooks logged
        row.update({key: value.detach().cpu().clone() for key, value in logged.items()})
    if not missing:
        return None
    kept = pending.batch_end or {}
    why = batch[1] if not batch[0] else f"its outputs ({kept.get('unstorable', 'not saved')}) are not in the file"
    return (
        f"The checkpoint was written in `{hook}` before these ran that hook for its batch: {', '.join(missing)}."
        f" They are not run again on resume ({why}, or this Trainer does not have them): what they would have"
        " done then is missing from the resumed run. For an exact resume, save in a later hook (for example"
        " `ModelCheckpoint(save_on_train_epoch_end=True)`), or let lightning-repro load the train data"
        " sample-keyed from a map-style dataset, and return tensors, numbers or dicts of them from training_step."
    )


def _missing(hook: str, missing: list[str]) -> str:
    return (
        f"The checkpoint was written in `{hook}` before these callbacks ran that hook ({', '.join(missing)}),"
        " and this Trainer does not have them: what they would have done then is missing from the resumed run."
    )


def _batch_again(trainer: pl.Trainer, pending: ReproState) -> tuple[bool, Any]:
    loader = _batchend.single_train_loader(trainer)
    if loader is None or len(pending.data) != 1 or pending.remap:
        return False, "the batch comes from several train loaders, or the data is re-dealt"
    saved = capture_process_streams()
    try:
        found, batch = fetch_again(loader, pending.data[0])
        return (True, _batchend.transfer(trainer, batch)) if found else (False, batch)
    finally:
        restore_process_streams(saved)
