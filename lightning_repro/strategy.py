"""``ReproDDPStrategy`` at its earlier path (the module lives in :mod:`lightning_repro.strategies.ddp`)."""

from __future__ import annotations

from lightning_repro.strategies.ddp import ReproDDPStrategy, register_strategy

__all__ = ["ReproDDPStrategy", "register_strategy"]
