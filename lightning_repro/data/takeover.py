"""Take over a ``DataLoader`` without changing the user's code.

:func:`prepare_dataloader` edits a loader in place so that:

* the order comes from a dedicated generator re-seeded from ``(seed, stage, loader, epoch,
  pass)`` whenever an iterator is created, never from the global RNG;
* ``dataset[i]`` runs with python, numpy and torch seeded from ``(seed, stage, loader, epoch,
  pass, i)`` (sample-keyed access), in workers and in the main process alike; in the main
  process the process streams are put back after each batch, so loading never shifts them;
* the user's ``worker_init_fn`` still runs, followed by the seeding of the worker streams;
* a resume skips the consumed batches at the index level: for the standard samplers
  (``SequentialSampler``, ``RandomSampler``, ``DistributedSampler`` under a ``BatchSampler``)
  the first resumed batch is sliced straight out of the epoch's order, whatever the number of
  skipped batches; other samplers are advanced index by index, loading no data (exact when their order
  replays from the seed: an INFO line says so, a :class:`~lightning_repro.NotExactWarning` when it does not).

A loader over an ``IterableDataset`` gets item-keyed streams and per-worker positions instead
(:mod:`lightning_repro.data.streaming`, :mod:`lightning_repro.data.workerpos`): its copy's class becomes a subclass
of its own whose iterator takes each batch's worker stamp off. A ``torchdata.nodes`` ``Loader``: :mod:`.nodes`.
The order and position live in :mod:`lightning_repro.data.samplers`, the seeds in :mod:`lightning_repro.streams`,
the fast save/restore of the process streams in :mod:`lightning_repro.data.fastrng`; this module wires them in.
Warnings go through a :class:`~lightning_repro._warn.WarningCache` the caller holds (the callback keeps one per
instance), so each cause is warned once per run, on rank 0, at the user's line.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    default_collate,
    default_convert,
)

from lightning_repro._lightning.hooks import IndexRecorder, recorded_batch_sampler
from lightning_repro._warn import WarningCache
from lightning_repro.data import nodes, webloader
from lightning_repro.data.foreign import EXACT_SEEDINGS, seeding_text
from lightning_repro.data.generators import OwnGenerator, find_generators
from lightning_repro.data.keyed import KeyedBatch, KeyedCollate, KeyedDataset, SampleKey
from lightning_repro.data.libraries import poses_as_dataset, posing, positioned_by_loader, unrepeatable_stages
from lightning_repro.data.passkey import SharedKey
from lightning_repro.data.passseeder import PassSeeder
from lightning_repro.data.samplers import ReproBatchSampler
from lightning_repro.data.streamcollate import StreamCollate
from lightning_repro.data.streaming import KeyedIterable
from lightning_repro.data.wdsstages import unrepeatable_advice
from lightning_repro.data.workerinit import _WorkerInit
from lightning_repro.data.workerpos import StreamPosition, loader_position, plain_loader_class, stream_loader
from lightning_repro.exceptions import NotExactWarning
from lightning_repro.streams import StreamKey

__all__ = [
    "KeyedBatch",
    "ReproBatchSampler",
    "SampleKey",
    "StreamKey",
    "fetch_again",
    "loader_position",
    "position_mismatch",
    "prepare_dataloader",
]

log = logging.getLogger(__name__)


def _force_setattr(loader: DataLoader[Any], name: str, value: Any) -> None:
    # DataLoader refuses to set some attributes after __init__; we replace them before any iterator exists
    object.__setattr__(loader, name, value)


def _strip_layers(loader: DataLoader[Any]) -> None:
    """Take our layers off a copy that Lightning re-instantiated from a loader we prepared."""
    plain_loader_class(loader)
    if isinstance(loader.dataset, (KeyedDataset, KeyedIterable)):
        _force_setattr(loader, "dataset", loader.dataset.dataset)
    if isinstance(loader.collate_fn, (KeyedCollate, StreamCollate)):
        loader.collate_fn = loader.collate_fn.collate_fn
    if isinstance(loader.worker_init_fn, _WorkerInit):
        loader.worker_init_fn = loader.worker_init_fn.user_fn


def _private_copy(loader: DataLoader[Any]) -> DataLoader[Any]:
    """A shallow copy of the user's loader to take over.

    The user's object is never edited, so there is nothing to give back at teardown, and one loader
    object can serve several loops and trainers.
    """
    clone = copy.copy(loader)
    _force_setattr(clone, "_iterator", None)  # a persistent-workers iterator belongs to the user's loader
    _strip_layers(clone)
    return clone


def _plain_indices(batch: Any) -> Any:
    return list(batch.indices) if type(batch) is KeyedBatch else batch


class _PlainIndexRecorder(IndexRecorder):
    """Lightning's predict-time recorder, kept outermost over our batch sampler.

    ``BasePredictionWriter`` receives the recorded batches as ``batch_indices``: plain lists of
    indices, as in plain Lightning, while the loader still gets our keyed batches.
    """

    def __init__(self, batch_sampler: Any) -> None:
        super().__init__(batch_sampler, _plain_indices)


def _warn_once(cache: WarningCache, message: str, category: type[Warning]) -> None:
    # rank 0, at the user's line; not a reason of the resume line, which judges the data position itself
    cache.warn(message, category=category, note=False)


def _own_generators(dataset: Any, cache: WarningCache) -> list[OwnGenerator]:
    """The generators ``dataset`` holds that we key per sample; a warning for each one we cannot key."""
    found, unkeyable = find_generators(dataset)
    name = type(dataset).__name__
    for generator in found:
        log.debug(f"{name}.{generator.path} ({type(generator.obj).__name__}) is re-seeded per sample")
    for path, reason in unkeyable:
        cache.warn(  # a reason of the resume line too: nothing restores it
            f"{name}.{path} looks like a random generator that lightning-repro cannot re-seed per sample ({reason}):"
            " what it draws depends on num_workers and on which worker loads a sample, and a resume does not"
            " restore it. Draw from python `random`, `numpy.random`, `torch` (keyed per sample), or hold a"
            " `random.Random`, `numpy.random.Generator`, `numpy.random.RandomState` or CPU `torch.Generator`"
            " (found and keyed per sample too).",
            category=NotExactWarning,
        )
    return found


def _take_over_iterable(
    loader: DataLoader[Any],
    current: Any,
    batched: bool,
    *,
    seed: int,
    rank: int,
    stream: StreamKey,
    counter: Callable[[], int],
    generator: torch.Generator,
    keyed: bool,
    consumed: Callable[[], int] | None,
    cache: WarningCache,
) -> DataLoader[Any]:
    """The takeover of a loader over an ``IterableDataset`` (:mod:`lightning_repro.data.streaming`)."""
    name = type(loader.dataset).__name__
    workers = int(loader.num_workers)
    if workers > 1 and not getattr(loader, "in_order", True):
        _warn_once(
            cache,
            f"The loader over {name} has in_order=False: its batches come in the order {workers} workers finish"
            " them, which depends on timing, so neither a repeat nor a resume of it is exact. Leave in_order=True"
            " (the default) to make both exact.",
            NotExactWarning,
        )
    for stage in unrepeatable_stages(loader.dataset):
        cache.warn(  # a reason of the resume line too: nothing restores what it drew
            f"{name}'s `{stage}` (webdataset) seeds itself from the process id and the clock: its order differs in"
            f" every run, so this run cannot be repeated and a resume of it is not exact. To fix it,"
            f" {unrepeatable_advice(stage)}.",
            category=NotExactWarning,
        )
    wrapper = posing(KeyedIterable) if poses_as_dataset(loader) else KeyedIterable  # litdata checks its class
    positioned = positioned_by_loader(loader)
    loader = _private_copy(loader)
    dataset = wrapper(
        loader.dataset, owner=(stream.stage, stream.loader, rank), keyed=keyed, batch_size=loader.batch_size
    )
    dataset._positioned = positioned
    if workers > 0 and loader.persistent_workers and not batched:  # no batch request tells its workers the pass
        dataset._shared_key = SharedKey()
    if keyed:
        dataset._own = _own_generators(loader.dataset, cache)
    position = StreamPosition(num_workers=workers, consumed=consumed)
    seeder = PassSeeder(
        current,
        seed=seed,
        rank=rank,
        stream=stream,
        counter=counter,
        generator=generator,
        dataset=dataset,
        position=position,
        batched=batched,
        persistent=workers > 0 and bool(loader.persistent_workers),
    )
    _force_setattr(loader, "batch_sampler" if batched else "sampler", seeder)
    _force_setattr(loader, "dataset", dataset)
    draws = loader.collate_fn not in (default_collate, default_convert)  # torch's own draw nothing
    loader.collate_fn = StreamCollate(loader.collate_fn, dataset, seed_collate=draws)
    loader.generator = generator  # draws of the iterator's base seed no longer touch the global RNG
    loader.worker_init_fn = _WorkerInit(loader.worker_init_fn, seed, rank, stream)
    stream_loader(loader, position)
    return loader


def prepare_dataloader(
    loader: Any,
    *,
    seed: int,
    rank: int,
    stream: StreamKey,
    counter: Callable[[], int],
    sample_keyed: bool = True,
    world_size: int = 1,
    warning_cache: WarningCache | None = None,
    consumed: Callable[[], int] | None = None,
) -> Any:
    """Take over a shallow copy of ``loader`` (see the module docstring) and return the copy.

    The user's loader and the objects it holds are left as they are. Anything that is not a
    ``torch.utils.data.DataLoader`` is returned unchanged with a warning. A loader already prepared
    (also inside Lightning's predict-time ``_IndexBatchSamplerWrapper``) is re-bound to ``stream``
    and ``counter``. For ``trainer.predict``, Lightning's wrapper stays the outermost batch sampler,
    so ``BasePredictionWriter`` gets the batch indices as in plain Lightning.

    Args:
        loader: The dataloader.
        seed: The user seed.
        rank: The global rank (keys the worker streams only).
        world_size: The number of ranks (used to resume a checkpoint of another world size).
        stream: The stage and the index of the loader in that stage.
        counter: Returns, when a pass starts, the epoch (training) or ``2 * global_step`` (+1 in the sanity
            check) for evaluation.
        sample_keyed: Seed each ``dataset[i]`` from its key.
        warning_cache: Where the warnings already given are remembered, so each cause is warned once;
            hold one per run (the callback does). ``None``: a new cache, so this call warns afresh.
        consumed: For a loader over an ``IterableDataset``: returns how many batches of the current epoch training
            has consumed, so its per-worker position counts only those (:mod:`lightning_repro.data.workerpos`).
    """
    cache = WarningCache() if warning_cache is None else warning_cache
    held = webloader.inner_loader(loader)
    if held is not None and not webloader.why_not_taken_over(loader):  # wds.WebLoader: through its DataLoader
        kwargs: dict[str, Any] = {"seed": seed, "rank": rank, "stream": stream, "counter": counter}
        kwargs.update(world_size=world_size, sample_keyed=sample_keyed, consumed=consumed)
        return webloader.around(loader, prepare_dataloader(held, **kwargs, warning_cache=cache), consumed)
    if nodes.is_nodes_loader(loader):  # torchdata.nodes: a copy of its graph, keyed
        keys: dict[str, Any] = {"seed": seed, "rank": rank, "stream": stream, "counter": counter, "consumed": consumed}
        return nodes.take_over(loader, **keys, warn=functools.partial(_warn_once, cache, category=NotExactWarning))
    if isinstance(loader, (list, tuple, dict)) and not loader:  # `[]` from `val_dataloader()`: no loader at all
        return loader
    if not isinstance(loader, DataLoader):
        why = webloader.why_not_taken_over(loader) if held is not None else ""
        _warn_once(
            cache,
            f"lightning-repro cannot take over a {type(loader).__name__} (not a torch DataLoader{': ' if why else ''}"
            f"{why}): its order and randomness are not pinned, and a mid-epoch resume of it is not exact.",
            NotExactWarning,
        )
        return loader
    batched = loader.batch_sampler is not None
    current: Any = loader.batch_sampler if batched else loader.sampler
    inner = recorded_batch_sampler(current)  # trainer.predict records the batch indices
    recorded = inner is not None
    if recorded:
        current = inner
    if isinstance(current, ReproBatchSampler):
        current.stream, current.counter, current.rank, current.world_size = stream, counter, rank, world_size
        if recorded and type(loader.batch_sampler) is not _PlainIndexRecorder:
            _force_setattr(loader, "batch_sampler", _PlainIndexRecorder(current))
        return loader
    generator = torch.Generator()
    if isinstance(loader.dataset, IterableDataset):
        if isinstance(current, PassSeeder):
            current.stream, current.counter, current.rank = stream, counter, rank
            return loader
        return _take_over_iterable(
            loader,
            current,
            batched,
            seed=seed,
            rank=rank,
            stream=stream,
            counter=counter,
            generator=generator,
            keyed=sample_keyed,
            consumed=consumed,
            cache=cache,
        )
    sampler = ReproBatchSampler(
        current,
        batched=batched,
        seed=seed,
        rank=rank,
        stream=stream,
        counter=counter,
        loader_generator=generator,
        keyed=sample_keyed,
    )
    sampler.num_workers = int(loader.num_workers)
    sampler.persistent = sampler.num_workers > 0 and bool(loader.persistent_workers)
    sampler.world_size = world_size
    if not sampler.exact_skip and stream.stage != "predict":  # predict never resumes: nothing to say
        inner = current.sampler if batched and type(current) is BatchSampler else current
        name = type(inner).__name__ if type(current) is BatchSampler or not batched else type(current).__name__
        text = seeding_text(sampler.seeding, sampler._patches)
        if sampler.seeding in EXACT_SEEDINGS:  # supported and exact: an info line, not a warning
            cache.info_once(log, f"{name} is a sampler lightning-repro does not compute: {text}")
        else:
            _warn_once(cache, f"{name} is not a sampler lightning-repro knows: {text}", NotExactWarning)
    loader = _private_copy(loader)
    outermost: Any = _PlainIndexRecorder(sampler) if recorded else sampler
    _force_setattr(loader, "batch_sampler" if batched else "sampler", outermost)
    loader.generator = generator
    loader.worker_init_fn = _WorkerInit(loader.worker_init_fn, seed, rank, stream)
    if sample_keyed:
        keyed = KeyedDataset(loader.dataset)
        keyed._own = _own_generators(loader.dataset, cache)
        _force_setattr(loader, "dataset", keyed)
        if batched:
            keyed._seed_collate = loader.collate_fn is not default_collate  # torch's default draws nothing
            loader.collate_fn = KeyedCollate(loader.collate_fn, keyed)
        elif loader.collate_fn is not default_convert:  # default_convert draws nothing: skip the extra seeding
            keyed._keyed_collate = True
            loader.collate_fn = KeyedCollate(loader.collate_fn, keyed)
    return loader


def fetch_again(loader: Any, position: dict[str, Any]) -> tuple[bool, Any]:
    """The batch a taken-over map-style loader yielded just before the data position ``position``, loaded again.

    ``position``: a checkpoint's (``epoch``, ``pass``, ``offset`` batches consumed): the batch at ``offset - 1``.
    Returns ``(True, batch)`` or ``(False, why not)``. Sample-keyed loading makes it the same batch (each sample
    and the collation on their keys' streams, in the main process as in a worker) and puts the process streams
    back; torch's own fetch (``torch/utils/data/_utils/fetch.py: _MapDatasetFetcher``) runs it.
    """
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, ReproBatchSampler) or not sampler.keyed:
        return False, "its train loader is not loaded sample-keyed by lightning-repro"
    keys = None
    if int(position["offset"]) >= 1:
        keys = sampler.keys_at(int(position["epoch"]), int(position["pass"]), int(position["offset"]) - 1)
    if keys is None:
        return False, "its train loader's sampler cannot give that batch's samples again"
    from torch.utils.data._utils.fetch import _MapDatasetFetcher

    fetcher = _MapDatasetFetcher(loader.dataset, True, loader.collate_fn, loader.drop_last)  # batched: collated
    return True, fetcher.fetch(keys)  # type: ignore[no-untyped-call]


def position_mismatch(index: int, position: dict[str, Any], sampler: ReproBatchSampler) -> str | None:
    """Why a checkpoint's data position of train loader ``index`` cannot be given to ``sampler`` exactly, or None.

    Another number of batches per epoch, or another order of the same number (``shuffle=True`` changed to
    ``False``, another sampler, dataset length or batch size): the batches skipped would not be those consumed.
    ``position``: the checkpoint's record (its ``order``, :meth:`ReproBatchSampler.describe`, when it has one).
    """
    if position["length"] != len(sampler):
        return (
            f"Train dataloader {index} has {len(sampler)} batches per epoch now but had {position['length']} when"
            " the checkpoint was written: the data position cannot be restored exactly."
        )
    saved: Any = position.get("order")
    now = sampler.describe()
    # what both records hold (an older version's has fewer keys; a sampler of another kind, others); a user's
    # DistributedSampler seed is recorded only where there is one (`order.user_sampler_seed`)
    if isinstance(saved, dict):
        saved = {"sampler_seed": None, **saved} if "sampler_seed" in now else saved
        now = {"sampler_seed": None, **now} if "sampler_seed" in saved else now
    differ = [k for k in sorted(saved) if k in now and saved[k] != now[k]] if isinstance(saved, dict) else []
    if not differ:
        return None
    changed = ", ".join(f"{k} {saved[k]!r} -> {now[k]!r}" for k in differ)
    return (
        f"Train dataloader {index} orders its data otherwise than when the checkpoint was written ({changed}): the"
        " batches skipped would not be those consumed, so the data position cannot be restored exactly."
    )
