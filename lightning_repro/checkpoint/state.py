"""Choose and apply this rank's part of a loaded checkpoint entry on resume.

Building this rank's entry at save time and gathering every rank's part are in
:mod:`~lightning_repro.checkpoint.save`. The entry's layout, its SHA-256 and every check of a loaded entry are in
:mod:`~lightning_repro.checkpoint.entry`; Lightning's internals are reached through :mod:`lightning_repro._lightning`
only. Nothing here reads the callback: the seed, the train samplers and loaders, and the epoch counter are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

from lightning_repro._lightning import loops as _loops
from lightning_repro._lightning import results as _results
from lightning_repro._types import is_stateful
from lightning_repro._warn import warn as repro_warn
from lightning_repro.checkpoint import owned as _owned
from lightning_repro.checkpoint import replica as _replica
from lightning_repro.checkpoint.entry import Entry
from lightning_repro.data import mapepoch as _mapepoch
from lightning_repro.data.takeover import position_mismatch
from lightning_repro.exceptions import NotExactWarning, SeedMismatchError, TopologyError
from lightning_repro.rng import (
    capture_process_streams,
    check_restored,
    fork_process_streams,
    restore_process_streams,
)
from lightning_repro.shards import shaped_like
from lightning_repro.streams import reseed_after_topology_change

if TYPE_CHECKING:
    from lightning_repro._warn import WarningCache
    from lightning_repro.data.takeover import ReproBatchSampler
    from lightning_repro.data.workerpos import StreamPosition

__all__ = [
    "ReproState",
    "apply_data_position",
    "apply_iterable_state",
    "apply_process_state",
    "apply_stream_position",
    "check_restored",
    "end_remapped_epoch",
    "is_stateful_iterable",
    "parse_entry",
    "train_data_resumes_exactly",
]


@dataclass
class ReproState:
    """This rank's part of a parsed, checked entry, waiting to be applied on resume."""

    seed: int
    streams: dict[str, Any]
    data: list[dict[str, Any]]
    batches: int
    topology: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    logged: dict[str, Any] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] | None = None
    environment: dict[str, str] = field(default_factory=dict)
    remap: bool = False  # resumed under another world size: re-deal the data, re-seed the streams
    resharded: bool = False  # and the model is sharded: its shards (whose digests the restore check took) dealt anew
    iterables: dict[str, Any] = field(default_factory=dict)  # state_dict() of train IterableDatasets (main process)
    streaming: dict[str, Any] = field(default_factory=dict)  # per-worker positions of streaming train loaders
    pending: dict[str, Any] | None = None  # what the interrupted run still did after the checkpoint's batch
    trainer_metrics: dict[str, Any] = field(default_factory=dict)  # callback_metrics & co. at the checkpoint
    remainder: dict[str, Any] | None = None  # the rest of the hook the checkpoint was written in
    manifest: dict[str, Any] | None = None  # the run manifest at save time (None: written before manifests)
    restore_sha256: dict[str, str] = field(default_factory=dict)  # what the restore check compares (verify.py)
    trace: list[dict[str, Any]] | None = None  # the step trace's last records before the checkpoint
    save_guards: list[dict[str, Any]] | None = None  # what each checkpoint callback had saved (its guard)
    frozen: list[str] | None = None  # the parameters without requires_grad at the checkpoint (None: not recorded)
    pruned: list[dict[str, Any]] | None = None  # ModelPruning's masks at the checkpoint (checkpoint/pruned.py)
    rank0_restore_sha256: dict[str, str] = field(default_factory=dict)  # rank 0's digests (DDP files hold its state)
    generators: dict[str, Any] = field(default_factory=dict)  # the module's and callbacks' own (owned.py)
    accumulation: Any = None  # the Trainer's accumulate_grad_batches at the checkpoint (None: not recorded)
    batch_end: dict[str, Any] | None = None  # the outputs of the on_train_batch_end the file was written in
    validation_metrics: list[str] = field(default_factory=list)  # the metrics the run's validations had logged
    replica: dict[str, Any] | None = None  # DDP: the rank's own buffers, DDP's flag (checkpoint/replica.py)

    @classmethod
    def of(cls, entry: Entry, index: int) -> ReproState:
        """The state to apply from rank ``index``'s part of ``entry``.

        The shared values are given to every rank: what followed the checkpoint's batch (a due validation) and the
        rest of the hook it was written in are the same decisions on every rank, and every rank must take part in
        them (a validation, a checkpoint saved in it, are collectives under DDP). The trainer's metric dicts, the
        values of the pending log row and the manifest's environment and hardware are the rank's own (values logged
        without ``sync_dist`` differ by rank; a node's hardware, a launched rank's ``PYTHONHASHSEED``); a file
        written before the parts held them has rank 0's only, given to every rank.
        """
        part = entry.ranks[index]
        pending = entry.pending
        if pending is not None and part.pending_log is not None:
            pending = {**pending, "log": part.pending_log}
        manifest = entry.manifest
        if manifest is not None and part.own_manifest is not None:  # its own node and interpreter, not rank 0's
            manifest = {**manifest, **part.own_manifest}
        own = ("streams", "data", "batches", "metrics", "logged", "grads", "iterables", "streaming", "restore_sha256")
        more = ("trace", "generators", "batch_end", "validation_metrics", "replica")
        return cls(
            seed=entry.seed,
            topology=entry.topology,
            environment=entry.environment,
            pending=pending,
            trainer_metrics=entry.callback_metrics if part.callback_metrics is None else part.callback_metrics,
            remainder=entry.remainder,
            manifest=manifest,
            save_guards=entry.save_guards,
            frozen=entry.frozen,
            pruned=entry.pruned,
            rank0_restore_sha256=entry.ranks[0].restore_sha256,
            accumulation=entry.loops.get("accumulate_grad_batches"),  # checked where it is read
            **{name: getattr(part, name) for name in own + more},
        )


