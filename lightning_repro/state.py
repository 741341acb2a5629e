"""The checkpoint entry: build it at save time, parse and check it, apply it on resume.

The entry holds tensors and plain values only (``torch.load(weights_only=True)`` accepts it):

``version``, ``seed``, ``streams`` (the training process streams) and ``streams_sha256``,
``data`` (per train loader: epoch, pass, batch offset, length), ``batches`` (batches consumed
in the epoch), ``topology`` (world size, nodes, workers), ``environment`` (fingerprint),
``metrics`` (torchmetrics states), ``logged`` (epoch aggregates of ``self.log``) and ``grads``
(gradients accumulated so far when the checkpoint falls inside an accumulation window).
``entry_sha256`` (written last, by :func:`seal_entry`) is a SHA-256 of everything else in it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_repro.exceptions import CorruptStateError, NotExactWarning, ReproError, SeedMismatchError, TopologyError
from lightning_repro.fingerprint import environment_fingerprint
from lightning_repro.rng import (
    capture_process_streams,
    digest_process_streams,
    fork_process_streams,
    restore_process_streams,
    validate_process_streams,
)
from lightning_repro.streams import reseed_after_topology_change

if TYPE_CHECKING:
    from lightning_repro.callback import DeterminismCallback
    from lightning_repro.dataloaders import ReproBatchSampler

__all__ = [
    "DIGEST_KEY",
    "ENTRY_VERSION",
    "ReproState",
    "apply_data_position",
    "apply_iterable_state",
    "apply_process_state",
    "build_entry",
    "check_restored",
    "end_remapped_epoch",
    "entry_digest",
    "environment_changes",
    "epoch_cut_short",
    "epoch_processed",
    "finish_logged_values",
    "fix_loop_progress",
    "gather_ranks",
    "is_stateful_iterable",
    "loop_facts",
    "loops_restored",
    "parse_entry",
    "pending_after_batch",
    "restart_train_iterator",
    "run_pending",
    "seal_entry",
    "silence_not_resumable_warning",
    "step_plateau_schedulers_at_epoch_end",
    "train_data_resumes_exactly",
]

ENTRY_VERSION = 1
_REDUCTIONS = ("mean", "sum", "max", "min")


@dataclass
class ReproState:
    """A parsed, checked entry waiting to be applied on resume."""

    seed: int
    streams: dict[str, Any]
    data: list[dict[str, Any]]
    batches: int
    topology: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    logged: dict[str, Any] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] | None = None
    environment: dict[str, str] = field(default_factory=dict)
    remap: bool = False  # resumed under another world size: re-deal the data, re-seed the streams
    iterables: dict[str, Any] = field(default_factory=dict)  # state_dict() of train IterableDatasets
    pending: dict[str, Any] | None = None  # what the interrupted run still did after the checkpoint's batch
    trainer_metrics: dict[str, Any] = field(default_factory=dict)  # callback_metrics & co. at the checkpoint
    remainder: dict[str, Any] | None = None  # the rest of the hook the checkpoint was written in


# ---------------------------------------------------------------------------------------- save
def epoch_processed(trainer: pl.Trainer) -> int:
    """Epochs whose batches are all processed (Lightning's own epoch counter for samplers)."""
    return int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]


def _data_positions(callback: DeterminismCallback, trainer: pl.Trainer) -> tuple[int, list[dict[str, Any]]]:
    fit_loop = trainer.fit_loop
    batches = int(fit_loop.epoch_loop.batch_progress.current.ready)
    total = trainer.num_training_batches
    combined = fit_loop._combined_loader
    mode = getattr(combined, "_mode", "max_size_cycle")
    positions = []
    for index, sampler in sorted(callback.train_samplers.items()):
        epoch, current_pass = sampler.current if sampler.current is not None else (callback._train_counter(), 0)
        length = len(sampler)
        if batches >= total or length == 0:  # the epoch's data is used up
            pass_, offset = current_pass, length
        elif mode == "max_size_cycle":
            pass_, offset = divmod(batches, length)
        else:
            pass_, offset = 0, min(batches, length)
        positions.append(
            {
                "index": index,
                "epoch": int(epoch),
                "pass": int(pass_),
                "offset": int(offset),
                "length": length,
                "order": sampler.describe(),
            }
        )
    return batches, positions


def _logged_metric_objects(trainer: pl.Trainer) -> set[int]:
    """Ids of the Metric objects logged with ``on_epoch=True``: Lightning resets them after the epoch."""
    results = trainer.fit_loop.epoch_loop._results
    return {id(m.value) for m in results.values() if not m.is_tensor and m.meta.on_epoch}


