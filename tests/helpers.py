"""Helpers shared by the in-process tests: a settable counter, a loader takeover, a fast CPU Trainer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_repro.dataloaders import StreamKey, prepare_dataloader


class Counter:
    """The epoch (or step) a takeover reads when a pass starts; tests set ``value``."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


def prepare(loader: DataLoader[Any], counter: Counter | None = None, **kwargs: Any) -> DataLoader[Any]:
    """Take ``loader`` over as train loader 0 with seed 7."""
    return prepare_dataloader(
        loader, seed=7, rank=0, stream=StreamKey("train", 0), counter=counter or Counter(), **kwargs
    )


def fast_trainer(callbacks: Iterable[Any], **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer without logger, progress bar, summary or default checkpointing (``kwargs`` override)."""
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        **kwargs,
    }
    return pl.Trainer(callbacks=list(callbacks), **options)
