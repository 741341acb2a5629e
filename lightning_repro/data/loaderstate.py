"""The own state of a loader that saves one (torchdata's ``StatefulDataLoader``) in a pass our positions resumed.

Lightning loads a stateful train loader's saved ``state_dict()`` on resume and saves it in every checkpoint
(``loops/fit_loop.py``: ``state_dict["combined_loader"]``). When the checkpoint's per-worker positions resume the
loader, its own saved state is not loaded too (:func:`stamped_load_state_dict`: both would move the workers); its
iterator starts afresh and is told the batches consumed
(:func:`~lightning_repro.data.libraries.shift_loader_counters`). What it reports then differs from the
uninterrupted run's loader in one place: each worker's entry of its snapshot (``_snapshot["_worker_snapshots"]
["worker_<i>"]``, the worker's fetcher and dataset states) is the one the worker sent with its last batch, so until
a worker's first batch of the resumed pass it is the worker's state at the start of the new iterator, where the
uninterrupted run's loader holds the state after its last batch: the one the checkpoint saved
(:func:`stamped_state_dict` gives that back). A file written in that window (a validation due at the checkpoint's
batch runs before the first resumed batch; a step checkpoint before every worker's turn came) then holds what the
uninterrupted run's holds. Part of ``data/``: imports the bottom layer only.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from lightning_repro.data.libraries import give_main_copy_its_epoch, positioned_by_loader

__all__ = ["POSITION_ATTR", "keep_run_out_iterator", "stamped_load_state_dict", "stamped_state_dict"]

log = logging.getLogger(__name__)

POSITION_ATTR = "_repro_position"
"""The attribute of a stamped loader holding its :class:`~lightning_repro.data.workerpos.StreamPosition`."""
_SNAPSHOT, _WORKERS, _STEPS_SINCE = "_snapshot", "_worker_snapshots", "_steps_since_snapshot"  # torchdata's keys
_FINISHED = "_iterator_finished"  # torchdata's too: the saved iterator ran out


def keep_run_out_iterator(loader: Any) -> None:
    """Load a saved iterator that ran out as one that did not, in a map-style train loader with its own state.

    For Lightning's copy of a torchdata ``StatefulDataLoader``, whose batches our sampler gives.

    Lightning loads the train loaders' own states only when it resumes inside an epoch (``loops/fit_loop.py:
    _load_combined_loader_states``), so a saved iterator that ran out ran out before the epoch did: a loader beside a
    longer one in a ``CombinedLoader`` (in ``max_size`` mode it gives ``None`` from then on). torchdata's
    ``StatefulDataLoader.__iter__`` replaces a restored iterator that ran out by a fresh one, which reads the next
    pass in that epoch (the resumed run differed); kept, the restored iterator, whose batches our sampler gives from
    the checkpoint's data position (the end of its pass), yields none, as the uninterrupted run's did. Set on the
    instance.
    """
    if "load_state_dict" in vars(loader):
        return
    own = type(loader).load_state_dict

    def load_state_dict(state_dict: Any) -> Any:
        if isinstance(state_dict, dict) and state_dict.get(_FINISHED) is True:
            log.debug("a restored iterator that ran out is kept (it ran out before the epoch did)")
            state_dict = {**state_dict, _FINISHED: False}
        return own(loader, state_dict)

    vars(loader)["load_state_dict"] = load_state_dict


def stamped_load_state_dict(self: Any, state_dict: Any) -> Any:
    """``load_state_dict`` of a stamped loader class whose loader saves its own state (torchdata's).

    When the checkpoint's per-worker positions resume the loader, its own saved position is not applied too (both
    would move the workers): it is kept for :func:`stamped_state_dict`. Otherwise (a checkpoint without our record)
    it is, as without lightning-repro. A loader that positions its dataset itself (litdata's,
    :func:`~lightning_repro.data.libraries.positioned_by_loader`) always loads its own state: our positions then
    only key its items.
    """
    position = _position(self)
    # A state of another num_workers (reseeded) is not loaded either: torchdata's refuses it, and the epoch goes on in
    # a new pass
    given = position is not None and (position.resume is not None or position.reseeded is not None)
    if given and not positioned_by_loader(self):
        log.debug("the loader's own state is not loaded: the checkpoint's per-worker positions resume it")
        resume = position.resume if position is not None else None
        if position is not None and resume is not None and isinstance(state_dict, dict):
            position.unloaded = (int(resume["epoch"]), int(resume["pass"]), state_dict)
            position.unstarted = state_dict  # nothing read since the checkpoint until a pass begins: its state
        return None
    base: Any = type(self).__bases__[0]  # the user's class's own
    loaded = base.load_state_dict(self, state_dict)
    if position is not None and isinstance(state_dict, dict):
        # a copy: litdata's loader keeps the loaded per-worker counts as its own and moves them on in place
        position.loaded_own = copy.deepcopy(state_dict)
        record = position.resume
        if record is not None and not record.get("ended") and _read_to_its_end(self, state_dict):
            # a pass read to its end inside the epoch (beside a longer loader in a CombinedLoader): litdata would
            # start its next pass at once; resumed (`restore`), it ends as the uninterrupted run's iterator did, and
            # the next iter() (Lightning's CombinedLoader cycling it, in max_size_cycle mode) starts that pass
            self.restore = True
    # litdata's StreamingDataset.state_dict() writes the main-process copy's epoch into the loaded state itself
    # (`_state_dict.update(payload)`), which its workers read at the pass's first batch: a file written before
    # that batch (the rest of the checkpoint's hook, a due validation) would make them read another epoch's order
    dataset = getattr(self, "dataset", None)
    give_main_copy_its_epoch(getattr(dataset, "dataset", dataset))  # the user's, inside our keyed stream
    return loaded


def _read_to_its_end(loader: Any, state_dict: dict[str, Any]) -> bool:
    """Whether litdata's loader loaded a state of a pass with items read and none left (it does not resume one)."""
    yielded = state_dict.get("num_samples_yielded")  # a mix's: per worker, a count per dataset
    counts = list(yielded.values()) if isinstance(yielded, dict) else [yielded]
    flat = [c for count in counts for c in (count if isinstance(count, list) else [count]) if isinstance(c, int)]
    return getattr(loader, "restore", None) is False and any(count > 0 for count in flat)


