"""The checkpoint entry: a typed schema, its plain-dict form, its SHA-256, and every check of a loaded one.

The entry is stored in the ``.ckpt`` under ``checkpoint["callbacks"][state_key]`` as tensors and plain values only
(``torch.load(weights_only=True)`` accepts it). Version 2 (written since 0.1.0's restructure)::

    version            2
    seed               the run's seed
    topology           {"world_size", "num_nodes", "num_workers": [per train loader]}
    environment        the environment fingerprint (versions, hardware, flags)
    manifest           the run manifest (code, data, environment, seeds, hardware; see lightning_repro.manifest),
                       optional: absent in entries written before it (their drift is read from ``environment``)
    pending            what the run still did after the checkpoint's training batch (a log row, a validation);
                       under DDP the log row's values are rank 0's (each other rank's: its part's ``pending_log``)
    remainder          the rest of the hook the checkpoint was written in (callbacks after the writer)
    callback_metrics   trainer.callback_metrics, logged_metrics and progress_bar_metrics (rank 0's under DDP)
    truncated          the epoch was cut short (max_steps, a stop request) when it was written
    loops              facts that correct Lightning's loop counters on load (batches per epoch, accumulation)
    save_guards        optional: per checkpoint callback (state_key, index among that key's), the step and the file
                       (relative to its dirpath) it had saved once this checkpoint was written (not in its state);
                       the writer's ``then_last``: the ``last`` file it saves next in the same hook
    frozen             optional: the names of the parameters without ``requires_grad`` (``trainable.py``)
    in_flight          optional: written inside a training batch that Lightning trains again on resume: ``batch``, its
                       index, ``exact`` (the entry holds the batch's start), ``why`` not (``data/batchstart.py``)
    pruned             optional: per tensor ``ModelPruning`` pruned (a checkpoint then holds ``orig * mask`` only), its
                       module's path, name, mask, original values under the mask, the last forward's tensor when it
                       is no longer ``orig * mask``, a lottery-ticket copy's shared storage (``checkpoint/pruned.py``)
    ranks              one part per rank, indexed by global rank:
        streams, streams_sha256   the training process streams and their SHA-256
        batches                   batches consumed in the epoch
        data                      per train loader: index, epoch, pass, offset, length, order
        metrics                   torchmetrics states (and update counts)
        logged                    epoch aggregates of ``self.log``
        grads                     gradients accumulated so far (inside an accumulation window), else None
        iterables                 ``state_dict()`` of train ``IterableDataset``s read in the main process (written
                                  before per-worker positions; still read)
        streaming                 optional: per train loader over an ``IterableDataset`` (by index), the position
                                  of its pass: epoch, pass, batches consumed, whose turn is next, num_workers, the
                                  dataset's epoch (in the main process; optional: in the copies that read the
                                  pass), and per worker its consumed items, batches and dataset state
                                  (``data/workerpos.py``); ``ended`` once the epoch's data is used up (then it
                                  is what the pass leaves to the next epoch's)
        restore_sha256            optional: SHA-256 per saved component (parameters, optimizer, LR schedulers,
                                  data position, metric states), recomputed after a resume (``verify.py``;
                                  ``"c:<hex>"``: tensors of 64 KiB or more entered by their row checksums); and
                                  what the epoch-start hooks set (``"attribute ..."``, ``attributes.py``)
        trace                     the last step-trace records (plain dicts), when the trace is on (optional)
        generators                optional: the states of the generators the LightningModule and the callbacks
                                  hold, by path (``checkpoint/owned.py``)
        callback_metrics, pending_log, own_manifest
                                  optional, under DDP on ranks > 0 (the shared values are rank 0's): the rank's own
                                  ``callback_metrics`` & co., values of ``pending["log"]``, and manifest sections
                                  ``environment`` and ``hardware`` (its node, its interpreter: what its resume checks)
        replica                   optional, under DDP: the digest of the rank's module buffers, whether DDP's
                                  next forward broadcasts rank 0's (``forward_sync``), and the buffers themselves
                                  where they differ from rank 0's, which the file's state holds; the same for the
                                  user callbacks' states (``callbacks_sha256``, ``callbacks``)
                                  (``checkpoint/replica.py``)
    entry_sha256       SHA-256 of everything above (written last, by :func:`seal_entry`)

Version 1 held rank 0's part at the top level and the other ranks' parts under ``"other_ranks"``;
:meth:`Entry.from_dict` reads both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from lightning_repro._lightning.hooks import REPLAYED_HOOKS
from lightning_repro._lightning.results import REDUCTIONS
from lightning_repro.checkpoint.pruned import check_records
from lightning_repro.checkpoint.reading import read_checkpoint, same_save_said, saved_after
from lightning_repro.checkpoint.replica import check_replica
from lightning_repro.checkpoint.seal import DIGEST_KEY, check_digest, entry_digest, seal_entry
from lightning_repro.exceptions import CorruptStateError, ReproError
from lightning_repro.rng import digest_process_streams, validate_process_streams

__all__ = [
    "DIGEST_KEY",
    "ENTRY_VERSION",
    "OWN_MANIFEST_SECTIONS",
    "Entry",
    "RankPart",
    "entry_digest",
    "read_checkpoint",
    "same_save_said",
    "saved_after",
    "seal_entry",
]

ENTRY_VERSION = 2
"""The version :meth:`Entry.to_dict` writes; :meth:`Entry.from_dict` reads 1 and 2."""

_DAMAGED = "the lightning-repro checkpoint entry is damaged"

OWN_MANIFEST_SECTIONS = ("environment", "hardware")  # of the run manifest, a rank > 0 keeps its own (own_manifest)


def _plain(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, values as they are (no deep copy of tensors)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass
class RankPart:
    """One rank's part of the entry: its process streams, data position and epoch-level state."""

    streams: dict[str, Any]
    streams_sha256: str
    batches: int
    data: list[dict[str, Any]]
    metrics: dict[str, Any] = field(default_factory=dict)
    logged: dict[str, Any] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] | None = None
    iterables: dict[str, Any] = field(default_factory=dict)
    restore_sha256: dict[str, str] = field(default_factory=dict)  # the restore check's digests (optional)
    streaming: dict[str, Any] = field(default_factory=dict)  # per-worker positions of streaming loaders (optional)

    trace: list[dict[str, Any]] | None = None  # the step trace's last records (DeterminismCallback(trace=...))
    generators: dict[str, Any] = field(default_factory=dict)  # the module's and callbacks' own (optional)
    batch_end: dict[str, Any] | None = None  # the outputs of an on_train_batch_end the file is written in (optional)
    validation_metrics: list[str] = field(default_factory=list)  # the metrics validation logs (not saved; optional)
    replica: dict[str, Any] | None = None  # DDP: the rank's own buffers where unlike rank 0's (optional)
    ran_out: int | None = None  # a cycling epoch: the rank's train loaders that ran out, by index (optional)
    callback_metrics: dict[str, Any] | None = None  # DDP, rank > 0: its own trainer metric dicts (optional)
    pending_log: dict[str, torch.Tensor] | None = None  # DDP, rank > 0: its own pending log row (optional)
    own_manifest: dict[str, Any] | None = None  # DDP, rank > 0: its manifest's environment and hardware (optional)

    def to_dict(self) -> dict[str, Any]:
        """The part as plain values and tensors (the optional ``restore_sha256``, ``streaming``, ``trace``: if any)."""
        out = _plain(self)
        for name in ("generators", "restore_sha256", "streaming", "validation_metrics"):
            if not out[name]:
                del out[name]
        for name in ("trace", "batch_end", "replica", "ran_out", "callback_metrics", "pending_log", "own_manifest"):
            if out[name] is None:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, part: Any) -> RankPart:
        """Check one rank's part completely and return it typed.

        Raises:
            CorruptStateError: a value is missing, of the wrong type, or does not match its SHA-256.
        """
        if not isinstance(part, dict):
            raise CorruptStateError(f"{_DAMAGED}: a rank's part is a {type(part).__name__}")
        streams = _need(part, "streams", dict)
        validate_process_streams(streams)
        if digest_process_streams(streams) != _need(part, "streams_sha256", str):
            raise CorruptStateError(f"{_DAMAGED}: the RNG streams do not match their saved SHA-256")
        data = _need(part, "data", list)
        for position in data:
            if not isinstance(position, dict) or not all(
                isinstance(position.get(k), int) and position[k] >= 0
                for k in ("index", "epoch", "pass", "offset", "length")
            ):
                raise CorruptStateError(f"{_DAMAGED}: bad data position {position!r}")
        metrics, logged, iterables = (part.get(key) or {} for key in ("metrics", "logged", "iterables"))
        if not isinstance(iterables, dict):
            raise CorruptStateError(f"{_DAMAGED}: 'iterables' is not a dict")
        grads = part.get("grads")
        if not (isinstance(metrics, dict) and isinstance(logged, dict) and (grads is None or isinstance(grads, dict))):
            raise CorruptStateError(f"{_DAMAGED}: 'metrics', 'logged' or 'grads'")
        for key, item in logged.items():
            _check_logged(key, item)
        restore = part.get("restore_sha256") or {}
        if not isinstance(restore, dict) or not all(isinstance(v, str) for v in restore.values()):
            raise CorruptStateError(f"{_DAMAGED}: 'restore_sha256' is not a dict of digests")
        streaming = part.get("streaming") or {}
        if not isinstance(streaming, dict) or not all(_stream_record(r) for r in streaming.values()):
            raise CorruptStateError(f"{_DAMAGED}: 'streaming' holds a malformed worker position")
        trace = part.get("trace")
        if trace is not None and not (isinstance(trace, list) and all(isinstance(r, dict) for r in trace)):
            raise CorruptStateError(f"{_DAMAGED}: 'trace' is not a list of records")
        generators = part.get("generators") or {}
        if not isinstance(generators, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("kind"), str) for k, v in generators.items()
        ):
            raise CorruptStateError(f"{_DAMAGED}: 'generators' is not a dict of generator states")
        batch_end = part.get("batch_end")
        if batch_end is not None and not (
            isinstance(batch_end, dict) and ("outputs" in batch_end or isinstance(batch_end.get("unstorable"), str))
        ):
            raise CorruptStateError(f"{_DAMAGED}: 'batch_end' holds neither outputs nor why not")
        validation_metrics = part.get("validation_metrics") or []
        if not (isinstance(validation_metrics, list) and all(isinstance(n, str) for n in validation_metrics)):
            raise CorruptStateError(f"{_DAMAGED}: 'validation_metrics' is not a list of names")
        if not check_replica(part.get("replica")):
            raise CorruptStateError(f"{_DAMAGED}: 'replica' is not a record of the rank's buffers")
        ran_out = part.get("ran_out")
        if ran_out is not None and not (type(ran_out) is int and ran_out >= 0):
            raise CorruptStateError(f"{_DAMAGED}: 'ran_out' is not a mask of train loaders")
        for key, check in _OWN_CHECKS.items():
            if part.get(key) is not None and not check(part[key]):
                raise CorruptStateError(f"{_DAMAGED}: a rank's {key!r} is malformed")
        return cls(
            streams=streams,
            streams_sha256=part["streams_sha256"],
            batches=_need(part, "batches", int),
            data=data,
            metrics=metrics,
            logged=logged,
            grads=grads,
            iterables=iterables,
            restore_sha256=restore,
            streaming=streaming,
            trace=trace,
            generators=generators,
            batch_end=batch_end,
            validation_metrics=validation_metrics,
            replica=part.get("replica"),
            ran_out=ran_out,
            **{key: part.get(key) for key in _OWN_CHECKS},
        )


