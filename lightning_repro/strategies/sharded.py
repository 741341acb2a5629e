"""Sharded training made reproducible: FSDP2 and tensor parallelism (``ModelParallelStrategy``), FSDP.

:class:`ReproModelParallelStrategy` (registered as ``"model_parallel_repro"``) and :class:`ReproFSDPStrategy`
(``"fsdp_repro"``) do for sharded models what :class:`~lightning_repro.ReproDDPStrategy` does for DDP:
``PYTHONHASHSEED`` and ``CUBLAS_WORKSPACE_CONFIG`` exported while the ranks start, the ranks stopped together on a
SIGTERM, the process group destroyed at exit, and, once the model is sharded, every data-parallel rank's process
streams re-seeded from ``(seed, data-parallel rank)`` (the ranks of one tensor-parallel group keep one stream).
Checkpoints hold every rank's part of the entry in both of Lightning's layouts (the callback does that); the
restore check and the step trace digest each rank's local shards (:mod:`lightning_repro.shards`).

A model built on the meta device (``trainer.init_module(empty_init=True)``) and sharded in ``configure_model`` is
initialised by :func:`materialize_unsharded`: each module's ``reset_parameters`` draws the full tensors, as it
would without sharding, and each rank keeps its shard of them (Lightning's own materialisation draws each rank's
shard from its stream as if it were the whole tensor: every rank gets the same values, none a non-sharded init's).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry
from typing_extensions import override

from lightning_repro._lightning.signals import handle_at_batch_end
from lightning_repro._lightning.strategies import LauncherSeam
from lightning_repro._warn import warn
from lightning_repro.exceptions import ReproWarning
from lightning_repro.seeding import CUBLAS_WORKSPACE
from lightning_repro.shards import is_sharded, local_shard
from lightning_repro.strategies.ddp import (
    _destroy_process_group_at_exit,
    _find_callback,
    _launch_with_hash_seed,
    _process_group_initialized,
)

__all__ = ["ReproFSDPStrategy", "ReproModelParallelStrategy", "materialize_unsharded", "register_sharded_strategies"]

MODEL_PARALLEL_NAME = "model_parallel_repro"
FSDP_NAME = "fsdp_repro"


def materialize_unsharded(module: torch.nn.Module, device: torch.device) -> bool:
    """Initialise a module whose parameters are on the meta device as the same module without sharding would be.

    The module is moved to ``device`` uninitialised (``to_empty``); then, module by module in ``modules()`` order
    (Lightning's order), ``reset_parameters()`` runs on full-size plain tensors put in place of the module's own
    ``DTensor`` parameters and buffers, and each rank copies its shard of the result into its local shard (no
    communication: every rank draws the same full tensors from the same streams). Returns whether anything was on
    the meta device. Modules without ``reset_parameters`` stay uninitialised, with a warning, as in Lightning.
    """
    tensors = itertools.chain(module.parameters(), module.buffers())
    if not any(t.is_meta for t in tensors):
        return False
    from torch.distributed.tensor import distribute_tensor

    module.to_empty(device=device)
    uninitialized = set()
    for sub in module.modules():
        own = [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]
        if not own:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if not callable(reset):
            uninitialized.add(type(sub).__name__)
            continue
        swapped: dict[str, torch.Tensor] = {}
        for name, tensor in own:
            if is_sharded(tensor):
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=local_shard(tensor).device)
                stand_in = torch.nn.Parameter(full, requires_grad=tensor.requires_grad) if name in dict(
                    sub.named_parameters(recurse=False)
                ) else full
                swapped[name] = tensor
                setattr(sub, name, stand_in)
        try:
            reset()
        finally:
            for name, original in swapped.items():
                full = getattr(sub, name).detach()
                setattr(sub, name, original)
                mesh, placements = original.device_mesh, original.placements  # type: ignore[attr-defined]
                shard = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
                with torch.no_grad():
                    local_shard(original).copy_(shard)
    if uninitialized:
        warn(
            "Parameter initialisation incomplete: these modules' parameters or buffers stay uninitialised after"
            f" the meta device because they define no `reset_parameters()`: {', '.join(sorted(uninitialized))}."
            " Give them a `reset_parameters()` (or build them outside `init_module(empty_init=True)`).",
            ReproWarning,
        )
    return True


class _ShardedRepro(LauncherSeam):
    """What the sharded strategies add to Lightning's (see the module); put it first in the bases."""

    _undo_sigterm: Callable[[], None] | None = None

    @override
    def before_launcher(self) -> None:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)

    @override
    def wrap_launch(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        return _launch_with_hash_seed(launch)  # the launcher copies os.environ into the ranks it starts

    def setup_environment(self) -> None:
        """Lightning's, and a process group it creates is destroyed at exit (as :class:`ReproDDPStrategy` does)."""
        created = not _process_group_initialized()
        super().setup_environment()  # type: ignore[misc]
        if created:
            _destroy_process_group_at_exit()

    def setup(self, trainer: pl.Trainer) -> None:
        """Lightning's setup (the model sharded, moved, its optimizers built), then the ranks seeded apart."""
        super().setup(trainer)  # type: ignore[misc]
        self._stop_sigterm_agreement()
        self._undo_sigterm = handle_at_batch_end(trainer, agree_across_ranks=True)
        callback = _find_callback(trainer)
        if callback is None:
            warn(
                f"{type(self).__name__} is used without DeterminismCallback: nothing is seeded per rank and the"
                " checkpoints hold no RNG state. Add `DeterminismCallback(seed=...)` to the Trainer's callbacks.",
                ReproWarning,
            )
            return
        callback.seed_rank(trainer)

    def teardown(self) -> None:
        """Lightning's teardown, the SIGTERM agreement removed first."""
        self._stop_sigterm_agreement()
        super().teardown()  # type: ignore[misc]

    def _stop_sigterm_agreement(self) -> None:
        undo, self._undo_sigterm = self._undo_sigterm, None
        if undo is not None:
            undo()


class ReproModelParallelStrategy(_ShardedRepro, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 ``fully_shard``, tensor parallelism) made reproducible.

    Use it with :class:`~lightning_repro.DeterminismCallback`; it accepts every argument of
    ``ModelParallelStrategy`` (``data_parallel_size``, ``tensor_parallel_size``, ``save_distributed_checkpoint``...)
    and is also usable as ``Trainer(strategy="model_parallel_repro")``. See the module for what it adds, and the
    docs' "Sharded training" page for what is exact.
    """

    strategy_name = MODEL_PARALLEL_NAME

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        # before Lightning's materialisation, which then finds nothing left on the meta device
        materialize_unsharded(self.model, self.root_device)
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_sharded_strategies(strategy_registry)


class ReproFSDPStrategy(_ShardedRepro, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) made reproducible; CUDA only, as ``FSDPStrategy`` is.

    FSDP1 materialises and initialises each wrapped module's full parameters before sharding them, on every rank
    from the same streams, so the shards are those of a non-sharded init. Accepts every argument of
    ``FSDPStrategy``; also usable as ``Trainer(strategy="fsdp_repro")``.
    """

    strategy_name = FSDP_NAME

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_sharded_strategies(strategy_registry)


def register_sharded_strategies(registry: Any = None) -> None:
    """Register ``"model_parallel_repro"`` and ``"fsdp_repro"`` in Lightning's registry; safe to call again."""
    registry = StrategyRegistry if registry is None else registry
    if MODEL_PARALLEL_NAME not in registry:
        registry.register(
            MODEL_PARALLEL_NAME,
            ReproModelParallelStrategy,
            description="FSDP2 / tensor parallelism with per-rank RNG state in checkpoints (lightning-repro)",
        )
    if FSDP_NAME not in registry:
        registry.register(
            FSDP_NAME,
            ReproFSDPStrategy,
            description="FSDP with per-rank RNG state in checkpoints (lightning-repro)",
        )