def _warn(cache: WarningCache | None, message: str, category: type[Warning]) -> None:
    if cache is None:
        repro_warn(message, category)
    else:
        cache.warn(message, category=category)


def is_stateful_iterable(loader: Any) -> bool:
    """A loader over an ``IterableDataset`` that implements ``state_dict()`` and ``load_state_dict()``.

    Not a loader that keeps its own state (litdata's ``StreamingDataLoader``, torchdata's ``StatefulDataLoader``):
    Lightning saves and restores that state (``"combined_loader"`` in the loops' entry), which positions its
    dataset, whose ``state_dict()`` may take arguments only the loader knows (litdata's does).
    """
    from torch.utils.data import IterableDataset

    dataset = getattr(loader, "dataset", None)
    return isinstance(dataset, IterableDataset) and is_stateful(dataset) and not is_stateful(loader)


# ---------------------------------------------------------------------------------------- load: choose this rank's part
def _describe_topology(topology: dict[str, Any]) -> str:
    text = f"world size {topology.get('world_size')} ({topology.get('num_nodes')} node(s))"
    replicas = topology.get("data_parallel_size", topology.get("world_size"))
    if replicas != topology.get("world_size"):
        tensor = int(topology.get("world_size", 1)) // max(1, int(replicas or 1))
        text = f"{text[:-1]}, data parallel {replicas} x tensor parallel {tensor})"
    return text


def parse_entry(
    entry: dict[str, Any],
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    num_nodes: int = 1,
    on_topology_change: str = "error",
    cache: WarningCache | None = None,
    data_parallel: tuple[int, int] | None = None,
) -> ReproState | None:
    """Check a loaded entry completely (:meth:`Entry.from_dict`) and return this rank's part; nothing is applied.

    ``data_parallel``: this rank's ``(rank, size)`` among the data-parallel replicas (default ``(rank,
    world_size)``); under tensor parallelism a changed split of the same world size is a topology change too.

    Raises:
        SeedMismatchError: the entry was written with another seed.
        CorruptStateError: a part of the entry is damaged (the message names it).
        TopologyError: the world size or node count changed and ``on_topology_change="error"``.
        ReproError: the entry's version is newer than this lightning-repro understands.
    """
    if not entry:
        return None
    parsed = Entry.from_dict(entry)
    if parsed.seed != seed:
        raise SeedMismatchError(
            f"the checkpoint was written with seed {parsed.seed} but DeterminismCallback has seed {seed}:"
            f" resuming would mix two runs. Use DeterminismCallback(seed={parsed.seed}) to resume it,"
            " or start a new run without `ckpt_path`."
        )
    topology = parsed.topology
    saved_world = len(parsed.ranks)
    replica, replicas = data_parallel if data_parallel is not None else (rank, world_size)
    saved_replicas = int(topology.get("data_parallel_size", saved_world))
    current: dict[str, Any] = {"world_size": world_size, "num_nodes": num_nodes}
    if replicas != world_size:
        current["data_parallel_size"] = replicas
    same_split = saved_world == world_size and saved_replicas == replicas
    if same_split and int(topology.get("num_nodes", 1)) == num_nodes:
        return ReproState.of(parsed, rank)
    if on_topology_change == "error":
        raise TopologyError(
            f"the checkpoint was written with {_describe_topology(topology)} but this run has"
            f" {_describe_topology(current)}: the per-rank RNG streams cannot continue exactly. Resume with the same"
            " topology, or pass `on_topology_change='reseed'` to DeterminismCallback to continue with a deterministic"
            " re-seed (the data position is kept: no sample of the epoch is repeated or missed)."
        )
    if same_split:  # same ranks spread over other nodes: nothing to re-deal
        return ReproState.of(parsed, rank)
    _warn(
        cache,
        f"Resuming a checkpoint of {_describe_topology(topology)} with {_describe_topology(current)}"
        " (on_topology_change='reseed'): the rest of the epoch is dealt out to the current ranks and every"
        " rank's streams are re-seeded from (seed, world size, rank, position). The run is deterministic but"
        " differs from an uninterrupted run on the old topology.",
        NotExactWarning,
    )
    state = ReproState.of(parsed, min(rank, saved_world - 1))
    state.remap = True
    position = state.data[0] if state.data else {"epoch": 0, "offset": 0}
    # keyed by the data-parallel split (the world under DDP): a tensor-parallel group keeps one stream
    reseed = reseed_after_topology_change(seed, saved_replicas, replicas, replica, position["epoch"], state.batches)
    with fork_process_streams(reseed):  # derive the re-seeded state without touching the live streams
        state.streams = capture_process_streams()
    return state


