"""What each checkpoint callback had saved: ``ModelCheckpoint``'s guards, kept in our entry and given back on resume.

``callbacks/model_checkpoint.py`` keeps its save guard (``_last_global_step_saved``), its last file and a save it
deferred to the next validation's end out of its ``state_dict()`` (checked against Lightning 2.5.6 and 2.6.6).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer import call

from lightning_repro._lightning.hooks import _call, _wrap

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

__all__ = ["give_back_current_scores", "resave_in_place", "restore_save_guards", "save_guards"]

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
    then = _then_last(writer, frame) if writer is not None else ""
    deferred = _deferred_after(trainer, [callback for _, _, callback in callbacks])
    out = []
    for key, index, callback in callbacks:
        mine = callback is writer
        step = trainer.global_step if mine else getattr(callback, _GUARD)
        file = written if mine else str(getattr(callback, "_last_checkpoint_saved", "") or "")
        relative = _relative(file, getattr(callback, "dirpath", None))
        guard = {"state_key": key, "index": index, "step": int(step), "file": relative}
        if mine and then:
            guard["then_last"] = then  # the `last` file it saves next in this hook (`_last_saved_after_the_writer`)
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


def give_back_current_scores(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> list[str]:
    """Give each checkpoint callback back the ``current_score`` its state in ``checkpoint`` holds; what it lost.

    ``ModelCheckpoint.state_dict()`` holds ``current_score`` (the monitored value of its last save) and
    ``load_state_dict`` gives back every field but that one (``callbacks/model_checkpoint.py``, 2.5 and 2.6): every
    file a resumed run writes before that callback saves again held ``current_score=None`` where the uninterrupted
    run's holds the value. Only where Lightning gives back the rest (the same ``dirpath``); for each callback resumed
    in another ``dirpath`` (a run folder moved, a new one given), a fact for the resume line: its kept files, best
    scores and ``last`` start afresh there (Lightning's own warning says so too). The training is not changed by it.
    """
    states, afresh = checkpoint.get("callbacks"), list[str]()
    if not isinstance(states, dict):
        return afresh
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        state = states.get(getattr(callback, "state_key", None)) if hasattr(callback, "current_score") else None
        if not isinstance(state, dict) or "current_score" not in state:
            continue
        saved, dirpath = state.get("dirpath", getattr(callback, "dirpath", None)), getattr(callback, "dirpath", None)
        if saved != dirpath:
            afresh.append(
                f"{type(callback).__name__} in {dirpath} starts afresh: its files kept and best scores are not given"
                f" back outside the checkpoint's dirpath {saved}"
            )
            continue
        score = state["current_score"]
        callback.current_score = score.to(trainer.strategy.root_device) if hasattr(score, "to") else score
    return afresh


SavedAfter = Callable[[str, str, tuple[str, int], int], bool | None]
"""``(path, its name in the callback's dirpath, (state key, index) of the callback, step)``: the interrupted run's
save, or ``None``: a weights-only file written since, at that step (:func:`~.checkpoint.reading.saved_after`)."""


def restore_save_guards(
    trainer: pl.Trainer,
    guards: list[dict[str, Any]] | None,
    ours: Callback,
    saved_after: Callable[[Any], SavedAfter | None],
    same: Callable[[str, str], bool] | None = None,
) -> list[Callable[[], None]]:
    """On resume, before the first batch: tell each checkpoint callback what it had saved (:func:`save_guards`).

    A callback the checkpoint does not name keeps its values. The file is given back only where the callback's
    restored state knows it in its current ``dirpath`` (``last_model_path``, ``best_model_path``, ``best_k_models``):
    ``ModelCheckpoint.load_state_dict`` restores its paths only when the directory did not change. Then what the
    interrupted run saved after the checkpoint, at its step, is written again in place (:func:`resave_in_place`;
    ``saved_after(trainer.ckpt_path)`` says what it saved; ``same(path, other)``, whether a save of a later step
    holds what the interrupted run's file of that step holds): returns the undo of that.
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
            _linked_last(callback, getattr(trainer, "ckpt_path", None), file)
    _last_saved_after_the_writer(trainer, guards or [], callbacks)
    return resave_in_place(trainer, ours, saved_after(getattr(trainer, "ckpt_path", None)), same)


def _last_saved_after_the_writer(
    trainer: pl.Trainer, guards: list[dict[str, Any]], callbacks: dict[tuple[str, int], Callback]
) -> None:
    """Resumed from a callback's top-k file: it saved its ``last`` file next, in the same hook, as the run went on.

    ``ModelCheckpoint`` saves its top-k file (``_save_topk_checkpoint``), then its ``last`` file
    (``_save_last_checkpoint``: ``last_model_path`` set to it, ``_last_checkpoint_saved`` too unless linked). A
    resume from the top-k file loads the state before the second save: every later file of the resumed run named
    the top-k file as the callback's last save (our guard) and, after the callback's first save, no
    ``last_model_path``, where the uninterrupted run's name the ``last`` file. The writer's guard holds that file's
    name (``then_last``, :func:`_then_last`): the callback is given the state the save left. The file on disk is the
    interrupted run's (a later step's, when it went on), as it is after a resume from ``last.ckpt``.
    """
    resumed = getattr(trainer, "ckpt_path", None)
    for guard in guards:
        callback = callbacks.get((guard["state_key"], int(guard["index"])))
        then = guard.get("then_last")
        if callback is None or not isinstance(then, str) or not then or int(guard["step"]) != trainer.global_step:
            continue
        dirpath = getattr(callback, "dirpath", None)
        if not resumed or guard["file"] != _relative(str(resumed), dirpath):
            continue  # resumed from another file (the `last` file itself: its state is after the save already)
        path = os.path.join(str(dirpath), then)
        callback.last_model_path = path  # type: ignore[attr-defined]
        if getattr(callback, "save_last", None) != "link":
            setattr(callback, "_last_checkpoint_saved", path)  # noqa: B010


def _then_last(callback: Callback, frame: FrameType | None) -> str:
    """The ``last`` file ``callback`` saves right after the top-k file being written, relative to its ``dirpath``.

    ``""`` unless the file is written by its ``_save_topk_checkpoint`` (found on the call stack from ``frame``, with
    its ``monitor_candidates``) and it has ``save_last``. Named as ``_save_last_checkpoint`` names it: the template,
    versioned while a file of that name exists that is not its ``last_model_path`` (checked here on this rank's
    disk; Lightning broadcasts global rank 0's answer, and rank 0's entry is the one resumed from).
    """
    if not getattr(callback, "save_last", None):
        return ""
    while frame is not None and not (
        frame.f_code.co_name == "_save_topk_checkpoint" and frame.f_locals.get("self") is callback
    ):
        frame = frame.f_back
    if frame is None or not isinstance(frame.f_locals.get("monitor_candidates"), dict):
        return ""
    candidates = frame.f_locals["monitor_candidates"]
    name = callback.CHECKPOINT_NAME_LAST  # type: ignore[attr-defined]
    path = callback.format_checkpoint_name(candidates, name)  # type: ignore[attr-defined]
    if getattr(callback, "_enable_version_counter", True):
        version = callback.STARTING_VERSION  # type: ignore[attr-defined]
        while os.path.exists(path) and path != getattr(callback, "last_model_path", None):
            path = callback.format_checkpoint_name(candidates, name, ver=version)  # type: ignore[attr-defined]
            version += 1
    return _relative(str(path), getattr(callback, "dirpath", None))


def _linked_last(callback: Callback, resumed: Any, file: str) -> None:
    """Resumed from ``save_last="link"``'s ``last.ckpt`` (a link to ``file``): ``last_model_path`` is the link.

    ``file`` is what ``callback`` saved at the checkpoint's step; the uninterrupted run's ``last_model_path`` was the
    link once it linked it (``_save_last_checkpoint`` links after the top-k save, whose state may predate the link:
    ``""`` at the first one). Without it the resumed run found ``last.ckpt`` there, not its own, and linked
    ``last-v1.ckpt``: every later file named it.
    """
    dirpath = str(getattr(callback, "dirpath", ""))
    if getattr(callback, "save_last", None) != "link" or not resumed or not os.path.islink(str(resumed)):
        return
    link = os.path.join(dirpath, os.path.basename(str(resumed)))
    if os.path.realpath(str(resumed)) == os.path.realpath(file) and os.path.realpath(link) == os.path.realpath(file):
        setattr(callback, "last_model_path", link)  # noqa: B010


def resave_in_place(
    trainer: pl.Trainer,
    ours: Callback,
    saved_after: SavedAfter | None,
    same: Callable[[str, str], bool] | None = None,
) -> list[Callable[[], None]]:
    """On resume: each checkpoint callback writes again in place what the interrupted run saved at the checkpoint.

    The interrupted run went on past the checkpoint being resumed, at its step: an epoch-end save after a
    ``last.ckpt`` written on that epoch's last batch, the rest of the hook the checkpoint was written in. The resumed
    run saves them again, before it trains, and ``ModelCheckpoint._get_metric_interpolated_filepath_name`` finds each
    one (``file_exists``) and names the save ``NAME-v1.ckpt`` (``-v2`` if that exists): the folder would hold one
    file more than the uninterrupted run's, and ``best_model_path`` and later files would name it. A file
    ``saved_after`` says this very callback wrote at this step after the checkpoint is written again in place.
    Anything else (a file of another callback, of an earlier run, without our entry, of a later step: trained
    since, the resumed run's may differ) keeps Lightning's versioned name. Decided on global rank 0 and reduced, as
    ``file_exists`` is (``callbacks/model_checkpoint.py``, 2.5 and 2.6); ``saved_after`` is read on rank 0 only
    (``None``: the checkpoint is not on this rank's disk). Returns the undo of the wrappers.
    """
    saved: SavedAfter = saved_after or (lambda *_: False)  # every rank wraps: the decision is a collective
    first = trainer.global_step
    undo = []
    for key, index, callback in _guarded(trainer, ours):
        original = getattr(callback, "file_exists", None)
        if original is None:
            continue
        later: dict[str, str] = {}  # a later step's file of the interrupted run, while its save is being named
        undo.append(_wrap(callback, "file_exists", _in_place(original, (key, index), callback, first, saved, later)))
        save = getattr(callback, "_save_checkpoint", None)
        if save is not None and same is not None:
            undo.append(_wrap(callback, "_save_checkpoint", _kept_if_same(save, callback, later, same)))
    return undo


def _in_place(
    original: Callable[[Any, pl.Trainer], bool],
    key: tuple[str, int],
    callback: Callback,
    first: int,
    saved: SavedAfter,
    later: dict[str, str],
) -> Callable[[Any, pl.Trainer], bool]:
    """``callback``'s ``file_exists``: a file it saved in the interrupted run at step ``first`` does not count.

    A file it saved at a later step does, and is noted in ``later`` (:func:`_kept_if_same` decides after the save), as
    is a weights-only file written since at this step, whoever wrote it (the save is kept if it holds the same).
    """

    def file_exists(filepath: Any, trainer: pl.Trainer) -> bool:
        if not original(filepath, trainer):
            return False
        step = trainer.global_step
        if step != first and str(filepath) == getattr(callback, "last_model_path", None):
            return True  # its own `last.ckpt`, written again at every save: Lightning does not version it
        name = _relative(str(filepath), getattr(callback, "dirpath", None))
        said = saved(str(filepath), name, key, step) if trainer.is_global_zero and name else False
        mine = trainer.strategy.reduce_boolean_decision(said is True, all=False)
        # a weights-only file written since at this step: no entry names its writer, its contents are compared
        unsure = trainer.strategy.reduce_boolean_decision(said is None, all=False)
        if step == first and mine:
            return False
        if later.get("step") != str(step):  # a note of another step (its save never came: `save_last="link"`)
            later.clear()
        if (mine or unsure) and "file" not in later:  # trained since, or unsure: Lightning's versioned name for now
            later.update(file=str(filepath), step=str(step))
        return True

    return file_exists


def _kept_if_same(
    save: Callable[[pl.Trainer, str], None],
    callback: Callback,
    later: dict[str, str],
    same: Callable[[str, str], bool],
) -> Callable[[pl.Trainer, str], None]:
    """``callback``'s ``_save_checkpoint``: a versioned save that holds what the interrupted run's file holds goes.

    A save versioned past the interrupted run's file of its step is dropped when it holds the same
    (``same``: ``checkpoint/reading.py: same_but_named``), and the callback names that file instead.

    ``ModelCheckpoint._save_checkpoint`` writes the file and notes it (``_last_checkpoint_saved``); the callers set
    ``best_model_path``, ``best_k_models``, ``kth_best_model_path`` or ``last_model_path`` to the versioned name: each
    is given the interrupted run's name (as the uninterrupted run named its file), and the versioned file is removed
    on global rank 0 (rank 0 compares, every rank follows). A save that differs keeps Lightning's versioned name.
    """

    def _save_checkpoint(trainer: pl.Trainer, filepath: str) -> None:
        noted, interrupted = later.pop("step", None), later.pop("file", None)
        if noted != str(trainer.global_step):
            interrupted = None
        save(trainer, filepath)
        if interrupted is None or interrupted == filepath:
            return
        alike = trainer.is_global_zero and same(filepath, interrupted)
        if not trainer.strategy.broadcast(alike):
            return
        if trainer.is_global_zero and os.path.isdir(filepath):  # a distributed checkpoint's directory
            shutil.rmtree(filepath)
        elif trainer.is_global_zero:
            os.remove(filepath)
        for name in ("best_model_path", "kth_best_model_path", "last_model_path", "_last_checkpoint_saved"):
            if getattr(callback, name, None) == filepath:
                setattr(callback, name, interrupted)
        best = getattr(callback, "best_k_models", None)
        if isinstance(best, dict) and filepath in best:
            callback.best_k_models = {(interrupted if k == filepath else k): v for k, v in best.items()}  # type: ignore[attr-defined]

    return _save_checkpoint
