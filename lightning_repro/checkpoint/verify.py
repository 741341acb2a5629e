"""The restore check: digests of what a checkpoint saves, recomputed once a resume has restored everything.

At save, :func:`add_restore_digests` puts a SHA-256 of each saved component into this rank's part of the entry
(``restore_sha256``): the module's ``state_dict()`` (parameters and buffers), every optimizer's and LR scheduler's
``state_dict()``, the data position (where each train sampler's pass resumes) and the torchmetrics states. The
process streams already have theirs (``streams_sha256``). On resume, :func:`check_restore` recomputes them from the
live objects after Lightning and lightning-repro have restored everything, just before the first resumed batch, and
names the components that differ.

Values are digested exactly: tensors by dtype, shape and raw bytes (copied to the CPU), plain values by a
type-tagged encoding (floats by their IEEE bits), dicts in sorted key order. Objects of other types contribute their
type's name and their attributes, never a ``repr`` (which may hold a memory address). The parameters, optimizer and
scheduler states are digested with their tensors of 64 KiB or more reduced to row checksums on their device
(:func:`~lightning_repro.checkpoint.hashing.row_checksums`: every bit counts, a few times cheaper than SHA-256 over
the bytes, which on a large model would cost a good part of the save); such a digest is written ``"c:<hex>"``, and a
component digested without any such tensor is the plain SHA-256 of the encoding, as in checkpoints written before,
whose digests are recomputed as they were written.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_utilities.core.rank_zero import rank_prefixed_message

from lightning_repro.checkpoint.hashing import feed
from lightning_repro.checkpoint.replica import ddp_module, restored_own_buffers
from lightning_repro.exceptions import NotExactWarning, RestoreError
from lightning_repro.rng import capture_process_streams, digest_process_streams
from lightning_repro.shards import is_sharded, prime_optimizer_states

if TYPE_CHECKING:
    from lightning_repro._warn import WarningCache
    from lightning_repro.checkpoint.entry import Entry
    from lightning_repro.checkpoint.state import ReproState
    from lightning_repro.data.samplers import ReproBatchSampler

__all__ = [
    "CHECKSUMMED",
    "COMPONENTS",
    "RESTORE_FAILED",
    "add_restore_digests",
    "check_restore",
    "checked_components",
    "digest_value",
    "live_digests",
    "restore_summary",
]

log = logging.getLogger(__name__)

COMPONENTS = ("parameters", "optimizer", "lr_schedulers", "process streams", "data position", "metric states")
"""The components the restore check compares, in the order its messages name them."""

CHECKSUMMED = "c:"
"""The prefix of a digest in which tensors of 64 KiB or more contributed their row checksums (see the module)."""
RESTORE_FAILED = "restore check failed"
"""How :func:`restore_summary` begins when the restore check found a difference (the resume is then not exact)."""

_SUMMED = ("parameters", "optimizer", "lr_schedulers")  # the components digested with checksums at save
_SKIP_ON_REMAP = ("process streams", "data position", "metric states")  # re-dealt on purpose under another topology


# ---------------------------------------------------------------------------------------- exact digests
def digest_value(value: Any, *, checksums: bool = False) -> str:
    """SHA-256 of a nest of dicts, lists, tuples, tensors and plain values, exact and the same in every process.

    ``checksums=True``: tensors of 64 KiB or more enter through their row checksums, and the digest, if any did, is
    prefixed with :data:`CHECKSUMMED`.

    Examples:
        >>> import torch
        >>> a = digest_value({"lr": 0.1, "state": {0: torch.ones(2)}})
        >>> a == digest_value({"state": {0: torch.ones(2)}, "lr": 0.1})
        True
        >>> a == digest_value({"lr": 0.1, "state": {0: torch.tensor([1.0, 1.0 + 2**-23])}})
        False
    """
    h = hashlib.sha256(b"lightning-repro restore v1")
    summed = feed(h, value, objects="attributes", checksums=checksums)
    return f"{CHECKSUMMED if summed else ''}{h.hexdigest()}"


# ---------------------------------------------------------------------------------------- the components
def _effective_position(index: int, counter: int, pass_: int, offset: int, length: int) -> list[int]:
    """A position at the end of a pass is the start of the next epoch's first pass (that is where a resume goes)."""
    if length > 0 and offset >= length:
        return [index, counter + 1, 0, 0]
    return [index, counter, pass_, offset]


