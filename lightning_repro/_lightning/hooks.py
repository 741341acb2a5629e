"""Lightning's hooks: our installs on a Trainer, the index recorder, the rest of a checkpoint's hook.

The installs (``setup_data``, ``process_dataloader``, ``load_checkpoint``, the launcher) and their undo, the
predict-time index recorder, the warning filter and the callbacks after the one that wrote a checkpoint
(``trainer/call.py``, ``loops/fit_loop.py``, ``loops/evaluation_loop.py``,
``trainer/connectors/logger_connector/logger_connector.py``, ``callbacks/model_checkpoint.py``; checked against
Lightning 2.5.6 and 2.6.6).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

__all__ = [
    "REPLAYED_HOOKS",
    "IndexRecorder",
    "hook_remainder",
    "install",
    "recorded_batch_sampler",
    "replay_hook_remainder",
    "silence_not_resumable_warning",
    "skip_hook",
    "skip_unused_batch_hooks",
]

REPLAYED_HOOKS = ("on_validation_end", "on_train_epoch_end", "on_train_batch_end")
_REPLAYING: list[dict[str, Any]] = []  # while a remainder is replayed: the hooks after the one being called
"""Hooks whose callbacks after the one that wrote a checkpoint are run again on resume."""

_MODULE = "<LightningModule>"

BATCH_HOOKS = (
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)
"""The callback hooks Lightning calls on every batch or step besides ``on_train_batch_start``/``_end``."""


def skip_unused_batch_hooks(callback: Callback) -> None:
    """Let Lightning skip the batch hooks ``callback``'s class leaves to ``Callback``'s no-ops.

    Lightning calls each hook of each callback through a profiler context and a ``state_key`` (~1.2 us a call,
    four per training step even for a no-op) and skips an attribute that is not callable
    (``_call_callback_hooks``: ``if callable(fn)``, in every supported version). Such a hook is set to None on
    the instance: a subclass that defines it is called as usual, and ``super().hook(...)`` still finds the no-op.
    """
    for name in BATCH_HOOKS:
        if getattr(type(callback), name) is getattr(Callback, name):
            setattr(callback, name, None)


def skip_hook(callback: Callback, name: str, *, skip: bool, owner: type) -> None:
    """Let Lightning skip ``callback``'s hook ``name`` while it has nothing to do (``skip``), or call it again.

    As :func:`skip_unused_batch_hooks`: None on the instance, which Lightning skips; only where the hook is
    ``owner``'s own, so a subclass that overrides it is always called.
    """
    if skip and getattr(type(callback), name) is getattr(owner, name):
        setattr(callback, name, None)
    else:
        callback.__dict__.pop(name, None)


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
    while frame is not None and frame.f_code is not target and frame.f_code is not _call.__code__:
        frame = frame.f_back
    if frame is None:
        return None
    if frame.f_code is _call.__code__:  # written by a callback of a replayed remainder (on resume): what follows it
        rest_of_replay = _REPLAYING[-1] if _REPLAYING else None
        return {k: v for k, v in rest_of_replay.items() if k != "args"} if rest_of_replay else None
    local = frame.f_locals
    hook, group, writer = local.get("hook_name"), local.get("callbacks"), local.get("callback")
    if hook not in REPLAYED_HOOKS or not isinstance(group, list) or writer is None:
        return None
    everyone = list(trainer.callbacks)  # type: ignore[attr-defined]
    position = next((i for i, cb in enumerate(group) if cb is writer), None)
    if position is None:
        return None
    rest: list[Callback | str] = list(group[position + 1 :])
    if hook == "on_train_batch_end":  # the hooks that do something, the module's too; the arguments: batchend.py
        rest = [cb for cb in rest if _has_hook(cb, hook)]
        rest += [_MODULE] if is_overridden(hook, trainer.lightning_module) else []
        names = named(trainer, rest, ours)
        args: tuple[Any, ...] = tuple(local.get("args") or ())
        if not names or len(args) != 3:
            return None
        last = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        return {"hook": hook, "callbacks": names, "batch_idx": int(args[2]), "last_batch": last}
    if hook == "on_train_epoch_end":
        monitoring = local.get("monitoring_callbacks")
        if monitoring is False:  # then the module's hook, then the monitoring callbacks
            rest += [_MODULE, *[cb for cb in everyone if _is_monitoring(cb)]]
    else:
        rest.append(_MODULE)
    return {"hook": hook, "callbacks": named(trainer, rest, ours)}


def _has_hook(callback: Any, hook: str) -> bool:
    """``callback``'s ``hook`` is its own (not ``Callback``'s no-op) and Lightning calls it (not None)."""
    return callable(getattr(callback, hook, None)) and getattr(type(callback), hook) is not getattr(Callback, hook)


def named(trainer: pl.Trainer, rest: list[Callback | str], ours: Callback) -> list[list[Any]]:
    """``[state_key, index in trainer.callbacks]`` of each callback in ``rest`` (``[_MODULE, -1]``), but ours."""
    everyone = list(trainer.callbacks)  # type: ignore[attr-defined]
    names: list[list[Any]] = []
    for item in rest:
        if item is ours:
            continue  # our own hooks are replayed by the resume itself
        if isinstance(item, str):
            names.append([item, -1])
        else:
            names.append([item.state_key, everyone.index(item)])
    return names


def _find(trainer: pl.Trainer, state_key: str, index: int) -> Callback | None:
    everyone = list(trainer.callbacks)  # type: ignore[attr-defined]
    found: Callback | None
    if 0 <= index < len(everyone) and everyone[index].state_key == state_key:
        found = everyone[index]
    else:
        found = next((cb for cb in everyone if cb.state_key == state_key), None)
    return found


def _call(
    trainer: pl.Trainer, hook: str, entries: list[Any], args: tuple[Any, ...] = (), extra: dict[str, Any] | None = None
) -> list[str]:
    """Call ``hook(*args)`` on each named callback (or the module), as ``_call_callback_hooks`` does.

    Returns the missing. ``extra``: what the remainder holds besides its callbacks (for a checkpoint they write).
    """
    pl_module = trainer.lightning_module
    missing = []
    for position, (state_key, index) in enumerate(entries):
        if state_key == _MODULE:
            call._call_lightning_module_hook(trainer, hook, *args)
            continue
        callback = _find(trainer, state_key, int(index))
        if callback is None:
            missing.append(state_key)
            continue
        previous, pl_module._current_fx_name = pl_module._current_fx_name, hook
        rest = [list(e) for e in entries[position + 1 :]]
        _REPLAYING.append({"hook": hook, "callbacks": rest, **(extra or {}), "args": args} if rest else {})
        try:
            getattr(callback, hook)(trainer, pl_module, *args)
        finally:
            _REPLAYING.pop()
            pl_module._current_fx_name = previous
    return missing


def replay_hook_remainder(trainer: pl.Trainer, remainder: dict[str, Any] | None) -> list[str]:
    """On resume, before the first batch: finish the hook the checkpoint was written in, as the run did.

    ``on_train_batch_end``'s: :func:`~lightning_repro._lightning.batchend.replay_batch_end`. Returns the state
    keys of callbacks that the checkpoint names but this Trainer does not have.
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


