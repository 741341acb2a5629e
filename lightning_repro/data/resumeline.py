"""The one visible line a resume prints on rank 0: exact or not, and why.

The callback calls :func:`say_resumed` at ``on_train_start``, once everything is restored and checked. The line
goes to :data:`~lightning_repro._warn.resume_log` (a child of Lightning's ``lightning.pytorch`` logger, shown by
default like Lightning's own "Restored all states from the checkpoint" line). It says ``exact`` only when nothing
of the resume is known to be lost: every :class:`~lightning_repro.NotExactWarning` given during the resume is a
reason, and so is a train loader whose position is not restored exactly (:func:`data_position`). The continuation
check of the step trace comes later, after the overlapping steps, in a second line (from the tracer).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lightning_repro._types import is_stateful
from lightning_repro._warn import PREFIX, from_every_rank, ranks_text, say
from lightning_repro.data.foreign import EXACT_SEEDINGS
from lightning_repro.data.libraries import library, own_state_text, pipeline_name, positioned_by_loader
from lightning_repro.data.litdatamix import passes_counted_per_copy, positions_each_worker
from lightning_repro.data.nodes import is_taken_over, nodes_position
from lightning_repro.data.samplers import ReproBatchSampler
from lightning_repro.data.workerpos import loader_position

__all__ = ["data_position", "every_rank_notes", "headline", "resume_line", "say_resumed"]

_HEADLINE_MAX = 300


def headline(message: str) -> str:
    """The first sentence of a warning's message, as a reason in the line."""
    first = message.split(". ", 1)[0].rstrip(".")
    return first if len(first) <= _HEADLINE_MAX else first[: _HEADLINE_MAX - 3] + "..."


def every_rank_notes(notes: Sequence[str], world_size: int) -> list[str]:
    """Rank 0's notes, then the other ranks' it lacks: the reasons rank 0's line gives.

    ``[rank N] ...``, or ``[ranks 1-7] ...`` for a note several ranks share (one note, not one a rank).

    A rank's own drift (its node, its interpreter) or a loader of its own may make its resume not exact while rank
    0's is. A collective under DDP (:func:`~lightning_repro._warn.from_every_rank`): every rank calls it, at the same
    point of the resume.
    """
    gathered = from_every_rank(list(notes), world_size)
    if gathered is None:
        return list(notes)
    own = list(gathered[0] or [])
    theirs: dict[str, list[int]] = {}  # a note of ranks > 0 -> the ranks that gave it, in the order first given
    for rank, given in enumerate(gathered[1:], start=1):
        for note in given or []:
            note = note.removeprefix(f"[rank {rank}] ")
            if note not in own and rank not in theirs.setdefault(note, []):
                theirs[note].append(rank)
    return own + [f"[{ranks_text(ranks)}] {note}" for note, ranks in theirs.items() if ranks]


def _sampler(loader: Any) -> ReproBatchSampler | None:
    for candidate in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if isinstance(candidate, ReproBatchSampler):
            return candidate
    return None


def _batches(count: int) -> str:
    return f"{count} batch" + ("es" if count != 1 else "")


def _skipped(sampler: ReproBatchSampler, batches: int) -> tuple[int, str]:
    """The batches a resumed train sampler skips in its pass, and what the resume line says of that pass.

    The epoch's ``batches``, unless its loader is beside a longer one in a ``CombinedLoader`` (cycled, or run out), or
    the epoch ended before its pass did (``limit_train_batches``, ``min_size`` mode: the rest of the pass is skipped).
    """
    _, pass_, skip = sampler.pass_start()
    if pass_ == 0 and skip == batches:
        return batches, ""
    if pass_:
        return skip, f" in its pass {pass_ + 1} of the epoch (cycled beside a longer loader)"
    if skip > batches:
        return skip, f" (the rest of its pass: the epoch ended after {batches} of them)"
    return skip, " (all of its pass: it ran out before the longest loader)" if 0 < len(sampler) <= skip else ""


def _sampler_name(sampler: ReproBatchSampler) -> str:
    """The user's sampler as the takeover names it: the one under a plain ``BatchSampler``, else the batch sampler."""
    plain = not sampler.batched or type(sampler.inner) is BatchSampler
    return type(sampler.sampler if plain else sampler.inner).__name__


