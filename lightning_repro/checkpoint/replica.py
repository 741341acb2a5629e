"""A DDP rank's own module state that Lightning's checkpoint does not hold: its buffers, where unlike rank 0's.

Lightning's DDP checkpoint is rank 0's ``state_dict()``, which every rank loads. The parameters are equal on every
rank; the buffers need not be: each rank's forward updates its own (BatchNorm's running statistics), a module's hooks
move them with the rank's batch (an EMA teacher), and DDP overwrites them with rank 0's only at a forward that follows
a synchronized one (``broadcast_buffers=True``, its default; not after a forward under ``no_sync``, which is every
batch of a gradient accumulation window but its last, nor after an evaluation forward) or never
(``broadcast_buffers=False``). A rank resumed with rank 0's buffers then validates, logs and trains on values the
interrupted run's rank did not have, and DDP's first forward of a new process broadcasts where the interrupted run's
next forward may not. The same holds for the modules a callback keeps (``EMAWeightAveraging``'s averaged copy of each
rank's module, whose buffers are that rank's), which Lightning saves from rank 0 too.

At a save each rank records, in its part of the entry (``replica``), the digest of its persistent buffers and whether
DDP's next forward broadcasts rank 0's (``forward_sync``). The parts travel in the entry's gather, after which every
rank knows whose buffers differ from rank 0's; those ranks send them in a second round of the gather (none when all
are equal: a model without buffers, or at a forward that just broadcast them), and the file keeps them in their parts.
On resume each rank puts its own buffers back and DDP's flag as it was (:func:`give_back`: after the sanity check,
whose forward broadcasts, and before the restore check, which then compares the rank's module with its own digest).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from lightning_repro._warn import warn
from lightning_repro.checkpoint.encoding import encode
from lightning_repro.checkpoint.gather import all_gather_bytes, pack_part, unpack_part
from lightning_repro.checkpoint.hashing import feed
from lightning_repro.checkpoint.owned import user_callbacks
from lightning_repro.exceptions import NotExactWarning
from lightning_repro.shards import shard_layout

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_repro._warn import WarningCache

__all__ = [
    "check_replica",
    "ddp_module",
    "exchange_buffers",
    "give_back",
    "replica_record",
    "restored_own_buffers",
    "sealed_part",
]

log = logging.getLogger(__name__)


def ddp_module(trainer: pl.Trainer) -> torch.nn.parallel.DistributedDataParallel | None:
    """The trainer's ``DistributedDataParallel`` wrapper, or None (another strategy, or not set up yet)."""
    model = getattr(trainer.strategy, "model", None)
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None


def _persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's plain-tensor buffers its ``state_dict()`` holds (what Lightning saves and loads), by name.

    Not a ``DTensor`` buffer: a distributed checkpoint holds each rank's shard of it.
    """
    names = {name for name, _ in module.named_buffers()}
    state = module.state_dict(keep_vars=True)
    return {k: v for k, v in state.items() if k in names and isinstance(v, torch.Tensor) and shard_layout(v) is None}


def _rank_buffers(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The module's persistent buffers, and those of the modules the callbacks hold, by path.

    A callback's module: ``EMAWeightAveraging``'s averaged model, a copy of each rank's module whose BatchNorm
    statistics are the rank's own.

    A callback's module is found among its direct attributes, at ``callback[<state_key>].<attribute>.<buffer>``; not
    the LightningModule or one of its submodules (a callback that keeps a reference to them).
    """
    module = trainer.lightning_module
    buffers = _persistent_buffers(module)
    own = {id(m) for m in module.modules()}
    for callback in user_callbacks(trainer):
        key = getattr(callback, "state_key", type(callback).__qualname__)
        held = getattr(callback, "__dict__", {})
        for name in sorted(held):
            value = held[name]
            if isinstance(value, torch.nn.Module) and id(value) not in own:
                buffers.update({f"callback[{key}].{name}.{k}": v for k, v in _persistent_buffers(value).items()})
    return buffers