def _eval_metric_objects(trainer: pl.Trainer) -> set[int]:
    """Ids of the Metric objects logged in validation: Lightning resets them when each validation ends.

    A checkpoint written in ``on_validation_end`` (where a monitored ``ModelCheckpoint`` saves) sees them still
    holding the finished validation's states; the run that goes on resets them right after, so they are not saved.
    """
    results = trainer.fit_loop.epoch_loop.val_loop._results
    return {id(m.value) for m in results.values() if not m.is_tensor}


def pending_after_batch(trainer: pl.Trainer) -> dict[str, Any] | None:
    """What Lightning still does for the current batch when a checkpoint is written in ``on_train_batch_end``.

    After that hook the uninterrupted run logs the batch's step values and runs a validation that is due at this
    batch; a resumed run starts with the next batch and would do neither (Lightning skips the due validation on
    purpose). Returns ``None`` when the checkpoint is not written at the end of a training batch.
    """
    if not trainer.training or trainer.sanity_checking:
        return None
    epoch_loop = trainer.fit_loop.epoch_loop
    current: Any = epoch_loop.batch_progress.current
    if not (current.ready >= 1 and current.processed == current.ready and current.completed == current.ready - 1):
        return None
    connector = trainer._logger_connector
    log: dict[str, torch.Tensor] | None = None
    accumulating = trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization
    fast_dev_run = bool(getattr(trainer, "fast_dev_run", False))
    if trainer.loggers and not accumulating and (connector.should_update_logs or fast_dev_run):
        log = {
            key: (value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(value))
            for key, value in connector.metrics["log"].items()
        }
    fetcher = trainer.fit_loop._data_fetcher
    validate = fetcher is not None and not epoch_loop._skip_next_val and epoch_loop._should_check_val_fx(fetcher)
    return {"log": log, "validate": bool(validate)}


_METRIC_DICTS = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")