def _saved_position(data: list[dict[str, Any]]) -> list[list[int]]:
    return [_effective_position(p["index"], p["epoch"], p["pass"], p["offset"], p["length"]) for p in data]


def _live_position(samplers: Mapping[int, ReproBatchSampler]) -> list[list[int]]:
    return [
        _effective_position(index, *sampler.pass_start(), len(sampler)) for index, sampler in sorted(samplers.items())
    ]


def _metric_values(pl_module: pl.LightningModule, names: Any) -> dict[str, Any]:
    """The states of the named torchmetrics modules, in the layout the entry saves them (``state._metric_states``)."""
    modules = dict(pl_module.named_modules())
    out: dict[str, Any] = {}
    for name in names:
        module = modules.get(name)
        metric_state = getattr(module, "metric_state", None)
        if module is None or not isinstance(metric_state, dict):
            out[name] = None
            continue
        out[name] = {"states": metric_state, "update_count": int(getattr(module, "update_count", 0))}
    return out


def _optimizer_state(optimizer: Any) -> dict[str, Any]:
    """``optimizer.state_dict()``; over sharded parameters with the param groups' tuples as lists.

    ``torch.distributed.checkpoint`` (``set_optimizer_state_dict``, how Lightning loads a sharded run's optimizer)
    gives a param group's tuples back as lists (AdamW's ``betas``): the same values, which must digest alike. Only
    for sharded parameters, so the digests of other runs (and of their older checkpoints) do not change.
    """
    state: dict[str, Any] = optimizer.state_dict()
    if not any(is_sharded(p) for group in optimizer.param_groups for p in group["params"]):
        return state
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in state["param_groups"]]
    return {**state, "param_groups": groups}


