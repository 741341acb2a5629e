"""The restore digests of a save taken off its critical path: computed in a thread while the shards are written.

A strategy that writes the tensors before the rest of the checkpoint (``ModelParallelStrategy``'s distributed
layout: the shards through ``torch.distributed.checkpoint``, then rank 0 ``torch.save``s the other values, our entry
among them) holds a :class:`DeferredEntry`. The callback's ``state_dict`` then calls :meth:`DeferredEntry.defer`:
the ``state_dict()``s of the module, optimizers and schedulers are taken there, as the synchronous path takes them
(:func:`~lightning_repro.checkpoint.verify.training_states`), and their digests
(:func:`~lightning_repro.checkpoint.verify.digest_training`) are computed in a thread (the checksum kernel and
``hashlib`` release the GIL) while Lightning collects the optimizer states and writes the shards. Nothing changes
those tensors meanwhile: training waits for the save to return. The callback's value in the checkpoint is a
placeholder until the strategy calls :meth:`Deferred.finish` (on every rank: it gathers every rank's part), which
waits for the thread, re-raises its error if it failed, puts the digests into this rank's part, gathers and seals the
entry as the synchronous path does and puts it in the placeholder's place. The digests are those the synchronous path
gives (tested). A placeholder that reached a file (its save never finished it) is no entry: reading it fails as a
damaged entry does (``'seed' is missing``), never a resume that says "exact".
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_repro.checkpoint import save as _save
from lightning_repro.checkpoint import verify
from lightning_repro.checkpoint.entry import ENTRY_VERSION

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_repro.checkpoint.entry import Entry

__all__ = ["UNFINISHED_KEY", "Deferred", "DeferredEntry"]

UNFINISHED_KEY = "unfinished"
"""The key of a placeholder entry (see the module)."""


class _Digests(threading.Thread):
    """:func:`~lightning_repro.checkpoint.verify.digest_training` of ``states``, in a thread; :meth:`result` waits."""

    def __init__(self, states: Mapping[str, Any]) -> None:
        super().__init__(name="lightning-repro restore digests", daemon=True)
        self._states: Mapping[str, Any] = states
        self._digests: dict[str, str] = {}
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self._digests = verify.digest_training(self._states)
        except BaseException as error:  # re-raised on the caller's thread by result()
            self._error = error
        finally:
            self._states = {}  # the tensors are not held past the save

    def result(self) -> dict[str, str]:
        """The digests, once computed; the thread's exception, raised here, if it failed."""
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._digests


class Deferred:
    """One save's entry waiting for its digests (made by :meth:`DeferredEntry.defer`)."""

    def __init__(self, entry: Entry, trainer: pl.Trainer, digests: _Digests) -> None:
        self.entry = entry
        self.trainer = trainer
        self.digests = digests
        self.placeholder: dict[str, Any] = {
            "version": ENTRY_VERSION,
            UNFINISHED_KEY: "lightning-repro's entry was not completed: the save that wrote this file did not finish"
            " it (its restore digests were still being computed)",
        }
        self.key: Any = None  # the callback's state key in checkpoint["callbacks"], once found

    def finish(self, checkpoint: dict[str, Any]) -> None:
        """Wait for the digests and put the sealed entry in the placeholder's place (a collective: every rank)."""
        entry = verify.add_restore_digests(self.entry, self.trainer, training=self.digests.result())
        checkpoint["callbacks"][self.key] = _save.gather_and_seal(entry, self.trainer)

    def discard(self) -> None:
        """Wait for the thread to end (a save that failed or was never written), ignoring what it computed."""
        self.digests.join()


class DeferredEntry:
    """A strategy's slot for the entry of the save in progress (see the module)."""

    def __init__(self) -> None:
        self._pending: Deferred | None = None

    def defer(self, entry: Entry, trainer: pl.Trainer) -> dict[str, Any]:
        """Start this save's restore digests in a thread; return the placeholder the callback's ``state_dict`` gives.

        ``entry``: this rank's entry as the synchronous path would digest, gather and seal it.
        """
        self.take(None)  # an earlier dump whose save never came
        self._pending = Deferred(entry, trainer, _Digests(verify.training_states(trainer)))
        return self._pending.placeholder

    def take(self, checkpoint: Mapping[str, Any] | None) -> Deferred | None:
        """The deferred entry whose placeholder ``checkpoint`` holds (then the strategy must finish it), or None.

        A pending entry that ``checkpoint`` does not hold (a dump whose save never came) is discarded.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        callbacks = checkpoint.get("callbacks") if checkpoint is not None else None
        for key, value in callbacks.items() if isinstance(callbacks, dict) else ():
            if value is pending.placeholder:
                pending.key = key
                return pending
        pending.discard()
        return None
