"""litdata's ``CombinedStreamingDataset`` resumed by its loader's own state with workers: each worker at its items.

A ``CombinedStreamingDataset`` mixes datasets: each worker's iterator picks the dataset of every item at random
(``random.Random(seed)``, the same draws in every worker). litdata's ``StreamingDataLoader`` records, per worker, the
items read of each dataset (``num_samples_yielded``, from the counts its items carry), and its ``state_dict()`` gives
each ``StreamingDataset`` the items read of it by all workers together; on resume each dataset deals that total out
to the workers as if they had read it in whole batches by turns (``_replay_sampling``), which the random picks do
not do: the resumed workers read other items (plain Lightning too). The mixing iterator of each worker is right (it
replays its picks from that worker's own counts).

Here, in each worker before its pass starts, every dataset of the mix gets a state whose total that replay deals out
to exactly this worker's items of it (:func:`replay_total`), in this worker's copy only: litdata's own resume then
puts each dataset at the items this worker read of it. A persistent worker forgets that state at its next pass
(:func:`forget_loaded_state`), as litdata's loader has the main process's copy do. Recognised by the module of the
class and the attributes read, never imported. Part of ``data/``: imports nothing of the package.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "forget_loaded_state",
    "passes_counted_per_copy",
    "position_worker",
    "positions_each_worker",
    "replay_total",
]


def _litdata(dataset: Any, *names: str) -> bool:
    cls = type(dataset)
    return cls.__module__.split(".", 1)[0] == "litdata" and cls.__name__ in names


def _combined(dataset: Any) -> bool:
    return _litdata(dataset, "CombinedStreamingDataset")


def _loaded_counts(dataset: Any) -> tuple[dict[int, list[int]], list[Any]] | None:
    """The items each worker read of each dataset, as the loader's loaded state gave them, and the datasets."""
    if not _combined(dataset):
        return None
    counts, parts = getattr(dataset, "_num_samples_yielded", None), getattr(dataset, "_datasets", None)
    if not isinstance(counts, dict) or not counts or not isinstance(parts, list):
        return None
    states = [getattr(part, "_state_dict", None) for part in parts]
    if not all(isinstance(s, dict) and {"batch_size", "num_workers"} <= s.keys() for s in states):
        return None
    if not all(isinstance(c, list) and len(c) == len(parts) for c in counts.values()):
        return None
    return counts, parts


def passes_counted_per_copy(dataset: Any) -> bool:
    """Whether each copy of ``dataset`` counts the epochs of its datasets itself: litdata's parallel reading.

    A ``ParallelStreamingDataset`` pass ends when one of its datasets runs out; that one starts its next epoch in
    the copy that read it (its own count), the others do not. A persistent worker keeps those counts from pass to
    pass; no state of the loader records them, so the passes after a resumed one cannot have them.
    """
    return _litdata(dataset, "ParallelStreamingDataset")


def positions_each_worker(dataset: Any) -> bool:
    """Whether ``dataset`` is a mix whose loaded state :func:`position_worker` puts each worker right from."""
    return _loaded_counts(dataset) is not None


def replay_total(items: int, batch_size: int, worker: int, num_workers: int) -> int:
    """A total of items that litdata's replay deals out so that ``worker`` gets ``items``.

    The replay (``_replay_sampling``) deals whole batches by turns, then the rest: the total is whole rounds of every
    worker, then a batch each for the workers before it, then its rest.

    Examples:
        >>> replay_total(7, 4, 1, 2)  # 1 round of 2 workers x 4, worker 0's next batch, then worker 1's 3
        15
    """
    rounds, rest = divmod(items, batch_size)
    return num_workers * rounds * batch_size + worker * batch_size + rest


def position_worker(dataset: Any, worker: int) -> bool:
    """In worker ``worker``'s copy of a mix: each dataset's loaded state set to deal this worker its own items.

    Returns whether it did (a mix with a loaded state that counts this worker).
    """
    loaded = _loaded_counts(dataset)
    if loaded is None or worker not in loaded[0]:
        return False
    counts, parts = loaded
    for part, items in zip(parts, counts[worker], strict=True):
        state = part._state_dict
        total = replay_total(int(items), int(state["batch_size"]), worker, int(state["num_workers"]))
        part._state_dict = {**state, "num_samples_yielded": total}
    return True


def forget_loaded_state(dataset: Any) -> None:
    """A persistent worker's copy of a mix, at a pass after its first: the state loaded before that one is stale.

    litdata's loader forgets it in the main process's copy at each new pass (``reset_state_dict``); a persistent
    worker keeps the copy it started with, whose loaded counts would replay the interrupted pass's picks again. The
    same for ``ParallelStreamingDataset``: the uninterrupted run's persistent workers never see a loaded state, and
    start each pass from their own copy's (a cycling one's loaded counts ended every later pass at once).
    """
    wrapper = _litdata(dataset, "CombinedStreamingDataset", "ParallelStreamingDataset")
    if wrapper and getattr(dataset, "_num_samples_yielded", None) is not None:
        dataset.reset_state_dict()
