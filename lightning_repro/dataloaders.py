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
  skipped batches; other samplers are advanced index by index, loading no data.
"""

from __future__ import annotations

import _random
import copy
import hashlib
import itertools
import logging
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_convert,
    get_worker_info,
)

from lightning_repro._lightning.hooks import IndexRecorder, recorded_batch_sampler
from lightning_repro.exceptions import NotExactWarning, ReproWarning
from lightning_repro.generators import (
    OwnGenerator,
    capture_generators,
    find_generators,
    reseed_generators,
    restore_generators,
)
from lightning_repro.seeding import derive_seed, fold_seed32, mix_seed, seed_process_streams

__all__ = [
    "KeyedBatch",
    "SampleKey",
    "StreamKey",
    "prepare_dataloader",
]

log = logging.getLogger(__name__)

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1
_COLLATE_SALT = 0x5DEECE66D_C0FFEE
_BATCH_SALT = 0x2545F4914F6CDD1D

_py_seed = _random.Random.seed
_py_inst = random._inst  # type: ignore[attr-defined]  # the generator behind the random module's functions
_np_seed = np.random.mtrand._rand.seed  # the RandomState behind numpy's global functions
_torch_gen = torch.default_generator


class SampleKey(NamedTuple):
    """One sample's index and the seed of its pass (loaders without a batch sampler)."""

    seed: int
    index: Any


class KeyedBatch(NamedTuple):
    """A batch of indices and the seed of its pass, as our batch sampler yields it."""

    seed: int
    indices: list[Any]


class StreamKey(NamedTuple):
    """Which loader a sampler feeds: the stage (``"train"``, ``"validate"``, ...) and its index there."""

    stage: str
    loader: int


def _index_int(index: Any) -> int:
    if type(index) is int:
        return index
    if isinstance(index, (int, np.integer)):
        return int(index)
    return int.from_bytes(hashlib.blake2b(repr(index).encode(), digest_size=8).digest(), "little")


def _seed_sample(seed: int) -> None:
    """Seed python, numpy and torch CPU for one sample: the hot path, ~7 us."""
    _py_seed(_py_inst, seed)
    _py_inst.gauss_next = None  # type: ignore[attr-defined]  # random.seed() clears it too
    _np_seed(fold_seed32(seed))
    _torch_gen.manual_seed(seed)


_FastState = tuple[Any, Any, torch.Tensor]


def _numpy_raw_layout() -> tuple[int, int, int] | None:
    """Where numpy's global generator keeps its state in memory, checked, or None to use the slow API.

    ``np.random.get_state()``/``set_state()`` cost ~70 us together, more than everything else per batch.
    The Mersenne Twister words and position sit behind ``bit_generator.ctypes.state_address`` (public API,
    2500 bytes); the cached Box-Muller value (``has_gauss``, ``gauss``) sits inside the RandomState object.
    Its offset is found by writing known values with ``set_state`` and reading them back; every
    mismatch falls back to the public API, so a numpy with another layout is slower, never wrong.
    """
    import ctypes
    import struct

    rs = np.random.mtrand._rand
    try:
        address = int(rs._bit_generator.ctypes.state_address)
        saved: Any = rs.get_state(legacy=True)
        try:
            markers = ((1, 1.2345678901234567), (0, -7.5), (1, 3.0e-300))
            rs.set_state(("MT19937", saved[1], saved[2], *markers[0]))
            raw = ctypes.string_at(id(rs), type(rs).__basicsize__)  # read only the object's own memory
            offset = raw.find(struct.pack("<d", markers[0][1]))
            if offset < 8 or offset % 8 or offset + 8 > type(rs).__basicsize__:
                return None
            for has_gauss, gauss in markers:
                rs.set_state(("MT19937", saved[1], saved[2], has_gauss, gauss))
                flag, value = struct.unpack("<iid", ctypes.string_at(id(rs) + offset - 8, 16))[0::2]
                if (flag, value) != (has_gauss, gauss):
                    return None
            words = np.asarray(saved[1], dtype=np.uint32).tobytes() + struct.pack("<i", saved[2])
            rs.set_state(saved)
            if ctypes.string_at(address, 2500) != words:
                return None
        finally:
            rs.set_state(saved)
        return address, id(rs) + offset - 8, 2500
    except Exception:  # any surprise: use the public API
        return None


_NUMPY_RAW = _numpy_raw_layout()


def _numpy_capture() -> Any:
    if _NUMPY_RAW is None:
        return np.random.get_state()
    import ctypes

    address, aug, size = _NUMPY_RAW
    return ctypes.string_at(address, size), ctypes.string_at(aug, 16)


