"""What the streaming libraries users train from need of the takeover: HF ``datasets``, litdata, webdataset.

The item-keyed streams and per-worker positions of :mod:`lightning_repro.data.streaming` serve every
``IterableDataset``; a library's pipeline differs in three ways, which this module tells the takeover, the workers'
iterator and the resume line:

* **whose state positions the resumed pass** (:func:`positioned_by_loader`, :func:`own_state_exact`): litdata's
  ``StreamingDataLoader`` keeps its own state, which Lightning saves and restores (its dataset then starts at its
  consumed items in each worker, and the loader at the right worker), so our streams are keyed from the restored
  per-worker positions and nothing is fast-forwarded; HF ``datasets`` drops its shuffle buffer on
  ``load_state_dict`` (its own resume repeats and skips examples), so a pipeline with a buffered shuffle is
  fast-forwarded instead of restored from its state;
* **what the loader checks of its dataset** (:func:`poses_as_dataset`): litdata's loader branches on
  ``isinstance(self.dataset, StreamingDataset)``, so our wrapper passes as the user's dataset class;
* **how a resume on another number of workers can go on** (:func:`redeals_workers`, :func:`main_reads_as_worker`):
  only litdata deals the rest of an epoch out to another number of workers itself; HF ``datasets`` reads another
  order with one worker than in the main process when a stage of its pipeline draws;
* **what cannot be repeated at all** (:func:`unrepeatable_stages`, :mod:`~lightning_repro.data.wdsstages`):
  webdataset's ``.shuffle(n)`` without ``seed`` or ``rng``, and its resampling without ``deterministic=True``, seed
  themselves from the process id and the clock;
* **what the loader counts itself** (:func:`shift_loader_counters`): torchdata's ``StatefulDataLoader`` counts the
  batches of a pass in its iterator, which a resumed pass (its own state not loaded) starts at 0; litdata's
  ``StreamingDataset`` writes its main-process copy's epoch into the loader's state
  (:func:`give_main_copy_its_epoch`), which nothing sets in a resumed pass read by workers, and its loader counts
  its passes, which Lightning does not give back after an epoch-end checkpoint (:func:`give_loader_its_epoch`).
* **an epoch that reaches the workers, or that the user gives** (:func:`epoch_shared_with_workers`,
  :func:`epoch_evidence`): HF shares its epoch with the workers; after an epoch-end checkpoint Lightning
  makes the next epoch's first iterator before ``on_train_epoch_start``, where users call ``set_epoch``.
* **an epoch the pipeline counts itself** (:func:`stage_epochs`, :func:`set_stage_epochs`): webdataset's
  ``detshuffle`` and deterministic ``ResampledShards`` seed each pass from their own count of passes, which a
  resumed process starts afresh.

The libraries are never imported here: a dataset is recognised by the module of its class, and only then are its
attributes read. Part of ``data/``: imports the bottom layer only.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_repro._types import is_stateful
from lightning_repro.data.wdsstages import set_stage_epochs, stage_epochs, unrepeatable_stages

__all__ = [
    "dataset_epoch",
    "end_loaded_pass",
    "epoch_evidence",
    "epoch_shared_with_workers",
    "give_evaluation_pass_its_epoch",
    "give_loader_its_epoch",
    "give_main_copy_its_epoch",
    "library",
    "main_reads_as_worker",
    "own_state_exact",
    "own_state_text",
    "pipeline_name",
    "poses_as_dataset",
    "posing",
    "positioned_by_loader",
    "redeals_workers",
    "set_stage_epochs",
    "shift_loader_counters",
    "stage_epochs",
    "stateful_iterable",
    "unrepeatable_stages",
]

_LIBRARIES = {"datasets": "HF datasets", "litdata": "litdata", "webdataset": "webdataset", "torchdata": "torchdata"}


def library(obj: Any) -> str | None:
    """The streaming library ``obj``'s class comes from (``"datasets"``, ``"litdata"``, ...), else ``None``.

    Examples:
        >>> library(object()) is None
        True
    """
    top = type(obj).__module__.split(".", 1)[0]
    return top if top in _LIBRARIES else None


def positioned_by_loader(loader: Any) -> bool:
    """Whether ``loader`` restores its dataset's position itself (litdata's ``StreamingDataLoader``).

    Lightning saves such a loader's ``state_dict()`` and calls its ``load_state_dict()`` before the resumed epoch's
    iterator exists; the dataset in each worker then starts at that worker's consumed items and the loader asks the
    right worker first. Our part is only to key the items from the restored per-worker positions.
    """
    return library(loader) == "litdata" and is_stateful(loader)


def redeals_workers(loader: Any) -> bool:
    """Whether ``loader`` deals the rest of an interrupted epoch out to another number of workers itself.

    litdata's ``StreamingDataset`` does (its elastic resume, ``_setup_elastic_resume``): restored on another
    ``num_workers``, it drops the items of the epoch's canonical order that were consumed and deals the others to
    the new workers, each read once. No other library (nor a plain ``IterableDataset``) can: torchdata's
    ``StatefulDataLoader`` refuses a state of another worker count, HF ``datasets`` and webdataset split their shards
    by worker (a worker's state or count means nothing to another split), and a dataset that reads
    ``get_worker_info()`` is a function of the worker count we cannot invert.
    """
    dataset = getattr(loader, "dataset", None)
    dataset = getattr(dataset, "dataset", dataset)  # under our wrapper
    return positioned_by_loader(loader) and callable(getattr(dataset, "_setup_elastic_resume", None))


def main_reads_as_worker(dataset: Any) -> bool:
    """Whether ``dataset`` read in the main process (``num_workers=0``) yields what one worker (``num_workers=1``) does.

    Not an HF ``datasets`` pipeline with a stage that draws (a buffered ``shuffle``, ``interleave_datasets`` with
    probabilities): in a worker, even the only one, HF gives each such stage a new generator (``shift_rngs``, seeded
    from a draw of the stage's own less the worker's id), so worker 0 reads another order than the main process.

    Examples:
        >>> main_reads_as_worker(object())
        True
    """
    if library(dataset) != "datasets":
        return True
    nodes, seen = [getattr(dataset, "_ex_iterable", None)], 0
    while nodes and seen < 256:  # the tree of examples iterables: each stage's source, or a mix's sources
        node = nodes.pop()
        if node is None:
            continue
        if callable(getattr(node, "shift_rngs", None)):
            return False
        nodes += [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or ())]
        seen += 1
    return True


def pipeline_name(loader: Any, dataset: Any) -> str:
    """How messages name a loader's pipeline: its dataset's class, and the library of each where it has one.

    ``StreamingDataset (litdata)``, ``IterableDataset (HF datasets) read by StatefulDataLoader (torchdata)``, or
    the dataset's class name for a dataset of no library we know.

    Examples:
        >>> import torch
        >>> pipeline_name(torch.utils.data.DataLoader([1]), [1])
        'list'
    """
    name = type(dataset).__name__
    if (lib := library(dataset)) is not None:
        name = f"{name} ({_LIBRARIES[lib]})"
    if (lib := library(loader)) is not None and library(dataset) != lib:
        name = f"{name} read by {type(loader).__name__} ({_LIBRARIES[lib]})"
    return name


def poses_as_dataset(loader: Any) -> bool:
    """Whether ``loader`` checks its dataset's class, so our wrapper must pass as the user's (litdata's loader)."""
    return library(loader) == "litdata"


def _buffered_shuffle(dataset: Any) -> bool:
    """An HF ``IterableDataset`` whose examples pass through a shuffle buffer (``.shuffle(seed, buffer_size)``)."""
    node = getattr(dataset, "_ex_iterable", None)
    seen = 0
    while node is not None and seen < 64:  # the chain of examples iterables, outermost first
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return True
        node = getattr(node, "ex_iterable", None)
        seen += 1
    return False


def own_state_exact(dataset: Any) -> bool:
    """Whether restoring ``dataset``'s own ``state_dict()`` in a worker puts it exactly where it was.

    False for an HF ``datasets`` pipeline with a buffered shuffle: its ``load_state_dict`` refills the buffer from
    the examples after the saved position, so the examples that were in the buffer are lost and others come early.
    """
    return not (library(dataset) == "datasets" and _buffered_shuffle(dataset))


def own_state_text(loader: Any, dataset: Any) -> str | None:
    """What the resume line says of a library's pipeline: the path its position took (``None``: nothing special)."""
    if positioned_by_loader(loader):
        return f"the {type(loader).__name__}'s own state, restored by Lightning"
    if not own_state_exact(dataset):
        return "not its own state_dict(), which drops HF's shuffle buffer"
    return None


def stateful_iterable(dataset: Any) -> bool:
    """``dataset`` has ``state_dict()`` (callable without arguments) and ``load_state_dict()``."""
    if not is_stateful(dataset):
        return False
    try:
        parameters = inspect.signature(dataset.state_dict).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume the usual one
        return True
    optional = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return all(p.default is not inspect.Parameter.empty or p.kind in optional for p in parameters)


def dataset_epoch(dataset: Any) -> int | None:
    """The epoch a dataset with ``set_epoch`` was last given, where it shows it (``epoch`` or ``_epoch``)."""
    if not callable(getattr(dataset, "set_epoch", None)):
        return None
    for name in ("epoch", "_epoch"):
        value = getattr(dataset, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def epoch_evidence(dataset: Any, record: dict[str, Any]) -> str | None:
    """Why ``dataset`` is taken to be given each epoch (``set_epoch(epoch)`` in ``on_train_epoch_start``), or ``None``.

    As far as the ``record`` of an epoch-end checkpoint shows: ``"each epoch"`` when its pass, of an epoch beyond 0,
    began with the dataset showing that epoch (that pass was made after the hook); ``"docs"`` for an HF ``datasets``
    pipeline, whose docs ask for ``set_epoch``; ``"predicted"`` when the pass of epoch 0 began at epoch 0 (it began
    before the hook in every run: 0 is also the epoch of a dataset never given one); ``None`` when the pass began
    with another epoch.
    """
    if record.get("dataset_epoch") != record["epoch"]:
        return None
    if int(record["epoch"]) > 0:
        return "each epoch"
    return "docs" if library(dataset) == "datasets" else "predicted"


def epoch_shared_with_workers(dataset: Any) -> bool:
    """Whether ``dataset``'s ``set_epoch`` in the main process reaches its workers' copies too (persistent or not).

    HF ``datasets`` keeps an ``IterableDataset``'s epoch in a tensor in shared memory
    (``_maybe_share_with_torch_persistent_workers``), which ``set_epoch`` updates in place.
    """
    import torch

    return isinstance(vars(dataset).get("_epoch") if hasattr(dataset, "__dict__") else None, torch.Tensor)


def give_main_copy_its_epoch(dataset: Any) -> None:
    """A litdata ``StreamingDataset`` whose state was loaded: its main-process copy takes the state's epoch.

    litdata's ``StreamingDataset.state_dict()`` (which its loader's ``state_dict()`` calls in the main process)
    records the main-process copy's ``current_epoch``. In an uninterrupted run the loader sets it at every pass
    (``set_epoch``); in a resumed pass ``set_epoch`` is ignored once a state is loaded, and only the copy that
    iterates takes the state's epoch (``__iter__``): with workers, the main-process copy keeps the epoch it was
    built with (1), every checkpoint written after the resume records it, and a resume from such a file iterates
    that epoch's order, not the interrupted one's. Called in the main process when a pass starts, this gives the
    main-process copy the state's epoch, as litdata's ``__iter__`` gives it to the copy that iterates; the same for
    each dataset of a ``CombinedStreamingDataset`` or ``ParallelStreamingDataset``.
    """
    if library(dataset) != "litdata":
        return
    for part in getattr(dataset, "_datasets", None) or ():  # a mix's or a parallel reading's (the state is theirs)
        give_main_copy_its_epoch(part)
    state = getattr(dataset, "_state_dict", None)
    epoch = state.get("current_epoch") if isinstance(state, dict) else None
    if isinstance(epoch, int) and isinstance(getattr(dataset, "current_epoch", None), int):
        dataset.current_epoch = epoch


def give_evaluation_pass_its_epoch(dataset: Any, count: int) -> None:
    """An evaluation pass of a pipeline that counts its passes: its count ``count`` (its counter), not the passes read.

    litdata's ``StreamingDataLoader`` counts its passes and gives the count to its dataset's ``set_epoch`` (its
    shuffle's seed); webdataset's ``detshuffle`` counts its own in the copy that iterates (the main process's with
    ``num_workers=0``; workers count on from the main process's copy, persistent ones from their own). An evaluation
    loader's count was how many passes it read in this process (or in that worker), which the sanity check of every
    ``fit`` and the validations a resumed or continued fit never ran change: its shuffled batches differed from the
    longer run's. Called when the pass starts (after the loader's own ``set_epoch``, before its workers copy the
    dataset) and in each worker at the pass's start, before its iterator is made: the pass is read with
    ``count + 1``, with or without workers, persistent or not.
    """
    if library(dataset) == "litdata" and callable(getattr(dataset, "set_epoch", None)):
        dataset.set_epoch(int(count) + 1)
    counts = stage_epochs(dataset)
    if counts is not None:  # each stage adds one at its pass's start
        set_stage_epochs(dataset, [int(count)] * len(counts))


def give_loader_its_epoch(loader: Any, state: Any) -> int | None:
    """After an epoch-end checkpoint: a litdata loader gets back the epoch count of its saved ``state``; that count.

    litdata's ``StreamingDataLoader`` counts its passes (``current_epoch``, one more at the start of each, given to
    its dataset's ``set_epoch``, which seeds the shuffle), and every other value of its state is reset when a pass
    starts. Lightning loads a loader's own state only on a mid-epoch resume: after an epoch-end checkpoint a fresh
    loader would count from 0 and read epoch 0's order again. ``None``: not such a loader, or no count in ``state``.
    """
    epoch = state.get("current_epoch") if isinstance(state, dict) else None
    if not positioned_by_loader(loader) or not isinstance(epoch, int) or isinstance(epoch, bool):
        return None
    if not isinstance(getattr(loader, "current_epoch", None), int):
        return None
    loader.current_epoch = epoch
    return epoch


def end_loaded_pass(loader: Any) -> bool:
    """After the resumed epoch: a litdata loader whose state was loaded starts its next pass afresh; whether it had to.

    litdata's ``StreamingDataLoader.load_state_dict`` sets ``restore``, which its ``__iter__`` reads to go on from the
    loaded state instead of starting a new pass, and clears only when a pass runs to its end. Lightning stops a
    sized loader's pass at the epoch's length without asking for more, so after a mid-epoch resume ``restore``
    stays set and the next epoch's pass "resumes" the loaded state again: it yields what the loaded position had
    left, or nothing (plain Lightning loses most of the epoch after the resumed one). Cleared here, as that pass's
    end would have, the next pass is the uninterrupted run's.
    """
    if not positioned_by_loader(loader) or getattr(loader, "restore", None) is not True:
        return False
    loader.restore = False
    return True


_YIELDED = "_sampler_iter_yielded"  # torchdata's name of its count of the batch requests drawn from the sampler


def shift_loader_counters(iterator: Any, batches: int) -> None:
    """Count ``batches`` more batches of the pass in a torchdata ``StatefulDataLoader`` iterator (a no-op for others).

    Our copy of such a loader does not load its own state on resume (the checkpoint's per-worker positions resume
    the pass), so its fresh iterator counts from the resume. Its counters are shifted by the batches the
    interrupted pass had consumed (and back by one for each batch request a worker answered by skipping its turn),
    so every ``state_dict()`` it gives after the resume holds what the uninterrupted run's gives. Every value the
    iterator derives from them is shifted with them: the batches yielded, the requests drawn, and the snapshots of
    its main state taken so far (the current one and those waiting for their batch).

    Only with a snapshot at every batch (``snapshot_every_n_steps=1``, torchdata's default) or none: with a longer
    interval the iterator chose which of its first requests carry a snapshot from the unshifted count, and a shift
    would break its pairing of snapshots and batches; its counters then count from the resume.
    """
    if library(iterator) != "torchdata" or not batches:
        return
    if getattr(iterator, "_snapshot_interval", 1) not in (None, 0, 1):
        return
    for name in ("_num_yielded", _YIELDED):
        value = getattr(iterator, name, None)
        if isinstance(value, int):
            setattr(iterator, name, value + batches)
    snapshot = getattr(iterator, "_snapshot", None)  # the multi-process iterator's last snapshot
    mains = [main for _, main in getattr(iterator, "_main_snapshots", ())]
    if isinstance(snapshot, dict):
        if isinstance(snapshot.get("_snapshot_step"), int):
            snapshot["_snapshot_step"] += batches
        mains.append(snapshot.get("_main_snapshot"))
    for main in mains:
        if isinstance(main, dict) and isinstance(main.get(_YIELDED), int):
            main[_YIELDED] += batches


_POSING: dict[type, type] = {}  # our wrapper class -> its subclass that passes as the wrapped dataset's class


def _rebuild_posing(base: type, state: dict[str, Any]) -> Any:
    cls: Any = posing(base)
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _posing_reduce(self: Any) -> tuple[Any, ...]:
    return _rebuild_posing, (_BASES[type(self)], dict(self.__dict__))


_BASES: dict[type, type] = {}


def posing(base: type) -> type:
    """A subclass of our dataset wrapper ``base`` whose instances pass ``isinstance`` checks for what they wrap.

    ``isinstance(obj, C)`` falls back to ``obj.__class__``: here the class of ``obj.dataset`` (``type(obj)`` stays the
    wrapper's, so our own checks see the wrapper). Pickled (and copied) by the wrapper's class, rebuilt as this one.
    """
    if base not in _POSING:
        namespace = {
            "__module__": base.__module__,
            "__class__": property(lambda self: type(self.__dict__["dataset"])),
            "__reduce__": _posing_reduce,
        }
        _POSING[base] = type(base.__name__, (base,), namespace)
        _BASES[_POSING[base]] = base
    return _POSING[base]