def _trainer_metrics(trainer: pl.Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """``trainer.callback_metrics``, ``logged_metrics`` and ``progress_bar_metrics`` as they are at the checkpoint.

    The callbacks that monitor a value (``ModelCheckpoint(monitor=...)``, ``EarlyStopping``) read them until the
    next validation updates them; a resumed run must see the same values, not an empty dict.
    """
    connector = trainer._logger_connector
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name in _METRIC_DICTS:
        values = getattr(connector, name, None) or {}
        out[name] = {
            key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
            for key, value in values.items()
            if isinstance(value, (torch.Tensor, int, float))
        }
    return out


def _apply_trainer_metrics(state: ReproState, trainer: pl.Trainer) -> None:
    connector = trainer._logger_connector
    for name, values in state.trainer_metrics.items():
        if name in _METRIC_DICTS and isinstance(values, dict):
            device = trainer.strategy.root_device
            getattr(connector, name).update({key: value.to(device) for key, value in values.items()})


def run_pending(trainer: pl.Trainer, pending: dict[str, Any] | None) -> None:
    """Do, before the first resumed batch, what :func:`pending_after_batch` found the interrupted run had left."""
    if not pending:
        return
    from lightning.pytorch.trainer import call

    connector = trainer._logger_connector
    if pending.get("log"):
        # as `update_train_step_metrics` does: the step and the epoch are the loop's, restored as they were saved
        connector.log_metrics(dict(pending["log"]))
    if pending.get("validate"):
        epoch_loop = trainer.fit_loop.epoch_loop
        val_loop = epoch_loop.val_loop
        val_loop.restarting = False  # a whole new validation, as in `_TrainingEpochLoop.on_advance_end`
        first_loop_iter = connector._first_loop_iter
        trainer.validating = True
        if not epoch_loop._should_accumulate():
            call._call_lightning_module_hook(trainer, "on_validation_model_zero_grad")
        val_loop.run()
        trainer.training = True
        connector._first_loop_iter = first_loop_iter
        # The epoch loop reads `_has_run` while restarting as "the interrupted validation has finished": left True
        # it would end the resumed epoch before its restart handling ran once (and then skip the next epoch).
        val_loop._has_run = False


def _metric_states(pl_module: pl.LightningModule, skip: set[int]) -> dict[str, Any]:
    from torchmetrics import Metric

    out: dict[str, Any] = {}
    for name, module in pl_module.named_modules():
        if isinstance(module, Metric) and id(module) not in skip:
            states: dict[str, Any] = {}
            for key, value in module.metric_state.items():
                if isinstance(value, torch.Tensor):
                    states[key] = value.detach().cpu().clone()
                else:
                    states[key] = [t.detach().cpu().clone() for t in value]
            out[name] = {"states": states, "update_count": int(module._update_count)}
    return out


def _logged_values(trainer: pl.Trainer) -> dict[str, Any]:
    results = trainer.fit_loop.epoch_loop._results
    out: dict[str, Any] = {}
    for key, metric in results.items():
        meta = metric.meta
        if not meta.on_epoch or (not metric.is_tensor and not meta.metric_attribute):
            continue
        reduce = next(r for r in _REDUCTIONS if getattr(meta, f"is_{r}_reduction"))
        tensor = metric.is_tensor
        out[key] = {
            "is_tensor": tensor,
            "value": metric.value.detach().cpu().clone() if tensor else None,
            "cumulated_batch_size": (
                metric.cumulated_batch_size.detach().cpu().clone() if tensor and reduce == "mean" else None
            ),
            "fx": meta.fx,
            "name": meta.name,
            "prog_bar": bool(meta.prog_bar),
            "logger": bool(meta.logger),
            "on_step": bool(meta.on_step),
            "reduce": reduce,
            "enable_graph": bool(meta.enable_graph),
            "add_dataloader_idx": bool(meta.add_dataloader_idx),
            "dataloader_idx": meta.dataloader_idx,
            "metric_attribute": meta.metric_attribute,
            "sync": bool(meta.sync.should),
            "rank_zero_only": bool(meta.sync.rank_zero_only),
        }
    return out


def _accumulated_grads(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, torch.Tensor] | None:
    if trainer.accumulate_grad_batches <= 1 or not trainer.fit_loop.epoch_loop._should_accumulate():
        return None
    if trainer.fit_loop.epoch_loop.batch_progress.current.ready == 0:
        return None
    return {
        name: param.grad.detach().cpu().clone()
        for name, param in pl_module.named_parameters()
        if param.grad is not None
    }


def build_entry(
    callback: DeterminismCallback, trainer: pl.Trainer, streams: dict[str, Any], *, truncated: bool = False
) -> dict[str, Any]:
    """Build the versioned checkpoint entry for this rank.

    Args:
        callback: The callback (its train samplers give the data position).
        trainer: The trainer.
        streams: The training process streams to save.
        truncated: The epoch was cut short and its epoch-end hooks are about to run: save the
            epoch-level values as they are now, and let the checkpoint resume mid-epoch.
    """
    from lightning_repro._lightning import hook_remainder

    pl_module = trainer.lightning_module
    batches, positions = _data_positions(callback, trainer)
    data_epoch = positions[0]["epoch"] if positions else callback._train_counter()
    remainder = None if truncated else hook_remainder(trainer, callback)
    # after the epoch-end hooks started, epoch-level values belong to a finished epoch, unless the resume is to
    # finish that epoch's end (a checkpoint written in on_train_epoch_end): then they are logged from the entry
    epoch_end_pending = remainder is not None and remainder["hook"] == "on_train_epoch_end"
    epoch_over = not truncated and epoch_processed(trainer) > data_epoch and not epoch_end_pending
    loaders = [callback.train_samplers[i] for i in sorted(callback.train_samplers)]
    return {
        "version": ENTRY_VERSION,
        "seed": callback.seed,
        "streams": streams,
        "streams_sha256": digest_process_streams(streams),
        "batches": batches,
        "data": positions,
        "topology": {
            "world_size": int(trainer.world_size),
            "num_nodes": int(trainer.num_nodes),
            "num_workers": [int(getattr(s, "num_workers", -1)) for s in loaders],
        },
        "environment": environment_fingerprint(),
        "metrics": _metric_states(
            pl_module, skip=_eval_metric_objects(trainer) | (_logged_metric_objects(trainer) if epoch_over else set())
        ),
        "pending": pending_after_batch(trainer),
        "remainder": remainder,
        "callback_metrics": _trainer_metrics(trainer),
        "logged": {} if epoch_over or batches == 0 else _logged_values(trainer),
        "grads": _accumulated_grads(trainer, pl_module),
        "iterables": {
            str(index): loader.dataset.state_dict() for index, loader in sorted(callback.train_iterables.items())
        },
        "truncated": truncated,
        "loops": loop_facts(trainer),
    }


_RANK_KEYS = ("streams", "streams_sha256", "batches", "data", "metrics", "logged", "grads", "iterables")


def is_stateful_iterable(loader: Any) -> bool:
    """A loader over an ``IterableDataset`` that implements ``state_dict()`` and ``load_state_dict()``."""
    from torch.utils.data import IterableDataset

    dataset = getattr(loader, "dataset", None)
    return isinstance(dataset, IterableDataset) and all(
        callable(getattr(dataset, name, None)) for name in ("state_dict", "load_state_dict")
    )


def apply_iterable_state(state: ReproState, index: int, loader: Any) -> None:
    """Give a train ``IterableDataset`` back the state it had when the checkpoint was written."""
    saved = state.iterables.get(str(index))
    if saved is not None:
        loader.dataset.load_state_dict(saved)


def gather_ranks(entry: dict[str, Any], trainer: pl.Trainer) -> dict[str, Any]:
    """Collect every rank's part of the entry into the entry rank 0 writes (a collective: call on all ranks).

    The entry holds rank 0's part at the top level and the other ranks' parts under ``"other_ranks"``.
    """
    import torch.distributed as dist

    part = {key: entry[key] for key in _RANK_KEYS}
    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return {**entry, "other_ranks": []}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return {**entry, **parts[0], "other_ranks": parts[1:]}


DIGEST_KEY = "entry_sha256"
"""The key of the entry's own SHA-256 (see :func:`seal_entry`)."""


def _hash_value(h: Any, value: Any) -> None:
    """Feed an unambiguous, type-tagged encoding of ``value`` into ``h`` (dicts in sorted key order)."""
    if value is None or isinstance(value, bool):
        h.update(b"N" if value is None else (b"T" if value else b"F"))
    elif isinstance(value, int):
        raw = str(value).encode()
        h.update(b"i" + struct.pack("<Q", len(raw)) + raw)
    elif isinstance(value, float):
        h.update(b"f" + struct.pack("<d", value))
    elif isinstance(value, (str, bytes)):
        raw = value.encode() if isinstance(value, str) else value
        h.update((b"s" if isinstance(value, str) else b"y") + struct.pack("<Q", len(raw)) + raw)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        header = f"{t.dtype}{tuple(t.shape)}".encode()
        h.update(b"t" + struct.pack("<Q", len(header)) + header)
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        h.update(b"d" + struct.pack("<Q", len(items)))
        for key, item in items:
            _hash_value(h, key)
            _hash_value(h, item)
    elif isinstance(value, (list, tuple)):
        h.update((b"l" if isinstance(value, list) else b"u") + struct.pack("<Q", len(value)))
        for item in value:
            _hash_value(h, item)
    else:
        raw = f"{type(value).__qualname__}:{value!r}".encode()
        h.update(b"o" + struct.pack("<Q", len(raw)) + raw)


def entry_digest(entry: dict[str, Any]) -> str:
    """SHA-256 of a whole checkpoint entry: every key but ``entry_sha256``, every tensor's dtype, shape and bytes.

    Example:
        >>> entry = {"version": 1, "seed": 3, "metrics": {"tp": torch.tensor([2])}}
        >>> entry_digest(entry) == entry_digest({**entry, "metrics": {"tp": torch.tensor([2])}})
        True
        >>> entry_digest(entry) == entry_digest({**entry, "metrics": {"tp": torch.tensor([3])}})
        False
    """
    h = hashlib.sha256(b"lightning-repro entry v1")
    _hash_value(h, {key: value for key, value in entry.items() if key != DIGEST_KEY})
    return h.hexdigest()


def seal_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """Write the SHA-256 of the whole entry into it (``entry_sha256``) and return it; call it last."""
    entry[DIGEST_KEY] = entry_digest(entry)
    return entry


def _check_digest(entry: dict[str, Any]) -> None:
    saved = entry.get(DIGEST_KEY)
    if saved is None:
        return  # written before entries were sealed: the per-part checks still run
    if not isinstance(saved, str) or saved != entry_digest(entry):
        raise CorruptStateError(
            "the lightning-repro checkpoint entry is damaged: its content (RNG streams, data position, metric"
            " states, logged values, topology, gradients or another part) does not match its saved SHA-256"
        )


# ---------------------------------------------------------------------------------------- load
def _need(entry: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in entry:
        raise CorruptStateError(f"the lightning-repro checkpoint entry is damaged: {key!r} is missing")
    value = entry[key]
    if not isinstance(value, kind):
        raise CorruptStateError(f"the lightning-repro checkpoint entry is damaged: {key!r} is a {type(value).__name__}")
    return value


def _describe_topology(topology: dict[str, Any]) -> str:
    return f"world size {topology.get('world_size')} ({topology.get('num_nodes')} node(s))"


def parse_entry(
    entry: dict[str, Any],
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    num_nodes: int = 1,
    on_topology_change: str = "error",
) -> ReproState | None:
    """Check a loaded entry completely and return this rank's part parsed; nothing is applied yet.

    Raises:
        SeedMismatchError: the entry was written with another seed.
        CorruptStateError: a part of the entry is damaged (the message names it).
        TopologyError: the world size or node count changed and ``on_topology_change="error"``.
        ReproError: the entry's version is newer than this lightning-repro understands.
    """
    if not entry:
        return None
    version = _need(entry, "version", int)
    if version > ENTRY_VERSION:
        raise ReproError(
            f"the checkpoint's lightning-repro entry has version {version}, this lightning-repro reads up to"
            f" {ENTRY_VERSION}: upgrade lightning-repro to resume it"
        )
    _check_digest(entry)
    saved_seed = _need(entry, "seed", int)
    if saved_seed != seed:
        raise SeedMismatchError(
            f"the checkpoint was written with seed {saved_seed} but DeterminismCallback has seed {seed}:"
            f" resuming would mix two runs. Use DeterminismCallback(seed={saved_seed}) to resume it,"
            " or start a new run without `ckpt_path`."
        )
    topology = _need(entry, "topology", dict)
    others = entry.get("other_ranks") or []
    if not isinstance(others, list):
        raise CorruptStateError("the lightning-repro checkpoint entry is damaged: 'other_ranks' is not a list")
    parts = [entry, *others]
    saved_world = int(topology.get("world_size", 1))
    if len(parts) != saved_world:
        raise CorruptStateError(
            f"the lightning-repro checkpoint entry is damaged: it holds {len(parts)} rank(s) of a world size of"
            f" {saved_world}"
        )
    parsed = [_parse_part(part, saved_seed, topology, index) for index, part in enumerate(parts)]
    current = {"world_size": world_size, "num_nodes": num_nodes}
    if saved_world == world_size and int(topology.get("num_nodes", 1)) == num_nodes:
        return parsed[rank]
    if on_topology_change == "error":
        raise TopologyError(
            f"the checkpoint was written with {_describe_topology(topology)} but this run has"
            f" {_describe_topology(current)}: the per-rank RNG streams cannot continue exactly. Resume with the same"
            " topology, or pass `on_topology_change='reseed'` to DeterminismCallback to continue with a deterministic"
            " re-seed (the data position is kept: no sample of the epoch is repeated or missed)."
        )
    if saved_world == world_size:  # same ranks spread over other nodes: nothing to re-deal
        return parsed[rank]
    rank_zero_warn(
        f"Resuming a checkpoint of {_describe_topology(topology)} with {_describe_topology(current)}"
        " (on_topology_change='reseed'): the rest of the epoch is dealt out to the current ranks and every"
        " rank's streams are re-seeded from (seed, world size, rank, position). The run is deterministic but"
        " differs from an uninterrupted run on the old topology.",
        category=NotExactWarning,
    )
    state = parsed[min(rank, saved_world - 1)]
    state.remap = True
    position = state.data[0] if state.data else {"epoch": 0, "offset": 0}
    reseed = reseed_after_topology_change(seed, saved_world, world_size, rank, position["epoch"], state.batches)
    with fork_process_streams(reseed):  # derive the re-seeded state without touching the live streams
        state.streams = capture_process_streams()
    return state


def _parse_part(entry: dict[str, Any], saved_seed: int, topology: dict[str, Any], rank: int) -> ReproState:
    streams = _need(entry, "streams", dict)
    validate_process_streams(streams)
    if digest_process_streams(streams) != _need(entry, "streams_sha256", str):
        raise CorruptStateError(
            "the lightning-repro checkpoint entry is damaged: the RNG streams do not match their saved SHA-256"
        )
    data = _need(entry, "data", list)
    for position in data:
        if not isinstance(position, dict) or not all(
            isinstance(position.get(k), int) and position[k] >= 0
            for k in ("index", "epoch", "pass", "offset", "length")
        ):
            raise CorruptStateError(f"the lightning-repro checkpoint entry is damaged: bad data position {position!r}")
    metrics = entry.get("metrics") or {}
    logged = entry.get("logged") or {}
    iterables = entry.get("iterables") or {}
    if not isinstance(iterables, dict):
        raise CorruptStateError("the lightning-repro checkpoint entry is damaged: 'iterables' is not a dict")
    grads = entry.get("grads")
    if not isinstance(metrics, dict) or not isinstance(logged, dict) or not (grads is None or isinstance(grads, dict)):
        raise CorruptStateError("the lightning-repro checkpoint entry is damaged: 'metrics', 'logged' or 'grads'")
    for key, item in logged.items():
        tensor = item.get("is_tensor", True) if isinstance(item, dict) else True
        if (
            not isinstance(item, dict)
            or item.get("reduce") not in _REDUCTIONS
            or (tensor and not isinstance(item.get("value"), torch.Tensor))
            or (not tensor and not isinstance(item.get("metric_attribute"), str))
        ):
            raise CorruptStateError(f"the lightning-repro checkpoint entry is damaged: logged value {key!r}")
    return ReproState(
        seed=saved_seed,
        streams=streams,
        data=data,
        batches=_need(entry, "batches", int),
        topology=topology,
        metrics=metrics,
        logged=logged,
        grads=grads,
        environment=entry.get("environment") or {},
        iterables=iterables,
        pending=_parse_pending(entry.get("pending")),
        trainer_metrics=_parse_trainer_metrics(entry.get("callback_metrics")),
        remainder=_parse_remainder(entry.get("remainder")),
    )


def _parse_remainder(value: Any) -> dict[str, Any] | None:
    from lightning_repro._lightning import REPLAYED_HOOKS

    if value is None:
        return None
    entries = value.get("callbacks") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("hook") not in REPLAYED_HOOKS
        or not isinstance(entries, list)
        or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and isinstance(e[1], int) for e in entries
        )
    ):
        raise CorruptStateError("the lightning-repro checkpoint entry is damaged: 'remainder' is malformed")
    return value