@dataclass
class Entry:
    """The whole checkpoint entry: what every rank shares, and one :class:`RankPart` per rank."""

    seed: int
    topology: dict[str, Any]
    ranks: list[RankPart]
    environment: dict[str, str] = field(default_factory=dict)
    pending: dict[str, Any] | None = None
    remainder: dict[str, Any] | None = None
    callback_metrics: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False
    loops: dict[str, int] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    save_guards: list[dict[str, Any]] | None = None
    frozen: list[str] | None = None
    in_flight: dict[str, Any] | None = None  # written inside a training batch (optional)
    pruned: list[dict[str, Any]] | None = None  # ModelPruning's masks (optional)
    version: int = ENTRY_VERSION  # the version it was read from; to_dict() writes ENTRY_VERSION

    def to_dict(self) -> dict[str, Any]:
        """The entry as plain values and tensors, in the layout of :data:`ENTRY_VERSION` (not sealed yet)."""
        out = _plain(self)
        out["version"] = ENTRY_VERSION
        out["ranks"] = [part.to_dict() for part in self.ranks]
        for optional in ("in_flight", "pruned"):
            if out[optional] is None:
                del out[optional]
        return out

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> Entry:
        """Check a loaded entry (version 1 or 2) completely and return it typed; nothing is applied.

        Raises:
            ReproError: the entry's version is newer than this lightning-repro understands.
            CorruptStateError: a part of the entry is damaged (the message names it).
        """
        version = _need(entry, "version", int)
        if version > ENTRY_VERSION:
            raise ReproError(
                f"the checkpoint's lightning-repro entry has version {version}, this lightning-repro reads up to"
                f" {ENTRY_VERSION}: upgrade lightning-repro to resume it"
            )
        check_digest(entry)
        seed = _need(entry, "seed", int)
        topology = _need(entry, "topology", dict)
        if version >= 2:
            parts = _need(entry, "ranks", list)
        else:  # rank 0's part at the top level, the others under "other_ranks"
            others = entry.get("other_ranks") or []
            if not isinstance(others, list):
                raise CorruptStateError(f"{_DAMAGED}: 'other_ranks' is not a list")
            parts = [{k: v for k, v in entry.items() if k != "callback_metrics"}, *others]  # the shared value
        saved_world = int(topology.get("world_size", 1))
        if len(parts) != saved_world:
            raise CorruptStateError(f"{_DAMAGED}: it holds {len(parts)} rank(s) of a world size of {saved_world}")
        return cls(
            seed=seed,
            topology=topology,
            ranks=[RankPart.from_dict(part) for part in parts],
            environment=entry.get("environment") or {},
            pending=_optional(entry, "pending"),
            remainder=_optional(entry, "remainder"),
            callback_metrics=_optional(entry, "callback_metrics") or {},
            truncated=bool(entry.get("truncated", False)),
            loops=entry.get("loops") or {},
            manifest=_manifest(entry),
            save_guards=_optional(entry, "save_guards"),
            frozen=_optional(entry, "frozen"),
            in_flight=_optional(entry, "in_flight"),
            pruned=_optional(entry, "pruned"),
            version=version,
        )


