""":class:`ReproBatchSampler`, which yields the order of a pass and owns its position.

The order itself is computed and sliced by the pure functions of :mod:`lightning_repro.data.order`.
:class:`ReproBatchSampler` replaces a loader's batch sampler (or sampler) and owns its
position: ``state_dict()``/``load_state_dict()`` in torchdata's style.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from lightning_repro import streams
from lightning_repro.data.foreign import IsolatedIterator, check_seeding, foreign_owners, foreign_patches
from lightning_repro.data.keyed import KeyedBatch, SampleKey
from lightning_repro.data.order import _global_order, _order, _Remap, _sliced_batches, user_sampler_seed
from lightning_repro.streams import StreamKey

__all__ = ["ReproBatchSampler"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1  # of ReproBatchSampler.state_dict()


class ReproBatchSampler:
    """Replaces a loader's batch sampler (or its sampler when ``batch_size=None``).

    Each ``iter()`` starts a *pass*: its order, sample seeds and worker base seed are derived
    from ``(seed, stage, loader index, counter, pass)`` where ``counter`` is the epoch for
    training and ``2 * global step (+1 in the sanity check)`` for evaluation. Its position (counter,
    pass, batches of the pass yielded) is :meth:`state_dict`; :meth:`load_state_dict` (or ``resume_at``)
    makes the next pass of that counter start at that pass and batch.

    It has the ``BatchSampler`` interface (``sampler``, ``batch_size``, ``drop_last``). Lightning
    re-instantiates a batch sampler it does not know as ``type(b)(sampler, batch_size=..., drop_last=...)``
    (``trainer.predict`` or a DDP sampler on a loader we prepared, such as ``trainer.train_dataloader``):
    that call gives a plain ``BatchSampler``, and the takeover of the new loader starts afresh.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A ``ReproBatchSampler``, or a plain ``BatchSampler`` when Lightning re-instantiates one (see above)."""
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
        self.persistent = False  # the loader's workers persist: they draw their base seed once (streams.loader_seed)
        self.current: tuple[int, int] | None = None  # (counter, pass) of the last iterator
        self._resume: tuple[int, int, int] | None = None  # (counter, pass, batches to skip)
        self._finished = False  # the current pass ran to its end
        self._started: tuple[int, int, int] | None = None  # the first pass since construction or a resume
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
        self._position = 0  # batches of the current pass yielded (skipped ones included)
        # ((counter, pass), position, batch) of the batches yielded and not yet consumed, while the step trace is on:
        # the sampler runs ahead of the training step by the prefetch, and the trace takes them in order (FIFO)
        self.trace_batches: deque[tuple[tuple[int, int], int, Any]] | None = None
        self.seeding = "exact"
        if not self.exact_skip:
            self.seeding, self._patches = check_seeding(inner, batched)

    def __len__(self) -> int:
        if self._remap is not None and (self._remap.active or self._remap.pending):
            return self._remap.length
        return len(self.inner)

    def pass_in_use(self) -> tuple[int, int] | None:
        """(counter, pass) of the pass the data position is in (``None`` before any).

        The pass a resume set, until an iterator starts it, else the last iterator's. A resume from an epoch's last
        batch starts no pass before that epoch's end hooks when no worker prefetches: a checkpoint written there is
        still in the resumed pass, as the uninterrupted run's is.
        """
        return self._resume[:2] if self._resume is not None else self.current

    def can_give_again(self) -> bool:
        """Whether :meth:`keys_at` computes a batch's samples again (a sample-keyed loader can then load it again)."""
        return self.keyed and self.exact_skip and self.batched and self._remap is None

    def keys_at(self, counter: int, pass_: int, position: int) -> Any | None:
        """What the sampler yields at ``position`` of pass ``pass_`` for ``counter``, computed again, or ``None``.

        Only for the samplers whose order this class computes (torch's sequential, random, distributed ones),
        batched by a ``BatchSampler``, with no re-dealt pass: nothing runs but the order's computation.
        """
        if not (self.exact_skip and self.batched and self._remap is None):
            return None  # what can_give_again says
        order = _order(self._sampler, streams.order_seed(self.seed, self.stream, counter, pass_), counter)
        if order is None:
            return None
        seed = streams.sample_seed(self.seed, self.stream, counter, pass_) if self.keyed else None
        return next(_sliced_batches(order, self._batch_size, self._drop_last, position, seed), None)

    def resume_at(self, counter: int, pass_: int, offset: int) -> None:
        """Make the next pass for ``counter`` start at pass ``pass_``, skipping ``offset`` batches."""
        self.load_state_dict({"counter": counter, "pass": pass_, "batches": offset})

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from, in torchdata's style: ``counter``, ``pass`` and ``batches`` yielded.

        ``batches`` counts what this sampler has yielded in the pass (skipped batches included). A
        ``DataLoader`` prefetches (workers, Lightning's fetcher), so that runs ahead of the batches the
        training loop consumed: the callback saves the loop's own count and resumes with it. A pass that
        ran to its end gives the start of the next pass of its counter; a pass re-dealt to another world
        size is not described (the checkpoint entry resumes it).

        Examples:
            >>> from torch.utils.data import BatchSampler, SequentialSampler
            >>> sampler = ReproBatchSampler(
            ...     BatchSampler(SequentialSampler(range(10)), 2, False), batched=True, seed=1, rank=0,
            ...     stream=StreamKey("train", 0), counter=lambda: 0, loader_generator=torch.Generator(), keyed=False)
            >>> it = iter(sampler); _ = next(it); _ = next(it)
            >>> sampler.state_dict()
            {'version': 1, 'counter': 0, 'pass': 0, 'batches': 2}
        """
        if self._resume is not None:
            counter, pass_, batches = self._resume
        elif self.current is None:
            counter, pass_, batches = int(self.counter()), 0, 0
        elif self._finished:
            counter, pass_, batches = self.current[0], self.current[1] + 1, 0
        else:
            counter, pass_, batches = self.current[0], self.current[1], self._position
        return {"version": _STATE_VERSION, "counter": counter, "pass": pass_, "batches": batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next pass of ``state_dict["counter"]`` start at its ``pass``, skipping its ``batches``.

        Raises:
            ValueError: a key is missing or not a non-negative int, or the state is of a newer version.
        """
        version = state_dict.get("version", _STATE_VERSION)
        if not isinstance(version, int) or version > _STATE_VERSION:
            raise ValueError(
                f"`state_dict['version']` must be an int up to {_STATE_VERSION}, got {version!r}: the state was"
                " written by a newer lightning-repro; resume with that version"
            )
        values = []
        for key in ("counter", "pass", "batches"):
            value = state_dict.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"`state_dict[{key!r}]` must be a non-negative int, got {value!r}; pass the dict"
                    " `ReproBatchSampler.state_dict()` returned"
                )
            values.append(value)
        self._resume = (values[0], values[1], values[2])
        self._started = None

    def pass_start(self) -> tuple[int, int, int]:
        """``(counter, pass, batches skipped)`` of the first pass since a resume (or construction), started or next.

        Unlike :meth:`state_dict`, prefetching (workers, Lightning's fetcher, a cycled loader running into its next
        pass) does not move it: the restore check compares it with the data position a checkpoint saved.
        """
        if self._resume is None and self._started is not None:
            return self._started
        return self._peek_pass()

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
            if (user_seed := user_sampler_seed(sampler)) is not None:
                info["sampler_seed"] = user_seed
        return info

    def resume_remapped(self, counter: int, pass_: int, offset: int, saved: dict[str, Any]) -> None:
        """Resume a pass written under another world size: split what remains of it over the ranks now.

        ``saved`` is :meth:`describe` of the loader that wrote the checkpoint (on any rank) and
        ``offset`` the batches each old rank had consumed. The samples of the pass that no rank
        consumed are dealt out to the current ranks, every rank getting the same number of batches.
        """
        order = _global_order(saved, streams.order_seed(self.seed, self.stream, counter, pass_), counter)
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
        loader_seed = streams.loader_seed(self.seed, self.rank, self.stream, counter, pass_, persistent=self.persistent)
        self.loader_generator.manual_seed(loader_seed)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                f"[rank: {self.rank}] {stage} loader {index}, counter {counter}, pass {pass_}: order seed"
                f" {streams.order_seed(self.seed, self.stream, counter, pass_)}, sample seed"
                f" {streams.sample_seed(self.seed, self.stream, counter, pass_)},"
                f" worker base seed from {loader_seed}"
            )
        return self._pass_iterator()

    def _pass_iterator(self) -> Iterator[Any]:
        counter, pass_, skip = self._peek_pass()
        self._resume = None
        self.current = (counter, pass_)
        if self.trace_batches is not None and not self._finished:
            self.trace_batches.clear()  # what a dropped iterator prefetched is never consumed
        elif self.trace_batches:  # nor what an iterator of this pass made before it (an early one, made again) gave
            kept = [record for record in self.trace_batches if record[0] != (counter, pass_)]
            self.trace_batches.clear()
            self.trace_batches.extend(kept)
        self._finished = False
        self._position = skip
        if self._started is None:
            self._started = (counter, pass_, skip)
        for batch in self._pass_batches(counter, pass_, skip):
            if self.trace_batches is not None:
                self.trace_batches.append(((counter, pass_), self._position, batch))
            self._position += 1
            yield batch
        self._finished = True

    def _pass_batches(self, counter: int, pass_: int, skip: int) -> Iterator[Any]:
        order_seed = streams.order_seed(self.seed, self.stream, counter, pass_)
        sample_seed = streams.sample_seed(self.seed, self.stream, counter, pass_)
        if self._remap is not None and self._remap.counter == counter:
            return self._remapped(counter, pass_, sample_seed)
        self._remap = None
        if self.exact_skip:
            order = _order(self._sampler, order_seed, counter)
            if order is not None:
                keyed_seed = sample_seed if self.keyed else None
                return _sliced_batches(order, self._batch_size, self._drop_last, skip, keyed_seed)
        return self._generic(order_seed, sample_seed, skip)

    def _generic(self, order_seed: int, sample_seed: int, skip: int) -> Iterator[Any]:
        inner = self.inner
        patches = foreign_patches(self._patches, order_seed)
        epoch = self.current[0] if self.current else 0

        def make() -> Iterator[Any]:
            self._forward_epoch(epoch)
            return iter(inner)

        iterator = IsolatedIterator(make, order_seed, patches=patches, isolate=self.seeding != "checked")
        for _ in range(skip):  # index level: no sample is loaded
            if next(iterator, _END) is _END:
                break
        return self._keyed(iterator, sample_seed)

    def _forward_epoch(self, epoch: int) -> None:
        """``set_epoch(epoch)`` on the user's samplers before a pass: a sampler that reshuffles per epoch still does.

        Training passes only: the counter of evaluation passes is not an epoch, and Lightning has already given
        evaluation samplers (``DistributedSampler`` subclasses such as its ``UnrepeatedDistributedSamplerWrapper``
        for predict included) the training epochs done (``_set_sampler_epoch``), as in plain Lightning.
        """
        if self.stream.stage != "train":
            return
        for owner in foreign_owners(self.inner, self.batched):
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch):
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