def _parse_trainer_metrics(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(d, dict) and all(isinstance(t, torch.Tensor) for t in d.values()) for d in value.values()
    ):
        raise CorruptStateError("the lightning-repro checkpoint entry is damaged: 'callback_metrics' is malformed")
    return value


def _parse_pending(pending: Any) -> dict[str, Any] | None:
    if pending is None:
        return None
    log = pending.get("log") if isinstance(pending, dict) else None
    if (
        not isinstance(pending, dict)
        or not isinstance(pending.get("validate"), bool)
        or not (log is None or (isinstance(log, dict) and all(isinstance(v, torch.Tensor) for v in log.values())))
    ):
        raise CorruptStateError("the lightning-repro checkpoint entry is damaged: 'pending' is malformed")
    return pending


def environment_changes(saved: dict[str, str]) -> list[str]:
    """What differs between the environment a checkpoint was written in and this one, as readable lines."""
    current = environment_fingerprint()
    return [
        f"{key}: {saved.get(key, '(absent)')!r} -> {current.get(key, '(absent)')!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]


def epoch_cut_short(trainer: pl.Trainer) -> bool:
    """In ``on_train_epoch_end``: the epoch ended before its data did (``max_steps``, a stop request).

    A loader of unknown length (an ``IterableDataset`` without ``__len__``) has ``num_training_batches == inf``: its
    epoch ended normally when the fetcher found the data exhausted (``is_last_batch``), not when a count was reached.
    """
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.current.ready < trainer.num_training_batches and not progress.is_last_batch)


