"""The keyed parts of a ``torchdata.nodes`` graph taken over (:mod:`lightning_repro.data.nodes`).

:class:`KeyedSampler` draws a ``SamplerWrapper``'s pass's order in the main process, on the pass's order stream;
:func:`numbered_class` numbers a mapper's inputs within a pass (the number in the node's state); :class:`KeyedMap`
seeds python, numpy and torch from each input's key before the user's ``map_fn`` runs. Part of ``data/``: imports the
bottom layer only.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import Sampler

from lightning_repro import streams
from lightning_repro.data.fastrng import ItemSeeder, capture_fast, restore_fast, seed_sample
from lightning_repro.data.foreign import seeded_generator

__all__ = [
    "ITERABLE",
    "IterableKey",
    "KeyedMap",
    "KeyedSampler",
    "MixtureKey",
    "Passes",
    "draws_nothing",
    "keyed_iterable",
    "keyed_mixture",
    "numbered_class",
]


class Passes:
    """The pass of a node within a counter (an epoch): 0 for the counter's first pass, 1 for its second..."""

    def __init__(self, counter: Callable[[], int]) -> None:
        self.counter = counter
        self.last: int | None = None
        self.index = 0

    def begin(self) -> tuple[int, int]:
        """A pass begins: its counter and its index among the counter's passes."""
        now = int(self.counter())
        self.index = self.index + 1 if now == self.last else 0
        self.last = now
        return now, self.index


def draws_nothing(sampler: Any) -> bool:
    """Whether ``sampler`` draws from nothing but a ``generator`` of its own (which our copy seeds) or nothing."""
    from torch.utils.data import DistributedSampler, SequentialSampler

    return hasattr(sampler, "generator") or type(sampler) in (DistributedSampler, SequentialSampler)


class KeyedSampler(Sampler[Any]):
    """A ``SamplerWrapper``'s sampler whose pass's order is drawn at the pass's start on the pass's order stream.

    The pass is keyed by the counter (the epoch, restored with the run) and the ``SamplerWrapper``'s own count of its
    passes, which it gives to ``set_epoch`` before each ``iter()`` and keeps in its state (so a source a
    ``MultiNodeWeightedSampler`` restarted within an epoch draws the same order in a resumed process). A ``generator``
    attribute is set to that stream's generator on a copy of the sampler; in the main thread (where torchdata resets
    the graph at ``iter()``), the process streams are also seeded from the order seed while the order is drawn, and put
    back. In another thread (a ``MultiNodeWeightedSampler`` pulled there restarting its source), the process streams
    are training's: only the generator is seeded (a sampler that draws from the process streams is warned of there).
    ``set_epoch`` of the user's sampler gets the counter, on our copy of the sampler.
    """

    def __init__(self, sampler: Any, seed: int, stream: streams.StreamKey, counter: Callable[[], int]) -> None:
        self.inner = copy.copy(sampler)
        self.seed, self.stream, self.counter, self.passes = seed, stream, counter, 0
        self.last: int | None = None  # the counter of the pass drawn last

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        """The ``SamplerWrapper``'s count of its passes (restored from its state): the pass's key with the counter."""
        self.passes = int(epoch)

    def next_pass(self, epoch: int) -> int:
        """Our copy's ``SamplerWrapper.epoch_updater``: its passes counted within the counter (from 0 in a new one).

        An evaluation loader's state is not saved: counted from the process's start, its passes would be numbered
        otherwise after a resume.
        """
        return epoch + 1 if int(self.counter()) == self.last else 0

    def __iter__(self) -> Iterator[Any]:
        counter = int(self.counter())
        self.last = counter
        order_seed = streams.order_seed(self.seed, self.stream, counter, self.passes)
        sampler = self.inner
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(counter)
        if hasattr(sampler, "generator"):
            sampler = copy.copy(sampler)
            sampler.generator = seeded_generator(order_seed)
        if not hasattr(sampler, "__len__"):
            return iter(sampler)  # drawn from its (seeded) generator, lazily
        if threading.current_thread() is not threading.main_thread():
            return iter(list(sampler))  # the process streams are training's (see the class)
        saved = capture_fast()
        try:
            seed_sample(order_seed)
            return iter(list(sampler))
        finally:
            restore_fast(saved)


