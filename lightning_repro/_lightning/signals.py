"""SIGTERM under DDP: every rank stops after the same training batch, and no collective runs in a signal handler.

Lightning's SIGTERM handler (``trainer/connectors/signal_connector.py: _SignalConnector._sigterm_notifier_fn``,
registered in ``Trainer._run`` after ``strategy.setup``) sets ``received_sigterm`` and, since Lightning 2.5.2
(PR #20825), runs ``torch.distributed.broadcast`` from inside the handler; the training epoch loop broadcasts rank
0's flag at each batch's start (``loops/training_epoch_loop.py: _broadcast_sigterm_tensor``), and each rank raises
``SIGTERMException`` by itself where it reads its own flag (``on_advance_end``, after each evaluation batch in
``loops/evaluation_loop.py``, at an epoch's end in ``loops/fit_loop.py``). When a scheduler signals every rank, the
handler's broadcast runs wherever each rank happens to be (twice on a rank that rank 0's launcher signals again),
the ranks' collectives no longer pair up, and they raise at different batches: the job hangs, in the collective
that gathers every rank's state into the checkpoint or in the barrier after the file is written.

:func:`stop_together_on_sigterm` replaces that: the handler only notes the signal, and at the end of every training
batch (``_save_loggers_on_train_batch_end``, just before the epoch loop reads the flag) every rank all-reduces
what it noted, so ``received_sigterm`` turns true on every rank at the same batch and every rank raises there.
Read in Lightning 2.6.6 (not run on 2.5.x here); ``_broadcast_sigterm_tensor`` is left out only where it exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.rank_zero import rank_prefixed_message  # what Lightning's rank_zero re-exports

from lightning_repro._lightning.hooks import _wrap

__all__ = ["stop_together_on_sigterm"]

log = logging.getLogger(__name__)


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (a collective: every rank calls it at the same point)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return flag
    tensor = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def stop_together_on_sigterm(trainer: pl.Trainer) -> Callable[[], None]:
    """Let a SIGTERM on any rank stop every rank after the same training batch; returns the undo.

    Call it before Lightning registers its signal handlers (``strategy.setup``); undo it in ``strategy.teardown``.
    The handler only notes the signal (and logs it as Lightning does); at the end of each training batch, once that
    batch's validation (if one was due) is over, the ranks agree: if any noted one, ``trainer.received_sigterm`` is
    set on every rank and Lightning raises ``SIGTERMException`` there on every rank. Lightning's broadcast of rank
    0's flag at each batch's start is left out (the agreement replaces it: still one collective per batch).
    """
    connector: Any = trainer._signal_connector  # trainer/trainer.py: Trainer.__init__
    epoch_loop: Any = trainer.fit_loop.epoch_loop
    noted = [False]

    def note_sigterm(signum: int, frame: FrameType | None) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        noted[0] = True

    save_loggers = epoch_loop._save_loggers_on_train_batch_end

    def save_loggers_then_agree() -> None:
        save_loggers()
        # every rank, every batch (never skipped on one rank only): the ranks' collectives stay paired
        if _any_rank(noted[0] or connector.received_sigterm, trainer.strategy.root_device):
            connector.received_sigterm = True  # on every rank at this batch: on_advance_end raises SIGTERMException

    undo = [
        _wrap(connector, "_sigterm_notifier_fn", note_sigterm),
        _wrap(epoch_loop, "_save_loggers_on_train_batch_end", save_loggers_then_agree),
    ]
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # Lightning >= 2.5.2
        undo.append(_wrap(epoch_loop, "_broadcast_sigterm_tensor", lambda: None))

    def undo_all() -> None:
        while undo:
            undo.pop()()

    return undo_all
