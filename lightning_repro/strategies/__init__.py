"""Strategies: Lightning's strategies with lightning-repro's seeding and checkpoint gathering.

Owns :class:`ReproDDPStrategy` (``ddp``, registered as ``"ddp_repro"``): rank-aware seeding once the model is
wrapped, ``PYTHONHASHSEED`` exported while the ranks start, every rank's part gathered into rank 0's checkpoint.

May import the bottom layer, the concern folders (``data``, ``checkpoint``, ``trace``, ``manifest``) and
``callback``; Lightning's private API only through ``_lightning``.
"""

from __future__ import annotations

from lightning_repro.strategies.ddp import ReproDDPStrategy, register_strategy

__all__ = ["ReproDDPStrategy", "register_strategy"]