def _numpy_restore(state: Any) -> None:
    if _NUMPY_RAW is None:
        np.random.set_state(state)
        return
    import ctypes

    address, aug, size = _NUMPY_RAW
    ctypes.memmove(address, state[0], size)
    ctypes.memmove(aug, state[1], 16)


def _capture_fast() -> _FastState:
    return random.getstate(), _numpy_capture(), _torch_gen.get_state()


def _restore_fast(state: _FastState) -> None:
    random.setstate(state[0])
    _numpy_restore(state[1])
    _torch_gen.set_state(state[2])


class _KeyedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Wraps a map-style dataset; seeds the sample streams from each sample's key."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._batched = callable(getattr(dataset, "__getitems__", None))
        self._pending: _FastState | None = None
        self._keyed_collate = False  # without auto-collation: run the user's collate_fn on the sample's stream
        self._own: list[OwnGenerator] = []  # generators the dataset holds itself: keyed per sample too

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # forward user attributes (``loader.dataset.classes``...); guard against recursion while unpickling
        if name.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)

    def __getitem__(self, key: Any) -> Any:
        if type(key) is not SampleKey:
            return self.dataset[key]
        if self._own:
            return self._getitems_own(KeyedBatch(key.seed, [key.index]), single=True)
        if self._keyed_collate:
            return self._getitem_then_collate(key)
        saved = _capture_fast() if get_worker_info() is None else None
        try:
            _seed_sample(mix_seed(key.seed, _index_int(key.index)))
            return self.dataset[key.index]
        finally:
            if saved is not None:
                _restore_fast(saved)

    def _getitem_then_collate(self, key: SampleKey) -> Any:
        """One sample without auto-collation, leaving the streams on the sample's collate stream.

        Like a batch: the user's ``collate_fn`` runs next on ``mix_seed(seed ^ _COLLATE_SALT, index)``, then
        :class:`_KeyedCollate` puts the process streams back (main process).
        """
        saved = _capture_fast() if get_worker_info() is None else None
        index = _index_int(key.index)
        try:
            _seed_sample(mix_seed(key.seed, index))
            item = self.dataset[key.index]
            _seed_sample(mix_seed(key.seed ^ _COLLATE_SALT, index))
        except BaseException:
            if saved is not None:
                _restore_fast(saved)
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
        saved = _capture_fast() if get_worker_info() is None else None
        first = _index_int(indices[0]) if indices else 0
        try:
            if self._batched:
                # a batched `__getitems__` draws for the whole batch at once: key it by the batch
                _seed_sample(mix_seed(seed ^ _BATCH_SALT, first))
                data = list(self.dataset.__getitems__(list(indices)))
            else:
                data = []
                append, dataset = data.append, self.dataset
                py_seed, py_inst, np_seed, torch_seed = _py_seed, _py_inst, _np_seed, _torch_gen.manual_seed
                for index in indices:  # the hot loop: _seed_sample(mix_seed(...)) inlined
                    z = (seed + ((index if type(index) is int else _index_int(index)) + 1) * _GOLDEN) & _MASK64
                    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
                    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
                    z ^= z >> 31
                    py_seed(py_inst, z)
                    py_inst.gauss_next = None  # type: ignore[attr-defined]
                    np_seed((z ^ (z >> 32)) & 0xFFFFFFFF)
                    torch_seed(z)
                    append(dataset[index])
            _seed_sample(mix_seed(seed ^ _COLLATE_SALT, first))  # collate_fn draws from the batch's stream
        except BaseException:
            if saved is not None:
                _restore_fast(saved)
            raise
        if saved is not None:
            self._pending = saved  # _KeyedCollate puts the process streams back after collation
        return data


    def _getitems_own(self, batch: KeyedBatch, *, single: bool = False) -> Any:
        """``__getitems__`` (or, ``single``, ``__getitem__``) for a dataset that holds its own generators.

        The global streams are seeded exactly as in the other paths; each own generator is re-seeded next from
        the same sample (or batch) seed and its path. In the main process the own generators' states are put
        back after the batch, like the process streams, so the user's objects are left as found.
        """
        seed, indices = batch
        main = get_worker_info() is None
        saved = _capture_fast() if main else None
        own_saved = capture_generators(self._own) if main else None
        first = _index_int(indices[0]) if indices else 0
        collate = not single or self._keyed_collate
        try:
            if self._batched and not single:
                z = mix_seed(seed ^ _BATCH_SALT, first)
                _seed_sample(z)
                reseed_generators(self._own, z)
                data = list(self.dataset.__getitems__(list(indices)))
            else:
                data = []
                for index in indices:
                    z = mix_seed(seed, _index_int(index))
                    _seed_sample(z)
                    reseed_generators(self._own, z)
                    data.append(self.dataset[index])
            if collate:
                _seed_sample(mix_seed(seed ^ _COLLATE_SALT, first))  # collate_fn draws from the batch's stream
        except BaseException:
            if saved is not None:
                _restore_fast(saved)
            raise
        finally:
            if own_saved is not None:
                restore_generators(self._own, own_saved)
        if saved is not None:
            if collate:
                self._pending = saved  # _KeyedCollate puts the process streams back after collation
            else:
                _restore_fast(saved)
        return data[0] if single else data


