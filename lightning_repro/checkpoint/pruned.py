"""The pruning of a ``ModelPruning`` run: saved with the entry, put back on resume.

``ModelPruning`` with ``make_pruning_permanent=True`` (its default) writes every checkpoint's ``state_dict`` with the
pruning made permanent: ``weight`` is ``weight_orig * weight_mask``, and the mask and the original values under it
are not in the file. A module resumed from it is not pruned: its masked weights get gradients and train again until
``ModelPruning``'s next pruning, and that pruning picks from other values (plain Lightning resumes it so too).

The entry's shared ``pruned`` value holds, per pruned tensor of the LightningModule (``torch.nn.utils.prune``'s
re-parametrisation: a forward pre-hook, ``<name>_orig`` and ``<name>_mask``): where it is (the module's path and the
tensor's name), its mask (as booleans when it holds only 0 and 1), the original values under the mask (the ones the
file lost; the optimizer's weight decay and momentum keep moving them), and the tensor the last forward computed
when it is no longer ``orig * mask`` (an optimizer step since: a global pruning ranks the weights by it), and
whether ``<name>_orig`` shares its storage with ``ModelPruning``'s lottery-ticket copy of the module (its reset
assigns ``.data``: the copy then moves with training, and later resets change nothing; ``_lightning/pruning.py``).
On resume the same pruning is applied again (``prune.custom_from_mask``, on the same ``Parameter``, so the
optimizer's state stays attached), the values under the mask, that tensor and the shared storage are put back,
before the restore check compares them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from lightning_utilities.core.rank_zero import rank_prefixed_message
from torch import nn
from torch.nn.utils import prune

from lightning_repro._lightning.pruning import original_shares_storage, prunes_saved_checkpoints, share_storage_again
from lightning_repro.checkpoint import trainable as _trainable
from lightning_repro.exceptions import NotExactWarning

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_repro._warn import WarningCache

__all__ = ["check_records", "entry_pruning", "give_back", "give_back_module", "module_record", "pruned_tensors"]

log = logging.getLogger("lightning_repro.callback")


def _hooks(module: nn.Module) -> dict[str, prune.BasePruningMethod]:
    """``module``'s pruning hooks by the name of the tensor each prunes, in the order they were registered."""
    found: dict[str, prune.BasePruningMethod] = {}
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, prune.BasePruningMethod) and hook._tensor_name is not None:
            found[hook._tensor_name] = hook
    return found


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def pruned_tensors(module: nn.Module) -> list[dict[str, Any]] | None:
    """Every pruned tensor of ``module`` as the entry records it; ``None`` when none is pruned.

    Also ``None`` when a pruned tensor is sharded (a ``DTensor``): its local shards are not recorded here, and the
    restore check says what differs.
    """
    records: list[dict[str, Any]] = []
    for path, sub in module.named_modules():
        for name, hook in _hooks(sub).items():
            orig, mask, current = getattr(sub, name + "_orig"), getattr(sub, name + "_mask"), getattr(sub, name)
            if not all(type(t) in (torch.Tensor, nn.Parameter) for t in (orig, mask, current)):
                return None
            with torch.no_grad():
                binary = _same_bits(mask, (mask != 0).to(mask.dtype))
                record: dict[str, Any] = {
                    "module": path,
                    "name": name,
                    "mask": (mask != 0).cpu() if binary else mask.detach().cpu().clone(),
                    "masked": orig.detach()[mask == 0].cpu().clone(),
                }
                if not _same_bits(current, hook.apply_mask(sub)):  # type: ignore[no-untyped-call]
                    record["current"] = current.detach().cpu().clone()
            records.append(record)
    return records or None


def entry_pruning(trainer: pl.Trainer) -> list[dict[str, Any]] | None:
    """The entry's ``pruned`` value: :func:`pruned_tensors`, when a ``ModelPruning`` writes checkpoints without masks.

    Other prunings (``make_pruning_permanent=False``, the user's own ``torch.nn.utils.prune``) leave each
    ``<name>_orig`` and ``<name>_mask`` in the checkpoint's ``state_dict``: nothing is lost, nothing recorded.
    """
    if not any(prunes_saved_checkpoints(callback) for callback in trainer.callbacks):  # type: ignore[attr-defined]
        return None
    module = trainer.lightning_module
    records = pruned_tensors(module)
    for record in records or []:
        if original_shares_storage(trainer, module.get_submodule(record["module"]), record["name"]):
            record["lottery_shared"] = True
    return records


