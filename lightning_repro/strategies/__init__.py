"""Strategies: Lightning's strategies with lightning-repro's seeding and checkpoint gathering.

Owns :class:`ReproDDPStrategy` (``ddp``, registered as ``"ddp_repro"``): rank-aware seeding once the model is
wrapped, ``PYTHONHASHSEED`` exported while the ranks start, every rank's part gathered into rank 0's checkpoint; and
the sharded strategies (``sharded``): :class:`ReproModelParallelStrategy` (FSDP2 / tensor parallelism,
``"model_parallel_repro"``) and :class:`ReproFSDPStrategy` (FSDP, ``"fsdp_repro"``), seeded per data-parallel rank,
with a meta-device model initialised as without sharding.

May import the bottom layer, the concern folders (``data``, ``checkpoint``, ``trace``, ``manifest``) and
``callback``; Lightning's private API only through ``_lightning``.
"""

from __future__ import annotations

from lightning_repro.strategies.ddp import ReproDDPStrategy, register_strategy
from lightning_repro.strategies.sharded import (
    ReproFSDPStrategy,
    ReproModelParallelStrategy,
    register_sharded_strategies,
)

__all__ = [
    "ReproDDPStrategy",
    "ReproFSDPStrategy",
    "ReproModelParallelStrategy",
    "register_sharded_strategies",
    "register_strategy",
]
