"""The checkpoint side of :class:`~lightning_repro.DeterminismCallback`: what it saves, checks and restores.

A base of the callback, holding the state it initialises in ``_init_resume``: the check of a checkpoint's entry as soon
as the file is read (before Lightning loads the weights), the entry a checkpoint gets (``checkpoint.state``, sealed),
the restore at ``on_train_start`` (the last moment before the first resumed batch) with the restore check, the rest of
the hook the checkpoint was written in, the resume's one visible line, and the end of the resumed epoch (lifecycle).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.rank_zero import rank_prefixed_message

from lightning_repro._lightning import cycled as _cycled
from lightning_repro._lightning import guards as _guards
from lightning_repro._lightning import hooks as _hooks
from lightning_repro._lightning import inflight as _inflight
from lightning_repro._lightning import lastbatch as _lastbatch
from lightning_repro._lightning import loops as _loops
from lightning_repro._lightning import results as _results
from lightning_repro._lightning import strategies as _strategies
from lightning_repro._lightning import swa as _swa
from lightning_repro._lightning.restart import restart_train_iterator
from lightning_repro._types import is_stateful
from lightning_repro.checkpoint import accumulation as _accumulation
from lightning_repro.checkpoint import pruned as _pruned
from lightning_repro.checkpoint import save as _save
from lightning_repro.checkpoint import state as _state
from lightning_repro.checkpoint import trainable as _trainable
from lightning_repro.checkpoint import verify
from lightning_repro.checkpoint.entry import DIGEST_KEY, Entry, read_checkpoint, same_save_said, saved_after
from lightning_repro.checkpoint.remainder import finish_hook_remainder, stop_requested
from lightning_repro.data import libraries as _libraries
from lightning_repro.data import resumeline as _resumeline
from lightning_repro.data.batchstart import BatchStart, resume_in_flight
from lightning_repro.data.loaderstate import keep_run_out_iterator
from lightning_repro.data.nodes import is_taken_over
from lightning_repro.data.takeover import ReproBatchSampler
from lightning_repro.data.workerpos import StreamPosition, loader_position
from lightning_repro.exceptions import NotExactWarning
from lightning_repro.rng import capture_process_streams
from lightning_repro.trace.tracer import attach_trace_tail

if TYPE_CHECKING:
    from lightning_repro._warn import WarningCache
    from lightning_repro.checkpoint.attributes import UserAttributes
    from lightning_repro.checkpoint.state import ReproState
    from lightning_repro.data.batchstart import Rewind
    from lightning_repro.manifest.run import RunManifest
    from lightning_repro.rng import StreamFork
    from lightning_repro.trace.tracer import StepTracer

__all__ = ["ResumeMixin"]

log = logging.getLogger("lightning_repro.callback")  # the callback's log lines keep the callback's logger


class ResumeMixin(Callback):
    """Save, check and restore the callback's checkpoint entry (see the module)."""

    seed: int
    sample_keyed: bool
    ignore_checkpoint_state: bool
    on_topology_change: Literal["error", "reseed"]
    on_divergence: Literal["warn", "error"]
    tracer: StepTracer | None
    restored: bool
    train_samplers: dict[int, ReproBatchSampler]
    train_iterables: dict[int, Any]
    train_streams: dict[int, StreamPosition]
    _streams_given: set[int]
    _streams_legacy: set[int]
    _trainer: pl.Trainer | None
    _pending: ReproState | None
    _checked: tuple[Any, ReproState | None] | None
    _truncated: tuple[int, Entry] | None
    _rebuild_train_iterator: bool
    _rewound: bool
    _at_first_batch: list[Callable[[], None]]
    _resumed_from: Any
    _afresh: list[str]  # the checkpoint callbacks resumed in another dirpath: facts of the resume line
    _eval: StreamFork
    _warnings: WarningCache
    _undo: list[Callable[[], None]]  # the installs of this fit, undone at its end (TakeoverMixin)
    _run_manifest: RunManifest
    _attributes: UserAttributes
    _validation_metrics: set[str]  # the metrics the resumed entry says the run's validations logged (save.py)

    def _init_resume(self) -> None:
        self.restored, self.train_samplers = False, {}
        self.train_iterables = {}  # train loaders whose main-process dataset state is saved (none since `streaming`)
        self.train_streams = {}  # the per-worker positions of train loaders over an IterableDataset
        self._streams_given: set[int] = set()  # the train loaders given a checkpoint's per-worker position
        self._streams_legacy: set[int] = set()  # ... or an older checkpoint's main-process dataset state
        self._pending, self._truncated = None, None
        self._checked = None  # (entry's SHA-256, parsed) read with the file
        self._rebuild_train_iterator = False  # the train loader was set up before the loops' state was restored
        self._at_first_batch = []  # undo what lasts from a resume to its first batch
        self._resumed_from, self._afresh = None, []  # the checkpoint this fit resumes from (set when it is loaded)
        # The seals of the entries saved in this fit before training started, and whether the file being loaded holds
        # one: the Tuner saves a file in `on_fit_start`, loads it back once it tried its values: put back at once.
        self._saved_before_training: set[str] | None = set()  # None: training started
        self._own_restore, self._batch_start = False, BatchStart()  # each batch's start: a file written inside it
        self._rewound = False  # the checkpoint being resumed was written inside a batch, at whose start it resumes

    # ------------------------------------------------------------------ the file is read
    def _checking_loader(self, load_checkpoint: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        """Wrap ``strategy.load_checkpoint``: read the file, then check our entry before Lightning restores anything."""

        def wrapped(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            checkpoint: dict[str, Any] = read_checkpoint(load_checkpoint, checkpoint_path, *args, **kwargs)
            self._checked = None
            entry = checkpoint.get("callbacks", {}).get(self.state_key) if isinstance(checkpoint, dict) else None
            saved = self._saved_before_training
            self._own_restore = bool(entry) and saved is not None and entry.get(DIGEST_KEY) in saved
            if entry and (self._own_restore or not self.ignore_checkpoint_state):
                parsed = self._parse(entry)  # raises before the model holds the checkpoint's weights
                # Lightning hands load_state_dict a deep copy of the entry: know it by its SHA-256
                self._checked = (entry.get(DIGEST_KEY), parsed)
            return checkpoint

        return wrapped

    def _loaded_checkpoint(self, trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
        """``on_load_checkpoint``: the loop counters corrected in memory, a checkpoint without our entry said."""
        self._trainer = trainer
        # the file keeps Lightning's loop counters as Lightning wrote them; correct them in memory only
        _loops.fix_loop_progress(checkpoint, checkpoint.get("callbacks", {}).get(self.state_key))
        self._afresh = _guards.give_back_current_scores(trainer, checkpoint)  # not given back by load_state_dict
        if self._own_restore:  # a tuner's file of this fit: nothing is resumed (see `_init_resume`)
            return
        self._resumed_from = getattr(trainer, "ckpt_path", None) or "a checkpoint"
        entry = checkpoint.get("callbacks", {}).get(self.state_key)
        self._rewound, not_exact = resume_in_flight(_loops.batch_in_flight(checkpoint), entry)
        self._at_first_batch += _cycled.give_back(entry, trainer)  # the loaders that ran out in a cycling epoch
        for said in filter(None, (not_exact, stop_requested(entry))):  # a batch not resumed exactly, a stop not saved
            self._warnings.warn(said, category=NotExactWarning)
        if self.state_key not in checkpoint.get("callbacks", {}):
            self._warnings.warn(
                "The checkpoint has no lightning-repro entry (it was written without DeterminismCallback, or by an"
                " older version): the RNG streams and the data position cannot be restored, so the resumed run will"
                " not continue bitwise (a mid-epoch resume restarts the epoch's data order). Training goes on.",
                category=NotExactWarning,
            )

    def _load_entry(self, state_dict: dict[str, Any]) -> None:
        """``load_state_dict``: the entry checked when the file was read, or parsed now."""
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] == state_dict.get(DIGEST_KEY):
            parsed = checked[1]  # parsed and checked when the file was read
        else:
            parsed = self._parse(state_dict)
        if not self._own_restore:  # the loaders this fit built before the entry came (a sharded strategy restores
            self._pending, trainer = parsed, self._trainer  # after its setup, where estimated_stepping_batches does)
            for index, loader in enumerate((parsed and trainer and _loops.train_loaders(trainer)) or []):
                self._register_train_loader(trainer, index, loader)  # type: ignore[arg-type]  # get it now
            return
        # a tuner puts back what it saved in this fit before training, now: the process streams its trials drew
        # from and the metric states they updated too (Lightning restores the rest), and nothing is resumed
        self._own_restore = False
        if parsed is not None and self._trainer is not None:
            _state.apply_process_state(parsed, self._trainer, self._trainer.lightning_module, cache=self._warnings)
            if parsed.frozen is not None:
                _trainable.restore_trainable(self._trainer.lightning_module, parsed.frozen)

    def _parse(self, state_dict: dict[str, Any]) -> ReproState | None:
        if self.ignore_checkpoint_state and not self._own_restore:
            if state_dict:
                self._warnings.warn(
                    "DeterminismCallback(ignore_checkpoint_state=True): the checkpoint's lightning-repro entry is NOT"
                    " checked or restored. The RNG streams, the data position, metric states and logged epoch values"
                    " start afresh: the resumed run will NOT continue like the interrupted one.",
                    category=NotExactWarning,
                )
            return None
        trainer = self._trainer
        pending = _state.parse_entry(
            state_dict,
            seed=self.seed,
            rank=trainer.global_rank if trainer is not None else 0,
            world_size=trainer.world_size if trainer is not None else 1,
            num_nodes=trainer.num_nodes if trainer is not None else 1,
            data_parallel=_strategies.data_parallel(trainer) if trainer is not None else None,
            on_topology_change=self.on_topology_change,
            cache=self._warnings,
        )
        if pending is not None:
            self._run_manifest.check_resumed(pending, trainer, warn=lambda m, c: self._warnings.warn(m, category=c))
        return pending

    # ------------------------------------------------------------------ a train loader is taken over
    def _register_train_loader(self, trainer: pl.Trainer, index: int, dataloader: Any) -> None:
        """Know a taken-over train loader (its sampler or its stateful iterable), and give it its resumed position."""
        sampler = getattr(dataloader, "batch_sampler", None)
        if sampler is None:
            sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, ReproBatchSampler):
            self.train_samplers[index] = sampler
            if is_stateful(dataloader):  # its own state beside our sampler (a StatefulDataLoader)
                keep_run_out_iterator(dataloader)
            if self.tracer is not None:
                self.tracer.watch(sampler)
            if self._pending is not None:  # built before the loops were restored (estimated_stepping_batches): its
                early = not _loops.loops_restored(trainer)  # length is checked once the loaders in use are known
                warned = {"warn": not early, "cache": self._warnings, "loader": dataloader}
                _state.apply_data_position(self._pending, index, sampler, **warned)
                self._rebuild_train_iterator |= early  # a fresh run's iterator, re-created then (_lightning/restart.py)
        elif (position := loader_position(dataloader)) is not None:
            self.train_streams[index] = position
            self._streams_given.discard(index)
            self._streams_legacy.discard(index)
            if self._pending is not None:
                self._give_stream_position(trainer, index, dataloader, position)
        elif self._pending is not None and is_taken_over(dataloader):  # torchdata.nodes: by its state Lightning saved
            self._rebuild_train_iterator |= not _loops.loops_restored(trainer)

    def _give_stream_position(self, trainer: pl.Trainer, index: int, dataloader: Any, position: StreamPosition) -> None:
        assert self._pending is not None
        given = _state.apply_stream_position(
            self._pending,
            index,
            position,
            num_workers=int(dataloader.num_workers),
            name=_libraries.pipeline_name(dataloader, dataloader.dataset.dataset),
            redeal=_libraries.redeals_workers(dataloader),
            alike=_libraries.main_reads_as_worker(dataloader.dataset.dataset),
            on_topology_change=self.on_topology_change,
            cache=self._warnings,
        )
        if given:
            self._streams_given.add(index)
        elif _state.is_stateful_iterable(dataloader) and str(index) in self._pending.iterables:
            _state.apply_iterable_state(self._pending, index, dataloader)  # an older checkpoint's main-process state
            self._streams_legacy.add(index)
        self._rebuild_train_iterator |= given and not _loops.loops_restored(trainer)  # built early: see above

    # ------------------------------------------------------------------ on_train_start: restore at the last moment
    def _resume(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
        """Restore what the checkpoint's entry holds, at the last moment; return what the restore check found."""
        restore = None
        if self._pending is not None and self._rebuild_train_iterator:
            self._rebuild_train_iterator = False
            for index, sampler in self.train_samplers.items():  # the loaders in use now (each warning once)
                _state.apply_data_position(self._pending, index, sampler, cache=self._warnings)
            for index, position in self.train_streams.items():
                if index in self._streams_given:  # the early iterator of a fresh run's epoch may have taken it
                    position.resume = self._pending.streaming[str(index)]
            restart_train_iterator(trainer, fresh_workers=bool(self.train_streams))
        if self._pending is not None:
            if not _loops.epoch_start_hooks_run(trainer):  # what the skipped epoch-start hooks built or set
                _swa.rebuild_swa_schedulers(trainer, pl_module)
                changed = _accumulation.resume_accumulation(trainer, self, self._pending.accumulation)
                if changed is not None:  # another accumulation than the checkpoint's run, batches left
                    self._warnings.warn(changed, category=NotExactWarning)
            _pruned.give_back_module(trainer, pl_module, self._pending.pruned, self._pending.frozen, self._warnings)
            if self._rewound:  # written inside a batch, resumed at its start: Lightning trains it again
                _inflight.count_batch_unread(trainer)
            _state.apply_process_state(self._pending, trainer, pl_module, cache=self._warnings)
            self._validation_metrics = set(self._pending.validation_metrics)
            if _loops.resumed_with_batches_left(trainer) and _loops.batches_ready(trainer) > 0:
                _results.resume_inside_epoch(trainer)  # the next batch is not the epoch's first: keep what is put back
            # The restore check, here: all is restored, nothing moved yet. Later (the first batch's start) the rest of
            # the checkpoint's hook, a pending validation, on_train_epoch_start may change parameters, metrics, streams.
            differing = verify.check_restore(
                self._pending, trainer, self.train_samplers, on_divergence=self.on_divergence, cache=self._warnings
            )
            # before anything that may save: ModelCheckpoint must know what it saved (not in its own state)
            guards = self._pending.save_guards
            self._undo += _guards.restore_save_guards(trainer, guards, self, saved_after, same_save_said)
            restore = verify.restore_summary(self._pending, differing)
            for loader, state in _loops.loader_states_not_loaded(trainer):  # an epoch-end checkpoint's
                if (stream := loader_position(loader)) is not None:
                    stream.loader_epoch = _libraries.give_loader_its_epoch(loader, state)  # litdata's pass count
                    stream.unstarted = state if isinstance(state, dict) else None  # what it reports until its pass
            self._finish_hook_remainder(trainer)
            self._at_first_batch += _loops.run_pending(trainer, self._pending.pending)
            self.restored = True
            rank = trainer.global_rank
            log.info(rank_prefixed_message(f"restored the RNG streams and data position of seed {self.seed}", rank))
            if self._pending.batches and _state.train_data_resumes_exactly(trainer):
                # Lightning warns that a mid-epoch resume of a loader without state_dict() is unreliable: ours
                # restores the data position (the resume line says whether exactly), so hide it, for this epoch only
                self._at_first_batch.append(_hooks.silence_not_resumable_warning())
        hooks_run = _loops.epoch_start_hooks_run(trainer)
        for position in self.train_streams.values():  # the epoch given to a pass read before on_train_epoch_start
            if position.epoch_end is not None:
                position.epoch_end.settle(hook_runs=hooks_run)
        return restore

    def _start_trace(self, trainer: pl.Trainer) -> None:
        """After the restore: the continuation check starts at the checkpoint's step."""
        if self.tracer is not None:
            pending = self._pending
            # a run re-dealt to another world size does not continue the interrupted one bitwise: nothing to check
            check = pending is not None and not pending.remap
            tail = pending.trace if pending is not None else None
            self.tracer.start(trainer, resumed=pending is not None, check=check, tail=tail)

    def _say_resumed(self, trainer: pl.Trainer, notes: list[str], restore: str | None) -> None:
        """The one visible line of a resume, on rank 0: exact or not, and why (``data.resumeline``)."""
        pending = self._pending
        data: tuple[bool, list[str]] = (True, [])
        if pending is not None and not pending.remap:  # a re-dealt epoch is not exact: its note says why
            loaders = _loops.train_loaders(trainer)
            data = _resumeline.data_position(
                loaders,
                pending.batches if _lastbatch.goes_on_in_epoch(trainer) else 0,  # else a new epoch (after fit)
                sample_keyed=self.sample_keyed,
                streaming={i: pending.streaming[str(i)] for i in self._streams_given},
                legacy=self._streams_legacy,
            )
        _resumeline.say_resumed(
            self._resumed_from,
            trainer.global_step,
            trainer.current_epoch,
            notes=_resumeline.every_rank_notes(notes, trainer.world_size),  # a collective: every rank is here
            restore=restore,
            restore_exact=not (restore or "").startswith(verify.RESTORE_FAILED),
            data=data,
            continuation=self.tracer.to_check() if self.tracer is not None else None,
            facts=self._afresh,
        )

    def _finish_hook_remainder(self, trainer: pl.Trainer) -> None:
        assert self._pending is not None
        remainder = self._pending.remainder
        problem = finish_hook_remainder(trainer, self._pending)
        if remainder and remainder["hook"] == "on_train_epoch_end":
            _results.finish_logged_values(trainer)  # the epoch those values belong to is over now
        if problem:
            self._warnings.warn(problem, category=NotExactWarning)

    def _end_resume_patches(self) -> None:
        while self._at_first_batch:
            self._at_first_batch.pop()()

    def _end_epoch(self, trainer: pl.Trainer) -> None:
        """``on_train_epoch_end``: the resumed epoch is over; an epoch cut short is snapshotted before its end."""
        self._end_resume_patches()
        if self._pending is not None:
            _results.finish_logged_values(trainer)
            _loops.allow_plateau_step(trainer)
            for loader in _loops.train_loaders(trainer) or []:  # litdata's, its state loaded
                _libraries.end_loaded_pass(loader)
            if self._pending.remap:
                _state.end_remapped_epoch(self.train_samplers.values(), trainer)
            self._pending = None
        if _loops.epoch_cut_short(trainer):
            # The epoch was cut short (max_steps, a stop request): Lightning now runs the epoch-end hooks and marks it
            # finished, so a resume would skip its remaining batches. Snapshot the state before those hooks.
            self._truncated = (trainer.global_step, self._build_entry(trainer, capture_process_streams(), True))

    # ------------------------------------------------------------------ the entry a checkpoint gets
    def _entry(self) -> dict[str, Any]:
        """``state_dict``: this rank's part with every rank's gathered into the file rank 0 writes, sealed."""
        trainer = self._trainer
        if trainer is None:
            return {}
        if self._truncated is not None and self._truncated[0] == trainer.global_step:
            entry = self._truncated[1]
        elif self._eval.saved is not None:  # inside an evaluation loop the process streams are the evaluation's
            entry = self._build_entry(trainer, self._eval.saved)
        else:  # inside a training batch: resume at its start where that is exact (data.batchstart)
            rewind = self._batch_start.rewind(trainer) if trainer.training else None
            streams = rewind.streams if rewind is not None and rewind.streams is not None else None
            entry = self._build_entry(trainer, streams or capture_process_streams(), rewind=rewind)
        # the save guards as they are once this file is saved; the frozen parameters, ModelPruning's masks
        entry = replace(entry, save_guards=_guards.save_guards(trainer, self), **_pruned.module_record(trainer))
        entry = verify.add_restore_digests(entry, trainer)  # what Lightning saves in this checkpoint, as it is now
        entry = self._attributes.add_digests(entry)  # and what this epoch's start hooks set
        if self.tracer is not None:
            entry = attach_trace_tail(entry, self.tracer.tail())
        # every rank's part, in the file rank 0 writes, sealed with a SHA-256 of the whole entry
        sealed = _save.gather_and_seal(entry, trainer)
        if self._saved_before_training is not None:  # a tuner may load it back in this fit (see `_init_resume`)
            self._saved_before_training.add(sealed[DIGEST_KEY])
        return sealed

    def _build_entry(
        self, trainer: pl.Trainer, streams: dict[str, Any], truncated: bool = False, rewind: Rewind | None = None
    ) -> Entry:
        return _save.build_entry(
            trainer,
            streams,
            seed=self.seed,
            samplers=self.train_samplers,
            iterables=self.train_iterables,
            ours=self,
            streaming=self.train_streams,
            truncated=truncated,
            manifest=self._run_manifest.value,
            rewind=rewind,
        )