def _manifest(entry: dict[str, Any]) -> dict[str, Any] | None:
    value = entry.get("manifest")
    if value is not None and not isinstance(value, dict):
        raise CorruptStateError(f"{_DAMAGED}: 'manifest' is a {type(value).__name__}")
    return value


def _need(entry: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in entry:
        raise CorruptStateError(f"{_DAMAGED}: {key!r} is missing")
    value = entry[key]
    if not isinstance(value, kind):
        raise CorruptStateError(f"{_DAMAGED}: {key!r} is a {type(value).__name__}")
    return value


def _check_logged(key: str, item: Any) -> None:
    tensor = item.get("is_tensor", True) if isinstance(item, dict) else True
    if (
        not isinstance(item, dict)
        or item.get("reduce") not in REDUCTIONS
        or (tensor and not isinstance(item.get("value"), torch.Tensor))
        or (not tensor and not isinstance(item.get("metric_attribute"), str))
    ):
        raise CorruptStateError(f"{_DAMAGED}: logged value {key!r}")


def _batch_end_remainder(value: dict[str, Any]) -> bool:
    return _counts(value, ("batch_idx",)) and isinstance(value.get("last_batch"), bool)


def _counts(value: Any, keys: tuple[str, ...]) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(k), int) and value[k] >= 0 for k in keys)


