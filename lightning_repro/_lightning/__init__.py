"""Every access to Lightning's private API, in one place, with the Lightning files and versions it was checked against.

No other module of lightning-repro imports a private Lightning name or reads or writes a private attribute of a
Lightning object (``tests/test_structure.py`` checks that). Each function names the Lightning file it relies on
(paths relative to ``lightning/pytorch/``); all were read in Lightning 2.5.6 and 2.6.6, where they behave alike
unless a docstring says otherwise. Three modules, one concern each:

* :mod:`.hooks`: the installs on a Trainer (``setup_data``, ``process_dataloader``, ``load_checkpoint``, the
  launcher) and their undo, the predict-time index recorder, the warning filter, and the rest of the hook a
  checkpoint was written in;
* :mod:`.loops`: loop progress (reads, writes, the checkpoint-counter corrections), the combined loader, what
  follows a training batch;
* :mod:`.results`: the epoch aggregates of ``self.log``, the trainer's metric dicts, torchmetrics' counters.
"""

from __future__ import annotations

from lightning_repro._lightning.hooks import (
    REPLAYED_HOOKS,
    IndexRecorder,
    hook_remainder,
    install,
    recorded_batch_sampler,
    replay_hook_remainder,
    silence_not_resumable_warning,
    wrap_launch,
)
from lightning_repro._lightning.loops import (
    accumulating,
    allow_plateau_step,
    batches_ready,
    combined_mode,
    epoch_cut_short,
    epoch_processed,
    fix_loop_progress,
    loop_facts,
    loops_restored,
    pending_after_batch,
    recount_train_batches,
    restart_train_iterator,
    run_pending,
    train_loaders,
)
from lightning_repro._lightning.results import (
    REDUCTIONS,
    eval_metric_ids,
    finish_logged_values,
    logged_metric_ids,
    logged_values,
    restore_logged_values,
    restore_trainer_metrics,
    set_metric_update_count,
    trainer_metrics,
)

__all__ = [
    "REDUCTIONS",
    "REPLAYED_HOOKS",
    "IndexRecorder",
    "accumulating",
    "allow_plateau_step",
    "batches_ready",
    "combined_mode",
    "epoch_cut_short",
    "epoch_processed",
    "eval_metric_ids",
    "finish_logged_values",
    "fix_loop_progress",
    "hook_remainder",
    "install",
    "logged_metric_ids",
    "logged_values",
    "loop_facts",
    "loops_restored",
    "pending_after_batch",
    "recorded_batch_sampler",
    "recount_train_batches",
    "replay_hook_remainder",
    "restart_train_iterator",
    "restore_logged_values",
    "restore_trainer_metrics",
    "run_pending",
    "set_metric_update_count",
    "silence_not_resumable_warning",
    "train_loaders",
    "trainer_metrics",
    "wrap_launch",
]
