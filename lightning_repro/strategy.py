"""``ReproDDPStrategy``: DDP with rank-aware seeding and every rank's RNG state in the checkpoint."""

from __future__ import annotations

import logging
import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_repro.exceptions import ReproWarning
from lightning_repro.seeding import CUBLAS_WORKSPACE

__all__ = ["ReproDDPStrategy", "register_strategy"]

log = logging.getLogger(__name__)

STRATEGY_NAME = "ddp_repro"


class ReproDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` made reproducible; use it with :class:`~lightning_repro.DeterminismCallback`.

    * Before child processes start, ``PYTHONHASHSEED`` and ``CUBLAS_WORKSPACE_CONFIG`` are exported
      so every rank hashes and computes alike.
    * The model is initialised identically on every rank (the callback seeds every process from the
      seed); once DDP has wrapped it, each rank's process streams are re-seeded from
      ``(seed, rank)``, so dropout masks differ across ranks while the run stays a function of the seed.
    * The callback gathers every rank's RNG state into the one checkpoint rank 0 writes, and every
      rank restores its own on resume.

    Without the callback this strategy behaves as ``DDPStrategy`` and warns once. Accepts every
    argument of ``DDPStrategy``; also usable as ``Trainer(strategy="ddp_repro")``.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        _export_child_environment()

    @override
    def _configure_launcher(self) -> None:
        _export_child_environment()  # the launcher copies os.environ into the processes it starts
        super()._configure_launcher()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # moves and wraps the model in DDP
        callback = _find_callback(trainer)
        if callback is None:
            rank_zero_warn(
                "ReproDDPStrategy is used without DeterminismCallback: nothing is seeded per rank and the"
                " checkpoints hold no RNG state. Add `DeterminismCallback(seed=...)` to the Trainer's callbacks.",
                category=ReproWarning,
            )
            return
        callback.seed_rank(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_strategy(strategy_registry)


def _export_child_environment() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    seed = os.environ.get("PL_GLOBAL_SEED")
    if "PYTHONHASHSEED" not in os.environ and seed is not None:
        os.environ["PYTHONHASHSEED"] = seed


def _find_callback(trainer: pl.Trainer) -> Any:
    from lightning_repro.callback import DeterminismCallback

    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, DeterminismCallback):
            return callback
    return None


def register_strategy(registry: Any = None) -> None:
    """Register ``"ddp_repro"`` in Lightning's strategy registry; safe to call any number of times."""
    registry = StrategyRegistry if registry is None else registry
    if STRATEGY_NAME not in registry:
        registry.register(
            STRATEGY_NAME,
            ReproDDPStrategy,
            description="DDP with rank-aware seeding and per-rank RNG state in checkpoints (lightning-repro)",
        )
