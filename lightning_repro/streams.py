"""The stream table of DESIGN.md as functions: the one place that names a stream's keys.

Every seed a run uses comes from one of these functions, and only they call
:func:`~lightning_repro.seeding.derive_seed` with a stream's keys, so a stream cannot be derived with
other keys in another place. Pass-level seeds (order, samples, loader, worker) are keyed by the
loader's :class:`StreamKey`, the ``counter`` (the epoch for training, ``2 * global step (+1 in the
sanity check)`` for evaluation) and the ``pass`` (how many times the loader was iterated for that
counter). An ``IterableDataset`` has no sample index: the ``k``-th item worker ``w`` yields in a pass is keyed
by ``(seed, rank, stage, loader, counter, pass, w, k)`` (:func:`iterable_seed`, :func:`worker_items_seed`,
then :func:`item_seed` of ``k``). Per-sample seeds mix a pass's sample seed with the sample index (SplitMix64,
:func:`~lightning_repro.seeding.mix_seed`), the only per-sample cost; :func:`item_seeds` is that
mixer inlined for a whole batch.

| stream | function |
|---|---|
| process streams, rank ``r`` once the model is wrapped | :func:`rank_seed` |
| process streams after a resume on another world size | :func:`reseed_after_topology_change` |
| data order of a pass (sampler generator, a foreign sampler's private stream) | :func:`order_seed` |
| base of a pass's sample streams | :func:`sample_seed` |
| one sample (``dataset[i]``) | :func:`item_seed` / :func:`item_seeds` |
| a batch drawn by ``__getitems__`` at once | :func:`batch_seed` |
| ``collate_fn`` of a batch | :func:`collate_seed` |
| a generator the dataset holds, within a sample's stream | :func:`own_generator_seed` |
| the loader generator (the workers' base seed) | :func:`loader_seed` |
| a worker (``worker_init_fn``) | :func:`worker_seed` |
| base of a pass's item streams over an ``IterableDataset`` | :func:`iterable_seed` |
| one worker's items in that pass (its ``k``-th item: :func:`item_seed` of ``k``) | :func:`worker_items_seed` |
| the dataset's ``__iter__`` call in that worker | :func:`iter_seed` |
| the collate of that worker's ``b``-th batch | :func:`collate_seed` of ``b`` |
| a ``torchdata.nodes`` mapper's inputs in a pass (its ``n``-th: :func:`item_seed` of ``n``) | :func:`nodes_seed` |
| a ``torchdata.nodes`` ``MultiNodeWeightedSampler``'s seed (rank and epoch mixed in by it) | :func:`mixture_seed` |
| a ``torchdata.nodes`` ``IterableWrapper``'s iterable in a pass | :func:`nodes_iterable_seed` |
| validation, test, predict, sanity check | :func:`eval_seed` |
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from lightning_repro.seeding import derive_seed, mix_seed

__all__ = [
    "StreamKey",
    "batch_seed",
    "collate_seed",
    "eval_seed",
    "index_int",
    "item_seed",
    "item_seeds",
    "iter_seed",
    "iterable_seed",
    "loader_seed",
    "mixture_seed",
    "nodes_iterable_seed",
    "nodes_seed",
    "order_seed",
    "own_generator_seed",
    "pruning_seed",
    "rank_seed",
    "reseed_after_topology_change",
    "sample_seed",
    "stages_seed",
    "worker_items_seed",
    "worker_seed",
]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1
_COLLATE_SALT = 0x5DEECE66D_C0FFEE
_BATCH_SALT = 0x2545F4914F6CDD1D
_WORKER_SALT = 0x7F4A7C159E3779B9
_ITER_SALT = 0x1B873593CC9E2D51


class StreamKey(NamedTuple):
    """Which loader a sampler feeds: the stage (``"train"``, ``"validate"``, ...) and its index there."""

    stage: str
    loader: int


# ------------------------------------------------------------------ process streams
def rank_seed(seed: int, rank: int) -> int:
    """The process streams of global rank ``rank`` once the model is wrapped (world size > 1)."""
    return derive_seed(seed, "rank", rank)


def pruning_seed(seed: int, epoch: int) -> int:
    """The process streams ``ModelPruning`` prunes on at the end of ``epoch`` under data parallelism: every rank's."""
    return derive_seed(seed, "pruning", epoch)


