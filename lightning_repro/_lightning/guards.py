"""What each checkpoint callback had saved: ``ModelCheckpoint``'s guards, kept in our entry and given back on resume.

``callbacks/model_checkpoint.py`` keeps its save guard (``_last_global_step_saved``), its last file and a save it
deferred to the next validation's end out of its ``state_dict()`` (checked against Lightning 2.5.6 and 2.6.6).
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer import call

from lightning_repro._lightning.hooks import _call

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

__all__ = ["restore_save_guards", "save_guards"]

_GUARD = "_last_global_step_saved"
_DEFER = "_defer_save_until_validation"


def _guarded(trainer: pl.Trainer, ours: Callback) -> list[tuple[str, int, Callback]]:
    """The callbacks with ``ModelCheckpoint``'s guard, each with its state key and its rank among that key's."""
    found: list[tuple[str, int, Callback]] = []
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if callback is not ours and isinstance(getattr(callback, _GUARD, None), int):
            key = callback.state_key
            found.append((key, sum(k == key for k, _, _ in found), callback))
    return found


def _relative(file: str, dirpath: Any) -> str:
    """``file`` relative to ``dirpath`` when it is in it (as ``os.path.join(dirpath, name)`` made it), else ""."""
    if not file or dirpath is None:
        return ""
    name = file[len(str(dirpath)) :].lstrip("/")
    return name if file.startswith(str(dirpath)) and os.path.join(str(dirpath), name) == file else ""


def save_guards(trainer: pl.Trainer, ours: Callback) -> list[dict[str, Any]]:
    """What each checkpoint callback knows it saved, as it will be once the checkpoint being written is on disk.

    ``callbacks/model_checkpoint.py``: ``ModelCheckpoint`` skips a step it saved already (``_last_global_step_saved
    == trainer.global_step``, in ``_should_skip_saving_checkpoint`` and ``on_train_epoch_end``/``on_validation_end``
    for ``last.ckpt``), writes ``last.ckpt`` at ``on_train_end`` unless it saved a file (``_last_checkpoint_saved``),
    and keeps neither in its ``state_dict()``. ``_save_checkpoint(trainer, filepath)`` sets both once
    ``trainer.save_checkpoint`` returns: the callback found running it on the call stack (the writer) is given the
    current step and that file; every other callback with the guard its values as they are. Returns
    ``{"state_key", "index" (among the callbacks of that state key), "step", "file"}`` per callback, the file
    relative to the callback's ``dirpath`` (no absolute path: the entry of a run does not depend on its directory),
    and ``"defer"``, its save deferred to the next validation's end (:func:`_deferred_after`), where it has that flag.
    Read in Lightning 2.5.0 and 2.6.6 (the same attributes and ``_save_checkpoint``; the save at ``on_train_end`` is
    2.6's).
    """
    callbacks = _guarded(trainer, ours)
    writer, written = None, ""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and writer is None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "_save_checkpoint" else None
        if any(owner is cb for _, _, cb in callbacks):
            writer, written = owner, str(frame.f_locals.get("filepath") or "")
        frame = frame.f_back
    deferred = _deferred_after(trainer, [callback for _, _, callback in callbacks])
    out = []
    for key, index, callback in callbacks:
        mine = callback is writer
        step = trainer.global_step if mine else getattr(callback, _GUARD)
        file = written if mine else str(getattr(callback, "_last_checkpoint_saved", "") or "")
        relative = _relative(file, getattr(callback, "dirpath", None))
        guard = {"state_key": key, "index": index, "step": int(step), "file": relative}
        if id(callback) in deferred:
            guard["defer"] = deferred[id(callback)]
        out.append(guard)
    return out


def _deferred_after(trainer: pl.Trainer, callbacks: list[Callback]) -> dict[int, bool]:
    """Each callback's ``_defer_save_until_validation`` as it will be once the checkpoint being written is on disk.

    ``ModelCheckpoint.on_train_batch_end`` defers a due save whose monitored metric is missing (or stale before a
    validation) to ``on_validation_end``, which saves and clears the flag; the flag is not in its ``state_dict()``.
    The flags are recorded as they are, but for the callback whose ``on_validation_end`` is writing this file (found
    on the call stack as :func:`hook_remainder` finds it, in Lightning's call or in the replay of a remainder): it
    is saving what it deferred, its flag is cleared once its hook returns. The callbacks after it keep theirs: their
    ``on_validation_end`` is replayed on resume.
    """
    flags = {id(cb): bool(getattr(cb, _DEFER)) for cb in callbacks if isinstance(getattr(cb, _DEFER, None), bool)}
    targets = (call._call_callback_hooks.__code__, _call.__code__)  # Lightning's hook call, or our replay of it
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code not in targets:
        frame = frame.f_back
    if frame is not None and frame.f_locals.get("hook_name", frame.f_locals.get("hook")) == "on_validation_end":
        writer = frame.f_locals.get("callback")
        if id(writer) in flags:
            flags[id(writer)] = False
    return flags


def restore_save_guards(trainer: pl.Trainer, guards: list[dict[str, Any]] | None, ours: Callback) -> None:
    """On resume, before the first batch: tell each checkpoint callback what it had saved (:func:`save_guards`).

    A callback the checkpoint does not name keeps its values. The file is given back only where the callback's
    restored state knows it in its current ``dirpath`` (``last_model_path``, ``best_model_path``, ``best_k_models``):
    ``ModelCheckpoint.load_state_dict`` restores its paths only when the directory did not change.
    """
    callbacks = {(key, index): callback for key, index, callback in _guarded(trainer, ours)}
    for guard in guards or []:
        callback = callbacks.get((guard["state_key"], int(guard["index"])))
        if callback is None:
            continue
        setattr(callback, _GUARD, int(guard["step"]))
        if isinstance(guard.get("defer"), bool) and hasattr(callback, _DEFER):
            setattr(callback, _DEFER, guard["defer"])
        if not guard["file"] or not hasattr(callback, "_last_checkpoint_saved"):
            continue
        file = os.path.join(str(getattr(callback, "dirpath", "")), guard["file"])
        known = {getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")}
        if file in known or file in getattr(callback, "best_k_models", {}):
            setattr(callback, "_last_checkpoint_saved", file)  # noqa: B010
