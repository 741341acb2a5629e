"""``ModelPruning``'s private state, read and set for the pruning's resume and for DDP (``checkpoint/pruned.py``).

Lightning's ``callbacks/pruning.py`` keeps, on the callback: ``_make_pruning_permanent`` (checkpoints hold
``orig * mask`` only), ``_parameters_to_prune`` (the ``(module, name)`` pairs it prunes) and ``_original_layers``
(the lottery-ticket reset's deep copies of those modules, taken at ``setup``; ``_copy_param`` resets a pruned
tensor by ``dst.data = src.data``, so from the first reset on ``<name>_orig`` shares its storage with the copy, and
the optimizer's in-place steps move both: every later reset is a no-op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import Callback, ModelPruning
from torch import nn

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["original_shares_storage", "prune_alike_on_every_rank", "prunes_saved_checkpoints", "share_storage_again"]


def prunes_saved_checkpoints(callback: Callback) -> bool:
    """Whether ``callback`` is a ``ModelPruning`` that writes the pruned weights without their masks into checkpoints.

    ``callbacks/pruning.py: on_save_checkpoint`` replaces ``checkpoint["state_dict"]`` when
    ``make_pruning_permanent`` (its default, kept as ``_make_pruning_permanent``).
    """
    return isinstance(callback, ModelPruning) and bool(getattr(callback, "_make_pruning_permanent", True))


def prune_alike_on_every_rank(trainer: pl.Trainer, seed_of: Callable[[int], int]) -> list[Callable[[], None]]:
    """Run each ``ModelPruning``'s pruning on process streams seeded alike on every rank; returns the undos.

    A random pruning (``"random_unstructured"``, a custom ``pruning_fn`` that draws) draws its masks from the
    process streams (``callbacks/pruning.py: _run_pruning``, from ``on_train_epoch_end`` or
    ``on_validation_epoch_end``). Under rank-aware seeding every rank would draw other masks, and the replicas,
    which DDP keeps equal only through their averaged gradients, would prune different weights. Each pruning runs on
    streams seeded from ``seed_of(epoch)``, the same on every rank, and the rank's own streams are put back after
    it. Set on the instance, as Lightning's ``_run_pruning(current_epoch)``.
    """
    from lightning_repro._lightning.inflight import on_instance
    from lightning_repro.rng import fork_process_streams

    undos: list[Callable[[], None]] = []
    for callback in getattr(trainer, "callbacks", []):
        if not isinstance(callback, ModelPruning) or "_run_pruning" in vars(callback):
            continue
        run = callback._run_pruning

        def alike(current_epoch: int, run: Callable[[int], None] = run) -> None:
            with fork_process_streams(seed_of(current_epoch)):
                run(current_epoch)

        undos.append(on_instance(callback, "_run_pruning", alike))
    return undos


def _lottery_pairs(trainer: pl.Trainer) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(pruned module, tensor name, its lottery-ticket copy)`` of every ``ModelPruning`` that keeps copies."""
    pairs = []
    for callback in getattr(trainer, "callbacks", []):
        layers = getattr(callback, "_original_layers", None) if isinstance(callback, ModelPruning) else None
        for layer in (layers or {}).values():
            for i, name in layer["names"]:
                pairs.append((callback._parameters_to_prune[i][0], name, layer["data"]))
    return pairs


def original_shares_storage(trainer: pl.Trainer, module: nn.Module, name: str) -> bool:
    """Whether ``module``'s ``<name>_orig`` shares its storage with a lottery-ticket copy's ``name`` (reset once)."""
    orig = getattr(module, name + "_orig", None)
    for pruned, tensor_name, copy in _lottery_pairs(trainer):
        src = getattr(copy, tensor_name, None)
        if pruned is module and tensor_name == name and orig is not None and src is not None:
            return bool(orig.untyped_storage().data_ptr() == src.untyped_storage().data_ptr())
    return False


def share_storage_again(trainer: pl.Trainer, module: nn.Module, name: str) -> bool:
    """Make the lottery-ticket copy's ``name`` share ``<name>_orig``'s storage, as at the checkpoint; False: no copy."""
    for pruned, tensor_name, copy in _lottery_pairs(trainer):
        src = getattr(copy, tensor_name, None)
        if pruned is module and tensor_name == name and src is not None:
            src.data = getattr(module, name + "_orig").data
            return True
    return False