def _made_once(name: str, build: Callable[[], type]) -> type:
    """The class ``build`` makes (once torchdata is imported), kept as this module's global ``name`` (picklable)."""
    made = globals().get(name)
    if made is None:
        made = build()
        made.__qualname__ = name
        globals()[name] = made
    return made  # type: ignore[no-any-return]


def numbered_class() -> type:
    """The node class that numbers a mapper's inputs (``Numbered``)."""
    return _made_once("Numbered", _build_numbered)


def _build_numbered() -> type:
    from torchdata.nodes import BaseNode  # type: ignore[import-untyped]

    class Numbered(BaseNode):  # type: ignore[misc, type-arg]
        """Numbers the items of its source in a pass: ``(item seed, item)``; the number is in its state."""

        def __init__(self, source: Any, base: Callable[[int, int], int], passes: Passes) -> None:
            super().__init__()
            self.source, self.base, self.passes = source, base, passes
            self.key, self.number = 0, 0

        def reset(self, initial_state: dict[str, Any] | None = None) -> None:
            super().reset(initial_state)
            counter, index = self.passes.begin()
            if initial_state is not None:
                self.source.reset(initial_state["source"])
                self.number, index = int(initial_state["number"]), int(initial_state["pass"])
                self.passes.index = index
            else:
                self.source.reset()
                self.number = 0
            self.key = self.base(counter, index)

        def next(self) -> tuple[int, int, Any]:
            item = next(self.source)
            number = self.number
            self.number += 1
            return self.key, number, item

        def get_state(self) -> dict[str, Any]:
            return {"source": self.source.state_dict(), "number": self.number, "pass": self.passes.index}

    return Numbered


@dataclasses.dataclass
class MixtureKey:
    """What our copy of a ``MultiNodeWeightedSampler`` keys its passes by (in ``vars(copy)[MIXTURE]``)."""

    seed: int
    stream: streams.StreamKey
    counter: Callable[[], int]
    index: int  # the mixture's index in the graph
    last: int | None = None  # the counter of its last pass


MIXTURE = "_lightning_repro_mixture"


def keyed_mixture(
    node: Any, sources: dict[str, Any], seed: int, stream: streams.StreamKey, counter: Callable[[], int], index: int
) -> Any:
    """Our copy of the ``MultiNodeWeightedSampler`` ``node`` (the ``index``-th in the graph) over ``sources``."""
    clone = copy.copy(node)
    clone.source_nodes = sources
    clone.__class__ = _made_once("Mixture", _build_mixture)
    vars(clone)[MIXTURE] = MixtureKey(seed, stream, counter, index)
    return clone


def _build_mixture() -> type:
    """Our copy's class of a ``MultiNodeWeightedSampler`` (see ``Mixture``)."""
    from torchdata.nodes import MultiNodeWeightedSampler  # type: ignore[import-untyped]

    class Mixture(MultiNodeWeightedSampler):  # type: ignore[misc]
        """A mixture whose passes are numbered within the counter and whose seed is the run's, keyed by the counter.

        torchdata seeds a pass's draws from ``(seed, rank, world size, its pass count)``, the count in its state: a
        train pass resumes with it, but an evaluation loader's state is not saved, and counted from the process's
        start its passes would mix otherwise after a resume.
        """

        def reset(self, initial_state: dict[str, Any] | None = None) -> None:
            key: MixtureKey = vars(self)[MIXTURE]
            counter = int(key.counter())
            if initial_state is None and counter != key.last:
                self._started, self._epoch = False, 0  # a new counter's first pass
            key.last = counter
            self.seed = streams.mixture_seed(key.seed, key.stream, counter, key.index)
            super().reset(initial_state)

    return Mixture


@dataclasses.dataclass
class IterableKey:
    """What our copy of an ``IterableWrapper`` pulled in the main thread keys its iterable's draws by."""

    base: Callable[[int, int], int]  # (counter, pass) -> streams.nodes_iterable_seed of the pass
    passes: Passes
    seeder: ItemSeeder | None = None  # the pass's


ITERABLE = "_lightning_repro_iterable"
_PASS = "lightning_repro_pass"  # our entry in the wrapper's state: its pass in the counter


