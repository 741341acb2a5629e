"""The rest of ``on_train_batch_end`` after a checkpoint written in it: its arguments kept, and given again on resume.

``loops/training_epoch_loop.py: _TrainingEpochLoop.advance`` (Lightning 2.5.0 to 2.6.6): after a batch's step,
``on_train_batch_end(outputs, batch, batch_idx)`` of the callbacks (the checkpoint callbacks last:
``trainer/connectors/callback_connector.py: _reorder_callbacks``), then the LightningModule's. A checkpoint written
there (``ModelCheckpoint(every_n_train_steps=...)``) holds nothing of what follows it: another checkpoint callback
that saves or defers at that step, the module's own hook (an EMA teacher moved towards the student, as in BYOL,
DINO or MoCo; a counter). The resumed run starts with the next batch. :func:`hooks.hook_remainder` names what
follows; this module keeps each rank's ``outputs`` (tensors on the CPU) and calls the rest again, with the batch
fetched again by the caller (``data/samplers.py: ReproBatchSampler.keys_at``).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer import call

from lightning_repro._lightning import results as _results
from lightning_repro._lightning.hooks import _MODULE, _REPLAYING, _call, _find

__all__ = ["BATCH_BYTES", "batch_outputs", "replay_batch_end", "saved_batch", "single_train_loader", "transfer"]

_HOOK = "on_train_batch_end"


BATCH_BYTES = 64 << 20
"""The bytes of batch tensors :func:`batch_outputs` keeps in a checkpoint, all ranks together (an equal share each),
unless told otherwise (``DeterminismCallback(keep_batch_bytes=...)``)."""


def batch_outputs(trainer: pl.Trainer, *, keep_batch: bool = False, cap: int | None = None) -> dict[str, Any]:
    """This rank's ``outputs`` of the ``on_train_batch_end`` running now, as a checkpoint holds them.

    ``{"outputs": value}`` (tensors detached, on the CPU, in the same dicts, lists and tuples), or
    ``{"unstorable": type name}`` for a value a ``weights_only`` checkpoint cannot hold. Found on the call stack
    (``trainer/call.py: _call_callback_hooks``: its ``args``), or in the replay of a remainder. ``keep_batch``: the
    batch as the hooks see it too (a batch the resume cannot load again: streamed, several loaders...), under
    ``"batch"``, or why not under ``"batch_unstorable"`` (a value a checkpoint cannot hold, or more than
    its share of ``cap`` bytes, :data:`BATCH_BYTES` when None).
    """
    args: tuple[Any, ...] = ()
    target = call._call_callback_hooks.__code__
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target and frame.f_locals.get("hook_name") == _HOOK:
            args = tuple(frame.f_locals.get("args") or ())
            break
        if frame.f_code is _call.__code__ and _REPLAYING:
            args = tuple(_REPLAYING[-1].get("args") or ())
            break
        frame = frame.f_back
    if not args:
        return {"unstorable": "no arguments"}
    stored, value = _storable(args[0])
    out = {"outputs": value} if stored else {"unstorable": str(value)}
    if keep_batch and len(args) > 1:
        limit = BATCH_BYTES if cap is None else cap
        size, share = _tensor_bytes(args[1]), limit // max(1, trainer.world_size)
        if size > share:
            kept = _size(share) + (f" a rank ({_size(limit)} in all)" if trainer.world_size > 1 else "")
            out["batch_unstorable"] = (
                f"its tensors hold {_size(size)}, over the {kept} a checkpoint keeps: raise"
                f" `DeterminismCallback(keep_batch_bytes=...)` to {_size(size * max(1, trainer.world_size))} or more"
            )
        else:
            stored, batch = _storable(args[1])
            out["batch" if stored else "batch_unstorable"] = batch if stored else f"a {batch}"
    return out


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def saved_batch(kept: dict[str, Any] | None, trainer: pl.Trainer) -> tuple[bool, Any]:
    """The batch :func:`batch_outputs` kept, on this rank's device: ``(True, batch)``, or ``(False, why not)``."""
    if kept is None or "batch" not in kept:
        reason = (kept or {}).get("batch_unstorable")
        return False, f"the checkpoint does not hold it ({reason})" if reason else "the checkpoint does not hold it"
    return True, _on_device(kept["batch"], trainer.strategy.root_device)


def _storable(value: Any) -> tuple[bool, Any]:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return True, value.detach().cpu().clone()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        items = [_storable(v) for v in value]
        bad = next((v for ok, v in items if not ok), None)
        return (False, bad) if bad is not None else (True, type(value)(v for _, v in items))
    if type(value) is dict and all(isinstance(k, str) for k in value):
        pairs = {k: _storable(v) for k, v in value.items()}
        bad = next((v for ok, v in pairs.values() if not ok), None)
        return (False, bad) if bad is not None else (True, {k: v for k, (_, v) in pairs.items()})
    return False, type(value).__name__