def module_record(trainer: pl.Trainer) -> dict[str, Any]:
    """What the entry records of the module besides its ``state_dict``: the shared ``frozen`` and ``pruned`` values."""
    return {"frozen": _trainable.frozen_parameters(trainer.lightning_module), "pruned": entry_pruning(trainer)}


def check_records(value: Any) -> bool:
    """``value`` is a well-formed ``pruned`` value (the entry's check of it when a checkpoint is read)."""
    return isinstance(value, list) and all(
        isinstance(r, dict)
        and isinstance(r.get("module"), str)
        and isinstance(r.get("name"), str)
        and isinstance(r.get("mask"), torch.Tensor)
        and isinstance(r.get("masked"), torch.Tensor)
        and r["masked"].numel() == int((r["mask"] == 0).sum())
        and isinstance(r.get("current", r["mask"]), torch.Tensor)
        and r.get("lottery_shared", True) is True
        for r in value
    )


def _unfit(module: nn.Module, record: dict[str, Any]) -> str | None:
    """Why ``record`` cannot be put back on ``module`` (its tensor is missing or of another shape), or None."""
    try:
        sub = module.get_submodule(record["module"])
    except AttributeError:
        return f"the module has no submodule {record['module']!r}"
    name = record["name"]
    hooks = _hooks(sub)
    tensor = getattr(sub, name + "_orig", None) if name in hooks else getattr(sub, name, None)
    if not isinstance(tensor, torch.Tensor) or (name not in hooks and not isinstance(tensor, nn.Parameter)):
        return f"{record['module']}.{name} is not a parameter of the module"
    if tensor.shape != record["mask"].shape:
        return f"{record['module']}.{name} has shape {tuple(tensor.shape)}, its mask {tuple(record['mask'].shape)}"
    return None


def give_back(module: nn.Module, records: list[dict[str, Any]] | None, rank: int) -> str | None:
    """Prune ``module`` again as the checkpoint's run had it pruned; returns why not (nothing changed), or None.

    A tensor pruned already (a module that prunes itself when built) gets the saved mask in its ``<name>_mask``.
    """
    if not records:
        return None
    for record in records:
        if (why := _unfit(module, record)) is not None:
            return f"the pruning the checkpoint recorded cannot be put back ({why}): the masked weights train again"
    with torch.no_grad():
        for record in records:
            sub, name = module.get_submodule(record["module"]), record["name"]
            hook = _hooks(sub).get(name)
            if hook is None:
                param = getattr(sub, name)
                mask = record["mask"].to(device=param.device, dtype=param.dtype)
                prune.custom_from_mask(sub, name, mask)  # type: ignore[no-untyped-call]
                hook = _hooks(sub)[name]
            else:
                mask = getattr(sub, name + "_mask")
                mask.copy_(record["mask"].to(device=mask.device, dtype=mask.dtype))
            orig, mask = getattr(sub, name + "_orig"), getattr(sub, name + "_mask")
            orig[mask == 0] = record["masked"].to(device=orig.device, dtype=orig.dtype)
            current = record.get("current")
            pruned = hook.apply_mask(sub) if current is None else current.to(orig.device)  # type: ignore[no-untyped-call]
            setattr(sub, name, pruned)
    message = f"pruning given back as at the checkpoint to {len(records)} tensor(s) (ModelPruning's masks)"
    log.info(rank_prefixed_message(message, rank))
    return None


def give_back_module(
    trainer: pl.Trainer,
    module: nn.Module,
    pruned: list[dict[str, Any]] | None,
    frozen: list[str] | None,
    cache: WarningCache,
) -> None:
    """On resume, the entry's ``pruned`` (:func:`give_back`), then its ``frozen`` (``trainable.py``).

    In that order: a pruned parameter is named ``<name>_orig`` only once pruned. A tensor the lottery-ticket reset
    had made share its storage with ``ModelPruning``'s copy of the module shares it again. What cannot be given back
    is a :class:`~lightning_repro.NotExactWarning` (through ``cache``).
    """
    rank = trainer.global_rank
    not_back = give_back(module, pruned, rank)
    if not_back is None:
        for record in pruned or []:
            if record.get("lottery_shared") and not share_storage_again(
                trainer, module.get_submodule(record["module"]), record["name"]
            ):
                not_back = (
                    f"{record['module']}.{record['name']} shared its storage with ModelPruning's lottery-ticket copy"
                    " at the checkpoint, and this run's ModelPruning keeps no such copy: its next reset differs"
                )
    if not_back is not None:
        cache.warn(not_back, category=NotExactWarning)
    if frozen is not None:
        _trainable.give_back(module, frozen, rank)
