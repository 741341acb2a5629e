"""The pass key of a loader whose persistent workers no batch request can tell it: told through shared memory.

A worker learns which pass it reads (the key of the pass's item streams, :mod:`lightning_repro.data.streaming`) from
the batch requests: torch's fetcher iterates a batch's indices before it reads the items, and our indices carry
the key (``Ticket``). A loader with ``batch_size=None`` sends no indices a worker's fetcher reads (it calls
``next()`` on the dataset's iterator and nothing else), so a worker knows only the key of the dataset copy it was
started with: right for workers started at every pass, stale from the second pass on for persistent ones. For
those, the main process writes each pass's key into one int64 of shared memory before the pass's
``_ResumeIteration`` goes to the workers (the iterator is made first: ``PassSeeder.__iter__``), and each worker
reads it when it starts the pass, after it took that message off its queue. An evaluation pass's count of passes
(``Ticket.counter``) goes beside it.
"""

from __future__ import annotations

import torch

__all__ = ["SharedKey"]

_MASK = (1 << 64) - 1


class SharedKey:
    """One pass key (and count) in shared memory, written in the main process and read in its loader's workers.

    Examples:
        >>> shared = SharedKey()
        >>> shared.set(2**64 - 1, 3)
        >>> shared.get(), shared.count()
        (18446744073709551615, 3)
        >>> shared.set(5)
        >>> shared.get(), shared.count() is None
        (5, True)
    """

    def __init__(self) -> None:
        # torch's reductions share the storage with the workers (fork: the mapping; spawn, forkserver: its handle)
        self._slot = torch.zeros(2, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]

    def set(self, key: int, count: int | None = None) -> None:
        """The key of the pass starting now (an unsigned 64-bit value), and its count (an evaluation pass's) or None."""
        self._slot[1] = -1 if count is None else count
        self._slot[0] = key - (1 << 64) if key >= 1 << 63 else key

    def get(self) -> int:
        """The key last set, in any process holding this object."""
        return int(self._slot[0]) & _MASK

    def count(self) -> int | None:
        """The count set with it (``None``: none)."""
        value = int(self._slot[1])
        return None if value < 0 else value