def reseed_after_topology_change(
    seed: int, saved_world: int, world_size: int, rank: int, epoch: int, batches: int
) -> int:
    """The process streams of ``rank`` resuming a checkpoint of ``saved_world`` ranks on ``world_size`` ranks.

    Keyed by the position (``epoch``, ``batches`` of the epoch) so that two resumes at one position agree.
    """
    return derive_seed(seed, "reseed", saved_world, world_size, rank, epoch, batches)


def eval_seed(seed: int, stage: str, global_step: int) -> int:
    """The process streams of an evaluation loop (``stage``: ``"validate"``, ``"test"``, ``"sanity"``...)."""
    return derive_seed(seed, "eval", stage, global_step)


# ------------------------------------------------------------------ a pass of a loader
def order_seed(seed: int, stream: StreamKey, counter: int, pass_: int) -> int:
    """The data order of a pass: the sampler's generator (or a foreign sampler's private stream)."""
    return derive_seed(seed, "order", stream.stage, stream.loader, counter, pass_)


def sample_seed(seed: int, stream: StreamKey, counter: int, pass_: int) -> int:
    """The base of a pass's sample streams; each sample's seed mixes in its index (:func:`item_seed`)."""
    return derive_seed(seed, "sample", stream.stage, stream.loader, counter, pass_)


def loader_seed(seed: int, rank: int, stream: StreamKey, counter: int, pass_: int, *, persistent: bool = False) -> int:
    """The loader generator of a pass on ``rank``: torch draws the workers' base seed from it.

    ``persistent``: the loader's workers persist. They draw their base seed once, when they start, at whatever pass
    that is (the run's first, the first after a resume, the first after Lightning reloaded the loader), and keep it:
    every pass gets the seed of the first pass of epoch 0, so a resumed run's workers start with the base seed (the
    ``get_worker_info().seed``, the process streams of ``worker_init_fn``) the interrupted run's workers had.
    """
    if persistent:
        counter = pass_ = 0
    return derive_seed(seed, "loader", rank, stream.stage, stream.loader, counter, pass_)


def worker_seed(seed: int, rank: int, stream: StreamKey, base_seed: int, worker_id: int) -> int:
    """The process streams of a dataloader worker (``base_seed``: torch's base seed of the iterator)."""
    return derive_seed(seed, "worker", rank, stream.stage, stream.loader, base_seed, worker_id)


# ------------------------------------------------------------------ samples and batches of a pass
def index_int(index: Any) -> int:
    """A sample index as the int its stream is keyed by (a 64-bit hash of its ``repr`` for other keys)."""
    if type(index) is int:
        return index
    if isinstance(index, (int, np.integer)):
        return int(index)
    return int.from_bytes(hashlib.blake2b(repr(index).encode(), digest_size=8).digest(), "little")


def item_seed(pass_sample_seed: int, index: Any) -> int:
    """The streams of ``dataset[index]`` in a pass whose :func:`sample_seed` is ``pass_sample_seed``."""
    return mix_seed(pass_sample_seed, index_int(index))


def item_seeds(pass_sample_seed: int, indices: Sequence[Any]) -> list[int]:
    """:func:`item_seed` of every index of a batch: the hot path, with ``mix_seed`` inlined.

    The one inlined copy of the mixer (``tests/test_streams.py`` checks it against :func:`item_seed`).
    """
    seeds: list[int] = []
    append = seeds.append
    for index in indices:
        z = (pass_sample_seed + ((index if type(index) is int else index_int(index)) + 1) * _GOLDEN) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        append(z ^ (z >> 31))
    return seeds


