"""torchdata's ``torchdata.nodes`` pipelines: a ``Loader`` over a graph of nodes, taken over through a copy of it.

A ``Loader(root)`` is not a torch ``DataLoader``: its nodes (``SamplerWrapper``, ``ParallelMapper``, ``Batcher``,
``Prefetcher``...) pull from each other, some in threads (a ``Prefetcher``'s, a ``ParallelMapper``'s reading thread)
and a ``ParallelMapper``'s ``map_fn`` in worker threads or processes. Lightning saves and loads the loader's own
``state_dict()`` (``loops/fit_loop.py``: ``"combined_loader"``), which positions every node; what plain torchdata
leaves unpinned is the randomness: a ``RandomSampler`` without generator draws its order from torch's global RNG
(lazily, in the thread that first pulls it), and ``map_fn`` draws from whatever state its thread or process has.

Lightning gets a copy of the loader (:func:`take_over`; the user's loader and nodes are left as they are) whose graph
is rebuilt with (:mod:`lightning_repro.data.nodekeys`):

- each ``SamplerWrapper``'s sampler in a ``KeyedSampler``: a pass's order drawn in the main process, at the pass's
  start, on the order stream of the pass (``streams.order_seed``; a ``generator`` attribute set to that stream's
  generator), the process streams put back;
- each ``Mapper``/``ParallelMapper`` fed by a ``Numbered`` node (its inputs numbered within the pass; the number is
  in the node's state, so torchdata's snapshots keep it) and its ``map_fn`` in a ``KeyedMap``, which seeds python,
  numpy and torch from ``(seed, rank, loader, counter, pass, mapper, number)`` (``streams.nodes_seed``) in whichever
  process runs it, so an item's draws are the same in every run, with any number of workers, before and after a
  resume;
- each ``MultiNodeWeightedSampler`` (a mixture of sources, restarting an exhausted one mid-pass) with its sources
  rebuilt and its ``seed`` from ``streams.mixture_seed``; its rank and world size are torchdata's, its pass count
  (in its state) counted within the counter;
- each ``IterableWrapper`` the main thread pulls with its iterable's draws keyed (``KeyedIterable``).

The loader's ``state_dict()`` is the one after the batches training consumed (Lightning fetches one batch ahead, which
torchdata's own state counts): :class:`_Recorded` keeps the state after each of the last batches. Not taken over,
with a ``NotExactWarning`` saying why (:func:`why_not_exact`): a node this module does not know, a ``map_fn`` that runs
in threads (``method="thread"``, or an inline ``Mapper`` under a thread-pulling node), which share the process
streams with training (``default_collate``/``default_convert``, which draw nothing, are exact there),
``in_order=False`` (items in the order workers finish). Part of ``data/``: imports the bottom layer only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from lightning_repro import streams
from lightning_repro.data.nodegraph import (
    DRAW_NOTHING,
    UNKNOWN,
    map_fn,
    node_kind,
    pulls_in_thread,
    source_of,
    why_not_exact,
)
from lightning_repro.data.nodekeys import KeyedMap, KeyedSampler, Passes, keyed_iterable, keyed_mixture, numbered_class
from lightning_repro.data.nodethreads import stop_threads

__all__ = [
    "is_nodes_loader",
    "is_taken_over",
    "nodes_position",
    "quiet_iterable_check",
    "take_over",
    "why_not_exact",
]

log = logging.getLogger(__name__)

_CHECK = "_check_dataloader_iterable"
_YIELDED = "num_yielded"  # torchdata's LoaderIterator.NUM_YIELDED_KEY
_OURS = "_lightning_repro_nodes"
_MAPPER_ARGUMENTS: tuple[str, ...] = ("num_workers", "in_order", "method", "multiprocessing_context", "max_concurrent")
_MAPPER_ARGUMENTS += ("snapshot_frequency", "prebatch")  # ParallelMapper's after source and map_fn, as it keeps them
_KEEP = 4  # states kept by _Recorded: Lightning fetches one batch ahead


def is_nodes_loader(obj: Any) -> bool:
    """Whether ``obj`` is a ``torchdata.nodes.Loader`` (or a subclass of it); torchdata is not imported for others."""
    if not any(cls.__module__.startswith("torchdata.nodes") for cls in type(obj).__mro__):
        return False
    try:
        from torchdata.nodes import Loader  # type: ignore[import-untyped]
    except ImportError:
        return False
    return isinstance(obj, Loader)


def _rebuild(node: Any, threaded: bool, make: dict[str, Any]) -> Any:
    """A copy of ``node`` and the nodes under it, keyed (see the module); the user's nodes are left as they are."""
    kind = node_kind(node)
    if kind == "MultiNodeWeightedSampler":
        sources = {name: _rebuild(source, threaded, make) for name, source in node.source_nodes.items()}
        make["mixtures"] += 1
        return keyed_mixture(node, sources, make["seed"], make["stream"], make["counter"], make["mixtures"] - 1)
    if kind == "IterableWrapper" and not threaded:  # pulled in the main thread: its iterable's draws keyed
        make["iterables"] += 1

        def iterable_base(counter: int, pass_: int, index: int = make["iterables"] - 1) -> int:
            return streams.nodes_iterable_seed(make["seed"], make["rank"], make["stream"], counter, pass_, index)

        return keyed_iterable(node, iterable_base, make["counter"])
    make["unkeyed"] |= kind == "IterableWrapper"  # in a thread: what its iterable draws is as it is
    source = source_of(node)
    below = None if source is None else _rebuild(source, threaded or pulls_in_thread(node), make)
    if kind == "SamplerWrapper":
        clone = copy.copy(node)
        clone.sampler = KeyedSampler(node.sampler, make["seed"], make["stream"], make["counter"])
        clone.epoch, clone.epoch_updater = 0, clone.sampler.next_pass  # its passes counted within the counter
        return clone
    if kind == "ParallelMapper":
        fn = map_fn(node)
        inline_thread = node.num_workers == 0 and threaded
        if fn in DRAW_NOTHING or inline_thread or (node.num_workers > 0 and node.method == "thread"):
            mapped_source, mapped_fn = below, fn  # draws nothing, or cannot be pinned (why_not_exact says so)
        else:
            index = make["mappers"]
            make["mappers"] += 1

            def base(counter: int, pass_: int, index: int = index) -> int:
                return streams.nodes_seed(make["seed"], make["rank"], make["stream"], counter, pass_, index)

            mapped_source = make["Numbered"](below, base, Passes(make["counter"]))
            mapped_fn = KeyedMap(fn, restore=node.num_workers == 0)
        return type(node)(mapped_source, mapped_fn, **{name: getattr(node, name) for name in _MAPPER_ARGUMENTS})
    clone = copy.copy(node)
    if below is not None:
        clone.source = below
    if hasattr(clone, "_it"):
        clone._it = None  # an iterator of the user's node is not ours to reset
    return clone


