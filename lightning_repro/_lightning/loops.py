"""Lightning's loop progress and data plumbing: reads, writes and the checkpoint-counter corrections.

Checked against Lightning 2.5.6 and 2.6.6 (``loops/fit_loop.py``, ``loops/training_epoch_loop.py``,
``loops/evaluation_loop.py``, ``trainer/connectors/data_connector.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage

from lightning_repro._lightning import cycled as _cycled
from lightning_repro._lightning.lastbatch import step_of_saved_batch
from lightning_repro._lightning.prepared import unwrap

__all__ = [
    "accumulating",
    "allow_plateau_step",
    "batch_in_flight",
    "batches_ready",
    "combined_mode",
    "epoch_cut_short",
    "epoch_done",
    "epoch_processed",
    "epoch_start_hooks_run",
    "evaluation_progress",
    "fix_loop_progress",
    "loader_states_not_loaded",
    "loop_facts",
    "loops_restored",
    "pending_after_batch",
    "put_back_evaluation_progress",
    "recount_train_batches",
    "resumed_with_batches_left",
    "run_pending",
    "train_loaders",
]


# ---------------------------------------------------------------------------------------- loop progress
def evaluation_progress(trainer: pl.Trainer) -> dict[str, dict[str, Any]]:
    """The fit's validation loop's progress counters (``batch_progress``), as state dicts.

    ``trainer/trainer.py: _run_sanity_check`` zeroes them after the sanity check, which a fit resumed from a
    checkpoint with no validation in progress runs: taken before it, put back with
    :func:`put_back_evaluation_progress`, they are what the interrupted run's (and its next files') hold.
    """
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    return {name: value.state_dict() for name, value in vars(val_loop).items() if isinstance(value, _BaseProgress)}


def put_back_evaluation_progress(trainer: pl.Trainer, saved: dict[str, dict[str, Any]]) -> None:
    """Load what :func:`evaluation_progress` took into the validation loop's counters."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    for name, state in saved.items():
        getattr(val_loop, name).load_state_dict(state)


def epoch_processed(trainer: pl.Trainer) -> int:
    """Epochs whose batches are all processed (``loops/fit_loop.py``: ``epoch_progress.current.processed``).

    Lightning's own epoch counter for samplers (``_set_sampler_epoch`` reads it).
    """
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]


def batches_ready(trainer: pl.Trainer) -> int:
    """Batches fetched in the current epoch (``loops/training_epoch_loop.py``: ``batch_progress.current.ready``)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)


def combined_mode(trainer: pl.Trainer) -> str:
    """The train ``CombinedLoader``'s mode (``utilities/combined_loader.py: _mode``), ``"max_size_cycle"`` if none."""
    return str(getattr(trainer.fit_loop._combined_loader, "_mode", "max_size_cycle"))


def train_loaders(trainer: pl.Trainer) -> list[Any] | None:
    """The train loaders as Lightning iterates them (``loops/fit_loop.py: _combined_loader.flattened``)."""
    combined = trainer.fit_loop._combined_loader
    return None if combined is None else [unwrap(loader) for loader in combined.flattened]


