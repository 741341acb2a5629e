"""``DeterminismCallback``: one callback that pins every random stream and resumes bitwise.

This module is the lifecycle, hook by hook; each hook delegates: the data side (installs, the takeover of loaders,
evaluation streams) is :mod:`lightning_repro._takeover`, the checkpoint side (the entry saved, checked and
restored, the resume line) :mod:`lightning_repro._resume`, and the work itself is in the folders below them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_prefixed_message
from typing_extensions import override

from lightning_repro import streams
from lightning_repro._lightning import cycled as _cycled
from lightning_repro._lightning import hooks as _hooks
from lightning_repro._lightning import lastbatch as _lastbatch
from lightning_repro._lightning import loops as _loops
from lightning_repro._lightning import pruning as _pruning
from lightning_repro._lightning import signals as _signals
from lightning_repro._lightning import strategies as _strategies
from lightning_repro._lightning.batchend import BATCH_BYTES
from lightning_repro._takeover import TakeoverMixin
from lightning_repro._warn import WarningCache
from lightning_repro.checkpoint.attributes import UserAttributes, validate_ignored
from lightning_repro.checkpoint.verify import RESTORE_FAILED
from lightning_repro.exceptions import NondeterminismWarning, ReproWarning
from lightning_repro.manifest import collect as _manifest
from lightning_repro.manifest.run import RunManifest
from lightning_repro.seeding import (
    check_hash_seed,
    flags_undone,
    seed_everything,
    seed_process_streams,
    set_deterministic_flags,
    validate_seed,
)
from lightning_repro.trace.tracer import StepTracer, validate_trace_options

__all__ = ["DEFAULT_TRACE_PARAMS_EVERY", "DeterminismCallback"]

log = logging.getLogger(__name__)

DEFAULT_TRACE_PARAMS_EVERY = 10
"""The default of ``trace_params_every``, measured with ``benchmarks/bench_trace.py`` (see docs/performance.md)."""


class DeterminismCallback(TakeoverMixin):
    """Pin every random source of a Lightning run from one seed, and resume it bitwise.

    Constructing the callback seeds python ``random``, numpy, torch CPU and every CUDA device (so a model built
    after it is initialised deterministically) and sets the determinism flags. During ``fit`` it takes over the
    dataloaders (seeded order, sample-keyed access, chained ``worker_init_fn``, resumable sampler), runs
    evaluation loops on their own streams, writes the RNG state and the data position into every checkpoint and
    restores them on resume, so the resumed run continues exactly like the uninterrupted one (a checkpoint inside
    a gradient-accumulation window too: the gradients accumulated so far are saved with it).

    Args:
        seed: The one seed of the run, an int in ``[0, 2**32 - 1]``.
        deterministic: ``True`` makes torch raise on operations without a deterministic
            implementation, ``"warn"`` only warns, ``False`` leaves torch's flags alone.
        sample_keyed: Seed python, numpy and torch from ``(seed, loader, epoch, index)`` while ``dataset[index]``
            runs, so augmentation does not depend on ``num_workers`` (a few us per sample; only the streams a
            sample draws from are seeded). ``False`` saves that, but augmentation then depends on which worker
            loads a sample, and a mid-epoch resume with workers is no longer exact.
        isolate_evaluation: Run validation, test, predict and the sanity check on streams seeded from
            ``(seed, loop, global step)``, so they never move the training streams.
        on_topology_change: A resume with another world size or node count: ``"error"`` raises
            :class:`~lightning_repro.TopologyError`; ``"reseed"`` warns, deals the rest of the epoch out to the
            current ranks (no sample repeated or missed) and re-seeds every rank's streams deterministically.
        ignore_checkpoint_state: Resume while ignoring the checkpoint's lightning-repro entry (one refused as
            damaged, say): Lightning restores weights, optimizer and loops, but not the RNG streams, data
            position, metric states or logged aggregates, and a :class:`~lightning_repro.NotExactWarning` says so.
        data_fingerprint: A string naming the data's version (a dataset hash, a DVC revision...), put in the
            run manifest's ``data`` section.
        data_paths: Files or directories whose contents are hashed into the manifest's ``data`` section (cached on
            path, size and mtime).
        on_env_drift: A resume in an environment changed in a way that can break bitwise continuation (versions,
            CPU or GPU, determinism flags, thread counts...): ``"warn"`` warns, ``"error"`` raises
            :class:`~lightning_repro.EnvironmentDriftError`. Changed code or data only warn.
        trace: Write the step trace (:mod:`lightning_repro.trace`), one record per optimizer step: ``True`` writes
            ``trace-rank{r}.jsonl`` in the directory of the checkpoint being resumed, else in the
            ``ModelCheckpoint``'s ``dirpath``, else in ``default_root_dir``; a path ending in ``.jsonl`` is rank 0's
            file (rank ``r > 0`` writes ``{stem}-rank{r}.jsonl`` beside it), another path a directory. A resumed
            run appends and checks its steps against the interrupted run's (the continuation check).
        trace_params_every: Digest the parameters every that many optimizer steps (default
            :data:`DEFAULT_TRACE_PARAMS_EVERY`, chosen with ``benchmarks/bench_trace.py``).
        on_divergence: What a divergence found at run time does, by the restore check on resume (parameters,
            optimizer, LR schedulers, process streams, data position, metric states differ from what was saved)
            or by the continuation check of a traced run: ``"warn"`` warns
            (:class:`~lightning_repro.NotExactWarning`) and training goes on; ``"error"`` raises
            :class:`~lightning_repro.RestoreError` or :class:`~lightning_repro.DivergenceError`. Either names what
            differs (the components; the step, the field and the likely cause).
        ignore_attributes: Attribute paths (``"module.epoch_t0"``, ``"callback[MyTimer].start"``) left out when a
            mid-epoch resume compares what the skipped ``on_train_epoch_start`` hooks set with the interrupted run's
            (:mod:`lightning_repro.checkpoint.attributes`): values training never reads, such as timings.
        keep_batch_bytes: A checkpoint written inside ``on_train_batch_end`` before hooks that still had to run
            (the module's own, an EMA teacher's) keeps the batch they get when the resume cannot load it again
            (streamed data, several train loaders): at most this many bytes of batch tensors, all ranks together
            (an equal share each; default 64 MiB). A larger batch is not kept and that resume is not exact (a
            ``NotExactWarning`` says so); ``0`` keeps none.

    Attributes:
        restored: Whether the last ``fit`` restored a checkpoint's entry (streams, data position, metric states).
        manifest: The run manifest of the last ``fit`` (:func:`~lightning_repro.collect_manifest`), stored in
            every checkpoint and written as ``repro_manifest.json`` in the logger's ``log_dir``, else in the
            ``default_root_dir``, never in a ``ModelCheckpoint``'s directory; ``None`` before a ``fit``.

    Raises:
        TypeError: ``seed`` is not an int, a flag is not a bool, ``ignore_attributes`` not a list of strings,
            ``trace`` not a bool, a path or None, ``trace_params_every`` or ``keep_batch_bytes`` not an int.
        ValueError: ``seed`` is out of range, ``deterministic`` is not True, False or "warn",
            ``on_topology_change`` is not "error" or "reseed", ``on_env_drift`` or ``on_divergence`` is not
            "warn" or "error", ``trace`` is an empty path, ``trace_params_every`` is below 1, or ``keep_batch_bytes``
            is negative.

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
        ignore_attributes: Collection[str] = (),
        keep_batch_bytes: int = BATCH_BYTES,
    ) -> None:
        self.seed = validate_seed(seed)
        if isinstance(keep_batch_bytes, bool) or not isinstance(keep_batch_bytes, int):
            raise TypeError(f"`keep_batch_bytes` must be an int (bytes), got {keep_batch_bytes!r}; e.g. 256 * 2**20")
        if keep_batch_bytes < 0:
            raise ValueError(f"`keep_batch_bytes` must be >= 0, got {keep_batch_bytes}; 0 keeps no batch")
        self.keep_batch_bytes = keep_batch_bytes
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
        ignored = validate_ignored(ignore_attributes)  # every argument checked before anything process-wide is set
        set_deterministic_flags(deterministic)
        self.deterministic = deterministic
        self.sample_keyed = sample_keyed
        self.isolate_evaluation = isolate_evaluation
        self.ignore_checkpoint_state = ignore_checkpoint_state
        seed_everything(self.seed)
        check_hash_seed(self.seed)
        self._trainer: pl.Trainer | None = None
        self._init_takeover()
        self._init_resume()
        self._attributes = UserAttributes(ignored)  # compared on resume
        self._ranks_seeded = False  # a strategy called seed_rank() in this fit
        self._warnings = WarningCache()  # each of our warnings once per callback
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

    @property
    def manifest(self) -> dict[str, Any] | None:
        """The run manifest of the last ``fit`` (see the callback's docstring), finished on first use."""
        return self._run_manifest.value

    @manifest.setter
    def manifest(self, value: dict[str, Any] | None) -> None:
        self._run_manifest.value = value

    # ------------------------------------------------------------------ setup: take over the data
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        self._truncated = None
        self._ranks_seeded = False
        self._evaluated_step: int | None = None  # a checkpoint's step, evaluated outside fit (on_load_checkpoint)
        if (undone := flags_undone(self.deterministic)) is not None:  # by the Trainer, built after this callback
            self._warnings.warn(undone, category=NondeterminismWarning)
        if stage == "fit":
            self.restored = False
            self._resumed_from, self._afresh = None, []
            self._saved_before_training, self._own_restore = set(), False  # a tuner may save before training
            self._validation_metrics = set()  # a resumed entry's, for the files this fit writes (save.py)
            self._before_sanity: dict[str, Any] | None = None  # the validation's counters a sanity check zeroes
            self._warnings.collect()  # what a resume loses, for the line on_train_start says (until then)
            self._run_manifest.start(trainer, pl_module)  # git runs (once per fit) as the fit starts
        self._uninstall()
        self._install(trainer)
        # the batch hooks have nothing to do without a trace (on_train_batch_start after the first batch: see there)
        _hooks.skip_hook(self, "on_train_batch_start", skip=False, owner=DeterminismCallback)
        # ... nor at a batch's end without a trace, unless a SLURM job's requeue signal is handled there
        idle = self.tracer is None and _signals.requeue_signal(trainer) is None
        _hooks.skip_hook(self, "on_train_batch_end", skip=idle, owner=DeterminismCallback)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()
        if stage == "fit":
            self._pass_counts.fit_ended(trainer)
        self._run_manifest.finish()  # a fit that ended before training started still waits for its git child

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._warnings.take_notes()
        self._uninstall()
        self._pass_counts.forget()
        self._run_manifest.finish()  # wait for the git child started in setup (a few ms, at most its timeout)
        if self.tracer is not None:
            self.tracer.close()  # Lightning skips the teardown hooks when a run raises

    # ------------------------------------------------------------------ ranks
    def seed_rank(self, trainer: pl.Trainer) -> None:
        """Re-seed this rank's process streams from ``(seed, rank)``: called once the model is wrapped.

        ``rank`` is the data-parallel rank: the global rank under DDP and FSDP; under tensor parallelism the ranks
        of one tensor-parallel group keep one stream (one dropout mask on a replicated activation).
        :class:`~lightning_repro.ReproDDPStrategy` and the sharded strategies call it from their ``setup``; without
        such a strategy every rank keeps the same process streams, and ``on_fit_start`` warns.
        """
        self._ranks_seeded = True
        rank, replicas = _strategies.data_parallel(trainer)
        if replicas <= 1:
            return
        rank_seed = streams.rank_seed(self.seed, rank)
        seed_process_streams(rank_seed)
        # what changes the model outside the averaged gradients must agree across ranks: a random pruning's masks
        self._undo += _pruning.prune_alike_on_every_rank(trainer, lambda epoch: streams.pruning_seed(self.seed, epoch))
        named = "rank" if replicas == trainer.world_size else "data-parallel rank"
        log.info(
            rank_prefixed_message(
                f"process streams (python, numpy, torch, CUDA) seeded from (seed={self.seed},"
                f" {named}={rank}) -> {rank_seed}; data order from (seed, loader, epoch), samples from"
                f" (seed, loader, epoch, index), workers from (seed, {named}, loader, epoch, worker)",
                trainer.global_rank,
            )
        )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # in the log dir, and to the loggers: before Lightning logs the module's and datamodule's hyperparameters
        # (`trainer.py: _run` calls `_log_hyperparams` right after `on_fit_start`), so that theirs come last, as in
        # plain Lightning, for a logger that keeps only the last call's (git ran since `setup`)
        self._run_manifest.publish(trainer)
        if trainer.world_size > 1 and not self._ranks_seeded:
            ours = _strategies.repro_counterpart(trainer.strategy)
            self._warnings.warn(
                f"DeterminismCallback runs under {type(trainer.strategy).__name__} with {trainer.world_size} ranks:"
                " every rank keeps the same process streams (identical dropout masks across ranks). Use"
                f" {ours} for rank-aware seeding.",
                category=ReproWarning,
            )

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None:  # resumed: Lightning zeroes the validation's counters after the sanity check
            self._before_sanity = _loops.evaluation_progress(trainer)

    # ------------------------------------------------------------------ training: restore at the last moment
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._before_sanity is not None:  # the checkpoint's counters, as the interrupted run went on with them
            _loops.put_back_evaluation_progress(trainer, self._before_sanity)
            self._before_sanity = None
        self._saved_before_training = None  # from here on, a file loaded in this fit is not a tuner's
        # each batch's start from here on (before the restore: its logged values are put back on top of the watch)
        self._undo += self._batch_start.install(trainer, pl_module)
        restore = self._resume(trainer, pl_module)
        if self._pending is not None and _lastbatch.end_counted_epoch(trainer):
            log.debug("resumed on the epoch's last batch: the epoch ends there (no batch fetched after it)")
        hooks_run = _loops.epoch_start_hooks_run(trainer)
        self._attributes.start(trainer, pl_module, self._pending, self._warnings, hooks_run)
        self._undo.append(self._attributes.watch(trainer, pl_module))  # each epoch's start, before its hooks
        self._batch_start.forget()  # the restore moved the streams
        self._start_trace(trainer)
        if self.tracer is not None and restore is not None and restore.startswith(RESTORE_FAILED):
            self.tracer.restore_failed = restore  # a divergence the continuation check finds is that one
        notes = self._warnings.take_notes()
        if self._resumed_from is not None:
            self._say_resumed(trainer, notes, restore)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.tracer is not None:
            self.tracer.finish()
            if self._resumed_from is not None:  # every rank resumed: each calls the collective
                self.tracer.say_every_rank()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._end_resume_patches()
        if self.tracer is not None:
            self.tracer.batch_start(trainer, batch, batch_idx, self.train_samplers)
        else:  # nothing left to do at a batch's start in this fit: Lightning skips the hook (~1.5 us a step)
            _hooks.skip_hook(self, "on_train_batch_start", skip=True, owner=DeterminismCallback)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.tracer is not None:
            self.tracer.batch_end(trainer, pl_module, outputs)
        _signals.requeue_if_due(trainer)  # SLURM's requeue signal came: its file, written where a step's file is

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attributes.epoch_start(trainer, pl_module)  # and before the first fetch: what the hooks set
        _cycled.new_epoch(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end_epoch(trainer)

    # ------------------------------------------------------------------ evaluation on its own streams
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
        return self._entry()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_entry(state_dict)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # validate/test/predict from a checkpoint: its evaluation streams are those of the step it was written at,
        # whatever step this Trainer is at (0 when fresh, where a fit ended after one): the same values either way
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._evaluated_step = None if fitting else int(checkpoint.get("global_step", trainer.global_step))
        self._loaded_checkpoint(trainer, checkpoint)