def step_plateau_schedulers_at_epoch_end(trainer: pl.Trainer) -> None:
    """Let Lightning step ``ReduceLROnPlateau`` (epoch interval) at the end of the epoch a run resumed in.

    ``FitLoop.on_advance_end`` skips them while the loop is "restarting", which it is until the end of the first
    epoch after a resume: the uninterrupted run stepped them there. Called from ``on_train_epoch_end`` (callbacks run
    before that check); the epoch's restart handling is long over by then.
    """
    trainer.fit_loop._restarting = False


_LIGHTNING_RESUME_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


def train_data_resumes_exactly(trainer: pl.Trainer) -> bool:
    """Every train loader is taken over (a ``ReproBatchSampler``) or an ``IterableDataset`` with ``state_dict()``."""
    from lightning_repro.dataloaders import ReproBatchSampler

    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return False
    for loader in combined.flattened:
        samplers = (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None))
        if not any(isinstance(s, ReproBatchSampler) for s in samplers) and not is_stateful_iterable(loader):
            return False
    return True


def silence_not_resumable_warning() -> Callable[[], None]:
    """Hide Lightning's "dataloader is not resumable" warning around a resumed epoch whose data position we restore.

    ``_TrainingEpochLoop.reset`` warns on every mid-epoch resume of a loader without ``state_dict()``; ours skips
    the consumed batches exactly, so the warning would not be true. Returns the function that removes the filter.
    """
    import warnings

    warnings.filterwarnings("ignore", message=_LIGHTNING_RESUME_WARNING)
    added = warnings.filters[0]

    def undo() -> None:
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
        if added in filters:
            filters.remove(added)
            mutated = getattr(warnings, "_filters_mutated", None)
            if callable(mutated):
                mutated()

    return undo