def accumulating(trainer: pl.Trainer) -> bool:
    """The current batch does not step the optimizer (``loops/training_epoch_loop.py: _should_accumulate``)."""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def epoch_cut_short(trainer: pl.Trainer) -> bool:
    """In ``on_train_epoch_end``: the epoch ended before its data did (``max_steps``, a stop request).

    A loader of unknown length (an ``IterableDataset`` without ``__len__``) has ``num_training_batches == inf``: its
    epoch ended normally when the fetcher found the data exhausted (``is_last_batch``), not when a count was reached.
    Versions differ when ``on_train_batch_start`` returns -1 (``loops/training_epoch_loop.py: advance``): 2.6 marks
    that batch the epoch's last (``is_last_batch``: not cut short here), 2.5 only stops (cut short: resumable).
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.current.ready < trainer.num_training_batches and not progress.is_last_batch)


def epoch_start_hooks_run(trainer: pl.Trainer) -> bool:
    """Whether the coming epoch's ``on_train_epoch_start`` hooks run (``loops/fit_loop.py: on_advance_start``).

    Lightning skips them when it restarts in the middle of an epoch or on an epoch's end (an iteration-based run's
    restart); read after ``FitLoop.reset`` (from ``on_train_start`` on).
    """
    loop = trainer.fit_loop  # the restart stages of PR #20379 (Lightning 2.5.0)
    return not (getattr(loop, "restarted_mid_epoch", False) or getattr(loop, "restarted_on_epoch_end", False))


def resumed_with_batches_left(trainer: pl.Trainer) -> bool:
    """Whether a resume restarted in the middle of an epoch that still has training batches to run.

    Read from ``on_train_start`` on: ``batch_progress.current.ready`` counts the epoch's batches already consumed (a
    checkpoint at an epoch's last batch resumes "on the last batch": none left; see :func:`fix_loop_progress`).
    """
    if not getattr(trainer.fit_loop, "restarted_mid_epoch", False):
        return False
    progress = trainer.fit_loop.epoch_loop.batch_progress
    total = trainer.num_training_batches
    if total == float("inf"):
        return not progress.is_last_batch
    return progress.current.ready < total


def loader_states_not_loaded(trainer: pl.Trainer) -> list[tuple[Any, Any]]:
    """The train loaders' own states in the checkpoint that Lightning did not load, each with its loader.

    ``loops/fit_loop.py: _load_combined_loader_states`` loads them (``CombinedLoader._load_state_dicts``, in the
    order of the stateful loaders of ``flattened``) only when the loop is ``restarting``, which it is not after a
    checkpoint written at an epoch's end: they stay in ``_combined_loader_states_to_load``.
    """
    loop = trainer.fit_loop
    states = loop._combined_loader_states_to_load
    combined = loop._combined_loader
    if loop.restarting or not states or combined is None:
        return []
    stateful = [loader for loader in combined.flattened if isinstance(loader, _Stateful)]
    return list(zip(stateful, states, strict=True)) if len(stateful) == len(states) else []


def epoch_done(trainer: pl.Trainer) -> bool:
    """Whether the current epoch's batches are all processed.

    ``loops/fit_loop.py: on_advance_end`` counts the epoch processed before ``on_train_epoch_end``; a checkpoint on
    its last batch, in ``on_train_batch_end``, comes before that.
    """
    current = trainer.fit_loop.epoch_progress.current
    return bool(current.processed >= current.ready)  # type: ignore[attr-defined]


def loops_restored(trainer: pl.Trainer) -> bool:
    """Whether Lightning has put the loops' counters back from the checkpoint.

    ``loops/loop.py: restarting`` says so mid-epoch; after a checkpoint written once an epoch's batches were all
    processed (an epoch-end checkpoint, ``trainer.save_checkpoint`` after ``fit``) ``FitLoop.restarting`` stays
    False (``loops/fit_loop.py``: "if the last epoch completely finished, we are not actually restarting"), but the
    epoch counters are back: a fresh run's are all zero until its first epoch starts.
    """
    fit_loop = trainer.fit_loop
    return bool(fit_loop.restarting) or fit_loop.epoch_progress.current.ready > 0


def allow_plateau_step(trainer: pl.Trainer) -> None:
    """Let Lightning step ``ReduceLROnPlateau`` (epoch interval) at the end of the epoch a run resumed in.

    ``loops/fit_loop.py: FitLoop.on_advance_end`` passes ``update_plateau_schedulers=not self.restarting``, and the
    loop is "restarting" until the end of the first epoch after a resume: the uninterrupted run stepped them there.
    Called from ``on_train_epoch_end`` (callbacks run before that check); the epoch's restart handling is over.
    """
    trainer.fit_loop._restarting = False


def recount_train_batches(trainer: pl.Trainer) -> None:
    """Count batches per epoch as the train loaders say (after an epoch re-dealt to another world size).

    As ``loops/fit_loop.py: FitLoop.setup_data`` does with ``trainer/connectors/data_connector.py:
    _parse_num_batches``: the next epoch's iterator takes the combined loader's new ``limits`` and the loop's own
    ``max_batches`` must agree with it.
    """
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return
    limits = [
        _parse_num_batches(RunningStage.TRAINING, len(loader), trainer.limit_train_batches)
        for loader in combined.flattened
    ]
    combined.limits = limits
    per_loader = [min(len(loader), limit) for loader, limit in zip(combined.flattened, limits, strict=True)]
    trainer.fit_loop.max_batches = min(per_loader) if combined._mode == "min_size" else max(per_loader)


def loop_facts(trainer: pl.Trainer) -> dict[str, int]:
    """What :func:`fix_loop_progress` needs to know about the run that writes a checkpoint (kept in our entry)."""
    total, ran_out = trainer.num_training_batches, _cycled.ran_out(trainer)  # ran out: the cycled ones, if any
    return {
        "num_training_batches": -1 if total == float("inf") else int(total),
        "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
        **({"ran_out": ran_out} if ran_out else {}),
        # the run was ending here: stopped (EarlyStopping, a Timer, the module), min_epochs and min_steps met
        **({"stopping": 1} if trainer.should_stop and trainer.fit_loop._can_stop_early else {}),
    }



def batch_in_flight(checkpoint: dict[str, Any]) -> int | None:
    """The index (in its epoch) of the training batch a checkpoint was written in the middle of, or None.

    Lightning counts a batch ``ready`` when it is fetched and ``processed`` when its training step (the optimizer
    step included) is done; a checkpoint between the two (written from ``on_train_batch_start``, ``training_step``,
    a backward or optimizer hook, or by ``OnExceptionCheckpoint`` after an exception there) counts the batch as
    read. Lightning's restart counts it unread again (``loops/progress.py: reset_on_restart``: ``ready`` back to
    ``completed``) and runs it, with the batch index it had.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop") if isinstance(checkpoint.get("loops"), dict) else None
    current = fit.get("epoch_loop.batch_progress", {}).get("current", {}) if isinstance(fit, dict) else {}
    ready, processed = int(current.get("ready", 0)), int(current.get("processed", 0))
    return processed if ready > processed else None