class _Recorded(Iterator[Any]):
    """The loader's iterator, with its state after each of the last batches it yielded, by batches of the epoch.

    A pass's batches are counted from the state it started at (a resumed pass's: torchdata's ``num_yielded``), and
    that count is what each state says: torchdata's ``LoaderIterator`` counts the batch it looks ahead at after a
    restored state (``has_next``) twice, once read ahead and once yielded, so a state written after a resume would say
    one more. ``base``: the epoch's batches before the pass's first (a loader cycled beside a longer one in a
    ``CombinedLoader`` reads several passes in an epoch; a pass of the same epoch keeps the earlier pass's ``states``,
    and at the batch where one ended and the next began, the state is the ended pass's: resumed there, the ended pass
    gives no batch and Lightning starts the next, as the uninterrupted run did). ``iterator=None``: a loaded pass read
    to its end (``first``, its state), which yields nothing.
    """

    def __init__(
        self, iterator: Any, counter: int, base: int, states: dict[int, Any] | None = None, first: Any = None
    ) -> None:
        self.iterator, self.counter, self.base = iterator, counter, base
        if iterator is not None:
            first = iterator.state_dict()
        self.yielded = self.start = int(first.get(_YIELDED, 0)) if isinstance(first, dict) else 0
        self.ended = iterator is None
        self.states: dict[int, Any] = {} if states is None else states
        self.states.setdefault(base + self.yielded, first)

    def __next__(self) -> Any:
        if self.iterator is None:
            raise StopIteration
        try:
            item = next(self.iterator)
        except StopIteration:
            self.ended = True
            raise
        self.yielded += 1
        state = self.iterator.state_dict()
        if isinstance(state, dict) and _YIELDED in state:
            state = {**state, _YIELDED: self.yielded}
        batches = self.base + self.yielded
        self.states[batches] = state
        self.states.pop(batches - _KEEP, None)
        return item

    def state_after(self, batches: int) -> Any:
        """The state after ``batches`` of the epoch (``None``: not kept).

        Once the pass ended, its last state for any later count: a ``CombinedLoader`` in ``max_size`` mode goes on
        without it.
        """
        state = self.states.get(batches)
        end = self.base + self.yielded
        if state is None and self.ended and batches > end:
            state = self.states.get(end)
        return state