def loops_restored(trainer: pl.Trainer) -> bool:
    """Whether Lightning has put the loops' counters back from the checkpoint (``restore_training_state``)."""
    return bool(trainer.fit_loop.restarting)


def restart_train_iterator(trainer: pl.Trainer) -> None:
    """Re-create the train iterator (and its workers' prefetch) from the samplers' current positions.

    ``FitLoop.setup_data`` creates the iterator when it builds the loader; a loader built before the loops' state
    was restored has an iterator for a fresh run's first epoch. Lightning does not re-create it on resume.
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is not None:
        iter(fetcher)


def apply_data_position(state: ReproState, index: int, sampler: ReproBatchSampler, *, warn: bool = True) -> None:
    """Tell a train sampler where its data stood when the checkpoint was written."""
    for position in state.data:
        if position["index"] == index:
            if warn and position["length"] != len(sampler):
                rank_zero_warn(
                    f"Train dataloader {index} has {len(sampler)} batches per epoch now but had {position['length']}"
                    " when the checkpoint was written: the data position cannot be restored exactly.",
                    category=NotExactWarning,
                )
            if state.remap:
                order = position.get("order") or {}
                if order.get("kind", "other") == "other":
                    if not warn:
                        return
                    rank_zero_warn(
                        f"Train dataloader {index}'s sampler cannot be re-dealt to another world size: its epoch"
                        " restarts from the beginning on every rank.",
                        category=NotExactWarning,
                    )
                    return
                sampler.resume_remapped(position["epoch"], position["pass"], position["offset"], order)
                return
            sampler.resume_at(position["epoch"], position["pass"], position["offset"])
            return


def _apply_metrics(state: ReproState, pl_module: pl.LightningModule) -> None:
    from torchmetrics import Metric

    modules = dict(pl_module.named_modules())
    for name, saved in state.metrics.items():
        module = modules.get(name)
        if not isinstance(module, Metric):
            rank_zero_warn(
                f"The checkpoint holds the state of metric {name!r}, which the model no longer has:"
                " it is not restored.",
                category=NotExactWarning,
            )
            continue
        for key, value in saved["states"].items():
            current = getattr(module, key)
            device = current.device if isinstance(current, torch.Tensor) else module.device
            if isinstance(value, torch.Tensor):
                setattr(module, key, value.to(device))
            else:
                setattr(module, key, [t.to(device) for t in value])
        module._update_count = int(saved["update_count"])
        module._computed = None


def _apply_logged(state: ReproState, trainer: pl.Trainer) -> None:
    """Put back the epoch aggregates of ``self.log``, so the epoch's values equal the uninterrupted run's."""
    if not state.logged:
        return
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    results = trainer.fit_loop.epoch_loop._results
    saved_values: dict[str, dict[str, Any]] = {}
    for key, item in state.logged.items():
        meta = _Metadata(
            fx=item["fx"],
            name=item["name"],
            prog_bar=item["prog_bar"],
            logger=item["logger"],
            on_step=item["on_step"],
            on_epoch=True,
            reduce_fx=item["reduce"],
            enable_graph=item["enable_graph"],
            add_dataloader_idx=item["add_dataloader_idx"],
            dataloader_idx=item["dataloader_idx"],
            metric_attribute=item["metric_attribute"],
        )
        meta.sync = _Sync(_should=item["sync"], fn=trainer.strategy.reduce, rank_zero_only=item["rank_zero_only"])
        is_tensor = bool(item.get("is_tensor", True))
        metric = _ResultMetric(meta, is_tensor)
        if is_tensor:
            _set_logged(metric, item)
            saved_values[key] = item
        else:
            metric.value = _module_attribute(trainer.lightning_module, item["metric_attribute"])
            metric._repro_seeded = True
        metric._update_count = 1  # it holds updates: computing it must not warn that it has none
        results[key] = metric
    # When the run logs a key again, Lightning compares its metadata with the stored one: let the
    # first log after the resume create the entry itself, starting from the saved aggregate.
    original_log = results.log
    original_update = results.update_metrics

    def log(fx: str, name: str, *args: Any, **kwargs: Any) -> None:
        key = f"{fx}.{name}"
        if results.dataloader_idx is not None and kwargs.get("add_dataloader_idx", True):
            key += f".{results.dataloader_idx}"
        if key in saved_values and key in results and getattr(results[key], "_repro_seeded", False):
            del results[key]
        original_log(fx, name, *args, **kwargs)

    def update_metrics(key: str, value: Any, batch_size: int) -> None:
        item = saved_values.pop(key, None)
        if item is not None and not getattr(results[key], "_repro_seeded", False):
            _set_logged(results[key], item)
        original_update(key, value, batch_size)
        if not saved_values:
            vars(results).pop("log", None)
            vars(results).pop("update_metrics", None)

    results.log = log  # type: ignore[method-assign]
    results.update_metrics = update_metrics  # type: ignore[method-assign]


def _module_attribute(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _set_logged(metric: Any, item: dict[str, Any]) -> None:
    device = metric.value.device
    metric.value = item["value"].to(device)
    if item["cumulated_batch_size"] is not None:
        metric.cumulated_batch_size = item["cumulated_batch_size"].to(device)
    metric._repro_seeded = True


def end_remapped_epoch(samplers: Iterable[ReproBatchSampler], trainer: pl.Trainer) -> None:
    """After the epoch re-dealt to a new world size, count batches per epoch as the loaders say again."""
    from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
    from lightning.pytorch.trainer.states import RunningStage

    for sampler in samplers:
        sampler.end_remap()
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        return
    limits = [
        _parse_num_batches(RunningStage.TRAINING, len(loader), trainer.limit_train_batches)
        for loader in combined.flattened
    ]
    combined.limits = limits
    per_loader = [min(len(loader), limit) for loader, limit in zip(combined.flattened, limits, strict=True)]
    # the next epoch's iterator takes the new limits; the loop's own count must agree with it
    trainer.fit_loop.max_batches = min(per_loader) if combined._mode == "min_size" else max(per_loader)


def finish_logged_values(trainer: pl.Trainer) -> None:
    """Remove the temporary wrappers of :func:`_apply_logged` at the end of the resumed epoch."""
    results = trainer.fit_loop.epoch_loop._results
    vars(results).pop("log", None)
    vars(results).pop("update_metrics", None)


def apply_process_state(state: ReproState, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Restore the process streams, metric states, logged aggregates and accumulated gradients."""
    _apply_metrics(state, pl_module)
    _apply_logged(state, trainer)
    _apply_trainer_metrics(state, trainer)
    if state.grads:
        params = dict(pl_module.named_parameters())
        for name, grad in state.grads.items():
            if name in params:
                params[name].grad = grad.to(params[name].device)
    restore_process_streams(state.streams)
    check_restored(state.streams)