def _workers_text(record: dict[str, Any], library: tuple[bool, str | None] = (False, None)) -> str:
    """``worker positions restored: w0 12 items, w1 11 items (...)``, or for the main process ``12 items``.

    ``library``: whether the loader positioned its dataset itself, and what :func:`own_state_text` says of the path.
    """
    workers = record["workers"]
    if not workers and not record.get("ended"):  # written when the epoch's next pass had begun, none of it read
        return f"pass {record['pass']} of the epoch from its start"
    positioned, note = library
    states = [w for w in workers if w.get("state") is not None]
    forwarded = 0 if positioned else sum(int(w["items"]) for w in workers if w.get("state") is None)
    how = []
    if states:
        how.append("the dataset's state taken in the worker" if record["num_workers"] else "the dataset's state")
    if forwarded:
        how.append(f"a fast-forward of {forwarded} items")
    if positioned:  # the loader's own state put each worker's dataset at its items: nothing read again
        how = [note] if note else []
    elif note and forwarded:  # why a dataset with a state_dict() was fast-forwarded
        how[-1] = f"{how[-1]}, {note}"
    how_text = f" ({' and '.join(how)})" if how else ""
    if int(record["num_workers"]) <= 1:
        items = sum(int(w["items"]) for w in workers)
        return f"position restored at {items} items{how_text}"
    counts = ", ".join(f"w{w['worker']} {w['items']} items" for w in workers)
    return f"worker positions restored: {counts}{how_text}, next batch from w{record['turn']}"


def _stream_position(loader: Any, record: dict[str, Any] | None) -> tuple[bool, str]:
    dataset = getattr(loader.dataset, "dataset", loader.dataset)  # under our KeyedIterable
    name = type(dataset).__name__
    position = loader_position(loader)
    if record is not None and position is not None and position.replay:  # a WebLoader with stages (webloader.py)
        return True, (
            f"{name}: the epoch's pass read again from its start through the WebLoader's stages (in the main process),"
            f" its first {record['consumed']} batches dropped"
        )
    if record is not None:
        library = (positioned_by_loader(loader), own_state_text(loader, dataset))
        text = f"{name}: {_workers_text(record, library)}"
        if library[0] and _mixed_by_workers(dataset, record):
            return False, f"{text}; {_MIXED}"
        if _copies_count_passes(loader, dataset):
            return False, f"{text}; {_OWN_COUNTS}"
        if record.get("own_ahead"):
            return False, f"{text}; {_OWN_AHEAD}"
        return True, text
    if position is not None and position.reseed_note is not None:
        return False, f"{name}: {position.reseed_note}"
    return False, f"{name}'s position is not in the checkpoint: its epoch starts over"


_MIXED = (
    "litdata's CombinedStreamingDataset read by several workers resumes each of its datasets from the items read of it"
    " by all workers together, dealt out as if every worker had read every dataset alike (its workers choose their"
    " datasets at random), and its loaded state does not show each worker's items of each dataset to correct that"
    " (data/litdatamix.py): the resumed pass reads other items than the interrupted one (plain Lightning resumes it"
    " the same way); resume from an epoch-end checkpoint, or read it with num_workers=0, to be exact"
)


_OWN_AHEAD = (
    "its own state was saved with the first batch of its next pass held ahead of training by Lightning (a loader"
    " without length beside it), so that batch is skipped"
)

_OWN_COUNTS = (
    "litdata's ParallelStreamingDataset read by persistent workers: each worker's copy counts the epochs of its"
    " datasets itself (the one read to its end starts its next, the others not; plain Lightning too), which no saved"
    " state records, so the passes after the resumed one read other items than the uninterrupted run's; resume"
    " without persistent_workers to be exact"
)


def _copies_count_passes(loader: Any, dataset: Any) -> bool:
    """Persistent workers reading a dataset whose copies count their datasets' epochs themselves (litdata)."""
    return int(loader.num_workers) > 0 and bool(loader.persistent_workers) and passes_counted_per_copy(dataset)