def _digest(buffers: Any) -> str:
    h = hashlib.sha256(b"lightning-repro buffers v1")
    feed(h, buffers, objects="attributes", checksums=True)
    return h.hexdigest()


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is made of what a checkpoint loads with ``weights_only=True`` and hashes alike everywhere."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, torch.Tensor):
        return shard_layout(value) is None
    if depth > 8:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, (str, int)) and _plain(v, depth + 1) for k, v in value.items())
    return isinstance(value, (list, tuple)) and all(_plain(v, depth + 1) for v in value)


def _callback_states(trainer: pl.Trainer) -> dict[str, Any]:
    """Each user callback's ``state_dict()`` by its ``state_key`` (what Lightning saves from rank 0), where not empty.

    A rank's callback state may be its own: ``EarlyStopping``'s best score and patience count of a metric logged
    without ``sync_dist`` (the ranks stop together when one of them would), ``ModelCheckpoint``'s scores likewise.
    Only states of plain values (numbers, strings, tensors, in dicts, lists and tuples) are kept. Lightning calls
    every callback's ``state_dict()`` once per save; this calls it again only where it is Lightning's own (pure), so
    a ``state_dict`` the user wrote runs once per save as without us (Lightning's own tests count the calls): its
    state is rank 0's, as in plain Lightning.
    """
    states = {}
    for callback in user_callbacks(trainer):
        if not getattr(type(callback).state_dict, "__module__", "").startswith("lightning."):
            continue
        state = callback.state_dict()
        if state and _plain(state):
            states[str(callback.state_key)] = state
    return states


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def replica_record(trainer: pl.Trainer) -> dict[str, Any] | None:
    """This rank's ``replica`` record with several ranks (else None): its buffers' digest, and DDP's flag under DDP."""
    if trainer.world_size <= 1:
        return None
    buffers = _rank_buffers(trainer)
    record: dict[str, Any] = {"buffers_sha256": _digest(buffers) if buffers else ""}
    states = _callback_states(trainer)
    if states:
        record["callbacks_sha256"] = {key: _digest(state) for key, state in states.items()}
    ddp = ddp_module(trainer)
    if ddp is not None:
        record["forward_sync"] = bool(ddp.require_forward_param_sync)
    return record


def _buffer_senders(records: list[dict[str, Any]], trainer: pl.Trainer) -> list[int]:
    """The ranks whose buffers the file does not hold (see :func:`exchange_buffers`)."""
    digests = [record.get("buffers_sha256") for record in records]
    if None in digests or len(set(digests)) == 1:
        return []
    if ddp_module(trainer) is not None:
        return [r for r, digest in enumerate(digests) if digest != digests[0]]
    return list(range(len(records)))


def sealed_part(part: dict[str, Any]) -> dict[str, Any]:
    """A part as the file keeps it: the callback states' digests serve the exchange only.

    They would tie the file to the run's folder (``ModelCheckpoint``'s state holds its paths), and the states that
    matter travel whole.
    """
    record = part.get("replica")
    if not record or "callbacks_sha256" not in record:
        return part
    return {**part, "replica": {k: v for k, v in record.items() if k != "callbacks_sha256"}}


def _own_callbacks(record: dict[str, Any], first: dict[str, Any]) -> list[str]:
    """The callbacks whose state on a rank is not rank 0's, the one the file holds."""
    theirs, saved = record.get("callbacks_sha256") or {}, first.get("callbacks_sha256") or {}
    return sorted(key for key, digest in theirs.items() if saved.get(key) != digest)