def stamped_state_dict(self: Any) -> Any:
    """``state_dict`` of a stamped loader class: the loader's own, corrected where a resume left it behind.

    The checkpoint's own state of the loader when it was not loaded and nothing was read since (ours resumed it, or
    Lightning's epoch-end resume did not load it); litdata's loaded turn before its first batch; the saved snapshot
    entry of each worker that has not sent a batch in the pass the checkpoint's positions resumed, in place of its
    fresh start's (see the module).
    """
    position = _position(self)
    if position is not None and position.unstarted is not None:  # nothing read since the checkpoint
        return position.unstarted  # (the loader's own is not asked: litdata's writes into what it loaded)
    base: Any = type(self).__bases__[0]  # the user's class (the stamped class derives from it alone)
    state = _consumed_own_state(self, base) if position is not None else base.state_dict(self)
    if position is not None and position.loaded_own is not None:
        state = _litdata_turn_as_loaded(state, position.loaded_own)
    unloaded = position.unloaded if position is not None else None
    if position is None or unloaded is None or (position.counter, position.pass_) != unloaded[:2]:
        return state
    return _saved_entries_of_silent_workers(state, unloaded[2], position.yielded)


def _consumed_own_state(loader: Any, base: Any) -> Any:
    """A litdata loader's own state after the batches training consumed, not after those Lightning fetched ahead.

    Lightning's fetcher holds a batch ahead of training when the train loaders have no length (a litdata loader in
    a ``CombinedLoader`` beside a stream without ``__len__``), and litdata's ``StreamingDataLoader`` counts a batch
    once it has left its iterator (``_num_samples_yielded_streaming``, ``_latest_worker_idx``): its state, loaded on
    resume, skipped the batch held ahead (plain Lightning too). Both counts are put back by the batches ahead while
    the state is taken (a ``StreamingDataset``'s: a mix's counts per worker and dataset are left as they are). The
    batch ahead being its pass's first (the consumed ones are the pass before's) is not corrected: a
    :class:`~lightning_repro.NotExactWarning` says so, and the checkpoint's record of the position (``own_ahead``),
    so that the resume line from that checkpoint says NOT exact.
    """
    position = _position(loader)
    ahead = position.ahead() if positioned_by_loader(loader) else 0
    fields = ("_num_samples_yielded_streaming", "_latest_worker_idx")
    if ahead is None:
        from lightning_repro._warn import warn
        from lightning_repro.exceptions import NotExactWarning

        position.own_ahead = True  # the checkpoint's record says so too (checkpoint/save.py), and its resume line
        warn(
            "A checkpoint was written while Lightning held the first batch of litdata's next pass ahead of training"
            " (a loader without length beside it): the loader's own state is that pass's, so a resume from this"
            " checkpoint skips that batch and is not exact. Checkpoints at other steps are.",
            NotExactWarning,
        )
    if not ahead or not all(isinstance(getattr(loader, name, None), int) for name in fields):
        return base.state_dict(loader)
    saved = [getattr(loader, name) for name in fields]
    workers = max(1, int(getattr(loader, "num_workers", 0)))
    setattr(loader, fields[0], saved[0] - ahead * int(loader.batch_size))
    setattr(loader, fields[1], (saved[1] - ahead) % workers)
    try:
        return base.state_dict(loader)
    finally:
        for name, value in zip(fields, saved, strict=True):
            setattr(loader, name, value)


