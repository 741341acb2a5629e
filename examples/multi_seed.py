"""One seed is not evidence: a small training over several seeds, with the mean and a 95% interval.

``train(seed)`` is an ordinary Lightning training made reproducible by ``DeterminismCallback(seed)``: the model's
initialisation, the data order, the augmentation and dropout all follow the seed, and nothing else. It returns
the final training loss, the validation loss and the validation accuracy. ``run_seeds`` runs it once per seed,
each in a fresh process, and summarizes each metric: mean, standard deviation, the 95% confidence interval of
the mean and the 95% prediction band for one new run, which ``check_band`` uses.

Run::

    python examples/multi_seed.py                       # seeds 0, 1, 2: the table, and multi_seed_report.json
    python examples/multi_seed.py --seeds 5 --out report.json
    lightning-repro seeds examples.multi_seed:train --seeds 5   # the same from the command line (repo root)

A few seconds per seed on 2 CPU cores (most of it starting the process and importing torch).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_repro import DeterminismCallback, run_seeds
from lightning_repro.stats.seeds import print_report

SAMPLES, VAL_SAMPLES, FEATURES, BATCH, EPOCHS = 192, 64, 8, 32, 2


class NoisyPoints(Dataset):  # type: ignore[type-arg]
    """Fixed points (the same for every seed) with labels from a fixed rule; training reads add seeded jitter."""

    def __init__(self, size: int, *, offset: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(1000 + offset)  # the data is not what the seed varies
        self.x = torch.randn(size, FEATURES, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.augment:
            x = x + 0.2 * torch.randn(FEATURES)  # drawn from the sample's own stream (DeterminismCallback)
        return x, self.y[i]


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def train(seed: int) -> dict[str, float]:
    """Train with ``seed``; return the final training loss, the validation loss and the validation accuracy."""
    torch.set_num_threads(1)  # the numbers do not depend on it here, the speed on 2 shared cores does
    repro = DeterminismCallback(seed)  # first: it pins the model's initialisation too
    model = Classifier()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=EPOCHS,
        callbacks=[repro],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    train_loader = DataLoader(NoisyPoints(SAMPLES, offset=0, augment=True), batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(NoisyPoints(VAL_SAMPLES, offset=1, augment=False), batch_size=VAL_SAMPLES)
    trainer.fit(model, train_loader, val_loader)
    return {name: float(trainer.callback_metrics[name]) for name in ("train_loss", "val_loss", "val_acc")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds (0, 1, ...; default 3)")
    parser.add_argument("--out", default="multi_seed_report.json", help="where the report goes (JSON)")
    args = parser.parse_args()
    report = run_seeds(train, range(args.seeds), out=args.out)
    print_report(report)
    print(f"report written to {args.out}; check a new run with lightning_repro.check_band({args.out!r}, value, ...)")


if __name__ == "__main__":
    main()