def batch_seed(pass_sample_seed: int, first: int) -> int:
    """The streams of a batched ``__getitems__`` that draws for a whole batch, keyed by its first index."""
    return mix_seed(pass_sample_seed ^ _BATCH_SALT, first)


def collate_seed(pass_sample_seed: int, first: int) -> int:
    """The streams ``collate_fn`` draws from for the batch whose first index is ``first``."""
    return mix_seed(pass_sample_seed ^ _COLLATE_SALT, first)


def own_generator_seed(sample_stream_seed: int, salt: int) -> int:
    """A generator the dataset holds, within one sample's (or batch's) stream; ``salt`` hashes its path."""
    return mix_seed(sample_stream_seed, salt)


# ------------------------------------------------------------------ items of an IterableDataset
def iterable_seed(seed: int, rank: int, stream: StreamKey, counter: int, pass_: int) -> int:
    """The base of a pass's item streams over an ``IterableDataset`` on ``rank`` (see :func:`worker_items_seed`)."""
    return derive_seed(seed, "iterable", rank, stream.stage, stream.loader, counter, pass_)


def stages_seed(seed: int, rank: int, stream: StreamKey, counter: int) -> int:
    """The base of the streams a loader's main-process stages draw from in a pass (webdataset's ``WebLoader``).

    Its ``j``-th batch is pulled through the stages on :func:`item_seed` ``(this, j)``.
    """
    return derive_seed(seed, "stages", rank, stream.stage, stream.loader, counter)


def nodes_seed(seed: int, rank: int, stream: StreamKey, counter: int, pass_: int, mapper: int) -> int:
    """The base of the streams a ``torchdata.nodes`` mapper's ``map_fn`` draws from in a pass, on ``rank``.

    ``mapper``: the mapper's index in the graph (from the root down); its ``n``-th input of the pass draws from
    :func:`item_seed` ``(this, n)``.
    """
    return derive_seed(seed, "nodes", rank, stream.stage, stream.loader, counter, pass_, mapper)


def nodes_iterable_seed(seed: int, rank: int, stream: StreamKey, counter: int, pass_: int, iterable: int) -> int:
    """The base of the streams a ``torchdata.nodes`` ``IterableWrapper``'s iterable draws from in a pass, on ``rank``.

    ``iterable``: the wrapper's index in the graph; its ``iter()`` draws from :func:`iter_seed` ``(this)``, the
    ``next()`` of its ``k``-th item from :func:`item_seed` ``(this, k)``.
    """
    return derive_seed(seed, "nodes-iterable", rank, stream.stage, stream.loader, counter, pass_, iterable)


def mixture_seed(seed: int, stream: StreamKey, counter: int, sampler: int) -> int:
    """The ``seed`` of a ``torchdata.nodes`` ``MultiNodeWeightedSampler`` (the ``sampler``-th in the graph).

    Keyed by the ``counter`` too; 32 bits: torchdata seeds a generator with ``seed * world_size + rank`` and draws
    the seed of each of its passes from it by the pass's number (in our copy, its number within the counter, kept in
    its state).
    """
    return derive_seed(seed, "mixture", stream.stage, stream.loader, counter, sampler) & 0xFFFFFFFF


def worker_items_seed(pass_items_seed: int, worker: int) -> int:
    """The items of dataloader worker ``worker`` (0 in the main process) in a pass of :func:`iterable_seed`.

    Its ``k``-th item draws from :func:`item_seed` ``(this, k)``, the collate of its ``b``-th batch from
    :func:`collate_seed` ``(this, b)``.
    """
    return mix_seed(pass_items_seed ^ _WORKER_SALT, worker)


def iter_seed(worker_items: int) -> int:
    """The streams of the dataset's ``__iter__`` call in a worker whose :func:`worker_items_seed` is ``worker_items``.

    A generator function's body runs inside ``next()``: its draws belong to the items it yields.
    """
    return mix_seed(worker_items ^ _ITER_SALT, 0)
