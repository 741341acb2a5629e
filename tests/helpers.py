"""Helpers shared by the in-process tests: a settable counter, a loader takeover, a fast CPU Trainer, a v1 entry."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import __version__ as _lightning_version
from torch import nn
from torch.utils.data import DataLoader

from lightning_repro.checkpoint.entry import DIGEST_KEY, seal_entry
from lightning_repro.data.takeover import StreamKey, prepare_dataloader
from lightning_repro.manifest.fingerprint import CPU_FIELDS

LIGHTNING_26 = tuple(int(p) for p in _lightning_version.split(".")[:2]) >= (2, 6)
"""Lightning 2.6 or newer (the test-min environment runs 2.5.0, where some behaviours under test do not exist)."""

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


class SmallRegressor(pl.LightningModule):
    """A 4-input regressor with dropout, trained by SGD on ``(x, y)`` batches: the tests' smallest real module."""

    def __init__(self, dropout: float = 0.3, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(dropout), nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SaveAt(pl.Callback):
    """Saves ``path`` at the end of the batch ``at`` = ``(epoch, batch index)``: a kill point written as users do."""

    def __init__(self, path: Any, at: tuple[int, int]) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if (trainer.current_epoch, args[-1]) == self.at:
            trainer.save_checkpoint(self.path)


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


V1_ONLY_IN_V2 = ("frozen", "manifest", "restore_sha256", "save_guards", "trace")
"""What version 1 entries never held: the frozen parameters, the run manifest, the restore check's digests, the save
guards, the step trace."""


def as_v1_checkpoint(path: Path, target: Path, state_key: str = "DeterminismCallback") -> Path:
    """A copy of a checkpoint written here with its (version 2) entry laid out and sealed as version 1 wrote it.

    Version 1 held rank 0's part at the top level and the other ranks' parts under ``"other_ranks"``, recorded no
    manifest and no CPU fields in its environment fingerprint, and was sealed with the same digest as version 2
    (``seal_entry``). The weights and streams are this machine's, so a resume from it can be compared bitwise.
    """
    checkpoint = torch.load(path, weights_only=True)
    entry = checkpoint["callbacks"][state_key]
    ranks = [{k: v for k, v in part.items() if k not in V1_ONLY_IN_V2} for part in entry["ranks"]]
    shared = {k: v for k, v in entry.items() if k not in ("ranks", DIGEST_KEY, *V1_ONLY_IN_V2)}
    shared["environment"] = {k: v for k, v in shared["environment"].items() if k not in CPU_FIELDS}
    checkpoint["callbacks"][state_key] = seal_entry({**shared, **ranks[0], "version": 1, "other_ranks": ranks[1:]})
    torch.save(checkpoint, target)
    return target


def gather_trainer(world_size: int, module: nn.Module | None = None, *, ddp: bool = False, rank: int = 0) -> Any:
    """A stand-in for the trainer the entry's gather reads: its world size and rank, its module (whose buffers
    ``checkpoint/replica.py`` digests), and a strategy whose model is a ``DistributedDataParallel`` (``ddp``) or not."""
    wrapper = object.__new__(nn.parallel.DistributedDataParallel) if ddp else None
    strategy = type("FakeStrategy", (), {"model": wrapper})()
    fields = {"world_size": world_size, "global_rank": rank, "strategy": strategy}
    fields["lightning_module"] = module or nn.Linear(1, 1)
    return type("FakeTrainer", (), fields)()