def _mixed_by_workers(dataset: Any, record: dict[str, Any]) -> bool:
    """A litdata ``CombinedStreamingDataset`` resumed mid-pass by its loader's own state with several workers."""
    mid_pass = any(int(w["items"]) for w in record["workers"])
    combined = library(dataset) == "litdata" and type(dataset).__name__ == "CombinedStreamingDataset"
    return combined and int(record["num_workers"]) > 0 and mid_pass and not positions_each_worker(dataset)


def _iterable_position(dataset: Any, num_workers: int, batches: int) -> tuple[bool, str]:
    """What an older checkpoint's main-process state of ``dataset`` restores (written before per-worker positions)."""
    dataset = getattr(dataset, "dataset", dataset)  # under our KeyedIterable
    name = type(dataset).__name__
    if not is_stateful(dataset):
        return False, f"{name} is an IterableDataset without `state_dict()`: its epoch restarts from its beginning"
    if num_workers > 0:
        return False, f"{name}'s state is read in {num_workers} worker processes, not restored (num_workers=0 is exact)"
    if not callable(getattr(dataset, "__len__", None)):
        return False, f"{name} has no `__len__`: its saved state is one batch ahead, so a batch is skipped"
    return True, f"{name}'s state restored after {batches} batches"


def _after_epoch_end(loader: Any) -> tuple[bool, str]:
    """Whether a streaming loader's first pass after an epoch-end checkpoint is the uninterrupted run's; the text.

    With the epoch its dataset was given before its data was read, and why (:mod:`~lightning_repro.data.epochstart`).
    """
    user = getattr(loader.dataset, "dataset", loader.dataset)
    name = pipeline_name(loader, user)
    position = loader_position(loader)
    start = position.epoch_end if position is not None else None
    copies = int(loader.num_workers) > 0 and not loader.persistent_workers
    given = start.text(read=position.read_any(), copies=copies) if start is not None and position is not None else ""
    if positioned_by_loader(loader) and position is not None and position.loader_epoch is not None:
        return True, (
            f"{name}: a new pass after the epoch-end checkpoint, its loader given back its pass count"
            f" (current_epoch={position.loader_epoch}) from its saved state, which Lightning loads only mid-epoch"
        )
    if _copies_count_passes(loader, user):
        return False, f"{name}: {_OWN_COUNTS}"
    if positioned_by_loader(loader) and position is not None and position.loaded_own is not None:
        # a checkpoint on the epoch's last batch: Lightning restarts in that epoch and loads the loader's own state
        epoch = position.loaded_own.get("current_epoch")
        return True, f"{name}: a new pass after the epoch's last batch, its loader's state loaded (pass {epoch})"
    if positioned_by_loader(loader):
        return False, (
            f"{name}: an epoch-end resume reads another order (the loader's pass count, current_epoch, is not in the"
            " checkpoint's loader state); resume from a mid-epoch checkpoint (every_n_train_steps) to be exact"
        )
    return True, f"{name}: a new pass after the epoch-end checkpoint{given}"


