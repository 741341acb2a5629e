"""Build this rank's checkpoint entry at save time, and gather every rank's part into the entry rank 0 writes.

The entry's layout is in :mod:`~lightning_repro.checkpoint.entry`; choosing and applying the part of a loaded entry
on resume is in :mod:`~lightning_repro.checkpoint.state`. Lightning's internals are reached through
:mod:`lightning_repro._lightning` only. Nothing here reads the callback: the seed, the train samplers and loaders are
passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_repro._lightning import batchend as _batchend
from lightning_repro._lightning import cycled as _cycled
from lightning_repro._lightning import hooks as _hooks
from lightning_repro._lightning import loops as _loops
from lightning_repro._lightning import results as _results
from lightning_repro._lightning import strategies as _strategies
from lightning_repro.checkpoint.encoding import encode, encode_list, encode_static
from lightning_repro.checkpoint.entry import OWN_MANIFEST_SECTIONS, Entry, RankPart, seal_entry
from lightning_repro.checkpoint.gather import gather_parts
from lightning_repro.checkpoint.owned import capture_owned, find_owned, run_loaders, user_callbacks
from lightning_repro.checkpoint.replica import exchange_buffers, replica_record, sealed_part
from lightning_repro.data.mapepoch import dataset_state
from lightning_repro.data.takeover import ReproBatchSampler
from lightning_repro.manifest.fingerprint import environment_fingerprint
from lightning_repro.rng import digest_process_streams
from lightning_repro.shards import local_shard

if TYPE_CHECKING:
    from lightning_repro.data.batchstart import Rewind
    from lightning_repro.data.workerpos import StreamPosition

__all__ = ["build_entry", "gather_and_seal", "gather_ranks"]


def _data_positions(
    samplers: Mapping[int, ReproBatchSampler], trainer: pl.Trainer, epoch: int, batches: int
) -> tuple[int, list[dict[str, Any]]]:
    total = trainer.num_training_batches
    mode = _loops.combined_mode(trainer)
    positions = []
    for index, sampler in sorted(samplers.items()):
        counter, current_pass = sampler.pass_in_use() or (epoch, 0)
        length = len(sampler)
        if batches >= total or length == 0:  # the epoch's data is used up
            pass_, offset = current_pass, length
        elif mode == "max_size_cycle":
            pass_, offset = divmod(batches, length)
            if pass_ and not offset:  # at a pass's end: that pass (the next starts once the ended one gives none)
                pass_, offset = pass_ - 1, length
        else:
            pass_, offset = 0, min(batches, length)
        positions.append(
            {
                "index": index,
                "epoch": int(counter),
                "pass": int(pass_),
                "offset": int(offset),
                "length": length,
                "order": sampler.describe(),
            }
        )
    return batches, positions


def _stream_positions(positions: Mapping[int, StreamPosition], trainer: pl.Trainer, batches: int) -> dict[str, Any]:
    """Each streaming train loader's per-worker position in its pass, once ``batches`` of the epoch are consumed.

    The record names the epoch its pass belongs to (an epoch cut short is snapshotted once it is counted done). Once
    the epoch's data is used up it says ``ended``: what the pass leaves to the next epoch's (an epoch-end resume).
    A batch in flight is not consumed yet: a position folds a batch in only when the next one is counted read.
    """
    if batches == 0:
        return {}
    used_up = batches >= trainer.num_training_batches  # never, for a loader without __len__ (inf batches)
    processed = _loops.epoch_done(trainer)
    out = {}
    for index, position in sorted(positions.items()):
        # a loader without __len__ ends its epoch when its iterator runs out; once Lightning counted the epoch
        # processed (its end hooks, after fit) the next resumed iterator is the next epoch's. A checkpoint on its
        # last batch comes before that: Lightning resumes in that epoch, whose pass then runs out
        record = position.describe(batches, ended=used_up or (position.ended and processed))
        previous = position.previous  # (a pass begun after the epoch, none of it read: see StreamPosition.begin_pass)
        if record is None and processed and previous is not None and int(previous["consumed"]) == batches:
            record = previous
        if record is not None and vars(position).pop("own_ahead", False):  # data/loaderstate.py: not corrected
            record["own_ahead"] = True
        if record is not None:
            out[str(index)] = record
    return out


def _validation_metrics(trainer: pl.Trainer, ours: Callback) -> list[str]:
    """The module's metrics the run's validations logged: those this process's logged, and the resumed entry's.

    Lightning resets them when each validation ends, so no file holds their states (see
    :func:`~lightning_repro._lightning.results.eval_metric_ids`). A resumed process knows those its own validations
    logged only: the entry it resumed from names the earlier ones, so a file it writes before (or inside the rest of)
    its first validation leaves out what the uninterrupted run's file does.
    """
    from torchmetrics import Metric

    logged = _results.eval_metric_ids(trainer)
    names = set(getattr(ours, "_validation_metrics", ()))
    names.update(n for n, m in trainer.lightning_module.named_modules() if isinstance(m, Metric) and id(m) in logged)
    return sorted(names)


def _metric_states(pl_module: pl.LightningModule, skip: set[int], skip_names: set[str]) -> dict[str, Any]:
    from torchmetrics import Metric

    out: dict[str, Any] = {}
    for name, module in pl_module.named_modules():
        if isinstance(module, Metric) and id(module) not in skip and name not in skip_names:
            states: dict[str, Any] = {}
            for key, value in module.metric_state.items():
                if isinstance(value, torch.Tensor):
                    states[key] = value.detach().cpu().clone()
                else:
                    states[key] = [t.detach().cpu().clone() for t in value]
            out[name] = {"states": states, "update_count": int(module.update_count)}
    return out


def _accumulated_grads(
    trainer: pl.Trainer, pl_module: pl.LightningModule, in_flight: int | None
) -> dict[str, torch.Tensor] | None:
    """The gradients accumulated in the window so far; ``in_flight``: of the batches before that one (its start).

    Under manual optimization Lightning leaves the gradients to the user's code, so every gradient a parameter holds
    (a zero tensor too: an optimizer skips a parameter without one) is carried into the next batch: all are kept.
    """
    manual = not pl_module.automatic_optimization
    if not manual and not _inside_window(trainer, in_flight):
        return None
    grads = {
        name: local_shard(param.grad).detach().cpu().clone()  # a sharded gradient: this rank's shard
        for name, param in pl_module.named_parameters()
        if param.grad is not None
    }
    return grads or None if manual else grads


def _inside_window(trainer: pl.Trainer, in_flight: int | None) -> bool:
    """Whether batches of the accumulation window are behind the checkpoint (automatic optimization)."""
    if trainer.accumulate_grad_batches <= 1:
        return False
    if in_flight is not None:  # the window holds batches before it unless it is the window's first
        return in_flight % trainer.accumulate_grad_batches != 0
    return _loops.accumulating(trainer) and _loops.batches_ready(trainer) != 0


def _kept_batch(trainer: pl.Trainer) -> bool:
    """Whether the rest of an ``on_train_batch_end`` needs its batch kept: a resume cannot load it again.

    ``data/takeover.py: fetch_again`` loads a batch again from a single map-style loader taken over sample-keyed,
    whose sampler's order lightning-repro computes (not a ``WeightedRandomSampler``, nor a torchdata
    ``StatefulDataLoader``'s own sampler: their batch is kept).
    """
    sampler = getattr(_batchend.single_train_loader(trainer), "batch_sampler", None)
    return not (isinstance(sampler, ReproBatchSampler) and sampler.can_give_again())


def build_entry(
    trainer: pl.Trainer,
    streams: dict[str, Any],
    *,
    seed: int,
    samplers: Mapping[int, ReproBatchSampler],
    iterables: Mapping[int, Any],
    ours: Callback,
    streaming: Mapping[int, StreamPosition] | None = None,
    truncated: bool = False,
    manifest: dict[str, Any] | None = None,
    rewind: Rewind | None = None,
) -> Entry:
    """Build the checkpoint entry with this rank's part (see :func:`gather_ranks` for the others').

    Args:
        trainer: The trainer.
        streams: The training process streams to save.
        seed: The run's seed.
        samplers: The train loaders' samplers by loader index (they give the data position).
        iterables: The train loaders over an ``IterableDataset`` whose main-process ``state_dict()`` is saved, by
            loader index (none since per-worker positions: ``streaming``).
        streaming: The per-worker positions of the train loaders over an ``IterableDataset``, by loader index.
        ours: The callback writing the entry (its own hooks are not part of the hook remainder).
        truncated: The epoch was cut short and its epoch-end hooks are about to run: save the
            epoch-level values as they are now, and let the checkpoint resume mid-epoch.
        manifest: The run manifest (:func:`~lightning_repro.manifest.collect.collect_manifest`), stored as it is.
        rewind: Written inside a training batch (:meth:`~lightning_repro.data.batchstart.BatchStart.rewind`): a
            batch in flight counts unread (Lightning trains it again) and, when the rewind is exact, the logged
            values and gradients are those of the batch's start (``streams`` are its start's then).
    """
    pl_module = trainer.lightning_module
    epoch = _loops.epoch_processed(trainer)
    in_flight = rewind.batch if rewind is not None else None
    consumed = _loops.batches_ready(trainer) if in_flight is None else in_flight
    batches, positions = _data_positions(samplers, trainer, epoch, consumed)
    loaders_now = _loops.train_loaders(trainer) or []
    for position in positions:  # a map-style dataset given its epoch by the user (data/mapepoch.py)
        state = dataset_state(loaders_now[position["index"]]) if position["index"] < len(loaders_now) else None
        if state is not None:
            position["dataset_state"] = state
    data_epoch = positions[0]["epoch"] if positions else epoch
    remainder = None if truncated else _hooks.hook_remainder(trainer, ours)
    # after the epoch-end hooks started, epoch-level values belong to a finished epoch, unless the resume is to
    # finish that epoch's end (a checkpoint written in on_train_epoch_end): then they are logged from the entry
    epoch_end_pending = remainder is not None and remainder["hook"] == "on_train_epoch_end"
    batch_end = remainder is not None and remainder["hook"] == "on_train_batch_end"
    # (a stream's loader has no data position of ours that names its epoch: the loops say the epoch's end was reached;
    # a stream-only run saved after fit once kept the reset epoch aggregates: `trainer.callback_metrics` read NaN)
    ended = epoch > data_epoch or (not positions and _loops.epoch_done(trainer))
    epoch_over = not truncated and ended and not epoch_end_pending
    loaders = [samplers[i] for i in sorted(samplers)]
    topology: dict[str, Any] = {
        "world_size": int(trainer.world_size),
        "num_nodes": int(trainer.num_nodes),
        "num_workers": [int(getattr(s, "num_workers", -1)) for s in loaders],
    }
    _, replicas = _strategies.data_parallel(trainer)
    if replicas != trainer.world_size:  # tensor parallelism: the ranks of a tensor-parallel group share a replica
        topology["data_parallel_size"] = replicas
    skip = _results.logged_metric_ids(trainer) if epoch_over else set()
    validation = _validation_metrics(trainer, ours)
    before = rewind.logged if rewind is not None and rewind.exact else None
    cap = getattr(ours, "keep_batch_bytes", None)  # the batch a batch-end remainder needs, kept up to this size
    part = RankPart(
        streams=streams,
        streams_sha256=digest_process_streams(streams),
        batches=batches,
        data=positions,
        metrics=_metric_states(pl_module, skip=skip, skip_names=set(validation)),
        validation_metrics=validation,
        logged={} if epoch_over or batches == 0 else _results.logged_values(trainer, before),
        grads=_accumulated_grads(trainer, pl_module, in_flight),
        iterables={str(index): loader.dataset.state_dict() for index, loader in sorted(iterables.items())},
        streaming=_stream_positions(streaming or {}, trainer, batches),
        generators=capture_owned(find_owned(pl_module, user_callbacks(trainer), run_loaders(trainer))),
        batch_end=_batchend.batch_outputs(trainer, keep_batch=_kept_batch(trainer), cap=cap) if batch_end else None,
        ran_out=_cycled.cycling_mask(trainer),  # each rank's own (loops' ran_out: rank 0's)
    )
    return Entry(
        seed=seed,
        topology=topology,
        ranks=[part],
        environment=environment_fingerprint(),
        pending=_loops.pending_after_batch(trainer),
        remainder=remainder,
        callback_metrics=_results.trainer_metrics(trainer, batch_end=_loops.in_train_batch_end(trainer)),
        truncated=truncated,
        loops=_loops.loop_facts(trainer),
        manifest=manifest,
        in_flight=rewind.record() if rewind is not None else None,
    )


def _gathered(entry: Entry, trainer: pl.Trainer) -> tuple[Entry, list[bytes]]:
    """Every rank's part in ``entry`` (a new entry; ``entry`` is left as it is), and each part's encoding."""
    import torch.distributed as dist

    part = entry.ranks[0].to_dict()
    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return entry, [encode(part)]
    replica = replica_record(trainer)  # DDP: this rank's buffers as they are saved now (checkpoint/replica.py)
    if replica is not None:
        part["replica"] = replica
    if trainer.global_rank > 0:  # the shared values are rank 0's; its own values logged without sync_dist differ
        part["callback_metrics"] = entry.callback_metrics
        if entry.pending is not None and entry.pending.get("log") is not None:
            part["pending_log"] = entry.pending["log"]
        if entry.manifest is not None:  # its node's hardware, its interpreter (PYTHONHASHSEED: the launcher's)
            part["own_manifest"] = {k: entry.manifest[k] for k in OWN_MANIFEST_SECTIONS if k in entry.manifest}
    parts, codes = gather_parts(part, encode(sealed_part(part)))  # the digests of callback states: not in the file
    exchange_buffers(parts, codes, trainer)  # those unlike rank 0's, into their parts (a second round, or none)
    return replace(entry, ranks=[RankPart(**p) for p in parts]), codes


def gather_ranks(entry: Entry, trainer: pl.Trainer) -> Entry:
    """Collect every rank's part into the entry rank 0 writes (a collective: call it on every rank).

    ``entry`` holds this rank's part only and is left as it is (a truncated epoch's entry is gathered again by every
    checkpoint written at that step); returns a new entry. One ``all_gather`` when every packed part fits in 64 KiB
    (the process streams and data position take a few, twice: with their encoding), two otherwise
    (:mod:`~lightning_repro.checkpoint.gather`).
    """
    return _gathered(entry, trainer)[0]


def gather_and_seal(entry: Entry, trainer: pl.Trainer) -> dict[str, Any]:
    """:func:`gather_ranks`, as the plain dict a checkpoint holds, sealed (``entry_sha256``).

    The seal hashes each part as the rank that built it encoded it, and the manifest and the environment as they
    were encoded at the last save when they are unchanged: the same SHA-256 as :func:`~.entry.seal_entry` of the
    dict, without encoding the other ranks' parts or the unchanged values again.
    """
    gathered, codes = _gathered(entry, trainer)
    out = gathered.to_dict()
    encoded = {"ranks": encode_list(codes)}
    for key in _STATIC_KEYS:
        encoded[key] = encode_static(key, out[key])
    return seal_entry(out, encoded=encoded)


_STATIC_KEYS = ("environment", "manifest")
"""The entry's values that rarely change between saves (their encoding is remembered: ``encode_static``)."""