def _stream_record(value: Any) -> bool:
    """A streaming loader's position (``data/workerpos.py: StreamPosition.describe``) is well formed."""
    keys = ("epoch", "pass", "batches", "consumed", "turn", "num_workers")
    workers = value.get("workers") if isinstance(value, dict) else None
    epochs = [value.get(k) for k in ("dataset_epoch", "workers_epoch")] if isinstance(value, dict) else []
    stages = value.get("stage_epochs") if isinstance(value, dict) else None
    return (
        _counts(value, keys)
        and all(epoch is None or isinstance(epoch, int) for epoch in epochs)
        and (stages is None or (isinstance(stages, list) and all(isinstance(e, int) for e in stages)))
        and isinstance(value.get("ended", False), bool)
        and isinstance(workers, list)
        and all(_counts(w, ("worker", "items", "batches")) for w in workers)
    )


def _tensor_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values())


def _callback_names(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int) for e in value
    )


def _save_guard(value: Any) -> bool:
    kinds = {"state_key": str, "index": int, "step": int, "file": str}
    return (
        isinstance(value, dict)
        and all(isinstance(value.get(k), kind) for k, kind in kinds.items())
        and isinstance(value.get("defer", False), bool)
        and isinstance(value.get("then_last", ""), str)
    )


_SHARED_CHECKS: dict[str, Callable[[Any], bool]] = {
    "pending": lambda v: (
        isinstance(v, dict) and isinstance(v.get("validate"), bool) and (v.get("log") is None or _tensor_dict(v["log"]))
    ),
    "remainder": lambda v: (
        isinstance(v, dict)
        and v.get("hook") in REPLAYED_HOOKS
        and _callback_names(v.get("callbacks"))
        and (v["hook"] != "on_train_batch_end" or _batch_end_remainder(v))
    ),
    "callback_metrics": lambda v: isinstance(v, dict) and all(_tensor_dict(d) for d in v.values()),
    "save_guards": lambda v: isinstance(v, list) and all(_save_guard(g) for g in v),
    "frozen": lambda v: isinstance(v, list) and all(isinstance(name, str) for name in v),
    "in_flight": lambda v: (
        isinstance(v, dict)
        and all(isinstance(v.get(k), kind) for k, kind in (("batch", int), ("exact", bool), ("why", str)))
    ),
    "pruned": check_records,
}
_OWN_CHECKS: dict[str, Callable[[Any], bool]] = {  # a rank > 0's own values of what the entry shares (rank 0's)
    "callback_metrics": _SHARED_CHECKS["callback_metrics"],
    "pending_log": _tensor_dict,
    "own_manifest": lambda v: isinstance(v, dict) and all(isinstance(s, dict) for s in v.values()),
}


def _optional(entry: dict[str, Any], key: str) -> Any:
    """A shared value that may be absent (``None``), checked by :data:`_SHARED_CHECKS` when present."""
    value = entry.get(key)
    if value is not None and not _SHARED_CHECKS[key](value):
        raise CorruptStateError(f"{_DAMAGED}: {key!r} is malformed")
    return value