# ---------------------------------------------------------------------------------------- apply
def train_data_resumes_exactly(trainer: pl.Trainer) -> bool:
    """Every train loader is taken over (a ``ReproBatchSampler``) or an ``IterableDataset`` with ``state_dict()``."""
    from lightning_repro.data.takeover import ReproBatchSampler, loader_position

    loaders = _loops.train_loaders(trainer)
    if loaders is None:
        return False
    for loader in loaders:
        samplers = (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None))
        streaming = loader_position(loader) is not None
        known = any(isinstance(s, ReproBatchSampler) for s in samplers) or streaming
        if not known and not is_stateful_iterable(loader):
            return False
    return True


def apply_iterable_state(state: ReproState, index: int, loader: Any) -> None:
    """Give a train ``IterableDataset`` back the main-process state an older checkpoint saved (before ``streaming``)."""
    saved = state.iterables.get(str(index))
    if saved is not None and str(index) not in state.streaming:
        dataset = getattr(loader.dataset, "dataset", loader.dataset)  # under our KeyedIterable
        dataset.load_state_dict(saved)


def apply_stream_position(
    state: ReproState,
    index: int,
    position: StreamPosition,
    *,
    num_workers: int,
    name: str,
    redeal: bool = False,
    alike: bool = True,
    on_topology_change: str = "error",
    cache: WarningCache | None = None,
) -> bool:
    """Give a streaming train loader the per-worker position of its pass; whether it was given.

    ``num_workers`` 0 and 1 read alike (one stream of items, worker 0) where ``alike`` says so (not HF's pipelines
    that draw: ``libraries.main_reads_as_worker``); another change cannot give the workers' positions to other
    workers. With ``on_topology_change="reseed"`` the rest of the epoch is a new pass on the new
    workers (its own item streams): dealt out by the loader itself where it can (``redeal``: litdata's, each item of
    the epoch read once), else the epoch's data from its start. ``name``: the pipeline, as messages name it.

    Raises:
        TopologyError: ``num_workers`` changed and ``on_topology_change="error"``.
    """
    record = state.streaming.get(str(index))
    if record is None:
        return False
    if state.remap:
        _warn(
            cache,
            f"Train dataloader {index} over {name} (an IterableDataset) cannot be re-dealt to another world size:"
            " its epoch's data starts over on every rank (deterministic; the items read before the checkpoint are"
            " read again).",
            NotExactWarning,
        )
        return False
    saved = int(record["num_workers"])
    if saved != num_workers and (max(saved, 1) != max(num_workers, 1) or not alike):
        if redeal:
            why = f"{num_workers} workers read another order than {saved}, so no continuation is the uninterrupted run"
            goes_on = "the loader deals the rest of the epoch out to the new workers"
            detail = (
                "each item of the epoch is read once (its elastic resume); the run is deterministic, though not the"
                " uninterrupted run of either count"
            )
        elif max(saved, 1) == max(num_workers, 1):  # 0 and 1: the main process reads another order than a worker
            why = f"{name} reads another order in a worker (even the only one) than in the main process"
        else:
            why = "each worker's position in the epoch cannot be given to another number of workers (what a worker"
            why += " reads depends on the count)"
        if not redeal:
            goes_on = "the epoch's data starts over on the new workers"
            detail = "the run is deterministic, but the items read before the checkpoint are read again"
        if on_topology_change == "error":
            raise TopologyError(
                f"train dataloader {index} over the IterableDataset {name} was checkpointed with"
                f" num_workers={saved} and is resumed with num_workers={num_workers}: {why}. Resume with"
                f" num_workers={saved} (exact), or pass `on_topology_change='reseed'` to DeterminismCallback: then"
                f" {goes_on} ({detail})."
            )
        _warn(
            cache,
            f"Train dataloader {index} over {name} was checkpointed with num_workers={saved} and is resumed with"
            f" num_workers={num_workers} (on_topology_change='reseed'): {goes_on}. {detail[0].upper()}{detail[1:]}.",
            NotExactWarning,
        )
        position.reseed(record, "re-dealt by the loader to" if redeal else "the epoch's data starts over on")
        return False
    position.resume = record
    return True


