"""``StochasticWeightAveraging`` resumed in the middle of an epoch: its scheduler built again.

Checked against Lightning 2.5.6 and 2.6.6 (``callbacks/stochastic_weight_avg.py``). SWA builds its ``SWALR`` at the
start of the first averaging epoch (``on_train_epoch_start``, which sets ``_initialized``) and loads the saved
scheduler state there on resume, after ``on_fit_start`` removed the checkpoint's scheduler from the trainer
(``_clear_schedulers``). A resume in the middle of an averaging epoch does not run that hook
(``loops/fit_loop.py: on_advance_start``): the epoch ends without the scheduler's step, the next one builds it one
step late, and the learning rates part from the uninterrupted run's.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging

__all__ = ["rebuild_swa_schedulers"]


def rebuild_swa_schedulers(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
    """Build the ``SWALR`` of every SWA callback that a mid-epoch resume left without it; their names.

    Runs what the skipped ``on_train_epoch_start`` of an averaging epoch did: the callback's own hook, which builds
    the scheduler, loads its saved state and swaps it in. Its other work is done already: the averaging of that
    epoch (``_latest_update_epoch`` is the epoch), the optimizer's ``initial_lr`` (restored with the optimizer);
    a new ``SWALR`` leaves the restored learning rates as they are (its first step keeps the current ones). Call
    it only when the resumed epoch's start hooks are skipped.
    """
    rebuilt = []
    epoch = trainer.current_epoch
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if not isinstance(callback, StochasticWeightAveraging):
            continue
        if callback._initialized or callback._scheduler_state is None:
            continue
        if not callback.swa_start <= epoch <= callback.swa_end or callback._latest_update_epoch != epoch:
            continue
        callback.on_train_epoch_start(trainer, pl_module)
        rebuilt.append(callback.state_key)
    return rebuilt