def _training_digests(trainer: pl.Trainer, saved: Mapping[str, str] | None = None) -> dict[str, str]:
    """Parameters (and buffers), optimizer states and LR scheduler states, as Lightning saves them.

    With row checksums (at save), or as each of the ``saved`` digests was taken (on resume).
    """
    summed = {name: saved is None or saved.get(name, "").startswith(CHECKSUMMED) for name in _SUMMED}
    if saved is None and isinstance(trainer.strategy, ModelParallelStrategy) and trainer.strategy.model is not None:
        prime_optimizer_states(trainer.strategy.model, trainer.optimizers)  # what its optimizer_state() will save
    return {
        "parameters": digest_value(trainer.lightning_module.state_dict(), checksums=summed["parameters"]),
        "optimizer": digest_value(
            [_optimizer_state(optimizer) for optimizer in trainer.optimizers], checksums=summed["optimizer"]
        ),
        "lr_schedulers": digest_value(
            [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            checksums=summed["lr_schedulers"],
        ),
    }


def add_restore_digests(entry: Entry, trainer: pl.Trainer) -> Entry:
    """Return ``entry`` with the restore check's digests in this rank's part (``entry`` itself is not changed).

    Call it when the checkpoint is written (the callback's ``state_dict``): parameters, optimizer and scheduler
    states are digested as they are now, the data position and metric states as the entry holds them.
    """
    part = entry.ranks[0]
    digests = _training_digests(trainer)
    digests["data position"] = digest_value(_saved_position(part.data))
    digests["metric states"] = digest_value(part.metrics)
    return replace(entry, ranks=[replace(part, restore_sha256=digests), *entry.ranks[1:]])


def live_digests(trainer: pl.Trainer, state: ReproState, samplers: Mapping[int, ReproBatchSampler]) -> dict[str, str]:
    """The restore check's digests recomputed from the live objects after a resume (``state``: the parsed entry)."""
    digests = _training_digests(trainer, state.restore_sha256)
    live = capture_process_streams()
    if not live["cuda"]:
        live["cuda"] = state.streams["cuda"]  # CUDA not started here: its saved states wait in torch's lazy queue
    digests["process streams"] = digest_process_streams(live)
    digests["data position"] = digest_value(_live_position(samplers))
    digests["metric states"] = digest_value(_metric_values(trainer.lightning_module, state.metrics))
    return digests


# ---------------------------------------------------------------------------------------- the check
def check_restore(
    state: ReproState,
    trainer: pl.Trainer,
    samplers: Mapping[int, ReproBatchSampler],
    *,
    on_divergence: Literal["warn", "error"] = "warn",
    cache: WarningCache | None = None,
) -> list[str]:
    """Compare what a resume restored with what the checkpoint saved; return the components that differ.

    Call it once everything is restored and nothing has moved yet (before the first resumed batch). A checkpoint
    written without the digests (by an older lightning-repro) is not checked. Under a topology change
    (``on_topology_change="reseed"``) the streams, data position and metric states are re-dealt on purpose and only
    the parameters, optimizer and schedulers are compared.

    Raises:
        RestoreError: a component differs and ``on_divergence="error"``.
    """
    saved = dict(state.restore_sha256)
    rank = trainer.global_rank
    if not saved:
        log.debug(rank_prefixed_message("restore not verified: the checkpoint holds no restore digests", rank))
        return []
    # re-dealt to another topology, a sharded model's parameters and optimizer states are other shards, in another
    # layout: the digests of the saved ones cannot be compared (what each rank holds after the load is the file's)
    state.resharded = state.remap and any(is_sharded(p) for p in trainer.lightning_module.parameters())
    own, held = dict(saved), _held_by_the_file(state, trainer)
    saved.update(held)
    saved["process streams"] = digest_process_streams(state.streams)
    live = live_digests(trainer, state, samplers)
    checked = checked_components(state)
    differing = [name for name in checked if live[name] != saved[name]]
    if not differing:
        log.info(rank_prefixed_message(f"restore verified: {', '.join(checked)}", rank))
        _rank_unlike_rank0(own, held, trainer, cache)
        return []
    message = (
        f"[rank {rank}] the state restored from the checkpoint differs from the state it saved in:"
        f" {', '.join(differing)} (SHA-256 mismatch): the resumed run will not continue like the interrupted one."
        f" {_likely_cause(trainer, differing)}"
    )
    if on_divergence == "error":
        raise RestoreError(message)
    log.warning(message)  # every rank's (the warning below is rank 0's)
    other = trainer.global_rank > 0  # rank 0's line says its own through restore_summary(), another rank's as a note
    if cache is not None:
        cache.warn(message, category=NotExactWarning, note=other)
    else:
        from lightning_repro._warn import warn

        warn(message, NotExactWarning, note=other)
    return differing


def _likely_cause(trainer: pl.Trainer, differing: list[str]) -> str:
    """Why the restored state may differ from the saved one: what the run shows, else the usual suspects.

    The digests are of the state as it was when the checkpoint was written; an ``on_save_checkpoint`` that
    rewrites ``checkpoint["state_dict"]`` (``ModelPruning`` with ``make_pruning_permanent=True``, its default:
    the pruned weights without their masks) makes the file hold something else.
    """
    from lightning.pytorch.callbacks import Callback

    from lightning_repro._lightning.pruning import prunes_saved_checkpoints

    if "parameters" in differing:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if prunes_saved_checkpoints(callback):
                return (
                    "ModelPruning (make_pruning_permanent=True) writes the pruned weights into each checkpoint"
                    " without their masks, and this checkpoint's entry holds no record of them to prune the resumed"
                    " module again (written by an earlier lightning-repro, or the pruned tensors are sharded):"
                    " the weights it had masked train again (plain Lightning resumes it the same way); a checkpoint"
                    " written before the first pruning resumes exactly."
                )
    rewriting = [
        type(cb).__name__
        for cb in trainer.callbacks  # type: ignore[attr-defined]
        if not type(cb).__module__.startswith(("lightning.", "lightning_repro."))
        and type(cb).on_save_checkpoint is not Callback.on_save_checkpoint
    ]
    if type(trainer.lightning_module).on_save_checkpoint is not pl.LightningModule.on_save_checkpoint:
        rewriting.append(type(trainer.lightning_module).__name__)
    hooks = f" (here: `on_save_checkpoint` of {', '.join(rewriting)}, if it changes the checkpoint's state)"
    return (
        "The checkpoint was changed after it was written (a hook that rewrites what the file holds"
        f"{hooks if rewriting else ''}), or something (a hook, `configure_optimizers`, a `strict=False` load)"
        " changed the restored state before training resumed."
    )


def _held_by_the_file(state: ReproState, trainer: pl.Trainer) -> dict[str, str]:
    """The digests of what this rank loaded, where that is not its own saved state: under DDP the file holds rank 0's.

    Lightning's DDP checkpoint is rank 0's ``state_dict()``s (module, optimizers, schedulers), and every rank loads
    them; a rank's own state could differ at the save (BatchNorm's running statistics: each rank updates its own in
    its forward). Not under a sharded strategy (each rank loads its own shards) or a topology change.
    """
    if trainer.global_rank == 0 or state.remap or ddp_module(trainer) is None or not state.rank0_restore_sha256:
        return {}
    # its own buffers put back (checkpoint/replica.py): its module is its own at the save again
    own_module = restored_own_buffers(state.replica, state.remap)
    return {
        name: state.rank0_restore_sha256[name]
        for name in _SUMMED
        if name in state.rank0_restore_sha256 and not (own_module and name == "parameters")
    }


def _rank_unlike_rank0(
    own: Mapping[str, str], held: Mapping[str, str], trainer: pl.Trainer, cache: WarningCache | None
) -> None:
    """Say where this rank's state at the save was not rank 0's, which the file holds and this rank now has.

    DDP makes the parameters, gradients and so the optimizer states equal on every rank; the buffers differ after
    each forward, and with ``broadcast_buffers=True`` (DDP's default) rank 0's overwrite them at the next forward:
    a rank whose module's digest differs then continues as it would have. Anything else is a real difference.
    """
    ddp = ddp_module(trainer)
    unlike = [name for name in held if own.get(name) != held[name]]
    if "parameters" in unlike and ddp is not None and ddp.broadcast_buffers:
        unlike.remove("parameters")
        note = "buffers unlike rank 0's at the save: DDP broadcasts rank 0's at the next forward"
        log.debug(rank_prefixed_message(note, trainer.global_rank))
    if not unlike:
        return
    message = (
        f"[rank {trainer.global_rank}] this rank's {', '.join(unlike)} at the save differed from rank 0's, which the"
        " checkpoint holds (Lightning saves rank 0's state) and this rank resumed from: this rank does not continue"
        " like the interrupted run"
        + (
            " (with `broadcast_buffers=False` a rank's own buffers, BatchNorm's statistics, are in no checkpoint)"
            if unlike == ["parameters"]
            else ""
        )
    )
    log.warning(message)
    if cache is not None:  # a reason for rank 0's resume line (gathered there: data/resumeline.every_rank_notes)
        cache.warn(message, category=NotExactWarning)


def checked_components(state: ReproState) -> list[str]:
    """The components the restore check compares for ``state`` (none for a checkpoint without the digests)."""
    if not state.restore_sha256:
        return []
    saved = {*state.restore_sha256, "process streams"}
    skipped = (*_SKIP_ON_REMAP, *(("parameters", "optimizer") if state.resharded else ())) if state.remap else ()
    return [name for name in COMPONENTS if name in saved and name not in skipped]


def restore_summary(state: ReproState, differing: list[str]) -> str:
    """What the restore check found, for the resume line: ``"restore verified: ..."`` or what differs."""
    if differing:
        verb = "differs" if len(differing) == 1 else "differ"
        return f"{RESTORE_FAILED}: {', '.join(differing)} {verb} from what the checkpoint saved"
    checked = checked_components(state)
    if not checked:
        return "restore not verified: the checkpoint holds no restore digests (the RNG streams are checked)"
    return f"restore verified: {', '.join(checked)}"