class _KeyedCollate:
    """Runs the user's collate_fn on the batch's stream, then puts the process streams back."""

    def __init__(self, collate_fn: Callable[[Any], Any], dataset: _KeyedDataset) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, data: Any) -> Any:
        try:
            return self.collate_fn(data)
        finally:
            saved = self.dataset._pending
            if saved is not None:
                self.dataset._pending = None
                _restore_fast(saved)


class _WorkerInit:
    """Calls the user's ``worker_init_fn``, then seeds the worker streams."""

    def __init__(self, user_fn: Callable[[int], None] | None, seed: int, rank: int, stream: StreamKey) -> None:
        self.user_fn = user_fn
        self.seed = seed
        self.rank = rank
        self.stream = stream

    def __call__(self, worker_id: int) -> None:
        if self.user_fn is not None:
            self.user_fn(worker_id)
        info = get_worker_info()
        # info.seed = the iterator's base seed (drawn from our per-pass loader generator) + worker id
        base = info.seed if info is not None else 0
        seed_process_streams(
            derive_seed(self.seed, "worker", self.rank, self.stream.stage, self.stream.loader, base, worker_id)
        )


def _order(sampler: Any, order_seed: int, epoch: int) -> Sequence[int] | torch.Tensor | None:
    """The whole index order of one pass, for samplers whose order we can compute; else None."""
    if type(sampler) is SequentialSampler:
        return range(len(sampler.data_source))  # type: ignore[arg-type]
    if type(sampler) is RandomSampler and not sampler.replacement:
        n = len(sampler.data_source)  # type: ignore[arg-type]
        return _pass_order({"kind": "random", "n": n, "num_samples": sampler.num_samples}, order_seed, epoch)
    if type(sampler) is DistributedSampler:
        saved = sampler.seed, sampler.epoch  # put back afterwards: the sampler is not ours to keep
        sampler.seed = fold_seed32(order_seed)  # the same on every rank: order_seed has no rank in it
        sampler.set_epoch(epoch)
        try:
            description = {
                "kind": "distributed",
                "n": len(sampler.dataset),  # type: ignore[arg-type]
                "world_size": sampler.num_replicas,
                "shuffle": sampler.shuffle,
                "sampler_drop_last": sampler.drop_last,
            }
            everything = _pass_order(description, order_seed, epoch)
            return everything[sampler.rank :: sampler.num_replicas]
        finally:
            sampler.seed, sampler.epoch = saved
    return None