def fix_loop_progress(checkpoint: dict[str, Any], entry: dict[str, Any] | None) -> None:
    """Correct Lightning's loop progress in a checkpoint being *loaded*, in memory, before Lightning restores it.

    Reads and writes ``checkpoint["loops"]["fit_loop"]`` as ``loops/fit_loop.py`` and
    ``loops/training_epoch_loop.py`` write it (``epoch_progress``, ``epoch_loop.batch_progress``,
    ``epoch_loop.state_dict._batches_that_stepped``): the same layout in 2.5 and 2.6. Lightning 2.4 restores these
    counters differently (it re-runs the checkpoint's batch), which is why lightning-repro needs 2.5 or newer.
    The file keeps the counters as Lightning wrote them (a plain Lightning script resumes it as Lightning would);
    what we change, only when our entry is there to say so (its ``loops`` facts, from :func:`loop_facts`):

    * an epoch cut short (``max_steps``, a stop request) is marked finished by Lightning, and a resume would start
      the next epoch, silently dropping the rest of this one: we make it resume as if saved at the end of the last
      batch, in the middle of the epoch, and our entry skips the consumed batches;
    * a checkpoint written at the end of an epoch's last batch would close the epoch on resume without running its
      epoch-end hooks (metric resets, ``on_train_epoch_end``): we make it resume "on the last batch", which runs them.
      A loader of unknown length (``num_training_batches`` -1 in the facts) has its last batch marked by the
      fetcher, which looks one batch ahead (``is_last_batch``);
    * a checkpoint written in the middle of a batch that our entry rewound to the batch's start (its ``in_flight``
      record says ``exact``): Lightning runs that batch again (:func:`batch_in_flight`) but counts a step for the
      logger on restart (``loops/training_epoch_loop.py: reset``, ``_batches_that_stepped += 1`` when the batch
      counted read steps), which the file already holds: we take it back (and :func:`count_batch_unread` the rest).
    """
    fit = checkpoint.get("loops", {}).get("fit_loop")
    facts = entry.get("loops") if entry else None
    if not fit or not isinstance(facts, dict) or entry is None:
        return  # no entry, or one from a version that corrected the file itself
    total = facts.get("num_training_batches", -1)
    accumulate = max(1, int(facts.get("accumulate_grad_batches", 1)))
    batch_progress = fit["epoch_loop.batch_progress"]
    current = batch_progress["current"]
    rewound = entry.get("in_flight")
    if isinstance(rewound, dict) and rewound.get("exact") and batch_in_flight(checkpoint) is not None:
        final = current["ready"] == total or bool(batch_progress.get("is_last_batch"))
        if current["ready"] % accumulate == 0 or final:  # `not _should_accumulate()` as Lightning's reset reads it
            fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
        return
    if (
        not entry.get("truncated")
        and (current["ready"] == total or (total == -1 and bool(batch_progress.get("is_last_batch"))))
        and current["completed"] == current["ready"] - 1
        and fit["epoch_progress"]["current"]["processed"] == fit["epoch_progress"]["current"]["started"] - 1
    ):
        for part in ("total", "current"):
            batch_progress[part]["completed"] = batch_progress[part]["processed"]
        # The file was written before the batch's `on_advance_end` counted its step (an epoch's last batch always
        # steps). Resumed "on the last batch", Lightning counts it only where it goes through `on_advance_end` again,
        # which it does when the epoch-end validation is due (the restart path in `advance` returns early); else
        # the logger's step (and the epoch row) would stay one lower than in the uninterrupted run.
        pending = entry.get("pending")
        if not (isinstance(pending, dict) and pending.get("validate")):
            fit["epoch_loop.state_dict"]["_batches_that_stepped"] += 1
        return
    if not entry.get("truncated"):
        return
    for part in ("total", "current"):
        epoch = fit["epoch_progress"][part]
        if epoch["processed"] == epoch["started"]:
            epoch["processed"] = epoch["started"] - 1
            epoch["completed"] = epoch["processed"]
        batch = fit["epoch_loop.batch_progress"][part]
        if batch["completed"] == batch["processed"]:
            batch["completed"] = batch["processed"] - 1
    checkpoint["epoch"] = fit["epoch_progress"]["current"]["completed"]  # the epoch the run is in
    fit["epoch_loop.batch_progress"]["is_last_batch"] = False
    ready = fit["epoch_loop.batch_progress"]["current"]["ready"]
    if ready % accumulate == 0:
        # Lightning counts the last batch's step again when it resumes after a batch
        fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1