@contextlib.contextmanager
def quiet_iterable_check(setup_data: Callable[[], None]) -> Iterator[None]:
    """While a loop's ``setup_data`` runs: Lightning's check of a ``Loader`` starts no iterator of the user's.

    ``_check_dataloader_iterable`` (``trainer/connectors/data_connector.py``, called by the loops' ``setup_data``)
    calls ``iter()`` on the user's loader to see that it is iterable. For a ``Loader`` that starts its threads and
    workers: a ``ParallelMapper``'s reading thread pulls the user's sampler at once, and a ``RandomSampler`` without
    generator draws its seed from torch's global RNG there, in the training process, whenever that thread runs (two
    runs differed); and the iterator, which Lightning never uses (it iterates our copy), kept its worker processes
    (the process hung at exit, joining them). A ``Loader`` is iterable by its class: the check is skipped for it. The
    name is the defining module's global, replaced during the call only.
    """
    names = getattr(getattr(setup_data, "__func__", None), "__globals__", {})
    check = names.get(_CHECK)
    if check is None:
        yield
        return

    def checked(dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        return None if is_nodes_loader(dataloader) else check(dataloader, *args, **kwargs)

    names[_CHECK] = checked
    try:
        yield
    finally:
        names[_CHECK] = check


@dataclasses.dataclass
class _Ours:
    """What our copy of a ``Loader`` keeps (in its ``__dict__`` under :data:`_OURS`)."""

    consumed: Callable[[], int] | None  # a train loader's: the batches training consumed in the epoch
    counter: Callable[[], int]  # the counter (epoch) of the pass about to start
    warn: Callable[[str], None]  # a NotExactWarning's message
    not_exact: list[str]  # why_not_exact's reasons
    iterables: bool = False  # the graph has an IterableWrapper pulled in a thread: its iterable's draws as they are
    recorded: _Recorded | None = None  # the current pass's iterator
    loaded: bool = False  # Lightning loaded its own state (a mid-epoch resume)


def _ours(loader: Any) -> _Ours:
    return vars(loader)[_OURS]  # type: ignore[no-any-return]


def _base(loader: Any) -> Any:
    return type(loader).__bases__[0]  # the user's Loader class


def _iter(self: Any) -> Iterator[Any]:
    """``__iter__`` of our copy of a ``Loader``: its iterator, its states recorded (:class:`_Recorded`).

    A loaded state of a pass read to its end (a checkpoint on the epoch's last batch, or after the pass of a loader
    cycled beside a longer one, or run out beside it in ``max_size`` mode) gives no batch: Lightning, which cannot
    tell such a loader's epoch ended (it has no length), iterates it again in that epoch, and torchdata's ``Loader``
    would start the next pass there (``restart_on_stop_iteration``); the epoch after it starts that pass (a
    ``CombinedLoader`` cycling it, at once, as the uninterrupted run did).
    An earlier pass's iterator still running (cut by ``limit_val_batches``) is stopped first, safely (see
    :mod:`~lightning_repro.data.nodethreads`), before torchdata's reset stops it all at once.
    """
    if not self._iter_for_state_dict:  # else torchdata gives the iterator state_dict() made, not started
        stop_threads(self.root)
    ours = _ours(self)
    if self._next_iter_state_dict is None and (again := _dropped_pass_state(ours)) is not None:
        self._next_iter_state_dict = again  # the dropped pass again, where training left it (its start)
    restart, loaded = self.restart_on_stop_iteration, self._next_iter_state_dict
    loading = loaded is not None
    self.restart_on_stop_iteration = restart and not loading
    try:
        iterator = _base(self).__iter__(self)
    finally:
        self.restart_on_stop_iteration = restart
    counter, previous = ours.counter(), ours.recorded
    states = None
    if loading:  # the epoch's batches before the loaded pass's first: those consumed, less the pass's own
        base = int(ours.consumed()) - int(loaded.get(_YIELDED, 0)) if ours.consumed is not None else 0
    elif previous is not None and previous.ended and previous.counter == counter:  # cycled within the epoch
        base, states = previous.base + previous.yielded, previous.states
    else:
        base = 0
    if loading and restart and not iterator.has_next():
        # torchdata keeps the state has_next() cached before finding the end, and gives it for the whole next pass
        iterator._cached_state_dict = None
        ours.recorded = _Recorded(None, counter, max(base, 0), first=loaded)
        return ours.recorded
    ours.recorded = _Recorded(iterator, counter, max(base, 0), states)
    return ours.recorded


def _dropped_pass_state(ours: _Ours) -> Any:
    """The state to restart a train pass from whose iterator was dropped before its end in its epoch, or ``None``.

    A ``fit`` called again on the same Trainer (training continued) makes the epoch's iterator in
    ``FitLoop.setup_data`` and again after ``on_train_epoch_start`` (``training_epoch_loop.on_run_start``), dropping
    the first, which had read ahead: torchdata counts a pass more (its ``SamplerWrapper`` epoch, a mixture's pass, a
    mapper's pass), and the epoch's pass would be keyed as the epoch's second. Restarted from the state the training
    left it at (the pass's start there), it is the pass the uninterrupted run reads.
    """
    previous = ours.recorded
    if ours.consumed is None or previous is None or previous.iterator is None or previous.ended:
        return None
    if previous.counter != ours.counter():
        return None
    return previous.state_after(int(ours.consumed()))


def _state_dict(self: Any) -> dict[str, Any]:
    """``state_dict`` of our copy of a ``Loader``: the state after the batches training consumed in the pass.

    Lightning fetches a batch ahead of training, which the loader's own state counts as read; a resume from that
    would skip it.
    """
    ours = _ours(self)
    recorded, consumed = ours.recorded, ours.consumed
    if recorded is not None and consumed is not None:
        state = recorded.state_after(int(consumed()))
        if state is not None:
            return state  # type: ignore[no-any-return]
        ours.warn(
            f"lightning-repro has no state of the torchdata.nodes {type(self).__name__} after the {int(consumed())}"
            f" batches training consumed in this epoch (its current pass began after {recorded.base} of them and"
            f" yielded {recorded.yielded - recorded.start}): the checkpoint holds its own state, which counts the"
            " batches Lightning fetched ahead, so a resume from it skips them and is not exact."
        )
    return _base(self).state_dict(self)  # type: ignore[no-any-return]


def _load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
    _ours(self).loaded = True
    _base(self).load_state_dict(self, state_dict)


def nodes_position(loader: Any, batches: int) -> tuple[bool, str]:
    """Whether our copy of a ``Loader`` resumed exactly from ``batches`` consumed batches of the epoch; the text."""
    name = f"torchdata.nodes {type(loader).__name__}"
    ours = _ours(loader)
    if ours.not_exact:
        return False, f"{name}: {ours.not_exact[0]}"
    if not batches:
        return True, f"{name}: a new pass"
    if not ours.loaded:
        return False, f"{name}: its own state was not in the checkpoint, so its pass starts over"
    draws = "its draws keyed"
    if ours.iterables:  # what an iterable draws while iterated (in whichever thread pulls it) is not keyed
        draws += " but its IterableWrapper's iterable's, pulled in a thread, as they are (exact if it draws nothing)"
    return True, f"{name}: its own state after the {batches} consumed batches, loaded by Lightning, {draws}"


def is_taken_over(obj: Any) -> bool:
    """Whether ``obj`` is our copy of a ``Loader`` (:func:`take_over`)."""
    return type(obj) in _CLASSES.values()


_CLASSES: dict[type, type] = {}


def take_over(
    loader: Any,
    *,
    seed: int,
    rank: int,
    stream: streams.StreamKey,
    counter: Callable[[], int],
    consumed: Callable[[], int] | None,
    warn: Callable[[str], None],
) -> Any:
    """A copy of the ``Loader`` ``loader`` over a keyed copy of its graph (see the module); the user's is left as is.

    ``consumed``: for a train loader, the batches training consumed in the epoch (its ``state_dict()`` is the state
    after them). A graph with a node this module does not know is returned as it is; ``warn`` is given a
    ``NotExactWarning``'s message for that and for each other reason of :func:`why_not_exact`.
    """
    if is_taken_over(loader):
        return loader
    not_exact = why_not_exact(loader)
    unknown = [reason for reason in not_exact if reason.endswith(UNKNOWN)]
    if unknown:
        warn(
            f"lightning-repro cannot take over a {type(loader).__name__} (a `torchdata.nodes` pipeline: {unknown[0]}):"
            " its order and randomness are not pinned, and a mid-epoch resume of it is not exact. Pipelines of"
            " torchdata's own nodes (SamplerWrapper, IterableWrapper, Mapper, ParallelMapper, Batcher, Unbatcher,"
            " Prefetcher, PinMemory, MultiNodeWeightedSampler) are taken over, and around a node of your own that"
            " pulls from one node, its `source`, and holds no other."
        )
        return loader
    for reason in not_exact:
        warn(
            f"lightning-repro takes over the `torchdata.nodes` {type(loader).__name__}, but {reason}: two runs can"
            " differ, and a resume of it is not exact."
        )
    stop_threads(loader.root)
    make: dict[str, Any] = {"seed": seed, "rank": rank, "stream": stream, "counter": counter, "mappers": 0}
    make.update(mixtures=0, iterables=0, unkeyed=False)
    make["Numbered"] = numbered_class()
    clone = copy.copy(loader)
    clone.root = _rebuild(loader.root, False, make)
    clone._it, clone._next_iter_state_dict, clone._iter_for_state_dict = None, None, False
    cls = type(loader)
    if cls not in _CLASSES:
        body = {"__module__": cls.__module__, "__iter__": _iter, "state_dict": _state_dict}
        _CLASSES[cls] = type(cls.__name__, (cls,), {**body, "load_state_dict": _load_state_dict})
    clone.__class__ = _CLASSES[cls]
    ours = _Ours(consumed=consumed, counter=counter, warn=warn, not_exact=not_exact, iterables=make["unkeyed"])
    vars(clone)[_OURS] = ours
    return clone