def check_restored(saved: dict[str, Any]) -> None:
    """Recompute the fingerprint of the live streams after a restore and compare it with the saved one.

    Raises:
        CorruptStateError: a stream did not come back as saved.
    """
    live = capture_process_streams()
    if not live["cuda"]:
        live["cuda"] = saved["cuda"]  # CUDA not started here: its saved states wait in torch's lazy queue
    if digest_process_streams(live) != digest_process_streams(saved):
        raise CorruptStateError("the RNG streams restored from the checkpoint differ from the saved ones")


def loop_facts(trainer: pl.Trainer) -> dict[str, int]:
    """What :func:`fix_loop_progress` needs to know about the run that writes a checkpoint (kept in our entry)."""
    total = trainer.num_training_batches
    return {
        "num_training_batches": -1 if total == float("inf") else int(total),
        "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
    }


def fix_loop_progress(checkpoint: dict[str, Any], entry: dict[str, Any] | None) -> None:
    """Correct Lightning's loop progress in a checkpoint being *loaded*, in memory, before Lightning restores it.

    The file keeps the counters as Lightning wrote them (a plain Lightning script resumes it as Lightning would);
    what we change, only when our entry is there to say so:

    * an epoch cut short (``max_steps``, a stop request) is marked finished by Lightning, and a resume would start
      the next epoch, silently dropping the rest of this one: we make it resume as if saved at the end of the last
      batch, in the middle of the epoch, and our entry skips the consumed batches;
    * a checkpoint written at the end of an epoch's last batch would close the epoch on resume without running its
      epoch-end hooks (metric resets, ``on_train_epoch_end``): we make it resume "on the last batch", which runs them.
    """
    fit = checkpoint.get("loops", {}).get("fit_loop")
    facts = entry.get("loops") if entry else None
    if not fit or not isinstance(facts, dict):
        return  # no entry, or one from a version that corrected the file itself
    total = facts.get("num_training_batches", -1)
    accumulate = max(1, int(facts.get("accumulate_grad_batches", 1)))
    batch_progress = fit["epoch_loop.batch_progress"]
    current = batch_progress["current"]
    if (
        not entry.get("truncated")  # type: ignore[union-attr]
        and current["ready"] == total
        and current["completed"] == current["ready"] - 1
        and fit["epoch_progress"]["current"]["processed"] == fit["epoch_progress"]["current"]["started"] - 1
    ):
        for part in ("total", "current"):
            batch_progress[part]["completed"] = batch_progress[part]["processed"]
        return
    if not entry.get("truncated"):  # type: ignore[union-attr]
        return
    for part in ("total", "current"):
        epoch = fit["epoch_progress"][part]
        if epoch["processed"] == epoch["started"]:
            epoch["processed"] = epoch["started"] - 1
            epoch["completed"] = epoch["processed"]
        batch = fit["epoch_loop.batch_progress"][part]
        if batch["completed"] == batch["processed"]:
            batch["completed"] = batch["processed"] - 1
    checkpoint["epoch"] = fit["epoch_progress"]["current"]["completed"]  # the epoch the run is in
    fit["epoch_loop.batch_progress"]["is_last_batch"] = False
    ready = fit["epoch_loop.batch_progress"]["current"]["ready"]
    if ready % accumulate == 0:
        # Lightning counts the last batch's step again when it resumes after a batch
        fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