# ---------------------------------------------------------------------------------------- installs and their undo
def _wrap(obj: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Set ``obj.name`` on the instance; return the function that puts back what the instance had."""
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    setattr(obj, name, replacement)

    def undo() -> None:
        if had_own:
            setattr(obj, name, previous)
        else:
            vars(obj).pop(name, None)

    return undo


def install(
    trainer: pl.Trainer,
    *,
    setup_data: Callable[[Callable[[], None], str], Callable[[], None]],
    process_dataloader: Callable[[Any], Any],
    load_checkpoint: Callable[[Callable[..., dict[str, Any]]], Callable[..., dict[str, Any]]],
    on_exception: Callable[[BaseException], None],
) -> list[Callable[[], None]]:
    """Route every loop's data setup, every dataloader and the checkpoint read through the callback.

    ``setup_data(original, stage)`` wraps each loop's ``setup_data`` (``loops/fit_loop.py``,
    ``loops/evaluation_loop.py``, ``loops/prediction_loop.py``: where the loaders are built);
    ``process_dataloader(loader)`` receives each loader after ``Strategy.process_dataloader``
    (``trainer/connectors/data_connector.py: _process_dataloader``); ``load_checkpoint(original)`` wraps
    ``Strategy.load_checkpoint`` (``trainer/connectors/checkpoint_connector.py: resume_start``);
    ``on_exception(exception)`` runs after ``Strategy.on_exception``, which a failed run calls after the callbacks'
    ``on_exception`` (``trainer/call.py: _interrupt``): a callback that undoes these patches in its own
    ``on_exception`` reaches it only when Lightning did not call that hook, as when the exception came from a
    Tuner's trial, which had replaced ``trainer.callbacks`` and does not put them back when it fails
    (``tuner/lr_finder.py: _lr_find``, ``tuner/batch_size_scaling.py: _scale_batch_size``). The patches are set on
    the instances only; returns the functions that undo them (call them in reverse order).
    """
    loops: list[tuple[Any, str]] = [
        (trainer.fit_loop, "train"),
        (trainer.fit_loop.epoch_loop.val_loop, "validate"),
        (trainer.validate_loop, "validate"),
        (trainer.test_loop, "test"),
        (trainer.predict_loop, "predict"),
    ]
    undo = [_wrap(loop, "setup_data", setup_data(loop.setup_data, stage)) for loop, stage in loops]
    strategy = trainer.strategy
    original = strategy.process_dataloader
    undo.append(_wrap(strategy, "process_dataloader", lambda dl: process_dataloader(original(dl))))
    undo.append(_wrap(strategy, "load_checkpoint", load_checkpoint(strategy.load_checkpoint)))
    original_on_exception = strategy.on_exception

    def strategy_on_exception(exception: BaseException) -> None:
        original_on_exception(exception)
        on_exception(exception)

    undo.append(_wrap(strategy, "on_exception", strategy_on_exception))
    return undo


class IndexRecorder(_IndexBatchSamplerWrapper):
    """Lightning's predict-time index recorder (``overrides/distributed.py: _IndexBatchSamplerWrapper``).

    ``BasePredictionWriter`` receives what it records as ``batch_indices``; ``plain`` turns what the wrapped batch
    sampler yields into the plain list of indices that plain Lightning records.
    """

    def __init__(self, batch_sampler: Any, plain: Callable[[Any], list[int]]) -> None:
        super().__init__(batch_sampler)
        self.plain = plain

    @override
    def __next__(self) -> list[int]:
        iterator: Iterator[Any] | None = self._iterator
        assert iterator is not None  # __iter__ ran first, as in Lightning's own __next__
        batch: Any = next(iterator)
        self.seen_batch_indices.append(self.plain(batch))
        return batch  # type: ignore[no-any-return]


def recorded_batch_sampler(sampler: Any) -> Any:
    """The batch sampler inside Lightning's predict-time recorder, or ``None`` if ``sampler`` is not one."""
    return sampler._batch_sampler if isinstance(sampler, _IndexBatchSamplerWrapper) else None


_LIGHTNING_RESUME_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


def silence_not_resumable_warning() -> Callable[[], None]:
    """Hide Lightning's "dataloader is not resumable" warning around a resumed epoch whose data position we restore.

    ``loops/training_epoch_loop.py: _TrainingEpochLoop.reset`` warns on every mid-epoch resume of a loader without
    ``state_dict()``; ours skips the consumed batches exactly, so the warning would not be true. Returns the function
    that removes the filter.
    """
    warnings.filterwarnings("ignore", message=_LIGHTNING_RESUME_WARNING)
    added = warnings.filters[0]

    def undo() -> None:
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
        if added in filters:
            filters.remove(added)
            mutated = getattr(warnings, "_filters_mutated", None)
            if callable(mutated):
                mutated()

    return undo
