"""``DeterminismCallback``: one callback that pins every random stream and resumes bitwise."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.rank_zero import rank_prefixed_message
from typing_extensions import override

from lightning_repro import streams
from lightning_repro._lightning import hooks as _hooks
from lightning_repro._lightning import loops as _loops
from lightning_repro._lightning import results as _results
from lightning_repro._warn import WarningCache
from lightning_repro.checkpoint import state as _state
from lightning_repro.checkpoint import verify
from lightning_repro.checkpoint.entry import DIGEST_KEY, Entry, read_checkpoint, seal_entry
from lightning_repro.data import resumeline as _resumeline
from lightning_repro.data.takeover import ReproBatchSampler, StreamKey, prepare_dataloader
from lightning_repro.exceptions import NotExactWarning, ReproWarning
from lightning_repro.manifest import collect as _manifest
from lightning_repro.manifest.run import RunManifest
from lightning_repro.rng import StreamFork, capture_process_streams
from lightning_repro.seeding import (
    check_hash_seed,
    export_hash_seed,
    seed_everything,
    seed_process_streams,
    set_deterministic_flags,
    validate_seed,
)
from lightning_repro.trace.tracer import StepTracer, attach_trace_tail, validate_trace_options

if TYPE_CHECKING:
    from lightning_repro.checkpoint.state import ReproState

__all__ = ["DEFAULT_TRACE_PARAMS_EVERY", "DeterminismCallback"]

log = logging.getLogger(__name__)

DEFAULT_TRACE_PARAMS_EVERY = 10
"""The default of ``trace_params_every``, measured with ``benchmarks/bench_trace.py`` (see docs/performance.md)."""

_EVAL_HOOKS = {"validation": "validate", "test": "test", "predict": "predict"}


class DeterminismCallback(Callback):
    """Pin every random source of a Lightning run from one seed, and resume it bitwise.

    Constructing the callback seeds python ``random``, numpy, torch CPU and every CUDA device
    (so a model built after it is initialised deterministically) and sets the determinism
    flags. During ``fit`` it takes over the dataloaders (seeded order, sample-keyed access,
    chained ``worker_init_fn``, resumable sampler), runs evaluation loops on their own
    streams, writes the RNG state and the data position into every checkpoint and restores
    them on resume, so the resumed run continues exactly like the uninterrupted one.

    A checkpoint written inside a gradient-accumulation window resumes exactly too: the
    gradients accumulated so far are saved with it (only then; the entry is otherwise ~20 KiB).

    Args:
        seed: The one seed of the run, an int in ``[0, 2**32 - 1]``.
        deterministic: ``True`` makes torch raise on operations without a deterministic
            implementation, ``"warn"`` only warns, ``False`` leaves torch's flags alone.
        sample_keyed: Seed python, numpy and torch from ``(seed, loader, epoch, index)`` while
            ``dataset[index]`` runs, so augmentation does not depend on ``num_workers`` (about 10 us per
            sample that draws from all three, about 2 us for one that draws from none: only the streams a
            sample is seen to draw from are seeded, exactly). ``False`` saves that, but augmentation then
            depends on which worker loads a sample, and a mid-epoch resume with workers is no longer exact.
        isolate_evaluation: Run validation, test, predict and the sanity check on streams
            seeded from ``(seed, loop, global step)``, so they never move the training streams.
        on_divergence: What a resume does when the restored state differs from the saved one (the restore
            check: parameters, optimizer, LR schedulers, process streams, data position, metric states):
            ``"warn"`` warns (:class:`~lightning_repro.NotExactWarning`), ``"error"`` raises
            :class:`~lightning_repro.RestoreError`. Either names the components that differ.
        on_topology_change: What a resume with another world size or node count does:
            ``"error"`` raises :class:`~lightning_repro.TopologyError`; ``"reseed"`` warns, deals the
            rest of the epoch out to the current ranks (no sample repeated or missed) and re-seeds
            every rank's streams from ``(seed, old world size, new world size, rank, position)``.
        ignore_checkpoint_state: Resume from a checkpoint while ignoring its lightning-repro entry
            (for example one refused as damaged): Lightning restores the weights, optimizer and loops
            as usual, but the RNG streams, the data position, metric states and logged aggregates are
            not restored, and the run is not exact (a :class:`~lightning_repro.NotExactWarning` says so).
        data_fingerprint: A string naming the data's version (a dataset hash, a DVC revision...), put in the
            run manifest's ``data`` section.
        data_paths: Files or directories whose contents are hashed into the manifest's ``data`` section (cached on
            path, size and mtime, so unchanged data is not re-read; see :mod:`lightning_repro.manifest.datahash`).
        on_env_drift: What a resume does when the environment changed since the checkpoint was written in a way
            that can break bitwise continuation (torch/CUDA/cuDNN versions, GPU model, determinism flags, thread
            counts...): ``"warn"`` warns, ``"error"`` raises :class:`~lightning_repro.EnvironmentDriftError`.
            Changed code or data always only warn (see :mod:`lightning_repro.manifest.drift`).
        trace: Write the step trace (:mod:`lightning_repro.trace`): one record per optimizer step. ``True`` writes
            ``trace-rank{r}.jsonl`` in the directory of the checkpoint being resumed, else in the
            ``ModelCheckpoint``'s ``dirpath``, else in the trainer's ``default_root_dir``. A path ending in
            ``.jsonl`` is rank 0's file (rank ``r > 0`` writes ``{stem}-rank{r}.jsonl`` beside it); another path is
            a directory for ``trace-rank{r}.jsonl``. A resumed run appends to the file and checks its steps against
            the interrupted run's records past the checkpoint (the continuation check). ``None``/``False``: off.
        trace_params_every: Digest the parameters every that many optimizer steps (default
            :data:`DEFAULT_TRACE_PARAMS_EVERY`, 10, chosen with ``benchmarks/bench_trace.py``: see docs/performance.md).
        on_divergence: What a divergence found at run time does: ``"warn"`` warns
            (:class:`~lightning_repro.NotExactWarning`) and training goes on, ``"error"`` raises
            :class:`~lightning_repro.DivergenceError` naming the step, the field and the likely cause.

    Attributes:
        restored: Whether the last ``fit`` restored a checkpoint's entry (streams, data position, metric states).
        manifest: The run manifest collected at the start of the last ``fit`` (code, data, environment, seeds,
            hardware; :func:`~lightning_repro.collect_manifest`), stored in every checkpoint and written as
            ``repro_manifest.json`` in the logger's ``log_dir`` (beside ``hparams.yaml``), else in the
            ``default_root_dir``, never in a ``ModelCheckpoint``'s directory; ``None`` before a ``fit``.

    Raises:
        TypeError: ``seed`` is not an int, or a flag is not a bool.
        ValueError: ``seed`` is out of range, ``deterministic`` is not True, False or "warn",
            ``on_topology_change`` is not "error" or "reseed", ``on_env_drift`` or ``on_divergence`` is not
            "warn" or "error", or ``trace_params_every`` is below 1.

    Examples:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(callbacks=[DeterminismCallback(seed=42)], logger=False,
        ...                      enable_progress_bar=False, enable_checkpointing=False)
    """

    def __init__(
        self,
        seed: int,
        *,
        deterministic: bool | Literal["warn"] = True,
        sample_keyed: bool = True,
        isolate_evaluation: bool = True,
        on_topology_change: Literal["error", "reseed"] = "error",
        ignore_checkpoint_state: bool = False,
        data_fingerprint: str | None = None,
        data_paths: Sequence[str | os.PathLike[str]] | None = None,
        on_env_drift: Literal["warn", "error"] = "warn",
        trace: bool | str | os.PathLike[str] | None = None,
        trace_params_every: int | None = None,
        on_divergence: Literal["warn", "error"] = "warn",
    ) -> None:
        self.seed = validate_seed(seed)
        if on_topology_change not in ("error", "reseed"):
            raise ValueError(
                f"`on_topology_change` must be 'error' or 'reseed', got {on_topology_change!r};"
                " 'reseed' continues a checkpoint of another world size with a deterministic re-seed"
            )
        self.on_topology_change = on_topology_change
        self.on_env_drift, self.data_fingerprint, self.data_paths = _manifest.validate_options(
            on_env_drift=on_env_drift, data_fingerprint=data_fingerprint, data_paths=data_paths
        )
        validate_trace_options(trace, trace_params_every, on_divergence)
        self.on_divergence = on_divergence
        for name, flag in (
            ("sample_keyed", sample_keyed),
            ("isolate_evaluation", isolate_evaluation),
            ("ignore_checkpoint_state", ignore_checkpoint_state),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be a bool, got {flag!r}; pass True or False")
        set_deterministic_flags(deterministic)
        self.deterministic = deterministic
        self.sample_keyed = sample_keyed
        self.isolate_evaluation = isolate_evaluation
        self.ignore_checkpoint_state = ignore_checkpoint_state
        seed_everything(self.seed)
        check_hash_seed(self.seed)
        self._trainer: pl.Trainer | None = None
        self._undo: list[Callable[[], None]] = []
        self._loading: list[Any] | None = None  # [stage, next loader index] while a loop sets up its data
        self.train_samplers: dict[int, ReproBatchSampler] = {}
        self.train_iterables: dict[int, Any] = {}  # train loaders of an IterableDataset with state_dict()
        self._pending: ReproState | None = None
        self._checked: tuple[Any, ReproState | None] | None = None  # (entry's SHA-256, parsed) read with the file
        self._eval = StreamFork()  # the training streams, set aside while an evaluation loop runs
        self._truncated: tuple[int, Entry] | None = None
        self._rebuild_train_iterator = False  # the train loader was set up before the loops' state was restored
        self._at_first_batch: list[Callable[[], None]] = []  # undo what lasts from a resume to its first batch
        self._ranks_seeded = False  # a strategy called seed_rank() in this fit
        self._warnings = WarningCache()  # each of our warnings once per callback
        self.restored = False
        self._resumed_from: Any = None  # the checkpoint this fit resumes from (set when it is loaded)
        _hooks.skip_unused_batch_hooks(self)  # ~5 us per step of Lightning's hook dispatch, for no-ops
        self._warning_cache = self._warnings  # the data takeover warns once per cause for this callback too
        every = DEFAULT_TRACE_PARAMS_EVERY if trace_params_every is None else trace_params_every
        self._run_manifest = RunManifest(
            seed=self.seed,
            options={"sample_keyed": sample_keyed, "isolate_evaluation": isolate_evaluation},
            data_fingerprint=self.data_fingerprint,
            data_paths=self.data_paths,
            on_env_drift=self.on_env_drift,
        )
        self.tracer = (
            StepTracer(trace, params_every=every, on_divergence=on_divergence, warnings=self._warnings)
            if trace not in (None, False)
            else None
        )

    # ------------------------------------------------------------------ setup: take over the data
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._truncated = None
        self._ranks_seeded = False
        if stage == "fit":
            self.restored = False
            self._resumed_from = None
            self._warnings.collect()  # what a resume loses, for the line on_train_start says (until then)
            self._run_manifest.start(trainer, pl_module)  # git runs (once per fit) as the fit starts
        self._uninstall()
        self._install(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()
        self._run_manifest.finish()  # a fit that ended before training started still waits for its git child

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._warnings.take_notes()
        self._uninstall()
        self._run_manifest.finish()  # wait for the git child started in setup (a few ms, at most its timeout)
        if self.tracer is not None:
            self.tracer.close()  # Lightning skips the teardown hooks when a run raises

    def _install(self, trainer: pl.Trainer) -> None:
        self._undo += _hooks.install(
            trainer,
            setup_data=self._loading_wrapper,
            process_dataloader=self._process_dataloader,
            load_checkpoint=self._checking_loader,
        )
        self._undo.append(export_hash_seed(self.seed))  # for spawn/forkserver workers started during the run

    def _uninstall(self) -> None:
        self._end_resume_patches()
        while self._undo:
            self._undo.pop()()

    def _loading_wrapper(self, setup_data: Callable[[], None], stage: str) -> Callable[[], None]:
        def wrapped() -> None:
            previous, self._loading = self._loading, [stage, 0]
            try:
                setup_data()
            finally:
                self._loading = previous

        return wrapped

    def _checking_loader(self, load_checkpoint: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
        """Wrap ``strategy.load_checkpoint``: read the file, then check our entry before Lightning restores anything."""

        def wrapped(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            checkpoint: dict[str, Any] = read_checkpoint(load_checkpoint, checkpoint_path, *args, **kwargs)
            self._checked = None
            entry = checkpoint.get("callbacks", {}).get(self.state_key) if isinstance(checkpoint, dict) else None
            if entry and not self.ignore_checkpoint_state:
                parsed = self._parse(entry)  # raises before the model holds the checkpoint's weights
                # Lightning hands load_state_dict a deep copy of the entry: know it by its SHA-256
                self._checked = (entry.get(DIGEST_KEY), parsed)
            return checkpoint

        return wrapped

    def _process_dataloader(self, dataloader: Any) -> Any:
        trainer = self._trainer
        if self._loading is None or trainer is None:
            return dataloader
        stage, index = self._loading
        self._loading[1] += 1
        counter = self._train_counter if stage == "train" else self._eval_counter
        dataloader = prepare_dataloader(
            dataloader,
            seed=self.seed,
            rank=trainer.global_rank,
            stream=StreamKey(stage, index),
            counter=counter,
            sample_keyed=self.sample_keyed,
            world_size=trainer.world_size,
            warning_cache=self._warning_cache,
        )
        if stage == "train":
            sampler = getattr(dataloader, "batch_sampler", None)
            if sampler is None:
                sampler = getattr(dataloader, "sampler", None)
            if isinstance(sampler, ReproBatchSampler):
                self.train_samplers[index] = sampler
                if self.tracer is not None:
                    self.tracer.watch(sampler)
                if self._pending is not None:
                    _state.apply_data_position(self._pending, index, sampler, cache=self._warnings)
                    # Built early (`trainer.estimated_stepping_batches` in `configure_optimizers`, a callback reading
                    # `trainer.train_dataloader` in `setup`...): the loop counters are still those of a fresh run and
                    # an iterator may already exist (workers prefetch at creation). Re-create it once they are restored.
                    self._rebuild_train_iterator |= not _loops.loops_restored(trainer)
            elif _state.is_stateful_iterable(dataloader):
                self.train_iterables[index] = dataloader
                if self._pending is not None:
                    _state.apply_iterable_state(self._pending, index, dataloader)
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
        return 2 * self._trainer.global_step + int(self._trainer.sanity_checking)

    # ------------------------------------------------------------------ ranks
    def seed_rank(self, trainer: pl.Trainer) -> None:
        """Re-seed this rank's process streams from ``(seed, rank)``: called once the model is wrapped.

        :class:`~lightning_repro.ReproDDPStrategy` calls it from its ``setup``; without such a strategy every rank
        keeps the same process streams, and ``on_fit_start`` warns.
        """
        self._ranks_seeded = True
        if trainer.world_size <= 1:
            return
        rank_seed = streams.rank_seed(self.seed, trainer.global_rank)
        seed_process_streams(rank_seed)
        log.info(
            rank_prefixed_message(
                f"process streams (python, numpy, torch, CUDA) seeded from (seed={self.seed},"
                f" rank={trainer.global_rank}) -> {rank_seed}; data order from (seed, loader, epoch), samples from"
                " (seed, loader, epoch, index), workers from (seed, rank, loader, epoch, worker)",
                trainer.global_rank,
            )
        )

    @property
    def manifest(self) -> dict[str, Any] | None:
        """The run manifest of the last ``fit`` (see the class docstring), finished on first use."""
        return self._run_manifest.value

    @manifest.setter
    def manifest(self, value: dict[str, Any] | None) -> None:
        self._run_manifest.value = value

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1 and not self._ranks_seeded:
            self._warnings.warn(
                f"DeterminismCallback runs under {type(trainer.strategy).__name__} with {trainer.world_size} ranks:"
                " every rank keeps the same process streams (identical dropout masks across ranks). Use"
                " `strategy='ddp_repro'` (ReproDDPStrategy) for rank-aware seeding.",
                category=ReproWarning,
            )

    # ------------------------------------------------------------------ resume: restore at the last moment
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run_manifest.publish(trainer)  # in the log dir, and to the loggers (git ran meanwhile)
        restore = self._resume(trainer, pl_module)
        if self.tracer is not None:  # after the restore: the continuation check starts at the checkpoint's step
            pending = self._pending
            # a run re-dealt to another world size does not continue the interrupted one bitwise: nothing to check
            check = pending is not None and not pending.remap
            tail = pending.trace if pending is not None else None
            self.tracer.start(trainer, resumed=pending is not None, check=check, tail=tail)
        notes = self._warnings.take_notes()
        if self._resumed_from is not None:
            self._say_resumed(trainer, notes, restore)

    def _say_resumed(self, trainer: pl.Trainer, notes: list[str], restore: str | None) -> None:
        """The one visible line of a resume, on rank 0: exact or not, and why (``data.resumeline``)."""
        pending = self._pending
        data: tuple[bool, list[str]] = (True, [])
        if pending is not None and not pending.remap:  # a re-dealt epoch is not exact: its note says why
            loaders = _loops.train_loaders(trainer)
            data = _resumeline.data_position(loaders, pending.batches, sample_keyed=self.sample_keyed)
        _resumeline.say_resumed(
            self._resumed_from,
            trainer.global_step,
            trainer.current_epoch,
            notes=notes,
            restore=restore,
            data=data,
            continuation=self.tracer.to_check() if self.tracer is not None else None,
        )

    def _resume(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str | None:
        """Restore what the checkpoint's entry holds, at the last moment; return what the restore check found."""
        restore = None
        if self._pending is not None and self._rebuild_train_iterator:
            self._rebuild_train_iterator = False
            for index, sampler in self.train_samplers.items():
                _state.apply_data_position(self._pending, index, sampler, warn=False)
            _loops.restart_train_iterator(trainer)
        if self._pending is not None:
            _state.apply_process_state(self._pending, trainer, pl_module, cache=self._warnings)
            # The restore check, here: everything is restored and nothing has moved yet. Later (the first
            # on_train_batch_start) the rest of the checkpoint's hook, a pending validation and on_train_epoch_start
            # have run, and they may legitimately change parameters, metrics or the process streams.
            differing = verify.check_restore(
                self._pending, trainer, self.train_samplers, on_divergence=self.on_divergence, cache=self._warnings
            )
            # before anything that may save: ModelCheckpoint must know what it saved (not in its own state)
            _hooks.restore_save_guards(trainer, self._pending.save_guards, self)
            restore = verify.restore_summary(self._pending, differing)
            self._finish_hook_remainder(trainer)
            self._at_first_batch += _loops.run_pending(trainer, self._pending.pending)
            self.restored = True
            rank = trainer.global_rank
            log.info(rank_prefixed_message(f"restored the RNG streams and data position of seed {self.seed}", rank))
            if self._pending.batches and _state.train_data_resumes_exactly(trainer):
                # Lightning warns that a mid-epoch resume of a loader without state_dict() is unreliable: ours
                # restores the data position (the resume line says whether exactly), so hide it, for this epoch only
                self._at_first_batch.append(_hooks.silence_not_resumable_warning())
        return restore

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.tracer is not None:
            self.tracer.finish()

    def _finish_hook_remainder(self, trainer: pl.Trainer) -> None:
        assert self._pending is not None
        remainder = self._pending.remainder
        missing = _hooks.replay_hook_remainder(trainer, remainder)
        if remainder and remainder["hook"] == "on_train_epoch_end":
            _results.finish_logged_values(trainer)  # the epoch those values belong to is over now
        if missing:
            self._warnings.warn(
                f"The checkpoint was written in `{remainder['hook'] if remainder else ''}` before these callbacks ran"
                f" that hook ({', '.join(missing)}), and this Trainer does not have them: what they would have done"
                " at that moment is missing from the resumed run.",
                category=NotExactWarning,
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._end_resume_patches()
        if self.tracer is not None:
            self.tracer.batch_start(trainer, batch, batch_idx, self.train_samplers)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tracer is not None:
            self.tracer.batch_end(trainer, pl_module, outputs)

    def _end_resume_patches(self) -> None:
        while self._at_first_batch:
            self._at_first_batch.pop()()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_resume_patches()
        if self._pending is not None:
            _results.finish_logged_values(trainer)
            _loops.allow_plateau_step(trainer)
            if self._pending.remap:
                _state.end_remapped_epoch(self.train_samplers.values(), trainer)
            self._pending = None
        if _loops.epoch_cut_short(trainer):
            # The epoch was cut short (max_steps, a stop request): Lightning now runs the epoch-end hooks and
            # marks the epoch finished, so a resume would skip its remaining batches. Snapshot the state as
            # it is before those hooks; checkpoints written from here on resume in the middle of the epoch.
            self._truncated = (trainer.global_step, self._build_entry(trainer, capture_process_streams(), True))

    # ------------------------------------------------------------------ evaluation on its own streams
    def _eval_start(self, trainer: pl.Trainer, loop: str) -> None:
        if self.isolate_evaluation:
            stage = "sanity" if trainer.sanity_checking else loop
            self._eval.begin(streams.eval_seed(self.seed, stage, trainer.global_step))

    def _eval_end(self) -> None:
        self._eval.end()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "validate")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start(trainer, "predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_end()

    # ------------------------------------------------------------------ checkpoint entry
    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if trainer is None:
            return {}
        if self._truncated is not None and self._truncated[0] == trainer.global_step:
            entry = self._truncated[1]
        else:
            # inside an evaluation loop the process streams are the evaluation's: save the training ones
            streams = self._eval.saved if self._eval.saved is not None else capture_process_streams()
            entry = self._build_entry(trainer, streams)
        entry = replace(entry, save_guards=_hooks.save_guards(trainer, self))  # as they are once this file is saved
        entry = verify.add_restore_digests(entry, trainer)  # what Lightning saves in this checkpoint, as it is now
        if self.tracer is not None:
            entry = attach_trace_tail(entry, self.tracer.tail())
        # every rank's part, in the file rank 0 writes, sealed with a SHA-256 of the whole entry
        return seal_entry(_state.gather_ranks(entry, trainer).to_dict())

    def _build_entry(self, trainer: pl.Trainer, streams: dict[str, Any], truncated: bool = False) -> Entry:
        return _state.build_entry(
            trainer,
            streams,
            seed=self.seed,
            samplers=self.train_samplers,
            iterables=self.train_iterables,
            ours=self,
            truncated=truncated,
            manifest=self.manifest,
        )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] == state_dict.get(DIGEST_KEY):
            self._pending = checked[1]  # parsed and checked when the file was read
        else:
            self._pending = self._parse(state_dict)

    def _parse(self, state_dict: dict[str, Any]) -> ReproState | None:
        if self.ignore_checkpoint_state:
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
            on_topology_change=self.on_topology_change,
            cache=self._warnings,
        )
        if pending is not None:
            self._run_manifest.check_resumed(pending, trainer, warn=lambda m, c: self._warnings.warn(m, category=c))
        return pending

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._trainer = trainer
        # the file keeps Lightning's loop counters as Lightning wrote them; correct them in memory only
        _loops.fix_loop_progress(checkpoint, checkpoint.get("callbacks", {}).get(self.state_key))
        self._resumed_from = getattr(trainer, "ckpt_path", None) or "a checkpoint"
        if self.state_key not in checkpoint.get("callbacks", {}):
            self._warnings.warn(
                "The checkpoint has no lightning-repro entry (it was written without DeterminismCallback, or by an"
                " older version): the RNG streams and the data position cannot be restored, so the resumed run will"
                " not continue bitwise (a mid-epoch resume restarts the epoch's data order). Training goes on.",
                category=NotExactWarning,
            )

