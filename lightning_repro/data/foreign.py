"""Samplers we do not know (custom ``Sampler``/``BatchSampler`` classes): seeded through their attributes or isolated.

A foreign sampler's ``generator`` (and a ``DistributedSampler``'s ``seed``) is set to a generator of the pass's
order stream while it runs, once :func:`check_seeding` has shown that its order follows that attribute;
otherwise it runs on a private stream (:class:`IsolatedIterator`) seeded from the pass's order seed. Either way
the process streams neither feed it nor move, and the user's objects keep their own values in between.

Such a sampler is exact (the same order in every run, and a resume that advances it index by index continues it)
when two passes from the same seed give the same order: :func:`check_seeding` checks that too, and says
``"unstable"`` for a sampler that draws from something lightning-repro does not seed (its own state, the clock,
``os.urandom``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from lightning_repro.data.fastrng import capture_fast, restore_fast, seed_sample
from lightning_repro.seeding import fold_seed32

__all__ = [
    "EXACT_SEEDINGS",
    "IsolatedIterator",
    "check_seeding",
    "foreign_owners",
    "foreign_patches",
    "order_follows",
    "order_replays",
    "seeded_generator",
    "seeding_text",
]

_Patch = tuple[Any, str, Any]  # (object, attribute, the value it has while the foreign sampler runs)

EXACT_SEEDINGS = frozenset({"checked", "ignored", "private"})
"""The results of :func:`check_seeding` whose order is the same in every run (``"unstable"`` is not)."""


def _apply(patches: Sequence[_Patch]) -> list[_Patch]:
    """Set each patched attribute; return what puts the previous values back."""
    previous = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    return previous


def _unapply(previous: list[_Patch]) -> None:
    for owner, name, value in reversed(previous):
        setattr(owner, name, value)


class IsolatedIterator:
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
        outer = capture_fast() if isolate else None
        previous = _apply(self._patches)
        try:
            if isolate:
                seed_sample(seed)
            self._iterator = make()
            self._private = capture_fast() if isolate else None
        finally:
            _unapply(previous)
            if outer is not None:
                restore_fast(outer)

    def __iter__(self) -> IsolatedIterator:
        return self

    def __next__(self) -> Any:
        outer = None
        if self._private is not None:
            outer = capture_fast()
            restore_fast(self._private)
        previous = _apply(self._patches)
        try:
            return next(self._iterator)
        finally:
            _unapply(previous)
            if outer is not None:
                self._private = capture_fast()
                restore_fast(outer)


_PROBE = 64  # indices drawn per check of a foreign sampler


def _same_orders(
    target: Any, patches: Sequence[tuple[Any, str, Callable[[], Any]]], stream_seeds: tuple[int, int]
) -> bool:
    """Whether two draws of ``target``'s order (its first indices) agree.

    Each draw has fresh values of the patched attributes and the process streams seeded from one of
    ``stream_seeds``. The user's values and the process streams are put back; a sampler that fails to run
    does not agree.
    """
    outer = capture_fast()
    orders: list[str] = []
    try:
        for stream_seed in stream_seeds:
            previous = _apply([(owner, name, make()) for owner, name, make in patches])
            try:
                seed_sample(stream_seed)
                orders.append(repr(list(itertools.islice(iter(target), _PROBE))))
            finally:
                _unapply(previous)
    except Exception:  # a sampler that cannot run with our values: treat it as foreign
        return False
    finally:
        restore_fast(outer)
    return orders[0] == orders[1]


def order_follows(target: Any, patches: Sequence[tuple[Any, str, Callable[[], Any]]]) -> bool:
    """Whether ``target``'s order depends on the patched attributes alone (and not on the process streams).

    Two draws with the same values of the attributes, under two different states of the process
    streams, must give one order (the first indices of it).
    """
    return _same_orders(target, patches, (0x0DD5EED, 0xE7E45EED))


def order_replays(target: Any, patches: Sequence[tuple[Any, str, Callable[[], Any]]]) -> bool:
    """Whether ``target`` gives one order twice from the same state of the process streams and patched attributes.

    What a private stream needs to make the sampler exact: an order that depends on nothing but what we seed.
    """
    return _same_orders(target, patches, (0x5A3E5EED, 0x5A3E5EED))


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def foreign_owners(inner: Any, batched: bool) -> list[Any]:
    """The user's batch sampler and its sampler (when it has one), each once."""
    owners = [inner]
    nested = getattr(inner, "sampler", None)
    if batched and nested is not None and nested is not inner:
        owners.append(nested)
    return owners


def check_seeding(inner: Any, batched: bool) -> tuple[str, list[tuple[Any, str]]]:
    """How a sampler we do not know is seeded, and what is patched.

    The first value is ``"checked"``, ``"ignored"``, ``"private"`` or ``"unstable"``.

    Its ``generator`` (and a ``DistributedSampler``'s ``seed``) is set to ours while it runs; the
    claim that this seeds it is checked first (:func:`order_follows`). ``"ignored"``: the sampler
    has such an attribute but its order does not follow it; it then runs on a private stream, as
    a sampler without one (``"private"``) does. ``"unstable"``: on the private stream too its order
    differs between two passes from the same seed (:func:`order_replays`): it is not exact. The
    patched ``(object, attribute)`` pairs come second.
    """
    patches: list[tuple[Any, str, Callable[[], Any]]] = []
    for owner in foreign_owners(inner, batched):
        if hasattr(owner, "generator"):
            patches.append((owner, "generator", lambda: seeded_generator(0x5EED)))
        if isinstance(owner, DistributedSampler):
            patches.append((owner, "seed", lambda: 0x5EED))
    names = [(owner, name) for owner, name, _ in patches]
    if patches and order_follows(inner, patches):
        return "checked", names
    if not order_replays(inner, patches):
        return "unstable", names
    return ("ignored" if patches else "private"), names


def foreign_patches(patched: Sequence[tuple[Any, str]], order_seed: int) -> list[_Patch]:
    """The values the patched attributes take during a pass whose order seed is ``order_seed``."""
    values: dict[str, Callable[[], Any]] = {
        "generator": lambda: seeded_generator(order_seed),
        "seed": lambda: fold_seed32(order_seed),
    }
    return [(owner, name, values[name]()) for owner, name in patched]


def seeding_text(seeding: str, patched: Sequence[tuple[Any, str]]) -> str:
    """What is said of a foreign sampler (an info line, a warning when ``"unstable"``): what check_seeding found."""
    attributes = " and ".join(sorted({f"`{name}`" for _, name in patched}))
    if seeding == "unstable":
        return (
            "two passes from the same seed gave different orders (it draws from something lightning-repro does not"
            " seed: its own state, the clock, os.urandom...), so its order differs between runs and a resume does"
            " not continue it exactly. Draw the order from its `generator` attribute (lightning-repro seeds it) or"
            " from torch's global RNG."
        )
    if seeding == "checked":
        how = (
            f"it is seeded through its {attributes} attribute (checked: two passes with the same {attributes}"
            " give one order, whatever the process streams)"
        )
    elif seeding == "ignored":
        how = (
            f"it has a {attributes} attribute, but its order does not follow it (two passes with the same"
            f" {attributes} gave different orders), so it runs on a private stream seeded per epoch"
        )
    else:
        how = "it has no `generator` attribute, so it runs on a private stream seeded per epoch"
    if seeding != "checked":
        how += " (checked: two passes from the same seed give one order)"
    return how + "; a mid-epoch resume advances it batch by batch (indices only, no data is loaded): exact."
