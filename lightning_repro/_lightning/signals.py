"""Signals a job gets from its scheduler, handled at a training batch's end: SIGTERM under DDP, and SLURM's requeue.

SIGTERM under DDP: every rank stops after the same training batch, and no collective runs in a signal handler.
Lightning's SIGTERM handler (``trainer/connectors/signal_connector.py: _SignalConnector._sigterm_notifier_fn``,
registered in ``Trainer._run`` after ``strategy.setup``) sets ``received_sigterm`` and, since Lightning 2.5.2
(PR #20825), runs ``torch.distributed.broadcast`` from inside the handler; the training epoch loop broadcasts rank
0's flag at each batch's start (``loops/training_epoch_loop.py: _broadcast_sigterm_tensor``), and each rank raises
``SIGTERMException`` by itself where it reads its own flag (``on_advance_end``, after each evaluation batch in
``loops/evaluation_loop.py``, at an epoch's end in ``loops/fit_loop.py``). When a scheduler signals every rank, the
handler's broadcast runs wherever each rank happens to be (twice on a rank that rank 0's launcher signals again),
the ranks' collectives no longer pair up, and they raise at different batches: the job hangs, in the collective
that gathers every rank's state into the checkpoint or in the barrier after the file is written.

SLURM's requeue signal (``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 by default): Lightning's handler
(``_slurm_sigusr_handler_fn``) writes ``hpc_ckpt_<N>.ckpt`` and runs ``scontrol requeue`` inside the signal handler,
wherever the process is: in the middle of a step (after its backward the file holds a state no batch boundary had,
and the restart trains that batch again on top of it), under DDP on each rank at another point (the save's
collectives do not pair up), and in every dataloader worker forked from the training process, which inherits the
handler and gets the signal too (SLURM signals every process of the job step): each worker writes the file from its
copy of the trainer, taken when the workers started (the epoch's start), and requeues the job again; the last file
written wins, and the restarted job resumes from a worker's stale state (Lightning issue #21406).

:func:`handle_at_batch_end` replaces both handlers by ones that only note the signal (nothing in a process forked
from the training process). A noted requeue runs Lightning's own handler (the file, then the requeue) from
DeterminismCallback's ``on_train_batch_end`` (:func:`requeue_if_due`), where ``ModelCheckpoint(every_n_train_steps)``
writes: a file the resume knows, exact (the rest of that hook, the batch's row, a validation due there are run again
before the first resumed batch). With one rank at the batch the signal came in (or the next, when it came after
that hook); with several, the ranks agree at every training batch's end (``_save_loggers_on_train_batch_end``, once
the batch's validation is over, just before the epoch loop reads the SIGTERM flag), in one all-reduce, on SIGTERM
(``received_sigterm`` set on every rank, so every rank raises ``SIGTERMException`` at that batch) and on a requeue,
which every rank then runs at the next batch's ``on_train_batch_end``. A requeue noted after the fit's last batch
runs when the fit loop ends; one noted outside a fit's loop (``validate``, ``test``, ``predict``, the sanity check)
runs at once, as in Lightning. Lightning's broadcast of rank 0's SIGTERM flag at each batch's start is left out
where the ranks agree (still one collective per batch).
Read in Lightning 2.6.6 (not run on 2.5.x here); ``_broadcast_sigterm_tensor`` is left out only where it exists.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from lightning_utilities.core.rank_zero import rank_prefixed_message  # what Lightning's rank_zero re-exports

from lightning_repro._lightning.hooks import _wrap

__all__ = ["handle_at_batch_end", "ignored_in_workers", "requeue_if_due", "requeue_signal"]

# the notes go where Lightning logs its own (its console handler on "lightning.pytorch" shows INFO): the SIGTERM
# line a user of plain Lightning sees stays, and the requeue's is seen beside it
log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")

# the requeue signals deferred by an installed handler: a dataloader worker started meanwhile ignores them
_DEFERRED: list[int] = []


def ignored_in_workers() -> tuple[int, ...]:
    """The signals a dataloader worker started now should ignore: a requeue signal the training process handles.

    A worker forked from the training process would run Lightning's handler on its stale copy of the trainer; one
    started by a fork server or spawned would die of the signal (SIGUSR1's default action), and the training
    process with it (``DataLoader worker ... is killed by signal``).
    """
    return tuple(sorted(set(_DEFERRED)))


def _any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag: whether it is true on any rank (a collective: every rank calls it at the same point)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return flags
    tensor = torch.tensor([1 if flag else 0 for flag in flags], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def requeue_signal(trainer: pl.Trainer) -> int | None:
    """The signal Lightning requeues a SLURM job on, when it does (``SLURMEnvironment(auto_requeue=True)``)."""
    environment = trainer._accelerator_connector.cluster_environment  # trainer/connectors/accelerator_connector.py
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
        return int(environment.requeue_signal)
    return None


class _AtBatchEnd:
    """What :func:`handle_at_batch_end` installs on a trainer (one per trainer: the callback's and a strategy's)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.connector: Any = trainer._signal_connector  # trainer/trainer.py: Trainer.__init__
        self.owner = os.getpid()
        self.agree = False  # the ranks agree at each batch's end (a strategy of ours, several ranks)
        self.sigterm = False  # SIGTERM is noted and agreed too
        self.noted_sigterm = False
        self.noted_requeue: int | None = None
        self.due = False  # the requeue runs at the next end of a training batch (DeterminismCallback's hook)
        self.in_fit_loop = False
        self.requeue: Any = self.connector._slurm_sigusr_handler_fn  # Lightning's: the file, then `scontrol requeue`
        self.requeue_signal = requeue_signal(trainer)
        epoch_loop: Any = trainer.fit_loop.epoch_loop
        self.save_loggers = epoch_loop._save_loggers_on_train_batch_end
        self.sigterm_notifier: Any = self.connector._sigterm_notifier_fn
        self.fit_run_start, self.fit_run_end = trainer.fit_loop.on_run_start, trainer.fit_loop.on_run_end
        self.undo = [
            _wrap(self.connector, "_slurm_sigusr_handler_fn", self.note_requeue),
            _wrap(self.connector, "_sigterm_notifier_fn", self.note_sigterm),
            _wrap(epoch_loop, "_save_loggers_on_train_batch_end", self.at_batch_end),
            _wrap(trainer.fit_loop, "on_run_start", self.on_fit_run_start),
            _wrap(trainer.fit_loop, "on_run_end", self.on_fit_run_end),
        ]
        if self.requeue_signal is not None:
            _DEFERRED.append(self.requeue_signal)

    def uninstall(self) -> None:
        while self.undo:
            self.undo.pop()()
        if self.requeue_signal is not None and self.requeue_signal in _DEFERRED:
            _DEFERRED.remove(self.requeue_signal)

    def agree_across_ranks(self) -> Callable[[], None]:
        """From now on the ranks agree at each batch's end, on SIGTERM too; returns the undo of that."""
        self.agree = self.sigterm = True
        epoch_loop: Any = self.trainer.fit_loop.epoch_loop
        undo = []
        if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # Lightning >= 2.5.2
            undo.append(_wrap(epoch_loop, "_broadcast_sigterm_tensor", lambda: None))

        def stop_agreeing() -> None:
            self.agree = self.sigterm = False
            while undo:
                undo.pop()()

        return stop_agreeing

    # ---------------------------------------------------------------- in the signal handler: note only
    def note_requeue(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.owner:
            return  # a process forked from the training process (a dataloader worker): that process writes the file
        if not self.in_fit_loop:
            self.requeue(signum, frame)  # outside a fit's loop: Lightning's handler, at once, as in Lightning
            return
        if self.noted_requeue is None:
            log.info(
                rank_prefixed_message(
                    f"Received the requeue signal {signum}: the checkpoint is written and the job requeued at the end"
                    " of a training batch",
                    self.trainer.local_rank,
                )
            )
        self.noted_requeue = signum
        if not self.agree:
            self.due = True  # one rank: at this batch's end if it is still to come, else the next one's

    def note_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if not self.sigterm:
            self.sigterm_notifier(signum, frame)
            return
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        self.noted_sigterm = True

    # ---------------------------------------------------------------- at a batch's end, on every rank
    def _agreed(self, flags: list[bool]) -> list[bool]:
        return _any_rank(flags, self.trainer.strategy.root_device) if self.agree else flags

    def _run_requeue(self) -> None:
        signum = self.noted_requeue or self.requeue_signal or 0  # a rank that did not get it runs it too
        self.noted_requeue, self.due = None, False
        self.requeue(signum, None)

    def at_batch_end(self) -> None:
        self.save_loggers()
        # every rank, every batch (never skipped on one rank only): the ranks' collectives stay paired
        stop = self.sigterm and (self.noted_sigterm or self.connector.received_sigterm)
        stop, requeue = self._agreed([stop, self.noted_requeue is not None])
        if requeue:
            self.due = True  # on every rank: the file at the next batch's on_train_batch_end
        if stop:
            self.connector.received_sigterm = True  # on every rank at this batch: on_advance_end raises

    def run_if_due(self) -> None:
        if self.due:
            self._run_requeue()

    def on_fit_run_start(self) -> None:
        self.fit_run_start()
        self.in_fit_loop = True

    def on_fit_run_end(self) -> Any:
        result = self.fit_run_end()
        self.in_fit_loop = False
        if self._agreed([self.due or self.noted_requeue is not None])[0]:  # noted after the last batch's end
            self._run_requeue()
        return result


def handle_at_batch_end(trainer: pl.Trainer, *, agree_across_ranks: bool) -> Callable[[], None]:
    """Let the scheduler's signals act at the end of a training batch (see the module docstring); returns the undo.

    Call it before Lightning registers its signal handlers (``DeterminismCallback.setup`` with one rank,
    ``strategy.setup`` with several: ``agree_across_ranks``, which adds SIGTERM and one all-reduce per batch).
    A second call on the same trainer (the callback's, then a strategy's) adds to the first.
    """
    installed: _AtBatchEnd | None = getattr(trainer, "_lightning_repro_at_batch_end", None)
    owner = installed is None
    state = _AtBatchEnd(trainer) if installed is None else installed
    if owner:
        trainer._lightning_repro_at_batch_end = state  # type: ignore[attr-defined]
    stop_agreeing = state.agree_across_ranks() if agree_across_ranks else None

    def undo() -> None:
        if stop_agreeing is not None:
            stop_agreeing()
        if owner:
            state.uninstall()
            vars(trainer).pop("_lightning_repro_at_batch_end", None)

    return undo


def requeue_if_due(trainer: pl.Trainer) -> None:
    """In ``on_train_batch_end`` (DeterminismCallback's): write the file and requeue the job, if the signal came.

    A file written there is one the resume knows (as ``ModelCheckpoint(every_n_train_steps=...)``'s): the rest of
    the batch's hooks, its logged row and a validation due at it are run again before the first resumed batch.
    """
    state: _AtBatchEnd | None = getattr(trainer, "_lightning_repro_at_batch_end", None)
    if state is not None:
        state.run_if_due()
