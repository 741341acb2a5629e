"""Sample-keyed access: ``dataset[i]`` on the streams of its key, in workers and in the main process alike.

:class:`~lightning_repro.data.samplers.ReproBatchSampler` yields :class:`KeyedBatch` (or :class:`SampleKey`) values:
the indices and the pass's sample seed. :class:`KeyedDataset` seeds python, numpy and torch from each
sample's seed (:func:`~lightning_repro.streams.item_seeds`) before ``dataset[i]``, and the collate stream
before ``collate_fn``; in the main process :class:`KeyedCollate` then puts the process streams back, so
loading never shifts them. Generators the dataset holds itself are re-seeded per sample too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.data import get_worker_info

from lightning_repro import streams
from lightning_repro.data.fastrng import FastState, capture_fast, item_seeds, restore_fast, seed_sample
from lightning_repro.data.generators import OwnGenerator, capture_generators, reseed_generators, restore_generators
from lightning_repro.data.usage import initial_usage, load_samples
from lightning_repro.streams import index_int

__all__ = ["DatasetWrapper", "KeyedBatch", "KeyedCollate", "KeyedDataset", "SampleKey"]


class SampleKey(NamedTuple):
    """One sample's index and the seed of its pass (loaders without a batch sampler)."""

    seed: int
    index: Any


class KeyedBatch(NamedTuple):
    """A batch of indices and the seed of its pass, as our batch sampler yields it."""

    seed: int
    indices: list[Any]


class DatasetWrapper:
    """Our layer over the user's ``dataset``: ``len()`` and the user's attributes forwarded to it.

    Under the map-style :class:`KeyedDataset` and the iterable ``data.streaming.KeyedIterable``.
    """

    dataset: Any
    _WRAPPER: frozenset[str] = frozenset({"dataset"})  # the public attributes the wrapper keeps itself

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # guard against recursion while unpickling (no `dataset` in the instance yet)
        if name.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # the user's code sets its dataset's attributes through the loader (a curriculum callback's
        # `trainer.train_dataloader.dataset.level = 2`): they go to the user's dataset, which reads them
        if self._forwards(name):
            setattr(self.__dict__["dataset"], name, value)
        else:
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._forwards(name):
            delattr(self.__dict__["dataset"], name)
        else:
            object.__delattr__(self, name)

    def _forwards(self, name: str) -> bool:
        """The name is the user's dataset's: not ours (private, or one of :attr:`_WRAPPER`), and not set on us."""
        own = name[:1] == "_" or name in self._WRAPPER or name in self.__dict__
        return not own and "dataset" in self.__dict__


class KeyedDataset(DatasetWrapper, torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Wraps a map-style dataset; seeds the sample streams from each sample's key."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._batched = callable(getattr(dataset, "__getitems__", None))
        self._pending: FastState | None = None
        self._keyed_collate = False  # without auto-collation: run the user's collate_fn on the sample's stream
        self._own: list[OwnGenerator] = []  # generators the dataset holds itself: keyed per sample too
        self._seed_collate = True  # False for torch's default_collate, which draws nothing
        self._used = initial_usage()  # the process streams its samples were seen drawing from (_usage)

    def __getitem__(self, key: Any) -> Any:
        if type(key) is not SampleKey:
            return self.dataset[key]
        if self._own:
            return self._getitems_own(KeyedBatch(key.seed, [key.index]), single=True)
        if self._keyed_collate:
            return self._getitem_then_collate(key)
        saved = capture_fast() if get_worker_info() is None else None
        try:
            seeds = [streams.item_seed(key.seed, key.index)]
            data, self._used = load_samples(self.dataset, [key.index], seeds, self._used)
            return data[0]
        finally:
            if saved is not None:
                restore_fast(saved)

    def _getitem_then_collate(self, key: SampleKey) -> Any:
        """One sample without auto-collation, leaving the streams on the sample's collate stream.

        Like a batch: the user's ``collate_fn`` runs next on ``streams.collate_seed(seed, index)``, then
        :class:`KeyedCollate` puts the process streams back (main process).
        """
        saved = capture_fast() if get_worker_info() is None else None
        index = index_int(key.index)
        try:
            data, self._used = load_samples(self.dataset, [key.index], [streams.item_seed(key.seed, index)], self._used)
            item = data[0]
            seed_sample(streams.collate_seed(key.seed, index))
        except BaseException:
            if saved is not None:
                restore_fast(saved)
            raise
        if saved is not None:
            self._pending = saved
        return item

    def __getitems__(self, batch: Any) -> list[Any]:
        if type(batch) is not KeyedBatch:
            return list(self.dataset.__getitems__(batch)) if self._batched else [self.dataset[i] for i in batch]
        if self._own:
            return self._getitems_own(batch)  # type: ignore[no-any-return]
        seed, indices = batch
        saved = capture_fast() if get_worker_info() is None else None
        first = index_int(indices[0]) if indices else 0
        try:
            if self._batched:
                # a batched `__getitems__` draws for the whole batch at once: key it by the batch
                seed_sample(streams.batch_seed(seed, first))
                data = list(self.dataset.__getitems__(list(indices)))
            else:
                data, self._used = load_samples(self.dataset, indices, item_seeds(seed, indices), self._used)
            if self._seed_collate:
                seed_sample(streams.collate_seed(seed, first))  # collate_fn draws from the batch's stream
        except BaseException:
            if saved is not None:
                restore_fast(saved)
            raise
        if saved is not None:
            self._pending = saved  # KeyedCollate puts the process streams back after collation
        return data


    def _getitems_own(self, batch: KeyedBatch, *, single: bool = False) -> Any:
        """``__getitems__`` (or, ``single``, ``__getitem__``) for a dataset that holds its own generators.

        The global streams are seeded exactly as in the other paths; each own generator is re-seeded next from
        the same sample (or batch) seed and its path. In the main process the own generators' states are put
        back after the batch, like the process streams, so the user's objects are left as found.
        """
        seed, indices = batch
        main = get_worker_info() is None
        saved = capture_fast() if main else None
        own_saved = capture_generators(self._own) if main else None
        first = index_int(indices[0]) if indices else 0
        collate = not single or self._keyed_collate
        try:
            if self._batched and not single:
                z = streams.batch_seed(seed, first)
                seed_sample(z)
                reseed_generators(self._own, z)
                data = list(self.dataset.__getitems__(list(indices)))
            else:
                data = []
                for index in indices:
                    z = streams.item_seed(seed, index)
                    seed_sample(z)
                    reseed_generators(self._own, z)
                    data.append(self.dataset[index])
            if collate:
                seed_sample(streams.collate_seed(seed, first))  # collate_fn draws from the batch's stream
        except BaseException:
            if saved is not None:
                restore_fast(saved)
            raise
        finally:
            if own_saved is not None:
                restore_generators(self._own, own_saved)
        if saved is not None:
            if collate:
                self._pending = saved  # KeyedCollate puts the process streams back after collation
            else:
                restore_fast(saved)
        return data[0] if single else data


class KeyedCollate:
    """Runs the user's collate_fn on the batch's stream, then puts the process streams back."""

    def __init__(self, collate_fn: Callable[[Any], Any], dataset: KeyedDataset) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, data: Any) -> Any:
        """Collate ``data`` with the user's ``collate_fn``; the process streams are put back afterwards."""
        try:
            return self.collate_fn(data)
        finally:
            saved = self.dataset._pending
            if saved is not None:
                self.dataset._pending = None
                restore_fast(saved)