# ---------------------------------------------------------------------------------------- what follows a batch
def in_train_batch_end(trainer: pl.Trainer) -> bool:
    """A training batch has run and its ``on_train_batch_end`` is running (``batch_progress``: processed, not done)."""
    if not trainer.training or trainer.sanity_checking:
        return False
    current: Any = trainer.fit_loop.epoch_loop.batch_progress.current
    return bool(current.ready >= 1 and current.processed == current.ready and current.completed == current.ready - 1)


def pending_after_batch(trainer: pl.Trainer) -> dict[str, Any] | None:
    """What Lightning still does for the current batch when a checkpoint is written in ``on_train_batch_end``.

    After that hook the uninterrupted run logs the batch's step values and runs a validation that is due at this
    batch (``loops/training_epoch_loop.py: _TrainingEpochLoop.advance`` and ``on_advance_end``); a resumed run
    starts with the next batch and would do neither (Lightning skips the due validation on purpose). Returns
    ``None`` when the checkpoint is not written at the end of a training batch.
    """
    if not in_train_batch_end(trainer):
        return None
    epoch_loop = trainer.fit_loop.epoch_loop
    connector = trainer._logger_connector
    log: dict[str, torch.Tensor] | None = None
    accumulate = trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization
    fast_dev_run = bool(getattr(trainer, "fast_dev_run", False))
    if trainer.loggers and not accumulate and (connector.should_update_logs or fast_dev_run):
        log = {
            key: (value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(value))
            for key, value in connector.metrics["log"].items()
        }
    fetcher = trainer.fit_loop._data_fetcher
    validate = fetcher is not None and not epoch_loop._skip_next_val and epoch_loop._should_check_val_fx(fetcher)
    return {"log": log, "validate": bool(validate)}