def data_position(
    loaders: Sequence[Any] | None,
    batches: int,
    *,
    sample_keyed: bool,
    streaming: Mapping[int, dict[str, Any]] | None = None,
    legacy: Collection[int] = (),
) -> tuple[bool, list[str]]:
    """Whether the train loaders continue exactly from ``batches`` consumed batches of the epoch, and what is said.

    A map-style loader taken over continues exactly: our samplers are sliced (O(1) in ``batches``), another sampler
    whose order replays from the seed is advanced index by index (no data is loaded). A loader over an
    ``IterableDataset`` does when it was given its per-worker position (``streaming``, by loader index: the
    checkpoint's records given to the loaders); ``legacy``: the loaders given an older checkpoint's main-process
    ``state_dict()`` instead (exact only with ``__len__`` and ``num_workers=0``). ``batches == 0`` (an epoch
    boundary): each loader starts a new pass, which is exact unless its order does not replay.
    """
    exact, said = True, list[str]()
    several = len(loaders or []) > 1
    for index, loader in enumerate(loaders or []):
        mark = len(said)
        sampler = _sampler(loader)
        if sampler is not None:
            if sampler.seeding != "exact" and sampler.seeding not in EXACT_SEEDINGS:
                exact = False
                said.append(f"{_sampler_name(sampler)}'s order does not replay from the seed")
            elif not sample_keyed and batches:
                exact = False
                said.append(
                    "sample_keyed=False: what the dataset draws while loading is not restored (exact only if it draws"
                    " nothing)"
                )
            elif batches and sampler.seeding == "exact":
                skip, detail = _skipped(sampler, batches)
                said.append(f"O(1) skip of {_batches(skip)}{detail}")
            elif batches:
                skip, detail = _skipped(sampler, batches)
                name = _sampler_name(sampler)
                said.append(f"index-by-index skip of {_batches(skip)} of {name}{detail} (no data loaded)")
        elif isinstance(loader, DataLoader) and isinstance(loader.dataset, IterableDataset):
            record = (streaming or {}).get(index)
            position = loader_position(loader)
            # an epoch-end checkpoint's (a loader without __len__ cannot mark it ended): a new pass starts
            if record is not None and (record.get("ended") or (position is not None and position.epoch_end)):
                ok, text = _after_epoch_end(loader)
                exact &= ok
                said.append(text)
            elif batches:
                if index in legacy:
                    ok, text = _iterable_position(loader.dataset, int(loader.num_workers), batches)
                else:
                    ok, text = _stream_position(loader, (streaming or {}).get(index))
                exact &= ok
                said.append(text)
        elif is_taken_over(loader):  # torchdata.nodes: its own state, of the consumed batches, loaded by Lightning
            ok, text = nodes_position(loader, batches)
            exact &= ok
            said.append(text)
        elif batches:
            exact = False
            said.append(f"a {type(loader).__name__} is not a DataLoader lightning-repro takes over")
        if several:  # which loader each part speaks of
            said[mark:] = [f"loader {index}: {text}" for text in said[mark:]]
    if exact and not batches:
        said.append("a new epoch starts")
    return exact, said


def resume_line(
    checkpoint: Any, step: int, epoch: int, *, reasons: Sequence[str], facts: Sequence[str]
) -> str:
    """``resumed from <checkpoint> at step S, epoch E: exact (facts)``, or ``...: NOT exact: reasons (facts)``."""
    head = f"resumed from {checkpoint} at step {step}, epoch {epoch}: "
    details = f" ({'; '.join(facts)})" if facts else ""
    if not reasons:
        return head + "exact" + details
    return head + "NOT exact: " + "; ".join(reasons) + details


def say_resumed(
    checkpoint: Any,
    step: int,
    epoch: int,
    *,
    notes: Sequence[str],
    restore: str | None,
    data: tuple[bool, list[str]],
    continuation: str | None = None,
    restore_exact: bool = True,
    facts: Sequence[str] = (),
) -> str:
    """Build the resume's line (see :func:`resume_line`), say it, and return it.

    Args:
        checkpoint: The checkpoint resumed from.
        step: The global step resumed at.
        epoch: The epoch resumed in.
        notes: The messages of the :class:`~lightning_repro.NotExactWarning` given during the resume.
        restore: What the restore check found (``"restore verified: ..."``), or ``None`` (no entry restored).
        data: :func:`data_position`'s result, or ``(True, [])`` when no data position was restored.
        continuation: What the continuation check will compare (the step trace), or ``None``.
        restore_exact: False when the restore check found a difference: ``restore`` is then a reason the resume
            is not exact (the restored state is not the one the checkpoint saved), not a fact beside "exact".
        facts: More facts of the resume that do not change the training (a checkpoint callback starting afresh).
    """
    reasons = list(dict.fromkeys(headline(note) for note in notes))
    data_exact, data_said = data
    told = [restore] if restore and restore_exact else []
    if restore and not restore_exact:
        reasons.append(restore)
    if data_said:
        told.append("data: " + ", ".join(data_said))
    if not data_exact:
        reasons.append("the data position is not restored exactly")
    if continuation:
        told.append(continuation)
    line = resume_line(checkpoint, step, epoch, reasons=reasons, facts=[*told, *facts])
    say(line)
    return PREFIX + line
