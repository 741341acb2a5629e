"""Sharded tensors (``DTensor``: FSDP2's parameters, tensor parallelism) seen as this rank's local shard.

Digests of a sharded model are taken over each rank's local shard (:meth:`DTensor.to_local`), never over a gathered
full tensor: exact, cheap (no collective) and compared rank by rank. :func:`shard_layout` names how a tensor is
sharded (placements, mesh shape and dimension names, global shape and stride, this rank's coordinate in the mesh),
and every digest feeds it beside the shard's bytes, so two different shardings of one tensor never give one digest.
A plain tensor has no layout (``None``) and is digested as before, so the digests of unsharded runs do not change.

Part of the bottom layer: imports torch only. ``torch.distributed.tensor`` is never imported here: a process where
it was not imported holds no ``DTensor``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["is_sharded", "local_shard", "prime_optimizer_states", "shaped_like", "shard_layout"]


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a ``DTensor`` (a parameter FSDP2 or tensor parallelism distributed over a mesh)."""
    kind = _dtensor_type()
    return kind is not None and isinstance(value, kind)


def shard_layout(value: Any) -> str | None:
    """How ``value`` is distributed, as one string; ``None`` for anything but a ``DTensor``.

    Examples:
        >>> shard_layout(torch.ones(2)) is None
        True
    """
    if not is_sharded(value):
        return None
    mesh = value.device_mesh
    coordinate = mesh.get_coordinate()
    return (
        f"DTensor(placements={tuple(value.placements)!r}, mesh={tuple(mesh.shape)}{tuple(mesh.mesh_dim_names or ())},"
        f" shape={tuple(value.shape)}, stride={tuple(value.stride())},"
        f" coordinate={tuple(coordinate) if coordinate is not None else None})"
    )


def local_shard(value: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a ``DTensor`` (no communication); any other tensor as it is.

    Examples:
        >>> t = torch.ones(2)
        >>> local_shard(t) is t
        True
    """
    if is_sharded(value):
        local: torch.Tensor = value.to_local()  # type: ignore[attr-defined]
        return local
    return value


def shaped_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (a local shard, as the checkpoint saved it) distributed as ``param`` is; a plain ``param``: as is.

    Gives a sharded parameter back its accumulated gradient on resume, laid out as the parameter.
    """
    if not is_sharded(param):
        return local.to(param.device)
    sharded: torch.Tensor = type(param).from_local(  # type: ignore[attr-defined]
        local.to(local_shard(param).device),
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        shape=param.shape,
        stride=param.stride(),
    )
    return sharded


def prime_optimizer_states(model: torch.nn.Module, optimizers: list[Any]) -> None:
    """Fill the empty state of each optimizer over sharded parameters, as saving it will.

    Lightning's ``ModelParallelStrategy.optimizer_state`` (after the callbacks' ``state_dict``, so after our restore
    digests) goes through ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, which first fills an
    optimizer's empty state (a step with zero gradients at learning rate 0: Adam's ``step``, ``exp_avg``...; the
    parameters keep their bits). A checkpoint written before the first optimizer step then holds that filled state;
    the digests must be of it. Calling the same public function here does exactly that fill, a moment earlier; it
    does nothing to an optimizer with a state or with gradients (torch's own conditions).
    """
    empty = [optimizer for optimizer in optimizers if not optimizer.state]  # after the first step: none, no scan
    if not any(is_sharded(p) for optimizer in empty for g in optimizer.param_groups for p in g["params"]):
        return
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    for optimizer in empty:
        if all(p.grad is None for group in optimizer.param_groups for p in group["params"]):
            get_optimizer_state_dict(model, optimizer)
