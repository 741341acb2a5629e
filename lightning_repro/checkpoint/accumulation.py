"""``GradientAccumulationScheduler`` resumed in the middle of an epoch: the epoch's accumulation set again.

The scheduler sets ``trainer.accumulate_grad_batches`` for the coming epoch in its ``on_train_epoch_start``, and
checks in ``on_train_start`` that the Trainer's own value is 1. A resume in the middle of an epoch does not run the
epoch-start hooks (``loops/fit_loop.py: on_advance_start``), so the resumed epoch went on with the Trainer's 1: an
optimizer step at every batch where the uninterrupted run accumulated, more steps, other weights (plain Lightning
does the same). The resume sets the epoch's value as the skipped hook would have, before the epoch loop's restart
reads it (``_should_accumulate`` in ``loops/training_epoch_loop.py: reset``), and after each scheduler's own
``on_train_start`` check: now for a scheduler that came before this callback, at the end of its ``on_train_start``
for one that comes after. Public API (the callback's ``get_accumulate_grad_batches``, the Trainer's
``accumulate_grad_batches``) and :func:`~lightning_repro._lightning.loops.resumed_with_batches_left`. A resumed epoch
that will accumulate another number of batches than the checkpoint's run did is said not exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, StochasticWeightAveraging

from lightning_repro._lightning import loops as _loops

__all__ = ["resume_accumulation"]


def resume_accumulation(trainer: pl.Trainer, ours: Callback, saved: Any) -> str | None:
    """Give the resumed epoch the accumulation its schedulers' skipped ``on_train_epoch_start`` set.

    Call it from ``ours``'s ``on_train_start``, only when the resumed epoch's start hooks are skipped. A scheduler
    later in ``trainer.callbacks`` than ``ours`` has not checked the Trainer's value yet: its ``on_train_start``
    (the instance's, once) sets the value after its check.

    Args:
        trainer: The resumed trainer.
        ours: The ``DeterminismCallback``.
        saved: The Trainer's ``accumulate_grad_batches`` when the checkpoint was written (our entry's ``loops``
            fact; anything but an int from 1 on, e.g. None from an entry without it, is not compared).

    Returns:
        Why the resumed epoch is not exact, when batches are left in it and it will accumulate another number of
        batches per optimizer step than the interrupted run did (another ``Trainer(accumulate_grad_batches=...)``,
        or a value set by a hook of the user's that the resume skips); else None.
    """
    callbacks: list[Callback] = list(trainer.callbacks)  # type: ignore[attr-defined]
    after = callbacks.index(ours) if ours in callbacks else len(callbacks)
    value = int(trainer.accumulate_grad_batches)
    for position, callback in enumerate(callbacks):
        if not isinstance(callback, GradientAccumulationScheduler):
            continue
        value = callback.get_accumulate_grad_batches(trainer.current_epoch)
        if position < after:
            trainer.accumulate_grad_batches = value
        else:
            callback.on_train_start = _then_set(callback, trainer, value)  # type: ignore[method-assign]
    known = isinstance(saved, int) and not isinstance(saved, bool) and saved >= 1
    if not known or value == saved or not _loops.resumed_with_batches_left(trainer):
        return None
    said = (
        f"The resumed epoch accumulates {value} batch(es) per optimizer step where the interrupted run accumulated"
        f" {saved} (`trainer.accumulate_grad_batches` at the checkpoint): its optimizer steps fall elsewhere. A"
        " resume in the middle of an epoch does not run `on_train_epoch_start`"
    )
    if any(isinstance(callback, StochasticWeightAveraging) for callback in callbacks):  # its BatchNorm epoch's value
        return said + ", where StochasticWeightAveraging set it for its BatchNorm epoch (a known exception)."
    return said + (
        "; set the value in the Trainer, in `on_train_start` too, or with `GradientAccumulationScheduler`, which"
        " lightning-repro gives the resumed epoch."
    )


def _then_set(callback: GradientAccumulationScheduler, trainer: pl.Trainer, value: int) -> Callable[..., None]:
    original = callback.on_train_start

    def on_train_start(*args: Any, **kwargs: Any) -> None:
        del callback.on_train_start  # once: the class's hook again from here on
        original(*args, **kwargs)
        trainer.accumulate_grad_batches = value

    return on_train_start