def run_pending(trainer: pl.Trainer, pending: dict[str, Any] | None) -> list[Callable[[], None]]:
    """Do, before the first resumed batch, what :func:`pending_after_batch` found the interrupted run had left.

    As ``trainer/connectors/logger_connector/logger_connector.py: update_train_step_metrics`` (the log row) and
    ``loops/training_epoch_loop.py: _TrainingEpochLoop.on_advance_end`` (the validation) do it. Returns what to
    undo once the first resumed batch starts (see :func:`_count_validation_once`).
    """
    if not pending:
        return []
    connector = trainer._logger_connector
    if pending.get("log"):
        # the step and the epoch are the loop's, restored as they were saved
        with step_of_saved_batch(trainer, pending):
            connector.log_metrics(dict(pending["log"]))
    if pending.get("validate"):
        epoch_loop = trainer.fit_loop.epoch_loop
        val_loop = epoch_loop.val_loop
        val_loop.restarting = False  # a whole new validation
        first_loop_iter = connector._first_loop_iter
        trainer.validating = True
        if not epoch_loop._should_accumulate():
            call._call_lightning_module_hook(trainer, "on_validation_model_zero_grad")
        # the uninterrupted run validates after `batch_progress.increment_completed()`; the resumed epoch loop counts
        # the batch completed in its `reset` (restarted on train batch end), after this: a checkpoint written in this
        # validation holds the counts the uninterrupted run's does
        progress = epoch_loop.batch_progress
        # (a checkpoint on an epoch's last batch has it counted on load already: `fix_loop_progress`)
        uncounted = progress.current.completed < progress.current.processed  # type: ignore[attr-defined]
        if uncounted:
            progress.increment_completed()
        try:
            val_loop.run()
        finally:
            if uncounted:
                progress.current.completed -= 1
                progress.total.completed -= 1
        trainer.training = True
        connector._first_loop_iter = first_loop_iter
        # The epoch loop reads `_has_run` while restarting as "the interrupted validation has finished": left True
        # it would end the resumed epoch before its restart handling ran once (and then skip the next epoch).
        val_loop._has_run = False
        return [_count_validation_once(val_loop)]
    return []


def _count_validation_once(val_loop: Any) -> Callable[[], None]:
    """Keep Lightning from counting the validation :func:`run_pending` ran a second time.

    On resume ``loops/training_epoch_loop.py: _TrainingEpochLoop.advance`` fast-forwards the validation's progress
    counters over a validation due at the checkpoint's batch, which it does not run
    (``loops/evaluation_loop.py: increment_progress_to_evaluation_end``); this one ran and counted its batches, so
    that fast-forward is skipped, once (``batch_progress`` totals as in the uninterrupted run). Returns the function
    that removes the skip if Lightning did not reach it (called at the first resumed batch).
    """

    def skip() -> None:
        vars(val_loop).pop("increment_progress_to_evaluation_end", None)

    val_loop.increment_progress_to_evaluation_end = skip  # on the instance: the class's method is untouched
    return skip
