"""Which parameters are trainable (``requires_grad``): saved with the entry, given back on resume.

Lightning's checkpoint holds no ``requires_grad`` flag. A run that unfreezes parameters at an epoch's start
(``BackboneFinetuning``, a user's ``on_train_epoch_start``) and is resumed later freezes them again where its setup
does (``BaseFinetuning.setup`` freezes the backbone) and does not run that epoch's start again: the optimizer holds
the parameters, but they get no gradient, and the resumed run trains another model. The entry records the frozen
parameters by name (the shared ``frozen`` value); the resume gives every parameter its flag back.
"""

from __future__ import annotations

import logging

from lightning_utilities.core.rank_zero import rank_prefixed_message
from torch import nn

__all__ = ["frozen_parameters", "give_back", "restore_trainable"]

log = logging.getLogger("lightning_repro.callback")


def frozen_parameters(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that do not require a gradient, in ``named_parameters`` order."""
    return [name for name, param in module.named_parameters() if not param.requires_grad]


def restore_trainable(module: nn.Module, frozen: list[str]) -> list[str]:
    """Set ``requires_grad`` of ``module``'s parameters as they were saved: False for ``frozen``, else True.

    Returns the names of the parameters whose flag changed (a parameter the model no longer has is left alone).
    """
    names = set(frozen)
    changed = []
    for name, param in module.named_parameters():
        trainable = name not in names
        if param.requires_grad != trainable:
            param.requires_grad_(trainable)
            changed.append(name)
    return changed


def give_back(module: nn.Module, frozen: list[str], rank: int) -> None:
    """:func:`restore_trainable` on resume; an INFO line names the parameters whose flag the run's setup had changed."""
    changed = restore_trainable(module, frozen)
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        message = f"requires_grad given back as at the checkpoint to {len(changed)} parameter(s): {shown}"
        log.info(rank_prefixed_message(message, rank))