def exchange_buffers(parts: list[dict[str, Any]], codes: list[bytes], trainer: pl.Trainer) -> None:
    """After the entry's gather: the ranks whose buffers the file does not hold add them to their parts (in place).

    Under DDP the file holds rank 0's: the ranks whose buffers differ from rank 0's. Under another strategy (a
    sharded one: a distributed checkpoint keeps one copy of a replicated tensor, of a rank it chooses) every rank,
    when any two differ. The same round carries the callback states unlike rank 0's (Lightning saves rank 0's under
    every strategy). A collective when some rank sends (every rank knows it from the gathered digests, so all take
    part), nothing otherwise. The changed parts are encoded again (``codes``, for the seal).
    """
    import torch.distributed as dist

    records = [part.get("replica") or {} for part in parts]
    senders = _buffer_senders(records, trainer)
    callbacks = [_own_callbacks(record, records[0]) for record in records]
    for r, part in enumerate(parts):  # the file keeps no digest of them (the codes were made without: sealed_part)
        parts[r] = sealed_part(part)
        records[r] = parts[r].get("replica") or {}
    if not senders and not any(callbacks):
        return
    rank = dist.get_rank()
    payload: dict[str, Any] = {}
    if rank in senders:
        payload["buffers"] = {k: v.detach().cpu().clone() for k, v in _rank_buffers(trainer).items()}
    if callbacks[rank]:
        states = _callback_states(trainer)
        payload["callbacks"] = {key: _on_cpu(states[key]) for key in callbacks[rank] if key in states}
    for r, sent in enumerate(all_gather_bytes(pack_part(payload, b"") if payload else b"")):
        if sent:
            parts[r] = {**parts[r], "replica": {**records[r], **unpack_part(sent)[0]}}
            codes[r] = encode(parts[r])


def check_replica(value: Any) -> bool:
    """Whether a part's ``replica`` record is well formed (None: not recorded)."""
    if value is None:
        return True
    if not isinstance(value, dict) or not isinstance(value.get("buffers_sha256"), str):
        return False
    if not isinstance(value.get("forward_sync", False), bool):
        return False
    buffers, digests, states = value.get("buffers", {}), value.get("callbacks_sha256", {}), value.get("callbacks", {})
    if not isinstance(digests, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in digests.items()):
        return False
    if not isinstance(states, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in states.items()):
        return False
    return isinstance(buffers, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in buffers.items()
    )


def restored_own_buffers(replica: dict[str, Any] | None, remap: bool) -> bool:
    """Whether a resume puts this rank's own buffers back (:func:`give_back`): its module is its own at the save."""
    return bool(replica and replica.get("buffers")) and not remap


def give_back(replica: dict[str, Any] | None, trainer: pl.Trainer, remap: bool, cache: WarningCache | None) -> None:
    """On resume: this rank's own buffers and callback states (where the file holds rank 0's), and DDP's flag.

    A saved buffer or callback state this run does not have (a callback that is gone, a buffer of another shape) is
    named in a ``NotExactWarning``: this rank goes on with the one the file holds.
    """
    if not replica:
        return
    lost: list[str] = []
    if replica.get("callbacks") and not remap:
        held = {str(callback.state_key): callback for callback in user_callbacks(trainer)}
        for key, state in replica["callbacks"].items():
            if key in held:
                held[key].load_state_dict(state)  # over rank 0's, which Lightning loaded
            else:
                lost.append(f"callback[{key}]'s state")
    if restored_own_buffers(replica, remap):
        live = _rank_buffers(trainer)
        with torch.no_grad():
            for name, value in replica["buffers"].items():
                here = live.get(name)
                if here is not None and here.shape == value.shape and here.dtype == value.dtype:
                    here.copy_(value)
                else:
                    lost.append(name)
    if lost:
        message = (
            f"[rank {trainer.global_rank}] this rank's own {', '.join(sorted(lost))} at the save (unlike the copy"
            " the checkpoint holds) cannot be put back: this run has no buffer of that name and shape, or no"
            " callback of that state key. This rank goes on with the checkpoint's copy, which it did not have: it"
            " does not continue like the interrupted run."
        )
        log.warning(message)  # on every rank (a warning shows on rank 0 only)
        (cache.warn if cache is not None else warn)(message, category=NotExactWarning)
    ddp = ddp_module(trainer)
    if ddp is not None and not remap and "forward_sync" in replica:
        ddp.require_forward_param_sync = replica["forward_sync"]