def keyed_iterable(node: Any, base: Callable[[int, int], int], counter: Callable[[], int]) -> Any:
    """Our copy of the ``IterableWrapper`` ``node``, pulled in the main thread (see ``KeyedIterable``)."""
    clone = copy.copy(node)
    clone._it = None  # an iterator of the user's is not ours
    clone.__class__ = _made_once("KeyedIterable", _build_iterable)
    vars(clone)[ITERABLE] = IterableKey(base, Passes(counter))
    return clone


def _build_iterable() -> type:
    """Our copy's class of an ``IterableWrapper`` pulled in the main thread (see ``KeyedIterable``)."""
    from torchdata.nodes import BaseNode, IterableWrapper, Stateful

    class KeyedIterable(IterableWrapper):  # type: ignore[misc]
        """An ``IterableWrapper`` whose iterable's draws are keyed, the process streams put back after each.

        Its ``iter()`` draws on the pass's ``iter_seed``, the ``next()`` of its ``k``-th item (a generator's body runs
        there) on ``item_seed(pass, k)``. A resumed pass is positioned as torchdata does (the iterable's own state,
        else ``k`` items read again), with the same keys, so the iterable comes out as it was.
        """

        def reset(self, initial_state: dict[str, Any] | None = None) -> None:
            BaseNode.reset(self, initial_state)  # IterableWrapper's own reset is done here, keyed
            key: IterableKey = vars(self)[ITERABLE]
            counter, index = key.passes.begin()
            if initial_state is not None:
                key.passes.index = index = int(initial_state.get(_PASS, index))
            base = key.base(counter, index)
            key.seeder = ItemSeeder(base)
            stateful = initial_state is not None and isinstance(self.iterable, Stateful)
            saved = capture_fast()
            try:
                seed_sample(streams.iter_seed(base))
                if stateful:
                    self.iterable.load_state_dict(initial_state[self.ITERABLE_KEY])  # type: ignore[index]
                self._it = iter(self.iterable)
            finally:
                restore_fast(saved)
            self._num_yielded = 0
            for _ in range(0 if initial_state is None else int(initial_state[self.NUM_YIELDED_KEY])):
                if not stateful:
                    self._next_keyed()  # the fast-forward: each item read again on its streams
                self._num_yielded += 1

        def next(self) -> Any:
            item = self._next_keyed()
            self._num_yielded += 1
            return item

        def _next_keyed(self) -> Any:
            key: IterableKey = vars(self)[ITERABLE]
            saved = capture_fast()
            try:
                key.seeder.seed(self._num_yielded)  # type: ignore[union-attr]
                return next(self._it)
            finally:
                restore_fast(saved)

        def get_state(self) -> dict[str, Any]:
            return {**super().get_state(), _PASS: vars(self)[ITERABLE].passes.index}

    return KeyedIterable


class KeyedMap:
    """A ``map_fn`` called with ``(pass key, number, item)``: the item's draws on ``streams.item_seed(key, number)``.

    The streams are put in place by an ``ItemSeeder`` of the pass (a block of items' states made at once, the same
    values as ``seed_sample`` of each item's seed). ``restore``: it runs in the main thread (an inline ``Mapper``), so
    the process streams are put back after it.
    """

    def __init__(self, fn: Callable[[Any], Any], restore: bool) -> None:
        self.fn, self.restore = fn, restore
        self.seeder: ItemSeeder | None = None  # the last pass's (in this process)

    def __getstate__(self) -> dict[str, Any]:
        return {"fn": self.fn, "restore": self.restore, "seeder": None}  # a worker makes its own

    def __call__(self, keyed: tuple[int, int, Any]) -> Any:
        """The user's ``map_fn`` of the item, on the item's streams."""
        key, number, item = keyed
        seeder = self.seeder
        if seeder is None or seeder.key != key:
            seeder = self.seeder = ItemSeeder(key)
        if not self.restore:
            seeder.seed(number)  # a worker's process or thread of its own: nothing to put back
            return self.fn(item)
        saved = capture_fast()
        try:
            seeder.seed(number)
            return self.fn(item)
        finally:
            restore_fast(saved)