def _on_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_on_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on_device(v, device) for k, v in value.items()}
    return value


def single_train_loader(trainer: pl.Trainer) -> Any | None:
    """The train loader when it is the only one, given as such (not in a list or dict): its batches are the hooks'."""
    combined = trainer.fit_loop._combined_loader
    iterables = None if combined is None else combined.iterables
    return iterables if isinstance(iterables, torch.utils.data.DataLoader) else None


def transfer(trainer: pl.Trainer, batch: Any) -> Any:
    """What ``_TrainingEpochLoop.advance`` does to a fetched batch: the module's transfer hooks, ``batch_to_device``."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
    return call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=0)


def replay_batch_end(
    trainer: pl.Trainer, remainder: dict[str, Any], kept: dict[str, Any] | None, batch: tuple[bool, Any]
) -> tuple[list[str], list[str], dict[str, Any]]:
    """Call the rest of the checkpoint's ``on_train_batch_end`` as the interrupted run did.

    ``kept``: this rank's :func:`batch_outputs`; ``batch``: ``(True, the batch fetched again)`` or ``(False, why)``.
    ``batch_progress.is_last_batch`` is the checkpoint's while they run (``ModelCheckpoint`` defers a save on an
    epoch's last batch). Without the outputs or the batch only Lightning's own ``ModelCheckpoint`` is called (it
    reads neither). Returns the names of the others (not called), those of the callbacks this Trainer does not have,
    and the values the hooks logged for the batch's log row (``self.log``: the checkpoint was written before they
    ran, and its ``pending`` row lacks them); those also go into ``trainer.logged_metrics`` & co., as after the hook.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    entries = [list(e) for e in remainder["callbacks"]]
    known = kept is not None and "outputs" in kept and batch[0]
    if known:
        assert kept is not None
        args = (_on_device(kept["outputs"], trainer.strategy.root_device), batch[1], remainder["batch_idx"])
        runnable, skipped = entries, []
    else:
        args = (None, None, remainder["batch_idx"])
        runnable = [e for e in entries if _reads_no_arguments(trainer, e)]
        skipped = [("LightningModule" if e[0] == _MODULE else e[0]) for e in entries if e not in runnable]
    extra = {"batch_idx": remainder["batch_idx"], "last_batch": remainder["last_batch"]}
    was, progress.is_last_batch = progress.is_last_batch, bool(remainder["last_batch"])
    # the batch is not counted completed inside its hook (`increment_completed` comes after it); an epoch's last
    # batch is, on load (`loops.fix_loop_progress`): a file saved in the hook holds the uninterrupted run's counts
    counts: Any = (progress.current, progress.total)
    counted = [part.completed for part in counts] if counts[0].completed == counts[0].processed else None
    for part in counts if counted else ():
        part.completed -= 1
    # inside a batch, `trainer.callback_metrics` & co. take the step values (`_first_loop_iter` set): not the epoch
    # values, which reading them before the first batch would compute (the restored dicts hold the batch's)
    connector = trainer._logger_connector
    first, connector._first_loop_iter = connector._first_loop_iter, False
    # `self.log` in these hooks finds the batch as `_LoggerConnector.on_batch_start` gave it (the size of a mean)
    results = trainer.fit_loop.epoch_loop._results
    given = (results.batch, results.batch_size)
    results.batch, results.batch_size = (args[1], None) if known else given
    before = _results.step_caches(trainer)
    try:
        missing = _call(trainer, _HOOK, runnable, args, extra)
    finally:
        progress.is_last_batch, connector._first_loop_iter = was, first
        results.batch, results.batch_size = given
        for part, completed in zip(counts, counted or (), strict=False):
            part.completed = completed
    logged = _results.logged_since(trainer, before)
    # what `_LoggerConnector.on_batch_end` does right after the hook: the batch's step values in the three dicts
    connector._progress_bar_metrics.update(logged["pbar"])
    connector._callback_metrics.update(logged["callback"])
    connector._logged_metrics.update(logged["log"])
    return skipped, missing, logged["log"]


def _reads_no_arguments(trainer: pl.Trainer, entry: list[Any]) -> bool:
    callback = None if entry[0] == _MODULE else _find(trainer, entry[0], int(entry[1]))
    return callback is not None and type(callback).on_train_batch_end is ModelCheckpoint.on_train_batch_end
