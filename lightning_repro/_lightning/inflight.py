"""Lightning's view of the training batch in flight: its counters, its fetch, the hook a checkpoint is written in.

For a checkpoint written inside a training batch (``data/batchstart.py``): where the batch stands in the loop's
progress, a call at each fetch of the train loop (the batch's start), the hook running (or that raised), whether a
train loader keeps its own position, and the fit's totals counted back on resume. Checked against Lightning 2.5.6
and 2.6.6 (``loops/training_epoch_loop.py``, ``loops/fetchers.py``, ``loops/progress.py``, ``trainer/call.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer import call

from lightning_repro._lightning.loops import train_loaders

__all__ = [
    "batch_in_progress",
    "count_batch_unread",
    "fetch_marker",
    "hook_in_progress",
    "on_instance",
    "stateful_train_loaders",
    "watch_epoch_setup",
    "watch_train_fetches",
]


def batch_in_progress(trainer: pl.Trainer) -> int | None:
    """The index in its epoch of the training batch counted read and not yet processed (``loops.batch_in_flight``)."""
    current: Any = trainer.fit_loop.epoch_loop.batch_progress.current
    return int(current.processed) if current.ready > current.processed else None


def count_batch_unread(trainer: pl.Trainer) -> None:
    """After a resume from a batch in flight, count it (and an optimizer step it began) unread in the fit's totals.

    Lightning's restart does it in the epoch's counters only (``loops/progress.py: reset_on_restart`` of
    ``current``): ``batch_progress.total`` and the optimizer's step total would stay one ahead for the rest of the
    fit (a validation every N batches of the fit, ``check_val_every_n_epoch=None``, at the wrong batch; every later
    checkpoint's loops). Called once the loops' restart stage is decided (``FitLoop.reset``, before
    ``on_train_start``), which reads the totals as the file has them.
    """
    epoch_loop: Any = trainer.fit_loop.epoch_loop
    total = epoch_loop.batch_progress.total
    total.ready = total.started = total.processed
    step = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    step.ready = step.completed


def fetch_marker(trainer: pl.Trainer) -> tuple[int, int]:
    """``(ready, processed)`` training batches of the whole fit (``batch_progress.total``): where a batch stands.

    Equal to what :func:`watch_train_fetches` passed at a batch's fetch between that fetch and the batch counted read;
    ``ready`` one higher from there until the batch's training step is done.
    """
    total: Any = trainer.fit_loop.epoch_loop.batch_progress.total
    return int(total.ready), int(total.processed)


def watch_train_fetches(trainer: pl.Trainer, take: Callable[[int, int], None]) -> Callable[[], None]:
    """Call ``take(*fetch_marker(trainer))`` right before every fetch of the train loop; returns the undo.

    ``loops/training_epoch_loop.py: on_run_start`` hands the fetcher the epoch loop's ``_on_before_fetch`` as
    ``_start_profiler``, which ``loops/fetchers.py`` calls before each ``next()`` of the train iterator: once in
    every ``advance``, before the batch's transfer hooks and ``on_train_batch_start``, and before the prefetch of a
    new iterator. Set on the instance; read again at each epoch's start (install it before the epoch starts).
    ``take`` gets the counters (:func:`fetch_marker`), not the trainer: a few attribute reads a batch.
    """
    epoch_loop: Any = trainer.fit_loop.epoch_loop
    total: Any = epoch_loop.batch_progress.total  # updated in place (`load_state_dict`, `reset_on_restart`)
    profile = epoch_loop._on_before_fetch

    def on_before_fetch() -> None:
        take(total.ready, total.processed)
        profile()

    return on_instance(epoch_loop, "_on_before_fetch", on_before_fetch)


def watch_epoch_setup(trainer: pl.Trainer, take: Callable[[], None]) -> Callable[[], None]:
    """Call ``take()`` after every ``FitLoop.setup_data`` from now on; returns the undo.

    ``loops/fit_loop.py: on_advance_start`` calls ``setup_data`` first (it reloads the train loader when asked),
    then only the samplers' ``set_epoch`` and the epoch's ``on_train_epoch_start`` hooks, every callback's (in the
    Trainer's order) and the LightningModule's: the last point before any of them at each epoch's start (also when
    a mid-epoch resume skips those hooks). Set on the instance (the fit loop's ``run`` calls it before
    ``on_train_start`` too: install it there, for the epochs).
    """
    fit_loop: Any = trainer.fit_loop
    setup = fit_loop.setup_data

    def setup_data() -> None:
        setup()
        take()

    return on_instance(fit_loop, "setup_data", setup_data)


def on_instance(obj: Any, name: str, value: Callable[..., Any]) -> Callable[[], None]:
    """``obj.name = value`` on the instance; the undo puts back what the instance had (or nothing)."""
    own: dict[str, Any] = obj.__dict__
    had, previous = name in own, own.get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if had:
            setattr(obj, name, previous)
        else:
            own.pop(name, None)

    return undo


def stateful_train_loaders(trainer: pl.Trainer) -> bool:
    """Whether a train loader keeps its own position (``state_dict()``: torchdata's, litdata's loaders).

    Lightning saves it with the loops (``loops/fit_loop.py: on_save_checkpoint``, ``"combined_loader"``) as the
    loader has it: a batch it yielded counts as read there.
    """
    return any(isinstance(loader, _Stateful) for loader in train_loaders(trainer) or [])


_HOOK_CALLS = (
    call._call_lightning_module_hook.__code__,
    call._call_callback_hooks.__code__,
    call._call_strategy_hook.__code__,
)


def hook_in_progress(trainer: pl.Trainer) -> str | None:
    """The Lightning hook the run is in while a checkpoint is written; in ``on_exception``, the one that raised.

    ``trainer/call.py`` names the running hook in the module's ``_current_fx_name`` (nested calls put the outer
    name back when they return). ``OnExceptionCheckpoint`` writes from ``on_exception``, which Lightning calls
    while it handles the exception (``trainer/call.py: _call_and_handle_interrupt``): the hook the exception came
    from is the innermost hook call (``hook_name``) on its traceback. ``None``: in none, or between two hooks.
    """
    name = getattr(trainer.lightning_module, "_current_fx_name", None)
    if name != "on_exception":
        return name if isinstance(name, str) else None
    error = sys.exc_info()[1]
    found: str | None = None
    tb = error.__traceback__ if error is not None else None
    while tb is not None:
        if tb.tb_frame.f_code in _HOOK_CALLS:
            hook = tb.tb_frame.f_locals.get("hook_name")
            found = hook if isinstance(hook, str) else found
        tb = tb.tb_next
    return found