def _pass_order(description: dict[str, Any], order_seed: int, epoch: int) -> Sequence[int] | torch.Tensor:
    """The order of one pass of a sampler as :meth:`ReproBatchSampler.describe` describes it: a pure function.

    A ``"distributed"`` pass is the order of all ranks interleaved (rank ``r`` takes ``order[r::world]``), with
    ``DistributedSampler``'s padding or truncation to a multiple of the world size. A ``"random"`` pass draws
    ``num_samples`` indices (``n`` when absent: entries written before it was recorded) as concatenated
    permutations of ``range(n)``. Both the pass itself (:func:`_order`) and the re-deal to another world size
    (:func:`_global_order`) use it, so they cannot disagree.

    Raises:
        ValueError: ``description["kind"]`` is not ``"sequential"``, ``"random"`` or ``"distributed"``.
    """
    kind, n = description["kind"], int(description["n"])
    if kind == "sequential":
        return range(n)
    if kind == "random":
        m = int(description.get("num_samples", n))
        generator = torch.Generator()
        generator.manual_seed(order_seed)
        parts = [torch.randperm(n, generator=generator) for _ in range(m // n)] if n else []
        if n and m % n:
            parts.append(torch.randperm(n, generator=generator)[: m % n])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    if kind != "distributed":
        raise ValueError(f"cannot recompute the order of a {kind!r} sampler")
    world = int(description["world_size"])
    if description["shuffle"]:
        generator = torch.Generator()
        generator.manual_seed(fold_seed32(order_seed) + epoch)  # as DistributedSampler.__iter__ does
        indices: list[int] = torch.randperm(n, generator=generator).tolist()
    else:
        indices = list(range(n))
    if description["sampler_drop_last"] and n % world:
        return indices[: math.ceil((n - world) / world) * world]
    total = math.ceil(n / world) * world
    while indices and len(indices) < total:
        indices += indices[: total - len(indices)]
    return indices


def _sliced_batches(
    order: Sequence[int] | torch.Tensor, batch_size: int | None, drop_last: bool, start: int, seed: int | None
) -> Iterator[Any]:
    """Batches ``start``, ``start + 1``, ... of ``order``: slicing, so the skip costs nothing."""
    n = len(order)
    if batch_size is None:  # no auto-collation: single indices
        for position in range(start, n):
            index = int(order[position])
            yield index if seed is None else SampleKey(seed, index)
        return
    num_batches = n // batch_size if drop_last else math.ceil(n / batch_size)
    is_tensor = isinstance(order, torch.Tensor)
    for j in range(start, num_batches):
        chunk = order[j * batch_size : (j + 1) * batch_size]
        indices = chunk.tolist() if is_tensor else list(chunk)  # type: ignore[union-attr]
        yield indices if seed is None else KeyedBatch(seed, indices)


_Patch = tuple[Any, str, Any]  # (object, attribute, the value it has while the foreign sampler runs)


def _apply(patches: Sequence[_Patch]) -> list[_Patch]:
    """Set each patched attribute; return what puts the previous values back."""
    previous = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    return previous


def _unapply(previous: list[_Patch]) -> None:
    for owner, name, value in reversed(previous):
        setattr(owner, name, value)


class _IsolatedIterator:
    """Runs a foreign sampler's iterator on a private stream, so it neither reads nor moves ours.

    ``patches`` (our ``generator`` or ``seed``) are set on the user's objects only while the sampler
    runs and put back after every step, so the user's sampler keeps its own values in between.
    ``isolate=False`` (a sampler checked to depend on its patched attributes alone) skips the private stream.
    """

    def __init__(
        self,
        make: Callable[[], Iterator[Any]],
        seed: int,
        *,
        patches: Sequence[_Patch] = (),
        isolate: bool = True,
    ) -> None:
        self._patches = tuple(patches)
        self._isolate = isolate
        outer = _capture_fast() if isolate else None
        previous = _apply(self._patches)
        try:
            if isolate:
                _seed_sample(seed)
            self._iterator = make()
            self._private = _capture_fast() if isolate else None
        finally:
            _unapply(previous)
            if outer is not None:
                _restore_fast(outer)

    def __iter__(self) -> _IsolatedIterator:
        return self

    def __next__(self) -> Any:
        outer = None
        if self._private is not None:
            outer = _capture_fast()
            _restore_fast(self._private)
        previous = _apply(self._patches)
        try:
            return next(self._iterator)
        finally:
            _unapply(previous)
            if outer is not None:
                self._private = _capture_fast()
                _restore_fast(outer)


_PROBE = 64  # indices drawn per check of a foreign sampler


def _order_follows(target: Any, patches: Sequence[tuple[Any, str, Callable[[], Any]]]) -> bool:
    """Whether ``target``'s order depends on the patched attributes alone (and not on the process streams).

    Two draws with the same values of the attributes, under two different states of the process
    streams, must give one order (the first indices of it). The user's values and the process
    streams are put back; a sampler that fails to run counts as not following.
    """
    outer = _capture_fast()
    orders: list[str] = []
    try:
        for stream_seed in (0x0DD5EED, 0xE7E45EED):
            previous = _apply([(owner, name, make()) for owner, name, make in patches])
            try:
                _seed_sample(stream_seed)
                orders.append(repr(list(itertools.islice(iter(target), _PROBE))))
            finally:
                _unapply(previous)
    except Exception:  # a sampler that cannot run with our values: treat it as foreign
        return False
    finally:
        _restore_fast(outer)
    return orders[0] == orders[1]


def _seeded_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


@dataclass
class _Remap:
    """A pass resumed under another world size: this rank's share of the samples no rank consumed."""

    counter: int
    pass_: int
    indices: list[int]
    length: int  # batches of the whole pass as the epoch loop counts them (consumed + this rank's share)
    pending: bool = True
    active: bool = False


def _global_order(saved: dict[str, Any], order_seed: int, epoch: int) -> list[int]:
    """The order in which the ranks that wrote a checkpoint consumed a pass, interleaved across ranks."""
    order = _pass_order(saved, order_seed, epoch)
    return order.tolist() if isinstance(order, torch.Tensor) else list(order)  # type: ignore[no-any-return]


class ReproBatchSampler:
    """Replaces a loader's batch sampler (or its sampler when ``batch_size=None``).

    Each ``iter()`` starts a *pass*: its order, sample seeds and worker base seed are derived
    from ``(seed, stage, loader index, counter, pass)`` where ``counter`` is the epoch for
    training and the global step for evaluation. ``resume_at`` makes the next pass of a given
    counter start at a given pass and batch.

    It has the ``BatchSampler`` interface (``sampler``, ``batch_size``, ``drop_last``). Lightning
    re-instantiates a batch sampler it does not know as ``type(b)(sampler, batch_size=..., drop_last=...)``
    (``trainer.predict`` or a DDP sampler on a loader we prepared, such as ``trainer.train_dataloader``):
    that call gives a plain ``BatchSampler``, and the takeover of the new loader starts afresh.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if "seed" not in kwargs and "batch_size" in kwargs:  # Lightning's re-instantiation, see above
            return BatchSampler(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        inner: Any,
        *,
        batched: bool,
        seed: int,
        rank: int,
        stream: StreamKey,
        counter: Callable[[], int],
        loader_generator: torch.Generator,
        keyed: bool,
    ) -> None:
        self.inner = inner
        self.batched = batched
        self.seed = seed
        self.rank = rank
        self.stream = stream
        self.counter = counter
        self.loader_generator = loader_generator
        self.keyed = keyed
        self.num_workers = 0  # of the loader, recorded for the checkpoint's topology
        self.current: tuple[int, int] | None = None  # (counter, pass) of the last iterator
        self._resume: tuple[int, int, int] | None = None  # (counter, pass, batches to skip)
        self._finished = False  # the current pass ran to its end
        self._remap: _Remap | None = None
        self.world_size = 1
        sampler = inner.sampler if batched and type(inner) is BatchSampler else inner
        self._sampler = sampler
        self._batch_size: int | None = inner.batch_size if batched and type(inner) is BatchSampler else None
        self._drop_last = bool(inner.drop_last) if batched and type(inner) is BatchSampler else False
        self.exact_skip = (not batched or type(inner) is BatchSampler) and type(sampler) in (
            SequentialSampler,
            RandomSampler,
            DistributedSampler,
        )
        if type(sampler) is RandomSampler and sampler.replacement:
            self.exact_skip = False
        # the BatchSampler interface: user code and Lightning's `_set_sampler_epoch` read these
        self.sampler: Any = getattr(inner, "sampler", None) if batched else inner
        self.batch_size: int | None = getattr(inner, "batch_size", None) if batched else None
        self.drop_last = bool(getattr(inner, "drop_last", False)) if batched else False
        self._patches: list[tuple[Any, str]] = []  # (user object, attribute) we set while a foreign sampler runs
        self.seeding = "exact" if self.exact_skip else self._check_seeding()

    def _foreign_owners(self) -> list[Any]:
        """The user's batch sampler and its sampler (when it has one), each once."""
        owners = [self.inner]
        nested = getattr(self.inner, "sampler", None)
        if self.batched and nested is not None and nested is not self.inner:
            owners.append(nested)
        return owners

    def _check_seeding(self) -> str:
        """How a sampler we do not know is seeded: ``"checked"``, ``"ignored"`` or ``"private"``.

        Its ``generator`` (and a ``DistributedSampler``'s ``seed``) is set to ours while it runs; the
        claim that this seeds it is checked first (:func:`_order_follows`). ``"ignored"``: the sampler
        has such an attribute but its order does not follow it; it then runs on a private stream, as
        a sampler without one (``"private"``) does.
        """
        patches: list[tuple[Any, str, Callable[[], Any]]] = []
        for owner in self._foreign_owners():
            if hasattr(owner, "generator"):
                patches.append((owner, "generator", lambda: _seeded_generator(0x5EED)))
            if isinstance(owner, DistributedSampler):
                patches.append((owner, "seed", lambda: 0x5EED))
        self._patches = [(owner, name) for owner, name, _ in patches]
        if not patches:
            return "private"
        return "checked" if _order_follows(self.inner, patches) else "ignored"

    def __len__(self) -> int:
        if self._remap is not None and (self._remap.active or self._remap.pending):
            return self._remap.length
        return len(self.inner)

    def resume_at(self, counter: int, pass_: int, offset: int) -> None:
        """Make the next pass for ``counter`` start at pass ``pass_``, skipping ``offset`` batches."""
        self._resume = (counter, pass_, offset)

    def describe(self) -> dict[str, Any]:
        """How this loader orders a pass: enough to recompute the order under another world size."""
        sampler: Any = self._sampler
        kind = {SequentialSampler: "sequential", RandomSampler: "random", DistributedSampler: "distributed"}.get(
            type(sampler), "other"
        )
        if not self.exact_skip or self._batch_size is None:
            kind = "other"
        info: dict[str, Any] = {"kind": kind, "batch_size": self._batch_size or 1, "drop_last": self._drop_last}
        if kind != "other":
            info["n"] = len(sampler.dataset if kind == "distributed" else sampler.data_source)
        if kind == "random":
            info["num_samples"] = int(sampler.num_samples)  # may differ from n: the re-deal needs it
        if kind == "distributed":
            info.update(
                world_size=int(sampler.num_replicas),
                shuffle=bool(sampler.shuffle),
                sampler_drop_last=bool(sampler.drop_last),
            )
        return info

    def resume_remapped(self, counter: int, pass_: int, offset: int, saved: dict[str, Any]) -> None:
        """Resume a pass written under another world size: split what remains of it over the ranks now.

        ``saved`` is :meth:`describe` of the loader that wrote the checkpoint (on any rank) and
        ``offset`` the batches each old rank had consumed. The samples of the pass that no rank
        consumed are dealt out to the current ranks, every rank getting the same number of batches.
        """
        stage, index = self.stream
        order_seed = derive_seed(self.seed, "order", stage, index, counter, pass_)
        order = _global_order(saved, order_seed, counter)
        old_world = int(saved.get("world_size", 1))
        remaining = order[offset * int(saved["batch_size"]) * old_world :]
        world, rank = self.world_size, self.rank
        if remaining and len(remaining) % world:  # pad as DistributedSampler does, also past one repetition
            pad = world - len(remaining) % world
            remaining = remaining + (remaining * math.ceil(pad / len(remaining)))[:pad]
        part = remaining[rank::world]
        size = self._batch_size or 1
        batches = len(part) // size if self._drop_last else math.ceil(len(part) / size)
        self._remap = _Remap(counter=counter, pass_=pass_, indices=part, length=offset + batches)
        self._resume = None

    def end_remap(self) -> None:
        """Forget a re-dealt pass once its epoch is over (the loader may not have run to its end)."""
        self._remap = None

    def _remapped(self, counter: int, pass_: int, sample_seed: int) -> Iterator[Any]:
        assert self._remap is not None
        self._remap.pending = False
        self._remap.active = True
        seed = sample_seed if self.keyed else None
        yield from _sliced_batches(self._remap.indices, self._batch_size, self._drop_last, 0, seed)
        self._remap = None

    def _peek_pass(self) -> tuple[int, int, int]:
        """(counter, pass, batches to skip) of the pass the next iterator starts, without committing it."""
        counter = int(self.counter())
        if self._remap is not None and self._remap.pending and self._remap.counter == counter:
            return counter, self._remap.pass_, 0
        if self._resume is not None and self._resume[0] == counter:
            return self._resume
        if self.current is not None and self.current[0] == counter:
            # a new pass only after the last one ran out (a cycled loader); an iterator dropped before its
            # end (Lightning re-creates the first iterator of an epoch after reloading loaders) is restarted
            return counter, self.current[1] + int(self._finished), 0
        return counter, 0, 0

    def __iter__(self) -> Iterator[Any]:
        # torch's multi-process iterator calls iter() twice per DataLoader iterator and only advances the
        # second: seed the loader generator now (the base seed is drawn right after the first call), but
        # commit the pass only when the iterator is first advanced.
        counter, pass_, _ = self._peek_pass()
        stage, index = self.stream
        loader_seed = derive_seed(self.seed, "loader", self.rank, stage, index, counter, pass_)
        self.loader_generator.manual_seed(loader_seed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                f"[rank: {self.rank}] {stage} loader {index}, counter {counter}, pass {pass_}: order seed"
                f" {derive_seed(self.seed, 'order', stage, index, counter, pass_)}, sample seed"
                f" {derive_seed(self.seed, 'sample', stage, index, counter, pass_)},"
                f" worker base seed from {loader_seed}"
            )
        return self._pass_iterator()

    def _pass_iterator(self) -> Iterator[Any]:
        counter, pass_, skip = self._peek_pass()
        self._resume = None
        self.current = (counter, pass_)
        self._finished = False
        stage, index = self.stream
        order_seed = derive_seed(self.seed, "order", stage, index, counter, pass_)
        sample_seed = derive_seed(self.seed, "sample", stage, index, counter, pass_)
        if self._remap is not None and self._remap.counter == counter:
            yield from self._remapped(counter, pass_, sample_seed)
            self._finished = True
            return
        self._remap = None
        if self.exact_skip:
            order = _order(self._sampler, order_seed, counter)
            if order is not None:
                keyed_seed = sample_seed if self.keyed else None
                yield from _sliced_batches(order, self._batch_size, self._drop_last, skip, keyed_seed)
                self._finished = True
                return
        yield from self._generic(order_seed, sample_seed, skip)
        self._finished = True

    def _generic(self, order_seed: int, sample_seed: int, skip: int) -> Iterator[Any]:
        inner = self.inner
        values: dict[str, Callable[[], Any]] = {
            "generator": lambda: _seeded_generator(order_seed),
            "seed": lambda: fold_seed32(order_seed),
        }
        patches = [(owner, name, values[name]()) for owner, name in self._patches]
        epoch = self.current[0] if self.current else 0

        def make() -> Iterator[Any]:
            self._forward_epoch(epoch)
            return iter(inner)

        iterator = _IsolatedIterator(make, order_seed, patches=patches, isolate=self.seeding != "checked")
        for _ in range(skip):  # index level: no sample is loaded
            if next(iterator, _END) is _END:
                break
        return self._keyed(iterator, sample_seed)

    def _forward_epoch(self, epoch: int) -> None:
        """``set_epoch(epoch)`` on the user's samplers before a pass: a sampler that reshuffles per epoch still does.

        Training passes only (the counter of evaluation passes is not an epoch); a ``DistributedSampler``
        is set on every pass, as before.
        """
        for owner in self._foreign_owners():
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch) and (self.stream.stage == "train" or isinstance(owner, DistributedSampler)):
                set_epoch(epoch)

    def _keyed(self, iterator: Iterator[Any], seed: int) -> Iterator[Any]:
        if not self.keyed:
            yield from iterator
        elif self.batched:
            for batch in iterator:
                yield KeyedBatch(seed, list(batch))
        else:
            for index in iterator:
                yield SampleKey(seed, index)


_END = object()


class _PassSeeder:
    """For an ``IterableDataset``: re-seeds the loader generator (the workers' base seed) at every pass."""

    def __init__(
        self,
        inner: Any,
        *,
        seed: int,
        rank: int,
        stream: StreamKey,
        counter: Callable[[], int],
        generator: torch.Generator,
    ) -> None:
        self.inner = inner
        self.seed, self.rank, self.stream, self.counter, self.generator = seed, rank, stream, counter, generator
        self._passes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        counter = int(self.counter())
        pass_ = self._passes.get(counter, -1) + 1
        self._passes = {counter: pass_}
        stage, index = self.stream
        self.generator.manual_seed(derive_seed(self.seed, "loader", self.rank, stage, index, counter, pass_))
        return iter(self.inner)


def _force_setattr(loader: DataLoader[Any], name: str, value: Any) -> None:
    # DataLoader refuses to set some attributes after __init__; we replace them before any iterator exists
    object.__setattr__(loader, name, value)


def _strip_layers(loader: DataLoader[Any]) -> None:
    """Take our layers off a copy that Lightning re-instantiated from a loader we prepared."""
    if isinstance(loader.dataset, _KeyedDataset):
        _force_setattr(loader, "dataset", loader.dataset.dataset)
    if isinstance(loader.collate_fn, _KeyedCollate):
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


_warned: set[str] = set()


def _seeding_text(sampler: ReproBatchSampler) -> str:
    """What the warning about a foreign sampler says of its seeding: only what :meth:`_check_seeding` found."""
    attributes = " and ".join(sorted({f"`{name}`" for _, name in sampler._patches}))
    if sampler.seeding == "checked":
        how = (
            f"it is seeded through its {attributes} attribute (checked: two passes with the same {attributes}"
            " give one order, whatever the process streams)"
        )
    elif sampler.seeding == "ignored":
        how = (
            f"it has a {attributes} attribute, but its order does not follow it (two passes with the same"
            f" {attributes} gave different orders), so it runs on a private stream seeded per epoch"
        )
    else:
        how = "it has no `generator` attribute, so it runs on a private stream seeded per epoch"
    return how + ", and a mid-epoch resume advances it batch by batch (indices only, no data is loaded)."


def _warn_once(message: str, category: type[Warning]) -> None:
    if message not in _warned:
        _warned.add(message)
        rank_zero_warn(message, category=category)


def _own_generators(dataset: Any) -> list[OwnGenerator]:
    """The generators ``dataset`` holds that we key per sample; a warning for each one we cannot key."""
    found, unkeyable = find_generators(dataset)
    name = type(dataset).__name__
    for generator in found:
        log.debug(f"{name}.{generator.path} ({type(generator.obj).__name__}) is re-seeded per sample")
    for path, reason in unkeyable:
        _warn_once(
            f"{name}.{path} looks like a random generator that lightning-repro cannot re-seed per sample ({reason}):"
            " what it draws depends on num_workers and on which worker loads a sample, and a resume does not"
            " restore it. Draw from python `random`, `numpy.random`, `torch` (keyed per sample), or hold a"
            " `random.Random`, `numpy.random.Generator`, `numpy.random.RandomState` or CPU `torch.Generator`"
            " (found and keyed per sample too).",
            NotExactWarning,
        )
    return found


def prepare_dataloader(
    loader: Any,
    *,
    seed: int,
    rank: int,
    stream: StreamKey,
    counter: Callable[[], int],
    sample_keyed: bool = True,
    world_size: int = 1,
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
        counter: Returns the epoch (training) or global step (evaluation) when a pass starts.
        sample_keyed: Seed each ``dataset[i]`` from its key.
    """
    if not isinstance(loader, DataLoader):
        _warn_once(
            f"lightning-repro cannot take over a {type(loader).__name__} (not a torch DataLoader): its order and"
            " randomness are not pinned, and a mid-epoch resume of it is not exact.",
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
        dataset = loader.dataset
        stateful = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )
        if not stateful:
            _warn_once(
                f"{type(dataset).__name__} is an IterableDataset without `state_dict()`/`load_state_dict()`: its"
                " workers are seeded, but it has no sample index, so a mid-epoch resume of it is not exact"
                " (the epoch restarts from its beginning). Implement both methods (and read it with"
                " num_workers=0) to resume it exactly.",
                NotExactWarning,
            )
        elif loader.num_workers > 0:
            _warn_once(
                f"{type(dataset).__name__} implements `state_dict()`, but it is read by {loader.num_workers} worker"
                " processes whose copies of it advance, not the one checkpoints can see: a mid-epoch resume of it"
                " is exact only with num_workers=0 (or a loader that saves its workers' state, such as torchdata's"
                " StatefulDataLoader).",
                NotExactWarning,
            )
        elif not callable(getattr(dataset, "__len__", None)):
            _warn_once(
                f"{type(dataset).__name__} implements `state_dict()` but has no `__len__`: Lightning fetches one batch"
                " ahead of a loader of unknown length, so the state a checkpoint saves is one batch ahead and a"
                " mid-epoch resume skips that batch. Give it a `__len__` to resume it exactly.",
                NotExactWarning,
            )
        if not isinstance(current, _PassSeeder):
            loader = _private_copy(loader)
            seeder = _PassSeeder(current, seed=seed, rank=rank, stream=stream, counter=counter, generator=generator)
            _force_setattr(loader, "batch_sampler" if batched else "sampler", seeder)
            loader.generator = generator  # draws of the iterator's base seed no longer touch the global RNG
            loader.worker_init_fn = _WorkerInit(loader.worker_init_fn, seed, rank, stream)
        else:
            current.stream, current.counter, current.rank = stream, counter, rank
        return loader
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
    sampler.world_size = world_size
    if not sampler.exact_skip and stream.stage != "predict":  # predict never resumes: nothing to warn about
        inner = current.sampler if batched and type(current) is BatchSampler else current
        name = type(inner).__name__ if type(current) is BatchSampler or not batched else type(current).__name__
        _warn_once(f"{name} is not a sampler lightning-repro knows: {_seeding_text(sampler)}", ReproWarning)
    loader = _private_copy(loader)
    outermost: Any = _PlainIndexRecorder(sampler) if recorded else sampler
    _force_setattr(loader, "batch_sampler" if batched else "sampler", outermost)
    loader.generator = generator
    loader.worker_init_fn = _WorkerInit(loader.worker_init_fn, seed, rank, stream)
    if sample_keyed:
        keyed = _KeyedDataset(loader.dataset)
        keyed._own = _own_generators(loader.dataset)
        _force_setattr(loader, "dataset", keyed)
        if batched:
            loader.collate_fn = _KeyedCollate(loader.collate_fn, keyed)
        elif loader.collate_fn is not default_convert:  # default_convert draws nothing: skip the extra seeding
            keyed._keyed_collate = True
            loader.collate_fn = _KeyedCollate(loader.collate_fn, keyed)
    return loader