def _position(loader: Any) -> Any:
    """The loader's :class:`~lightning_repro.data.workerpos.StreamPosition` (set by ``stream_loader``), or None."""
    return getattr(loader, "__dict__", {}).get(POSITION_ATTR)


def _litdata_turn_as_loaded(state: Any, loaded: dict[str, Any]) -> Any:
    """A litdata ``StreamingDataLoader`` loaded, before its first batch: the turn its loaded state says.

    Its ``load_state_dict`` keeps the worker after the one that read last (``latest_worker_idx + 1``, the next
    batch's), which its ``state_dict()`` then reports as the one that read last: a file written before the first
    resumed batch would make a resume from it start one turn later.
    """
    if not (isinstance(state, dict) and "latest_worker_idx" in state):
        return state
    if state.get("num_samples_yielded") != loaded.get("num_samples_yielded"):  # a batch since: its own turn
        return state
    return {**state, "latest_worker_idx": loaded.get("latest_worker_idx", state["latest_worker_idx"])}


def _saved_entries_of_silent_workers(state: Any, saved: Any, yielded: set[int]) -> Any:
    """``state`` with ``saved``'s snapshot entry for each worker not in ``yielded`` (a copy; ``state`` if none)."""
    try:
        snapshot, workers = state[_SNAPSHOT], state[_SNAPSHOT][_WORKERS]
        saved_workers = saved[_SNAPSHOT][_WORKERS]
        current = state.get(_STEPS_SINCE, 0) == 0  # a snapshot taken at the last batch (every step by default)
    except (KeyError, TypeError):
        return state
    if not current:  # an older snapshot may predate a worker's first batch, which `yielded` counts: left alone
        return state
    silent = {key: saved_workers[key] for key in workers if key in saved_workers and _worker(key) not in yielded}
    if not silent:
        return state
    return {**state, _SNAPSHOT: {**snapshot, _WORKERS: {**workers, **silent}}}


def _worker(key: str) -> int | None:
    """The worker id of a snapshot key (``"worker_3"``: 3), else ``None``."""
    head, _, number = key.rpartition("_")
    return int(number) if head == "worker" and number.isdigit() else None
