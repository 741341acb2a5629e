"""Lightning internals that a resume has to reach: where a checkpoint was written, and what came after it.

Checked against Lightning 2.5 and 2.6 (``lightning/pytorch/trainer/call.py``, ``loops/fit_loop.py``,
``loops/evaluation_loop.py``, ``trainer/connectors/logger_connector/logger_connector.py``).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping
from lightning.pytorch.trainer import call

__all__ = ["REPLAYED_HOOKS", "hook_remainder", "replay_hook_remainder"]

REPLAYED_HOOKS = ("on_validation_end", "on_train_epoch_end")
"""Hooks whose callbacks after the one that wrote a checkpoint are run again on resume."""

_MODULE = "<LightningModule>"


def _is_monitoring(callback: Callback) -> bool:
    # `_call_callback_hooks(monitoring_callbacks=...)` hard-codes these two (trainer/call.py)
    return isinstance(callback, (EarlyStopping, Checkpoint))


def hook_remainder(trainer: pl.Trainer, ours: Callback) -> dict[str, Any] | None:
    """Which hooks the run still calls, after the checkpoint being written, to finish the hook it is written in.

    A checkpoint written by a callback in ``on_validation_end`` (a monitored ``ModelCheckpoint``) or
    ``on_train_epoch_end`` (``save_on_train_epoch_end=True``) is a snapshot taken while that hook runs: the
    callbacks after the writer, the LightningModule's own hook, and for ``on_train_epoch_end`` the epoch's logged
    row and the plateau schedulers come after it. Lightning resumes past all of that. The writing callback is
    found on the call stack (``trainer/call.py: _call_callback_hooks``: its ``hook_name``, ``callbacks`` and
    ``callback`` locals). Returns ``None`` when the checkpoint is not written from such a hook.
    """
    target = call._call_callback_hooks.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code is not target:
        frame = frame.f_back
    if frame is None:
        return None
    local = frame.f_locals
    hook, group, writer = local.get("hook_name"), local.get("callbacks"), local.get("callback")
    if hook not in REPLAYED_HOOKS or not isinstance(group, list) or writer is None:
        return None
    everyone = list(trainer.callbacks)  # type: ignore[attr-defined]
    position = next((i for i, cb in enumerate(group) if cb is writer), None)
    if position is None:
        return None
    rest: list[Callback | str] = list(group[position + 1 :])
    if hook == "on_train_epoch_end":
        monitoring = local.get("monitoring_callbacks")
        if monitoring is False:  # then the module's hook, then the monitoring callbacks
            rest += [_MODULE, *[cb for cb in everyone if _is_monitoring(cb)]]
    else:
        rest.append(_MODULE)
    names: list[list[Any]] = []
    for item in rest:
        if item is ours:
            continue  # our own hooks are replayed by the resume itself
        if isinstance(item, str):
            names.append([item, -1])
        else:
            names.append([item.state_key, everyone.index(item)])
    return {"hook": hook, "callbacks": names}


def _find(trainer: pl.Trainer, state_key: str, index: int) -> Callback | None:
    everyone = list(trainer.callbacks)  # type: ignore[attr-defined]
    found: Callback | None
    if 0 <= index < len(everyone) and everyone[index].state_key == state_key:
        found = everyone[index]
    else:
        found = next((cb for cb in everyone if cb.state_key == state_key), None)
    return found


def _call(trainer: pl.Trainer, hook: str, entries: list[Any]) -> list[str]:
    """Call ``hook`` on each named callback (or the module), as ``_call_callback_hooks`` does; return the missing."""
    pl_module = trainer.lightning_module
    missing = []
    for state_key, index in entries:
        if state_key == _MODULE:
            call._call_lightning_module_hook(trainer, hook)
            continue
        callback = _find(trainer, state_key, int(index))
        if callback is None:
            missing.append(state_key)
            continue
        previous, pl_module._current_fx_name = pl_module._current_fx_name, hook
        try:
            getattr(callback, hook)(trainer, pl_module)
        finally:
            pl_module._current_fx_name = previous
    return missing


def replay_hook_remainder(trainer: pl.Trainer, remainder: dict[str, Any] | None) -> list[str]:
    """On resume, before the first batch: finish the hook the checkpoint was written in, as the run did.

    Returns the state keys of callbacks that the checkpoint names but this Trainer does not have.
    """
    if not remainder:
        return []
    hook, entries = remainder["hook"], remainder["callbacks"]
    if hook == "on_validation_end":
        trainer.validating = True
        try:
            return _call(trainer, hook, entries)
        finally:
            trainer.training = True
    # on_train_epoch_end (trainer/loops/fit_loop.py: _FitLoop.on_advance_end, from the callbacks on)
    fit_loop = trainer.fit_loop
    progress: Any = fit_loop.epoch_progress.current
    completed = progress.completed
    progress.completed = progress.processed - 1  # `trainer.current_epoch` as the hooks saw it
    connector = trainer._logger_connector
    connector.epoch_end_reached()
    try:
        missing = _call(trainer, hook, entries)
        connector.on_epoch_end()
        if fit_loop.epoch_loop._num_ready_batches_reached():
            fit_loop.epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=True)
        # Lightning logs the epoch row at the step of the epoch's last batch
        fit_loop.epoch_loop._batches_that_stepped -= 1
        connector.update_train_epoch_metrics()
        fit_loop.epoch_loop._batches_that_stepped += 1
    finally:
        progress.completed = completed
    return missing