def apply_data_position(
    state: ReproState, index: int, sampler: ReproBatchSampler, *, warn: bool = True, cache: Any = None, loader: Any = 0
) -> None:
    """Tell a train sampler where its data stood when the checkpoint was written (and its dataset its epoch)."""
    for position in state.data:
        if position["index"] == index:
            if loader and not state.remap:  # its dataset given the epoch a hook the resume skips gave it
                _mapepoch.give_epoch(loader, position, index, cache)
            problem = None if state.remap else position_mismatch(index, position, sampler)  # re-dealt: another length
            if warn and problem:  # another length or order
                _warn(cache, problem, NotExactWarning)
            if state.remap:
                order = position.get("order") or {}
                if order.get("kind", "other") == "other":
                    if not warn:
                        return
                    _warn(
                        cache,
                        f"Train dataloader {index}'s sampler cannot be re-dealt to another world size: its epoch"
                        " restarts from the beginning on every rank.",
                        NotExactWarning,
                    )
                    return
                sampler.resume_remapped(position["epoch"], position["pass"], position["offset"], order)
                return
            sampler.resume_at(position["epoch"], position["pass"], position["offset"])
            return


def _apply_metrics(state: ReproState, pl_module: pl.LightningModule, cache: WarningCache | None) -> None:
    from torchmetrics import Metric

    modules = dict(pl_module.named_modules())
    for name, saved in state.metrics.items():
        module = modules.get(name)
        if not isinstance(module, Metric):
            _warn(
                cache,
                f"The checkpoint holds the state of metric {name!r}, which the model no longer has:"
                " it is not restored.",
                NotExactWarning,
            )
            continue
        for key, value in saved["states"].items():
            current = getattr(module, key)
            device = current.device if isinstance(current, torch.Tensor) else module.device
            if isinstance(value, torch.Tensor):
                setattr(module, key, value.to(device))
            else:
                setattr(module, key, [t.to(device) for t in value])
        _results.set_metric_update_count(module, int(saved["update_count"]))


def end_remapped_epoch(samplers: Iterable[ReproBatchSampler], trainer: pl.Trainer) -> None:
    """After the epoch re-dealt to a new world size, count batches per epoch as the loaders say again."""
    for sampler in samplers:
        sampler.end_remap()
    _loops.recount_train_batches(trainer)


def apply_process_state(
    state: ReproState, trainer: pl.Trainer, pl_module: pl.LightningModule, *, cache: WarningCache | None = None
) -> None:
    """Restore the process streams, metrics, logged aggregates, gradients, the module's and callbacks' generators."""
    if state.generators and not state.remap and (lost := _owned.give_back(state.generators, trainer)):
        _warn(cache, lost, NotExactWarning)
    _apply_metrics(state, pl_module, cache)
    _results.restore_logged_values(trainer, state.logged)
    _results.restore_trainer_metrics(trainer, state.trainer_metrics)
    if state.grads:
        params = dict(pl_module.named_parameters())
        for name, grad in state.grads.items():
            if name in params:
                params[name].grad = shaped_like(grad, params[name])  # a sharded parameter: as its shard
    _replica.give_back(state.replica, trainer, state.remap, cache)  # this rank's own buffers (the file: rank 0's)
    restore_process_streams(state.streams)
    check_restored(state.streams)
