"""``ReproDDPStrategy``: DDP with rank-aware seeding and every rank's RNG state in the checkpoint."""

from __future__ import annotations

import atexit
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from lightning_repro._lightning.signals import handle_at_batch_end
from lightning_repro._lightning.strategies import LauncherHooks
from lightning_repro._warn import warn
from lightning_repro.callback import DeterminismCallback
from lightning_repro.exceptions import ReproWarning
from lightning_repro.seeding import CUBLAS_WORKSPACE, export_hash_seed

__all__ = ["ReproDDPStrategy", "register_strategy"]

log = logging.getLogger(__name__)

STRATEGY_NAME = "ddp_repro"


class ReproDDPStrategy(LauncherHooks):
    """Lightning's ``DDPStrategy`` made reproducible; use it with :class:`~lightning_repro.DeterminismCallback`.

    * ``CUBLAS_WORKSPACE_CONFIG`` is exported so every rank computes alike, and ``PYTHONHASHSEED``
      (the callback's seed, when it is not set) while the launcher starts the ranks, so every
      started rank hashes alike; it is removed from ``os.environ`` again when ``fit`` returns.
    * The model is initialised identically on every rank (the callback seeds every process from the
      seed); once DDP has wrapped it, each rank's process streams are re-seeded from
      ``(seed, rank)``, so dropout masks differ across ranks while the run stays a function of the seed.
    * The callback gathers every rank's RNG state into the one checkpoint rank 0 writes, and every
      rank restores its own on resume.
    * A SIGTERM (a scheduler's preemption, sent to every rank or to one) stops every rank after the same training
      batch, once that batch's validation is over: the handler only notes it, and at the end of each training batch
      the ranks agree (one all-reduce, in place of Lightning's broadcast of rank 0's flag). Lightning runs a
      collective inside its handler and lets each rank stop where it reads its own flag, so a job whose ranks are all
      signalled hangs, before or after ``OnExceptionCheckpoint`` writes its file.
    * A process group it creates is destroyed when the process exits (an ``atexit`` handler), while the
      interpreter is still whole, as Lightning does for NCCL only: a gloo group left to the interpreter's
      shutdown can abort the process after training ("terminate called without an active exception").

    Without the callback this strategy behaves as ``DDPStrategy`` and warns once. Accepts every
    argument of ``DDPStrategy``; also usable as ``Trainer(strategy="ddp_repro")``.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        self._undo_sigterm: Callable[[], None] | None = None

    @override
    def before_launcher(self) -> None:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)

    @override
    def wrap_launch(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        # the launcher copies os.environ into the processes it starts: export PYTHONHASHSEED only meanwhile
        return _launch_with_hash_seed(launch)

    @override
    def setup_distributed(self) -> None:
        created = not _process_group_initialized()
        super().setup_distributed()
        if created:
            _destroy_process_group_at_exit()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # moves and wraps the model in DDP
        self._stop_sigterm_agreement()
        # before the Trainer registers its signal handlers
        self._undo_sigterm = handle_at_batch_end(trainer, agree_across_ranks=True)
        callback = _find_callback(trainer)
        if callback is None:
            warn(
                "ReproDDPStrategy is used without DeterminismCallback: nothing is seeded per rank and the"
                " checkpoints hold no RNG state. Add `DeterminismCallback(seed=...)` to the Trainer's callbacks.",
                ReproWarning,
            )
            return
        callback.seed_rank(trainer)

    @override
    def teardown(self) -> None:
        self._stop_sigterm_agreement()
        super().teardown()

    def _stop_sigterm_agreement(self) -> None:
        undo, self._undo_sigterm = self._undo_sigterm, None
        if undo is not None:
            undo()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_strategy(strategy_registry)


def _launch_with_hash_seed(launch: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a launcher's ``launch`` so the ranks it starts get ``PYTHONHASHSEED`` = the callback's seed.

    The value is exported for the duration of ``launch`` (which starts the ranks, then runs rank 0's
    part of the job) and the previous environment is put back when it returns or raises. A ``partial`` of a
    module-level function: the launcher holding it, and the strategy holding the launcher, pickle as Lightning's.
    """
    function, owner = getattr(launch, "__func__", None), getattr(launch, "__self__", None)
    if function is not None and owner is not None:  # the class's function: a copy never finds this wrapper there
        launch = functools.partial(function, owner)
    return functools.partial(_launch_hashed, launch)


def _launch_hashed(launch: Callable[..., Any], function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    trainer = kwargs.get("trainer")
    callback = _find_callback(trainer) if trainer is not None else None
    undo = export_hash_seed(callback.seed) if callback is not None else None
    try:
        return launch(function, *args, **kwargs)
    finally:
        if undo is not None:
            undo()


def _process_group_initialized() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def _destroy_process_group() -> None:
    if _process_group_initialized():
        torch.distributed.destroy_process_group()


def _destroy_process_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit, before finalisation; registered once a process.

    Lightning leaves a gloo group to the interpreter's shutdown. A gloo worker thread can then still hold the
    last reference to a finished collective's tensors while the interpreter finalises; releasing them takes the
    GIL, which a thread may not do then: it unwinds with a forced exception through a ``noexcept`` destructor and
    the process aborts with "terminate called without an active exception" (exit code -6), after training
    finished. ``destroy_process_group`` in an ``atexit`` handler joins those threads while Python still runs.
    """
    if _destroy_process_group not in _REGISTERED_AT_EXIT:
        atexit.register(_destroy_process_group)
        _REGISTERED_AT_EXIT.append(_destroy_process_group)


_REGISTERED_AT_EXIT: list[Callable[[], None]] = []


def _find_callback(trainer: pl.Trainer) -> DeterminismCallback | None:
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, DeterminismCallback):
            return callback
    return None


def register_strategy(registry: Any = None) -> None:
    """Register ``"ddp_repro"`` in Lightning's strategy registry; safe to call any number of times."""
    registry = StrategyRegistry if registry is None else registry
    if STRATEGY_NAME not in registry:
        registry.register(
            STRATEGY_NAME,
            ReproDDPStrategy,
            description="DDP with rank-aware seeding and per-rank RNG state in checkpoints (lightning-repro)",
        )
