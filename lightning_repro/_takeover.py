"""The data side of :class:`~lightning_repro.DeterminismCallback`: its installs, the loaders, evaluation streams.

A base of the callback, on top of :class:`~lightning_repro._resume.ResumeMixin`, holding the state it initialises
in ``_init_takeover``: the installs on a Trainer and their undo (``setup_data``, ``process_dataloader``,
``load_checkpoint``, ``PYTHONHASHSEED`` for the processes a run starts), the takeover of every loader a loop sets up
(:func:`~lightning_repro.data.takeover.prepare_dataloader`), the ``counter`` of a train and an evaluation pass, and
evaluation loops run on their own streams. Part of the lifecycle layer, beside ``callback.py`` and ``_resume.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning_utilities.core.rank_zero import rank_prefixed_message

from lightning_repro import streams
from lightning_repro._lightning import hooks as _hooks
from lightning_repro._lightning import loops as _loops
from lightning_repro._lightning import signals as _signals
from lightning_repro._lightning import strategies as _strategies
from lightning_repro._lightning.prepared import unwrap
from lightning_repro._resume import ResumeMixin
from lightning_repro.data.nodes import is_taken_over, quiet_iterable_check
from lightning_repro.data.nodethreads import stop_threads
from lightning_repro.data.passcounts import PassCounts
from lightning_repro.data.takeover import StreamKey, prepare_dataloader
from lightning_repro.rng import StreamFork
from lightning_repro.seeding import export_hash_seed

if TYPE_CHECKING:
    from lightning_repro._warn import WarningCache

__all__ = ["TakeoverMixin"]

log = logging.getLogger("lightning_repro.callback")  # the callback's log lines keep the callback's logger


class TakeoverMixin(ResumeMixin):
    """The installs, the loaders' takeover and the evaluation streams of the callback (see the module)."""

    seed: int
    sample_keyed: bool
    isolate_evaluation: bool
    _undo: list[Callable[[], None]]
    _loading: list[Any] | None
    _eval: StreamFork
    _warning_cache: WarningCache

    def _init_takeover(self) -> None:
        self._undo = []
        self._loading = None  # [stage, next loader index] while a loop sets up its data
        self._eval = StreamFork()  # the training streams, set aside while an evaluation loop runs
        self._pass_counts = PassCounts()  # litdata loaders' pass counts, for a fit continued on the same Trainer

    def _install(self, trainer: pl.Trainer) -> None:
        self._undo += _hooks.install(
            trainer,
            setup_data=self._loading_wrapper,
            process_dataloader=self._process_dataloader,
            load_checkpoint=self._checking_loader,
            on_exception=self._exception_unseen,
        )
        self._undo.append(export_hash_seed(self.seed))  # for spawn/forkserver workers started during the run
        # SLURM's requeue signal, with one rank (several: our strategies agree on it; Lightning's as it is without)
        if trainer.world_size == 1 and _signals.requeue_signal(trainer) is not None:
            self._undo.append(_signals.handle_at_batch_end(trainer, agree_across_ranks=False))

    def _exception_unseen(self, exception: BaseException) -> None:
        """A run failed and Lightning did not call our ``on_exception``: what that hook does is done here.

        As when a Tuner's trial had replaced the Trainer's callbacks: the installs undone, ``PYTHONHASHSEED`` as it
        was, the trace closed.
        """
        if self._trainer is not None:
            self.on_exception(self._trainer, self._trainer.lightning_module, exception)

    def _uninstall(self) -> None:
        self._end_resume_patches()
        while self._undo:
            self._undo.pop()()

    def _loading_wrapper(self, setup_data: Callable[[], None], stage: str) -> Callable[[], None]:
        def wrapped() -> None:
            previous, self._loading = self._loading, [stage, 0]
            try:
                with quiet_iterable_check(setup_data):  # a torchdata.nodes Loader's: no thread, no draw left
                    setup_data()
            finally:
                self._loading = previous

        return wrapped

    def _process_dataloader(self, dataloader: Any) -> Any:
        trainer = self._trainer
        if self._loading is None or trainer is None:
            return dataloader
        stage, index = self._loading
        self._loading[1] += 1
        # the data-parallel replica: the ranks of one tensor-parallel group read the same batches and workers
        rank, replicas = _strategies.data_parallel(trainer)
        counter = self._train_counter if stage == "train" else self._eval_counter
        dataloader = prepare_dataloader(
            dataloader,
            seed=self.seed,
            rank=rank,
            stream=StreamKey(stage, index),
            counter=counter,
            sample_keyed=self.sample_keyed,
            world_size=replicas,
            warning_cache=self._warning_cache,
            consumed=(lambda: _loops.batches_ready(trainer)) if stage == "train" else None,
        )
        if stage == "train":
            self._register_train_loader(trainer, index, unwrap(dataloader))  # a WebLoader's: its loader
            if (count := self._pass_counts.watch(trainer, index, unwrap(dataloader))) is not None:
                said = f"train loader {index}: litdata's pass count {count} given on from this Trainer's last fit"
                said += " (training continued: a new loader counts from 0)"
                log.info(rank_prefixed_message(said, trainer.global_rank))
        if is_taken_over(dataloader):  # our copy of a torchdata.nodes Loader: its threads and workers end with the run
            self._undo.append(functools.partial(stop_threads, dataloader.root))
        return dataloader

    def _train_counter(self) -> int:
        """The ``counter`` of a train pass: the epochs whose batches are all processed (the epoch a pass belongs to)."""
        assert self._trainer is not None
        return _loops.epoch_processed(self._trainer)

    def _eval_counter(self) -> int:
        """The ``counter`` of an evaluation pass: ``2 * global_step``, plus 1 in the sanity check.

        Not the global step itself: the sanity check and a validation at step 0 must not share their streams.
        """
        assert self._trainer is not None
        return 2 * self._evaluated(self._trainer) + int(self._trainer.sanity_checking)

    def _evaluated(self, trainer: pl.Trainer) -> int:
        """The step whose weights an evaluation runs on: a checkpoint's loaded outside fit, else the trainer's."""
        step = getattr(self, "_evaluated_step", None)
        return trainer.global_step if step is None or trainer.training or trainer.sanity_checking else step

    def _eval_start(self, trainer: pl.Trainer, loop: str) -> None:
        if self.isolate_evaluation:
            stage = "sanity" if trainer.sanity_checking else loop
            self._eval.begin(streams.eval_seed(self.seed, stage, self._evaluated(trainer)))

    def _eval_end(self) -> None:
        self._eval.end()
